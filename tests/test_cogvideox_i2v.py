"""CogVideoX image-to-video through the engine: equal to diffusers' CogVideoXImageToVideoPipeline (the image's
latents beside the noisy ones), batched across requests at different step counts; a text-only request, or an image
to the text-to-video checkpoint, refused naming the field."""

import time

import numpy as np
import pytest
from diffusers import CogVideoXImageToVideoPipeline

from pipelines.image_request import RequestError
from pipelines.video import VideoRequest
from tests.helpers import demo_path, noise_image, running_engine, seeded

WIDTH, HEIGHT, FRAMES = 48, 32, 9  # [3, 4, 4, 6] latents ([F, C, H, W]) beside the image's 3 x 4 x 4 x 6


@pytest.fixture(scope="module")
def i2v_path(tmp_path_factory):
    return demo_path(tmp_path_factory, "cogvideox-i2v")


@pytest.fixture(scope="module")
def engine(i2v_path):
    with running_engine(i2v_path, max_batch_size=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(i2v_path):
    pipe = CogVideoXImageToVideoPipeline.from_pretrained(i2v_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(pipe, **kwargs) -> np.ndarray:
    seed = kwargs.pop("seed")
    return pipe(**kwargs, generator=seeded(seed), output_type="np").frames[0]


@pytest.mark.parametrize("guidance,negative", [(6.0, "blurry"), (1.0, None)])
def test_image_to_video_equals_diffusers(engine, reference, guidance, negative):
    """The 40x40 image is resized to the 48x32 output and VAE-encoded with a draw from the request's generator."""
    args = dict(prompt="the boat sails away", negative_prompt=negative, image=noise_image(40, seed=3), width=WIDTH,
                height=HEIGHT, num_frames=FRAMES, num_inference_steps=3, guidance_scale=guidance, seed=11)
    ours = engine.submit_video("m", VideoRequest(**args)).result(timeout=120)
    ref = _reference(reference, **args)
    assert ours["frames"].shape == ref.shape == (FRAMES, HEIGHT, WIDTH, 3) and ours["seed"] == 11
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_concurrent_requests_share_forwards_and_equal_diffusers(engine, reference):
    """Two animations of one shape, of different images, at different step counts, guidance and seeds share the
    denoiser's forwards, each equal to its own pipeline call."""
    common = dict(width=WIDTH, height=HEIGHT, num_frames=FRAMES)
    specs = [dict(prompt="a cat", image=noise_image(48, seed=1), seed=1, num_inference_steps=5, guidance_scale=6.0,
                  **common),
             dict(prompt="a dog", image=noise_image(32, seed=2), seed=2, num_inference_steps=3, guidance_scale=3.0,
                  negative_prompt="dull", **common)]
    before = engine.metrics.stage.max_batch_size("m/denoise", "m")
    handles = []
    for spec in specs:
        handles.append(engine.submit_video("m", VideoRequest(**spec)))
        time.sleep(0.01)
    batched = [h.result(timeout=120)["pixels"] for h in handles]
    assert before < 2 <= engine.metrics.stage.max_batch_size("m/denoise", "m")
    for got, spec in zip(batched, specs):
        np.testing.assert_allclose(got, _reference(reference, **spec), atol=1e-5)


def test_tasks_defaults_and_refusals(engine, tmp_path_factory):
    """The checkpoint animates images only, 49 frames by default (the image-to-video __call__'s); a request with no
    image names `model`, and the text-to-video checkpoint refuses an image naming `image`."""
    info = engine.models["m"]
    assert (info.family, info.tasks) == ("cogvideox", ("image-to-video",))
    assert info.video_defaults["num_frames"] == 49
    request = engine.family("m").validate(VideoRequest(prompt="x", image=noise_image(32)))
    assert (request.num_inference_steps, request.guidance_scale, request.num_frames) == (50, 6.0, 49)
    with pytest.raises(RequestError) as err:
        engine.submit_video("m", VideoRequest(prompt="x", width=WIDTH, height=HEIGHT, num_frames=FRAMES))
    assert err.value.param == "model" and "image-to-video" in err.value.message
    with running_engine(demo_path(tmp_path_factory, "cogvideox")) as t2v, pytest.raises(RequestError) as err:
        t2v.submit_video("m", VideoRequest(prompt="x", image=noise_image(32), width=32, height=32, num_frames=9))
    assert err.value.param == "image"
