"""Stable Diffusion through the engine: equal to diffusers, batched across requests, cancellable."""

import time

import numpy as np
import pytest
from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline, StableDiffusionPipeline
from PIL import Image

from pipelines import Pipeline
from pipelines.image_request import ImageRequest, RequestError, Task
from serve.errors import http_status
from stages.events import EventKind, StageError
from tests.helpers import half_mask, noise_image, running_engine, seeded, variant


@pytest.fixture(scope="module")
def reference(sd_path):
    pipe = StableDiffusionPipeline.from_pretrained(sd_path, safety_checker=None, feature_extractor=None,
                                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def engine(sd_path):
    """Batching off: one request per denoiser forward, as the reference runs."""
    with running_engine(sd_path, name="sd", max_batch_size=1) as eng:
        yield eng


@pytest.fixture(scope="module")
def batching_engine(sd_path):
    with running_engine(sd_path, name="sd", max_batch_size=8) as eng:
        yield eng


def test_text_to_image_equals_diffusers(engine, reference):
    ours = engine.submit_image("sd", ImageRequest(prompt="a red bicycle", negative_prompt="blurry", n=2,
                                                  num_inference_steps=4, guidance_scale=6.0, seed=11)).result()
    ref = reference("a red bicycle", negative_prompt="blurry", num_images_per_prompt=2, num_inference_steps=4,
                    guidance_scale=6.0, generator=seeded(11), output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)
    assert ours["seed"] == 11 and len(ours["images"]) == 2


def test_no_guidance_equals_diffusers(engine, reference):
    ours = engine.submit_image("sd", ImageRequest(prompt="a boat", num_inference_steps=3, guidance_scale=1.0,
                                                  seed=5)).result()
    ref = reference("a boat", num_inference_steps=3, guidance_scale=1.0, generator=seeded(5), output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_image_to_image_equals_diffusers(engine, reference):
    pipe = variant(reference, StableDiffusionImg2ImgPipeline)
    image = noise_image()
    ours = engine.submit_image("sd", ImageRequest(prompt="a cat", task=Task.IMAGE_TO_IMAGE, image=image, strength=0.6,
                                                  num_inference_steps=5, seed=3)).result()
    ref = pipe("a cat", image=image, strength=0.6, num_inference_steps=5, generator=seeded(3), output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_inpainting_equals_diffusers(engine, reference):
    pipe = variant(reference, StableDiffusionInpaintPipeline)
    image, mask = noise_image(), half_mask()
    ours = engine.submit_image("sd", ImageRequest(prompt="a cat", task=Task.INPAINTING, image=image, mask=mask,
                                                  strength=0.75, num_inference_steps=5, seed=3)).result()
    ref = pipe("a cat", image=image, mask_image=mask, strength=0.75, num_inference_steps=5, generator=seeded(3),
               height=64, width=64, output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_concurrent_requests_share_forwards_and_equal_solo(engine, batching_engine):
    specs = [dict(seed=1, num_inference_steps=6), dict(seed=2, num_inference_steps=4),
             dict(seed=3, num_inference_steps=5, guidance_scale=3.0), dict(seed=4, num_inference_steps=6, n=2)]
    solo = [engine.submit_image("sd", ImageRequest(prompt=f"prompt {i}", **s)).result()["pixels"]
            for i, s in enumerate(specs)]
    handles = []
    for i, s in enumerate(specs):  # staggered arrivals: later requests join at a step boundary
        handles.append(batching_engine.submit_image("sd", ImageRequest(prompt=f"prompt {i}", **s)))
        time.sleep(0.02)
    batched = [h.result(timeout=120)["pixels"] for h in handles]
    for got, want in zip(batched, solo):
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert batching_engine.metrics.stage.max_batch_size("sd/denoise", "sd") >= 2


def test_cancel_mid_loop_stops_within_a_step(batching_engine):
    eng = batching_engine
    steps_seen = []
    long = eng.submit_image("sd", ImageRequest(prompt="long", num_inference_steps=200, seed=0))
    other = eng.submit_image("sd", ImageRequest(prompt="other", num_inference_steps=8, seed=9))
    cancelled_at = None
    for event in long.events(timeout=60):
        if event.kind is EventKind.PROGRESS:
            steps_seen.append(event.data["step"])
            if event.data["step"] == 3:
                long.cancel()
                cancelled_at = len(steps_seen)
    assert event.kind is EventKind.ERROR and event.data["code"] == "cancelled"
    assert len(steps_seen) == cancelled_at  # nothing reached the caller after the cancel
    with pytest.raises(StageError) as err:
        long.result(timeout=5)
    assert err.value.code == "cancelled"
    # The other request finishes, unchanged.
    other_out = other.result(timeout=120)
    assert other_out["pixels"].shape == (1, 64, 64, 3)
    deadline = time.time() + 10
    while not eng.executor.idle() and time.time() < deadline:
        time.sleep(0.01)
    assert eng.executor.idle()
    # The dropped request's loop state was released.
    assert all(p.queue_len() == 0 for p in eng.executor.pools.values())


def test_prompt_cache_hits_on_repeat(engine):
    before = engine.prompt_cache.stats.hits
    for _ in range(2):
        engine.submit_image("sd", ImageRequest(prompt="the same prompt", num_inference_steps=1, seed=0)).result()
    assert engine.prompt_cache.stats.hits >= before + 2  # the prompt and the empty negative, second time


def test_prompt_cache_is_per_tenant(engine):
    misses = engine.prompt_cache.stats.misses
    engine.submit_image("sd", ImageRequest(prompt="tenant prompt", tenant="a", num_inference_steps=1, seed=0)).result()
    engine.submit_image("sd", ImageRequest(prompt="tenant prompt", tenant="b", num_inference_steps=1, seed=0)).result()
    assert engine.prompt_cache.stats.misses >= misses + 4  # no cross-tenant hit


@pytest.mark.parametrize("field,request_kwargs", [
    ("prompt", dict(prompt="  ")),
    ("size", dict(prompt="x", width=60, height=64)),
    ("size", dict(prompt="x", width=4096, height=4096)),
    ("n", dict(prompt="x", n=0)),
    ("num_inference_steps", dict(prompt="x", num_inference_steps=0)),
    ("guidance_scale", dict(prompt="x", guidance_scale=-1.0)),
    ("image", dict(prompt="x", task=Task.IMAGE_TO_IMAGE)),
    ("strength", dict(prompt="x", task=Task.IMAGE_TO_IMAGE, image=Image.new("RGB", (64, 64)), strength=1.5)),
])
def test_bad_requests_name_the_field(engine, field, request_kwargs):
    with pytest.raises(RequestError) as err:
        engine.submit_image("sd", ImageRequest(**request_kwargs))
    assert err.value.param == field and 400 <= http_status(err.value) < 500


def test_mask_size_mismatch(engine):
    with pytest.raises(RequestError) as err:
        engine.submit_image("sd", ImageRequest(prompt="x", task=Task.INPAINTING, image=Image.new("RGB", (64, 64)),
                                               mask=Image.new("L", (32, 32))))
    assert err.value.param == "mask"


def test_unknown_model_is_404(engine):
    with pytest.raises(RequestError) as err:
        engine.submit_image("nope", ImageRequest(prompt="x"))
    assert http_status(err.value) == 404 and err.value.param == "model"


def test_python_api_matches_diffusers_and_streams(sd_path, reference):
    with Pipeline.from_pretrained(sd_path) as pipe:
        images = pipe("a lighthouse", num_inference_steps=3, seed=21)
        ref = reference("a lighthouse", num_inference_steps=3, generator=seeded(21)).images
        assert np.array_equal(np.asarray(images[0]), np.asarray(ref[0]))
        handle = pipe.submit("a lighthouse", num_inference_steps=3, seed=21)
        kinds = [e.kind for e in handle.events(timeout=60)]
        assert kinds.count(EventKind.PROGRESS) == 3 and kinds[-1] is EventKind.FINAL

        import asyncio
        arr = asyncio.run(pipe.agenerate("a lighthouse", num_inference_steps=3, seed=21, output_type="np"))
        np.testing.assert_allclose(arr, np.asarray(ref[0])[None] / 255.0, atol=1 / 255)
