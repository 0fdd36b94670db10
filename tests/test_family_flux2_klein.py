"""FLUX.2 [klein] through the engine: text-to-image and multi-reference edits equal to diffusers' Flux2KleinPipeline,
with its true CFG (the negative prompt, or "") in one forward with the prompt rows, batched across requests at
different step counts, its __call__'s defaults, the prompt cache, a step-distilled checkpoint's refusals, and
/v1/models and one generation through the app."""

from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest
from diffusers import Flux2KleinPipeline

from pipelines.families.flux2_klein import Flux2KleinFamily
from pipelines.image_request import ImageLimits, ImageRequest, RequestError, Task
from pipelines.registry import detect_family
from stages.diffusion.step_cache import StepCacheConfig
from tests.helpers import demo_path, noise_image, running_engine, seeded
from tests.test_serve_support import read_image
from tests.test_step_cache import PSNR_FLOOR_DB, psnr, skipped

WIDTH, HEIGHT = 32, 16  # multiples of 8 (the tiny VAE's factor 4, times the 2x2 patches): 2 x 4 image tokens
MSL = 32  # a short max_sequence_length keeps the 27-layer encoder cheap
ATOL = 1e-5


@pytest.fixture(scope="module")
def klein_path(tmp_path_factory):
    return demo_path(tmp_path_factory, "flux2_klein")


