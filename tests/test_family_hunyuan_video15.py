"""HunyuanVideo 1.5 through the engine: text-to-video equal to diffusers' HunyuanVideo15Pipeline and image-to-video
to HunyuanVideo15ImageToVideoPipeline (the guider's CFG in one forward with the prompt rows), batched across requests
at different step counts, the pipeline's defaults, and /v1/models."""

import time

import numpy as np
import pytest
from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

from pipelines.image_request import RequestError
from pipelines.video import VideoRequest
from tests.helpers import demo_path, noise_image, running_engine, seeded

WIDTH, HEIGHT, FRAMES = 48, 32, 9  # [4, 3, 2, 3] latents ([C, F, H, W]; VAE 16x spatial, 4x temporal)
ATOL = 1e-5


@pytest.fixture(scope="module")
def t2v_path(tmp_path_factory):
    return demo_path(tmp_path_factory, "hunyuan_video15")


@pytest.fixture(scope="module")
def engine(t2v_path):
    with running_engine(t2v_path, max_batch_size=4) as eng:
        yield eng


def _pipeline(cls, path):
    pipe = cls.from_pretrained(path)  # offline: the saved checkpoint reloads by itself
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def reference(t2v_path):
    return _pipeline(HunyuanVideo15Pipeline, t2v_path)


def _reference(pipe, **kwargs) -> np.ndarray:
    """The pipeline's frames, its guider at the request's guidance_scale (__call__ takes none)."""
    seed, guidance = kwargs.pop("seed"), kwargs.pop("guidance_scale")
    pipe.guider = pipe.guider.new(guidance_scale=guidance)
    return pipe(**kwargs, generator=seeded(seed), output_type="np").frames[0]


@pytest.mark.parametrize("prompt,guidance,negative", [('a shop sign that says "OPEN"', 6.0, "blurry"),
                                                      ("a red bicycle", 1.0, None)])
def test_text_to_video_equals_diffusers(engine, reference, prompt, guidance, negative):
    """The guider's CFG with a negative prompt and a quoted text (the ByT5 stream); and no guidance at 1.0."""
    args = dict(prompt=prompt, negative_prompt=negative, width=WIDTH, height=HEIGHT, num_frames=FRAMES,
                num_inference_steps=2, guidance_scale=guidance, seed=11)
    ours = engine.submit_video("m", VideoRequest(**args)).result(timeout=120)
    ref = _reference(reference, **args)
    assert ours["frames"].shape == ref.shape == (FRAMES, HEIGHT, WIDTH, 3) and ours["frames"].dtype == np.uint8
    assert (ours["fps"], ours["seed"]) == (24.0, 11)
    np.testing.assert_allclose(ours["pixels"], ref, atol=ATOL)


def test_concurrent_requests_share_forwards_and_equal_diffusers(engine, reference):
    """Two requests of one shape at different step counts, guidance and seeds share the denoiser's forwards."""
    common = dict(width=WIDTH, height=HEIGHT, num_frames=FRAMES)
    specs = [dict(prompt="a cat", seed=1, num_inference_steps=3, guidance_scale=6.0, **common),
             dict(prompt="a dog on a long walk by the sea", seed=2, num_inference_steps=2, guidance_scale=3.0,
                  negative_prompt="dull", **common)]
    before = engine.metrics.stage.max_batch_size("m/denoise", "m")
    handles = []
    for spec in specs:
        handles.append(engine.submit_video("m", VideoRequest(**spec)))
        time.sleep(0.01)
    batched = [h.result(timeout=120)["pixels"] for h in handles]
    assert before < 2 <= engine.metrics.stage.max_batch_size("m/denoise", "m")
    for got, spec in zip(batched, specs):
        np.testing.assert_allclose(got, _reference(reference, **spec), atol=ATOL)


def test_image_to_video_equals_diffusers(tmp_path_factory):
    """The 56x40 image picks the pipeline's bucket (no size asked), is cropped to it, SigLIP- and VAE-encoded; a
    text-only request names `model`."""
    path = demo_path(tmp_path_factory, "hunyuan_video15-i2v")
    args = dict(prompt="the boat sails away", negative_prompt="blurry", image=noise_image(56, seed=3).resize((56, 40)),
                num_frames=FRAMES, num_inference_steps=2, guidance_scale=6.0, seed=7)
    with running_engine(path) as eng:
        info = eng.models["m"]
        assert (info.family, info.tasks) == ("hunyuan_video15", ("image-to-video",))
        ours = eng.submit_video("m", VideoRequest(**args)).result(timeout=120)
        with pytest.raises(RequestError) as err:
            eng.submit_video("m", VideoRequest(prompt="x", width=WIDTH, height=HEIGHT, num_frames=FRAMES))
        assert err.value.param == "model" and "image-to-video" in err.value.message
    ref = _reference(_pipeline(HunyuanVideo15ImageToVideoPipeline, path), **args)
    assert ours["frames"].shape == ref.shape == (FRAMES, 48, 64, 3)  # the 4:3-ish bucket at target_size 64
    np.testing.assert_allclose(ours["pixels"], ref, atol=ATOL)


def test_defaults_and_models_endpoint(engine):
    """Omitted fields take HunyuanVideo15Pipeline.__call__'s defaults (guidance: the guider's config), and
    /v1/models reports the family and its task on the stage graph."""
    from fastapi.testclient import TestClient

    from serve.app import create_app

    info = engine.models["m"]
    assert info.video_defaults == {"width": 80, "height": 48, "num_frames": 121, "fps": 24.0, "frame_factor": 4}
    req = engine.family("m").validate(VideoRequest(prompt="x"))
    assert (req.num_inference_steps, req.guidance_scale, req.num_frames, req.fps) == (50, 6.0, 121, 24.0)
    assert engine.family("m").request_rows(req) == 2
    assert engine.family("m").request_rows(engine.family("m").validate(VideoRequest(prompt="x", guidance_scale=1.0))) \
        == 1
    models = {m["id"]: m for m in TestClient(create_app(engine)).get("/v1/models").json()["data"]}
    assert (models["m"]["family"], models["m"]["execution"]) == ("hunyuan_video15", "stage-graph")
    assert "text-to-video" in models["m"]["tasks"] and "image-to-video" not in models["m"]["tasks"]
