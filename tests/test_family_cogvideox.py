"""CogVideoX through the engine: equal to diffusers' CogVideoXPipeline, batched across requests, defaults its own."""

import json
import shutil
import time

import numpy as np
import pytest
from diffusers import CogVideoXPipeline

from pipelines.video import VideoRequest
from tests.helpers import running_engine, seeded

SIZE, FRAMES = 32, 9  # 32 x 32 px, 9 frames -> [3, 4, 4, 4] latents ([F, C, H, W]), 12 video tokens


@pytest.fixture(scope="module")
def cog_path(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return str(build_demo_model("cogvideox", tmp_path_factory.mktemp("cogvideox-demo") / "cogvideox"))


@pytest.fixture(scope="module")
def engine(cog_path):
    with running_engine(cog_path) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(cog_path):
    pipe = CogVideoXPipeline.from_pretrained(cog_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(pipe, **kwargs) -> np.ndarray:
    seed = kwargs.pop("seed")
    return pipe(**kwargs, generator=seeded(seed), output_type="np").frames[0]


@pytest.mark.parametrize("guidance,negative", [(6.0, "blurry"), (1.0, None)])
def test_text_to_video_equals_diffusers(engine, reference, guidance, negative):
    args = dict(prompt="a red bicycle", negative_prompt=negative, width=SIZE + 16, height=SIZE, num_frames=FRAMES,
                num_inference_steps=4, guidance_scale=guidance, seed=11)
    ours = engine.submit_video("m", VideoRequest(**args)).result(timeout=60)
    ref = _reference(reference, **args)
    assert ours["frames"].shape == (FRAMES, SIZE, SIZE + 16, 3) and ours["frames"].dtype == np.uint8
    assert (ours["fps"], ours["seed"]) == (8.0, 11)
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_dpm_scheduler_equals_diffusers(cog_path, tmp_path):
    """CogVideoX-5b's scheduler: the previous step's x0 prediction and the request's generator carry across steps."""
    path = shutil.copytree(cog_path, tmp_path / "dpm")
    for config, edit in ((path / "scheduler" / "scheduler_config.json", {"_class_name": "CogVideoXDPMScheduler"}),
                         (path / "model_index.json", {"scheduler": ["diffusers", "CogVideoXDPMScheduler"]})):
        config.write_text(json.dumps(json.loads(config.read_text()) | edit))
    reference = CogVideoXPipeline.from_pretrained(path)
    reference.set_progress_bar_config(disable=True)
    assert type(reference.scheduler).__name__ == "CogVideoXDPMScheduler"
    args = dict(prompt="a boat", width=SIZE, height=SIZE, num_frames=FRAMES, num_inference_steps=4, seed=5)
    with running_engine(str(path)) as eng:
        ours = eng.submit_video("m", VideoRequest(**args)).result(timeout=60)
    np.testing.assert_allclose(ours["pixels"], _reference(reference, **args), atol=1e-5)


def test_concurrent_requests_share_forwards_and_equal_diffusers(cog_path, reference):
    """Two requests of one shape at different step counts, guidance and seeds share the denoiser's forwards."""
    common = dict(width=SIZE, height=SIZE, num_frames=FRAMES)
    specs = [dict(prompt="a cat", seed=1, num_inference_steps=12, guidance_scale=6.0, **common),
             dict(prompt="a dog", seed=2, num_inference_steps=9, guidance_scale=3.0, negative_prompt="dull", **common)]
    with running_engine(cog_path, max_batch_size=4) as batching:
        handles = []
        for spec in specs:
            handles.append(batching.submit_video("m", VideoRequest(**spec)))
            time.sleep(0.01)
        batched = [h.result(timeout=60)["pixels"] for h in handles]
        assert batching.metrics.stage.max_batch_size("m/denoise", "m") >= 2
    for got, spec in zip(batched, specs):
        np.testing.assert_allclose(got, _reference(reference, **spec), atol=1e-4)


def test_omitted_fields_take_the_pipeline_defaults(engine, reference):
    info = engine.models["m"]
    assert (info.family, "text-to-video" in info.tasks, info.size_factor) == ("cogvideox", True, 16)
    assert info.video_defaults == {"width": 720, "height": 480, "num_frames": 49, "fps": 8.0, "frame_factor": 4}
    req = engine.family("m").validate(VideoRequest(prompt="x"))
    # CogVideoXPipeline.__call__: 50 steps, guidance 6, transformer sample size x VAE scale, sample_frames
    config, scale = reference.transformer.config, reference.vae_scale_factor_spatial
    assert (req.num_inference_steps, req.guidance_scale) == (50, 6.0)
    assert (req.width, req.height, req.num_frames) == (config.sample_width * scale, config.sample_height * scale,
                                                       config.sample_frames) == (720, 480, 49)
    assert (req.fps, isinstance(req.seed, int)) == (8.0, True)
