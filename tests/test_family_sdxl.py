"""SDXL family: the engine's explicit, step-batched denoise loop equals the diffusers pipelines.

A tiny random-weight checkpoint (pipelines.demo) runs on CPU, offline. Every task is compared
with the diffusers pipeline it mirrors, same checkpoint, same seed, `output_type="np"`.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from PIL import Image

from pipelines.demo import build_demo_model
from pipelines.engine import Engine
from pipelines.image_request import ImageRequest, Task
from tests.helpers import running_engine, seeded, variant

ATOL = 1e-5  # float tolerance only: the same math in the same order


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(build_demo_model("sdxl", tmp_path_factory.mktemp("ckpt") / "sdxl"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    with running_engine(checkpoint) as eng:
        yield eng


@pytest.fixture(scope="module")
def pipes(checkpoint):
    """The three diffusers pipelines, the variants built from the text-to-image components."""
    from diffusers import StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline, StableDiffusionXLPipeline

    base = StableDiffusionXLPipeline.from_pretrained(checkpoint)  # float32
    base.set_progress_bar_config(disable=True)
    return {Task.TEXT_TO_IMAGE: base,
            Task.IMAGE_TO_IMAGE: variant(base, StableDiffusionXLImg2ImgPipeline),
            Task.INPAINTING: variant(base, StableDiffusionXLInpaintPipeline)}


@pytest.fixture(scope="module")
def image():
    rng = np.random.RandomState(0)
    return Image.fromarray(rng.randint(0, 256, (64, 64, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def mask():
    m = np.zeros((64, 64), np.uint8)
    m[16:48, 8:40] = 255  # white = repaint
    return Image.fromarray(m).convert("RGB")


def run(engine: Engine, request: ImageRequest) -> np.ndarray:
    return engine.submit_image("m", request).result(timeout=120)["pixels"]


# -- text-to-image ---------------------------------------------------------------------------

@pytest.mark.parametrize("n, negative, guidance", [
    (2, None, 5.0),  # CFG with SDXL's zero negatives (force_zeros_for_empty_prompt), two images
    (1, "blurry, low quality", 6.0),  # CFG with an encoded negative prompt
    (1, "", 6.0),  # an empty (not missing) negative prompt is encoded, not zeroed
    (1, None, 1.0),  # no CFG
])
def test_text_to_image_matches_diffusers(engine, pipes, n, negative, guidance):
    seed, steps = 11, 4
    ours = run(engine, ImageRequest(prompt="a red fox in the snow", negative_prompt=negative, n=n,
                                    num_inference_steps=steps, guidance_scale=guidance, seed=seed))
    ref = pipes[Task.TEXT_TO_IMAGE](
        "a red fox in the snow", negative_prompt=negative, num_images_per_prompt=n, num_inference_steps=steps,
        guidance_scale=guidance, generator=seeded(seed), output_type="np").images
    assert ours.shape == ref.shape == (n, 64, 64, 3)
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


def test_text_to_image_non_square(engine, pipes):
    ours = run(engine, ImageRequest(prompt="a lighthouse", width=64, height=96, num_inference_steps=3, seed=5))
    ref = pipes[Task.TEXT_TO_IMAGE]("a lighthouse", width=64, height=96, num_inference_steps=3,
                                    generator=seeded(5), output_type="np").images
    assert ours.shape == ref.shape == (1, 96, 64, 3)
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


def test_zero_negative_differs_from_empty_negative(engine):
    """force_zeros_for_empty_prompt: a missing negative is zeros, "" is the encoded empty string."""
    common = dict(prompt="a red fox", num_inference_steps=3, guidance_scale=6.0, seed=2)
    missing = run(engine, ImageRequest(negative_prompt=None, **common))
    empty = run(engine, ImageRequest(negative_prompt="", **common))
    assert np.abs(missing - empty).max() > 1e-4


# -- image-to-image --------------------------------------------------------------------------

@pytest.mark.parametrize("n, strength, negative", [(1, 0.6, None), (2, 0.75, "ugly")])
def test_image_to_image_matches_diffusers(engine, pipes, image, n, strength, negative):
    seed, steps, guidance = 21, 6, 5.0
    ours = run(engine, ImageRequest(prompt="a watercolor harbour", task=Task.IMAGE_TO_IMAGE, image=image, n=n,
                                    strength=strength, negative_prompt=negative, num_inference_steps=steps,
                                    guidance_scale=guidance, seed=seed))
    ref = pipes[Task.IMAGE_TO_IMAGE](
        "a watercolor harbour", image=image, strength=strength, negative_prompt=negative, num_images_per_prompt=n,
        num_inference_steps=steps, guidance_scale=guidance, generator=seeded(seed), output_type="np").images
    assert ours.shape == ref.shape == (n, 64, 64, 3)
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


# -- inpainting ------------------------------------------------------------------------------

@pytest.mark.parametrize("n, strength, negative", [(2, 0.8, None), (1, 1.0, "text, watermark")])
def test_inpainting_matches_diffusers(engine, pipes, image, mask, n, strength, negative):
    seed, steps = 31, 5
    # No guidance_scale: the family's inpainting default must be the inpaint pipeline's (7.5).
    ours = run(engine, ImageRequest(prompt="a wooden door", task=Task.INPAINTING, image=image, mask=mask, n=n,
                                    strength=strength, negative_prompt=negative, num_inference_steps=steps,
                                    seed=seed))
    ref = pipes[Task.INPAINTING](
        "a wooden door", image=image, mask_image=mask, strength=strength, negative_prompt=negative,
        num_images_per_prompt=n, num_inference_steps=steps, generator=seeded(seed), output_type="np").images
    assert ours.shape == ref.shape == (n, 64, 64, 3)
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


# -- step-level batching -----------------------------------------------------------------------

def test_requests_at_different_steps_share_forwards(engine, checkpoint, image):
    requests = [
        ImageRequest(prompt="a castle on a hill", num_inference_steps=16, seed=101),
        ImageRequest(prompt="a castle on a hill", negative_prompt="fog", n=2, num_inference_steps=12, seed=202),
        ImageRequest(prompt="a quiet lake", task=Task.IMAGE_TO_IMAGE, image=image, strength=0.9,
                     num_inference_steps=14, guidance_scale=1.0, seed=303),  # no CFG: one row, not two
    ]
    solo = [run(engine, r) for r in requests]

    with running_engine(checkpoint, max_batch_size=4) as batched_engine:
        handles, lock = [None] * len(requests), threading.Lock()

        def submit(k):
            time.sleep(0.02 * k)  # arrive a little apart: each joins the loop at another step
            h = batched_engine.submit_image("m", requests[k])
            with lock:
                handles[k] = h

        threads = [threading.Thread(target=submit, args=(k,)) for k in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together = [h.result(timeout=120)["pixels"] for h in handles]
        assert batched_engine.metrics.stage.max_batch_size("m/denoise", "m") > 1
    for got, want in zip(together, solo):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
