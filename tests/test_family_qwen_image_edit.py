"""Qwen-Image-Edit through the engine: instruction edits equal to diffusers' QwenImageEditPipeline (true CFG with a
negative prompt included), batched across requests, the prompt cache keyed by the input image too."""

import numpy as np
import pytest
from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from PIL import Image

from pipelines.image_request import ImageRequest, RequestError, Task
from tests.helpers import demo_path, running_engine, seeded

# The pipeline resizes the input to calculate_dimensions(1024 * 1024, ratio): 16k context tokens on the tiny
# checkpoint. Requests here ask for target_area AREA; the reference's calculate_dimensions is given the same area.
AREA = 48 * 32
OUT = (64, 32)  # calculate_dimensions(AREA, 60 / 40) for the 60 x 40 input: rounded to 32 px


def input_image(seed: int = 0, size=(60, 40)) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def edit_path(tmp_path_factory):
    return demo_path(tmp_path_factory, "qwen_image_edit")


@pytest.fixture(scope="module")
def engine(edit_path):
    with running_engine(edit_path, max_batch_size=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(edit_path):
    pipe = QwenImageEditPipeline.from_pretrained(edit_path)
    pipe.set_progress_bar_config(disable=True)
    original = pipeline_qwenimage_edit.calculate_dimensions
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: original(AREA, ratio))
        yield pipe


def _edit(image, extra=None, **kwargs) -> ImageRequest:
    return ImageRequest(task=Task.IMAGE_TO_IMAGE, image=image, extra=extra or {"target_area": AREA}, **kwargs)


def _reference(reference, image, prompt, steps, seed, **kwargs) -> np.ndarray:
    return reference(image=image, prompt=prompt, num_inference_steps=steps, generator=seeded(seed), output_type="np",
                     **kwargs).images


def test_family_and_tasks(engine):
    info = engine.models["m"]
    assert info.family == "qwen_image"
    assert set(info.tasks) == {"image-to-image"}


@pytest.mark.parametrize("negative,scale", [(None, 4.0), ("blurry, low quality", 3.0)])
def test_edit_equals_diffusers(engine, reference, negative, scale):
    """The input image goes through the text encoder and the VAE; the output takes the resized input's size. With a
    negative prompt true CFG guides (prompt and negative prompt differ in length: one forward, padded and masked)."""
    image = input_image()
    prompt = "make the sky purple and add a small boat"
    got = engine.submit_image("m", _edit(image, prompt=prompt, negative_prompt=negative, n=2, num_inference_steps=3,
                                         guidance_scale=scale, seed=7)).result(timeout=120)
    ref = _reference(reference, image, prompt, 3, 7, negative_prompt=negative, true_cfg_scale=scale,
                     num_images_per_prompt=2)
    assert got["pixels"].shape == ref.shape == (2, OUT[1], OUT[0], 3) and got["seed"] == 7
    np.testing.assert_allclose(got["pixels"], ref, atol=1e-5)


def test_concurrent_edits_share_forwards_and_equal_diffusers(engine, reference):
    """Two edits of the same output and context size and text length at different step counts share the
    transformer's forwards, each still equal to its own pipeline call."""
    specs = [dict(prompt="a red door", num_inference_steps=3, seed=1, image=input_image(1)),
             dict(prompt="a tan door", num_inference_steps=4, seed=2, image=input_image(2))]
    before = engine.metrics.stage.max_batch_size("m/denoise", "m")
    handles = [engine.submit_image("m", _edit(**spec)) for spec in specs]
    ours = [h.result(timeout=120)["pixels"] for h in handles]
    assert before < 2 <= engine.metrics.stage.max_batch_size("m/denoise", "m")
    for got, spec in zip(ours, specs):
        ref = _reference(reference, spec["image"], spec["prompt"], spec["num_inference_steps"], spec["seed"])
        np.testing.assert_allclose(got, ref, atol=1e-5)


def test_same_prompt_other_image_is_another_cache_entry(engine, reference):
    """The edit's embeddings depend on the image: the same prompt with another image never reuses an entry."""
    family = engine.family("m")
    outs = []
    for seed in (3, 4):
        image = input_image(seed)
        misses = family.prompt_cache.stats.misses
        got = engine.submit_image("m", _edit(image, prompt="add snow", num_inference_steps=2, seed=5))
        outs.append(got.result(timeout=120)["pixels"])
        assert family.prompt_cache.stats.misses == misses + 1
        np.testing.assert_allclose(outs[-1], _reference(reference, image, "add snow", 2, 5), atol=1e-5)
    assert np.abs(outs[0] - outs[1]).max() > 1e-4  # random tiny weights: the image moves the pixels by ~3e-4
    misses = family.prompt_cache.stats.misses  # the first image again: its entry is reused
    again = engine.submit_image("m", _edit(input_image(3), prompt="add snow", num_inference_steps=2, seed=5))
    np.testing.assert_array_equal(again.result(timeout=120)["pixels"], outs[0])
    assert family.prompt_cache.stats.misses == misses


def test_checks_before_the_image_and_bad_knobs(engine):
    """An edit's fields are checked before its image is decoded; a bad target_area names its field; the edit
    checkpoint makes no text-to-image (QwenImageEditPipeline.__call__ needs an image)."""
    engine.check_image("m", ImageRequest(task=Task.IMAGE_TO_IMAGE, prompt="x"))
    for request, param in [(_edit(input_image(), prompt="x", extra={"target_area": "big"}), "target_area"),
                           (ImageRequest(prompt="x", width=32, height=32), "model")]:
        with pytest.raises(RequestError) as err:
            engine.submit_image("m", request)
        assert err.value.param == param