@pytest.fixture(scope="module")
def engine(klein_path):
    with running_engine(klein_path, max_batch_size=4, step_cache=StepCacheConfig(enabled=True)) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(klein_path):
    pipe = Flux2KleinPipeline.from_pretrained(klein_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ours(engine, **kw):
    kw.setdefault("extra", {"max_sequence_length": MSL})
    return engine.submit_image("m", ImageRequest(**kw)).result(timeout=120)["pixels"]


def _theirs(reference, *, prompt, negative_prompt=None, seed, n=1, **kw):
    """Flux2KleinPipeline's own call: it takes no negative prompt text, only its embeddings ("" when none)."""
    if negative_prompt is not None:
        kw["negative_prompt_embeds"] = reference.encode_prompt(negative_prompt, max_sequence_length=MSL)[0]
    return reference(prompt=prompt, num_images_per_prompt=n, max_sequence_length=MSL, generator=seeded(seed),
                     output_type="np", **kw).images


def test_detected_served_and_listed_as_klein(klein_path, engine):
    from serve.models import model_object

    assert detect_family(klein_path) == "flux2_klein"
    info = engine.models["m"]
    assert (info.family, set(info.tasks)) == ("flux2_klein", {"text-to-image", "image-to-image"})
    assert model_object(info, 0)["execution"] == "stage-graph"


@pytest.mark.parametrize("negative", [None, "blurry, dark"])
def test_text_to_image_with_true_cfg_equals_diffusers(engine, reference, negative):
    """guidance 4.0 (the default) is true CFG: against "" without a negative prompt, else against it."""
    common = dict(prompt="A small red house on a green hill", width=WIDTH, height=HEIGHT, num_inference_steps=3, seed=7)
    got = _ours(engine, negative_prompt=negative, n=2, **common)
    want = _theirs(reference, negative_prompt=negative, n=2, **common)
    assert got.shape == (2, HEIGHT, WIDTH, 3)
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_edit_with_two_references_equals_diffusers(engine, reference):
    images = [noise_image(64, seed=1).resize((96, 64)), noise_image(64, seed=2)]
    got = _ours(engine, prompt="make it blue", task=Task.IMAGE_TO_IMAGE, image=images, negative_prompt="red",
                num_inference_steps=2, seed=4)
    want = _theirs(reference, image=images, prompt="make it blue", negative_prompt="red", num_inference_steps=2, seed=4)
    assert got.shape == want.shape == (1, 64, 96, 3)  # the first reference's size
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_concurrent_requests_share_forwards_and_equal_diffusers(engine, reference):
    """A CFG request with a negative prompt, one with "", and one without CFG (guidance 1) at different step
    counts share the transformer's forwards, each equal to its own pipeline call."""
    specs = [dict(prompt="a red door", negative_prompt="ugly", num_inference_steps=2, seed=1),
             dict(prompt="a blue fox", num_inference_steps=3, seed=2, guidance_scale=2.5),
             dict(prompt="a green cup", num_inference_steps=2, seed=3, guidance_scale=1.0, n=2)]
    before = engine.metrics.stage.max_batch_size("m/denoise", "m")
    handles = [engine.submit_image("m", ImageRequest(width=WIDTH, height=HEIGHT, extra={"max_sequence_length": MSL},
                                                     **spec)) for spec in specs]
    ours = [h.result(timeout=120)["pixels"] for h in handles]
    assert before < 2 <= engine.metrics.stage.max_batch_size("m/denoise", "m")
    for got, spec in zip(ours, specs, strict=True):
        want = _theirs(reference, width=WIDTH, height=HEIGHT, **{"guidance_scale": 4.0, **spec})
        np.testing.assert_allclose(got, want, atol=ATOL)


def test_omitted_fields_take_the_pipelines_defaults_and_prompts_are_cached(engine):
    """Flux2KleinPipeline.__call__'s defaults: 50 steps, guidance 4.0 (true CFG: two rows per image), 512 x 512 here
    (128 latent px x the VAE's factor), max_sequence_length 512; guidance 1 runs no CFG. A repeated prompt is a
    prompt-cache hit, another max_sequence_length is not."""
    family = engine.family("m")
    request = family.validate(ImageRequest(prompt="x"), ImageLimits())
    assert (request.num_inference_steps, request.guidance_scale, request.width, request.height) == (50, 4.0, 512, 512)
    assert family.uses_negative(request) and family.request_rows(request) == 2
    assert family.text_options(request) == {"max_sequence_length": 512}
    plain = family.validate(ImageRequest(prompt="x", guidance_scale=1.0, n=3), ImageLimits())
    assert not family.uses_negative(plain) and family.request_rows(plain) == 3
    first = family.cached_text("a cached cat", "t", {"max_sequence_length": MSL})
    assert first["embeds"].shape == (1, MSL, 3 * 16)  # hidden states 9, 18, 27 of the 16-wide Qwen3 side by side
    assert family.cached_text("a cached cat", "t", {"max_sequence_length": MSL}) is first
    assert family.cached_text("a cached cat", "t", {"max_sequence_length": 8}) is not first


@pytest.mark.parametrize("field,request_args", [
    ("max_sequence_length", dict(extra={"max_sequence_length": 0})),
    ("true_cfg_scale", dict(extra={"true_cfg_scale": 2.0})),  # Qwen-Image's / FLUX.1's knob: guidance_scale here
    ("image", dict(task=Task.IMAGE_TO_IMAGE, image=noise_image(48))),  # under 64 px a side
])
def test_bad_requests_are_rejected_naming_the_field(engine, field, request_args):
    with pytest.raises(RequestError) as info:
        engine.family("m").validate(ImageRequest(prompt="x", **request_args), ImageLimits())
    assert info.value.param == field


def test_step_cache_with_cfg_rows(engine):
    """FLUX.2's single-stream cache over a CFG request's two branches: threshold 0 equals the uncached output bit for
    bit; every other step reused changes it, within reason."""
    common = dict(prompt="a red bicycle", negative_prompt="blurry", width=WIDTH, height=HEIGHT, num_inference_steps=4,
                  seed=5)
    uncached = _ours(engine, **common)
    assert np.array_equal(_ours(engine, **common, step_cache={"method": "fbcache", "threshold": 0.0}), uncached)
    before = skipped(engine, "interval")
    cached = _ours(engine, **common, step_cache={"method": "interval", "interval": 2})
    assert skipped(engine, "interval") - before == 1 * 2  # step 1 of 0..3 (the last always runs), 2 branches
    assert not np.array_equal(cached, uncached) and psnr(cached, uncached) >= PSNR_FLOOR_DB


def test_a_step_distilled_checkpoint_runs_no_cfg(klein_path, tmp_path):
    """is_distilled: guidance_scale is ignored (one row per image, as __call__) and a negative prompt refused."""
    path = tmp_path / "distilled"
    shutil.copytree(klein_path, path)
    index = json.loads((path / "model_index.json").read_text())
    (path / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    family = Flux2KleinFamily("d", str(path))
    request = family.validate(ImageRequest(prompt="x", guidance_scale=4.0), ImageLimits())
    assert not family.uses_negative(request) and family.request_rows(request) == 1
    with pytest.raises(RequestError) as info:
        family.validate(ImageRequest(prompt="x", negative_prompt="blurry"), ImageLimits())
    assert info.value.param == "negative_prompt" and "distilled" in str(info.value)


def test_models_and_a_generation_through_the_app(engine, reference):
    """/v1/models lists the model as flux2_klein on the stage graph; /v1/images/generations returns its image (a PNG
    of the pipeline's pixels) with a negative prompt."""
    from fastapi.testclient import TestClient

    from serve.app import create_app

    with TestClient(create_app(engine)) as client:
        models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        reply = client.post("/v1/images/generations", json={
            "model": "m", "prompt": "a lighthouse", "size": "32x16", "num_inference_steps": 2, "seed": 5,
            "max_sequence_length": MSL, "negative_prompt": "fog"})
    assert (models["m"]["family"], models["m"]["execution"]) == ("flux2_klein", "stage-graph")
    assert reply.status_code == 200, reply.text
    got = np.asarray(read_image(base64.b64decode(reply.json()["data"][0]["b64_json"])).convert("RGB")).astype(np.int16)
    want = _theirs(reference, prompt="a lighthouse", negative_prompt="fog", width=32, height=16, num_inference_steps=2,
                   seed=5)[0]
    assert np.abs(got - (want * 255).round().astype(np.int16)).max() <= 1  # float error may round one level apart
