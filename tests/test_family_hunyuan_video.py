"""HunyuanVideo through the engine: equal to diffusers' HunyuanVideoPipeline, batched across requests, defaults its
own."""

import time

import numpy as np
import pytest
from diffusers import HunyuanVideoPipeline

from pipelines.video import VideoRequest
from tests.helpers import running_engine, seeded

SIZE, FRAMES = 32, 9  # 32 x 32 px, 9 frames -> [4, 3, 4, 4] latents ([C, F, H, W]), 48 video tokens


@pytest.fixture(scope="module")
def hv_path(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return str(build_demo_model("hunyuan_video", tmp_path_factory.mktemp("hunyuan-video-demo") / "hunyuan_video"))


@pytest.fixture(scope="module")
def engine(hv_path):
    with running_engine(hv_path) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(hv_path):
    pipe = HunyuanVideoPipeline.from_pretrained(hv_path)  # offline: the saved checkpoint reloads by itself
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(pipe, **kwargs) -> np.ndarray:
    seed = kwargs.pop("seed")
    return pipe(**kwargs, generator=seeded(seed), output_type="np").frames[0]


@pytest.mark.parametrize("guidance,true_cfg,negative", [(6.0, None, None), (3.5, 4.0, "blurry")])
def test_text_to_video_equals_diffusers(engine, reference, guidance, true_cfg, negative):
    """Embedded guidance alone, and true CFG (a second, negative forward) on top of it."""
    args = dict(prompt="a red bicycle", negative_prompt=negative, width=SIZE + 16, height=SIZE, num_frames=FRAMES,
                num_inference_steps=4, guidance_scale=guidance, seed=11)
    ours = engine.submit_video("m", VideoRequest(**args, true_cfg_scale=true_cfg)).result(timeout=60)
    ref = _reference(reference, **args, true_cfg_scale=true_cfg or 1.0)
    assert ours["frames"].shape == (FRAMES, SIZE, SIZE + 16, 3) and ours["frames"].dtype == np.uint8
    assert (ours["fps"], ours["seed"]) == (24.0, 11)
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_concurrent_requests_share_forwards_and_equal_diffusers(hv_path, reference):
    """Two requests of one shape at different step counts, guidance, true CFG and seeds share the forwards."""
    common = dict(width=SIZE, height=SIZE, num_frames=FRAMES)
    specs = [dict(prompt="a cat", seed=1, num_inference_steps=12, guidance_scale=6.0, **common),
             dict(prompt="a dog on a long walk by the sea", seed=2, num_inference_steps=9, guidance_scale=2.0,
                  negative_prompt="dull", true_cfg_scale=3.0, **common)]
    with running_engine(hv_path, max_batch_size=4) as batching:
        handles = []
        for spec in specs:
            handles.append(batching.submit_video("m", VideoRequest(**spec)))
            time.sleep(0.01)
        batched = [h.result(timeout=60)["pixels"] for h in handles]
        assert batching.metrics.stage.max_batch_size("m/denoise", "m") >= 2
    for got, spec in zip(batched, specs):
        np.testing.assert_allclose(got, _reference(reference, **spec), atol=1e-4)


def test_omitted_fields_take_the_pipeline_defaults(engine):
    info = engine.models["m"]
    assert (info.family, "text-to-video" in info.tasks, info.size_factor) == ("hunyuan_video", True, 16)
    assert info.video_defaults == {"width": 1280, "height": 720, "num_frames": 129, "fps": 24.0, "frame_factor": 4}
    req = engine.family("m").validate(VideoRequest(prompt="x"))
    # HunyuanVideoPipeline.__call__: 50 steps, guidance 6 (embedded), true_cfg_scale 1, 720 x 1280, 129 frames
    assert (req.num_inference_steps, req.guidance_scale, req.true_cfg_scale) == (50, 6.0, 1.0)
    assert (req.width, req.height, req.num_frames, req.fps, isinstance(req.seed, int)) == (1280, 720, 129, 24.0, True)
    assert not engine.family("m").uses_negative(req)  # a negative prompt alone does not turn on true CFG
    assert not engine.family("m").uses_negative(engine.family("m").validate(VideoRequest(prompt="x",
                                                                                          negative_prompt="y")))
