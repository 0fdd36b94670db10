"""FLUX.1 through the engine: equal to diffusers' Flux pipelines, and batched across requests."""

import time

import numpy as np
import pytest
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxPipeline

from pipelines.image_request import ImageRequest, RequestError, Task
from serve.errors import http_status
from tests.helpers import half_mask, noise_image, running_engine, seeded, variant

SIZE = 32  # 32 x 32 px -> 16 x 32 x 32 latents -> 256 packed tokens


@pytest.fixture(scope="module")
def flux_path(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return str(build_demo_model("flux", tmp_path_factory.mktemp("flux-demo") / "flux"))


@pytest.fixture(scope="module")
def engine(flux_path):
    with running_engine(flux_path) as eng:
        yield eng


@pytest.fixture(scope="module")
def batching_engine(flux_path):
    with running_engine(flux_path, max_batch_size=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(flux_path):
    pipe = FluxPipeline.from_pretrained(flux_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(engine, **kwargs):
    return engine.submit_image("m", ImageRequest(**kwargs)).result(timeout=120)


def test_defaults_follow_the_pipeline(engine, reference):
    info = engine.models["m"]
    assert info.family == "flux"
    assert info.size_factor == reference.vae_scale_factor * 2
    assert info.default_size == reference.default_sample_size * reference.vae_scale_factor
    assert set(info.tasks) == {"text-to-image", "image-to-image", "inpainting"}
    fam = engine.family("m")
    assert (fam.default_steps, fam.default_guidance) == (28, 3.5)


def test_text_to_image_equals_diffusers(engine, reference):
    ours = _run(engine, prompt="a red bicycle", n=2, width=SIZE, height=SIZE, num_inference_steps=4,
                guidance_scale=4.0, seed=11)
    ref = reference("a red bicycle", num_images_per_prompt=2, width=SIZE, height=SIZE, num_inference_steps=4,
                    guidance_scale=4.0, generator=seeded(11), output_type="np").images
    assert ours["pixels"].shape == (2, SIZE, SIZE, 3) and ours["seed"] == 11 and len(ours["images"]) == 2
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


@pytest.mark.parametrize("true_cfg", [1.0, 2.5])
def test_negative_prompt_equals_diffusers(engine, reference, true_cfg):
    """A negative prompt runs (true CFG) only with true_cfg_scale > 1, as in diffusers; else it is ignored."""
    ours = _run(engine, prompt="a red bicycle", negative_prompt="blurry", width=SIZE, height=SIZE + 16,
                num_inference_steps=3, seed=7, extra={"true_cfg_scale": true_cfg})
    ref = reference("a red bicycle", negative_prompt="blurry", true_cfg_scale=true_cfg, width=SIZE, height=SIZE + 16,
                    num_inference_steps=3, generator=seeded(7), output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_max_sequence_length_equals_diffusers(engine, reference):
    ours = _run(engine, prompt="a lighthouse", width=SIZE, height=SIZE, num_inference_steps=3, seed=5,
                extra={"max_sequence_length": 64})
    ref = reference("a lighthouse", max_sequence_length=64, width=SIZE, height=SIZE, num_inference_steps=3,
                    generator=seeded(5), output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_image_to_image_equals_diffusers(engine, reference):
    pipe = variant(reference, FluxImg2ImgPipeline)
    image = noise_image(SIZE)
    ours = _run(engine, prompt="a cat", task=Task.IMAGE_TO_IMAGE, image=image, strength=0.6, n=2,
                num_inference_steps=5, seed=3)
    ref = pipe("a cat", image=image, strength=0.6, num_images_per_prompt=2, height=SIZE, width=SIZE,
               num_inference_steps=5, guidance_scale=3.5, generator=seeded(3), output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


@pytest.mark.parametrize("strength,negative", [(0.8, None), (1.0, "ugly")])
def test_inpainting_equals_diffusers(engine, reference, strength, negative):
    pipe = variant(reference, FluxInpaintPipeline)
    image, mask = noise_image(SIZE), half_mask(SIZE)
    extra = {"true_cfg_scale": 3.0} if negative else {}
    ours = _run(engine, prompt="a dog", negative_prompt=negative, task=Task.INPAINTING, image=image, mask=mask,
                strength=strength, n=2, num_inference_steps=5, seed=4, extra=extra)
    ref = pipe("a dog", negative_prompt=negative, true_cfg_scale=extra.get("true_cfg_scale", 1.0), image=image,
               mask_image=mask, strength=strength, num_images_per_prompt=2, height=SIZE, width=SIZE,
               num_inference_steps=5, guidance_scale=3.5, generator=seeded(4), output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_concurrent_requests_share_forwards_and_equal_solo(engine, batching_engine):
    """Different seeds, step counts, embedded guidance scales (per-sample) and a true-CFG request in one forward."""
    specs = [dict(seed=1, num_inference_steps=8, guidance_scale=3.5),
             dict(seed=2, num_inference_steps=6, guidance_scale=5.0, n=2),
             dict(seed=3, num_inference_steps=7, guidance_scale=2.0, negative_prompt="dull",
                  extra={"true_cfg_scale": 2.0})]
    common = dict(width=SIZE, height=SIZE)
    solo = [_run(engine, prompt=f"prompt {i}", **common, **s)["pixels"] for i, s in enumerate(specs)]
    handles = []
    for i, s in enumerate(specs):  # staggered arrivals: later requests join at a step boundary
        handles.append(batching_engine.submit_image("m", ImageRequest(prompt=f"prompt {i}", **common, **s)))
        time.sleep(0.01)
    batched = [h.result(timeout=120)["pixels"] for h in handles]
    assert batching_engine.metrics.stage.max_batch_size("m/denoise", "m") > 1
    for got, want in zip(batched, solo):
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("extra", [{"max_sequence_length": 513}, {"max_sequence_length": 0},
                                   {"max_sequence_length": "64"}])
def test_bad_max_sequence_length(engine, extra):
    with pytest.raises(RequestError) as err:
        engine.submit_image("m", ImageRequest(prompt="x", width=SIZE, height=SIZE, extra=extra))
    assert err.value.param == "max_sequence_length" and http_status(err.value) == 400


def test_size_must_be_a_multiple_of_the_packed_factor(engine):
    with pytest.raises(RequestError) as err:
        engine.submit_image("m", ImageRequest(prompt="x", width=SIZE + 1, height=SIZE))
    assert err.value.param == "size"


def test_previews_unpack_to_the_request_size(engine):
    from stages.events import EventKind

    handle = engine.submit_image("m", ImageRequest(prompt="a tree", width=SIZE, height=SIZE + 16, num_inference_steps=4,
                                                   seed=1, previews=2))
    previews = [e.data["preview"] for e in handle.events(timeout=60)
                if e.kind is EventKind.PROGRESS and "preview" in e.data]
    assert len(previews) == 2 and all(p.size == (SIZE, SIZE + 16) for p in previews)
