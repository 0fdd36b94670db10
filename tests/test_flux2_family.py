"""FLUX.2 through the engine: text-to-image and multi-reference edits equal to diffusers' Flux2Pipeline, batched
across requests at different step counts, the pipeline's own defaults for what a request omits, the prompt cache,
step caching on the single-stream blocks, and one generation and one edit through a real server with the openai
client."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from diffusers import Flux2Pipeline
from PIL import Image

from pipelines.image_request import ImageLimits, ImageRequest, RequestError, Task
from stages.diffusion.step_cache import StepCacheConfig
from stages.events import EventKind
from tests.helpers import demo_path, running_engine, seeded
from tests.test_serve_support import Server, read_image
from tests.test_step_cache import PSNR_FLOOR_DB, psnr, skipped

# Multiples of 8 (the tiny VAE's factor 4, times the 2x2 patches): 2 x 4 image tokens.
WIDTH, HEIGHT = 32, 16
MSL = 32  # a short max_sequence_length keeps the 30-layer encoder cheap; the default is checked apart
ATOL = 1e-5


def _reference_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def flux2_path(tmp_path_factory):
    return demo_path(tmp_path_factory, "flux2")


@pytest.fixture(scope="module")
def engine(flux2_path):
    with running_engine(flux2_path, max_batch_size=4, step_cache=StepCacheConfig(enabled=True)) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(flux2_path):
    pipe = Flux2Pipeline.from_pretrained(flux2_path)  # offline: the save_pretrained checkpoint reloads
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ours(engine, **kw):
    kw.setdefault("extra", {"max_sequence_length": MSL})
    return engine.submit_image("m", ImageRequest(**kw)).result(timeout=120)


def test_family_and_tasks(engine):
    info = engine.models["m"]
    assert info.family == "flux2"
    assert set(info.tasks) == {"text-to-image", "image-to-image"}


def test_klein_is_not_this_family(flux2_path, tmp_path):
    """A Flux2Pipeline checkpoint is flux2; FLUX.2 [klein] (Flux2KleinPipeline: a Qwen3 encoder, true CFG with a
    negative prompt, no embedded guidance) is its own family (tests/test_family_flux2_klein.py)."""
    import json

    from pipelines.registry import detect_family

    assert detect_family(flux2_path) == "flux2"
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    assert detect_family(str(tmp_path)) == "flux2_klein"


@pytest.mark.parametrize("guidance", [4.0, 2.5])
def test_text_to_image_equals_diffusers(engine, reference, guidance):
    prompt = "A small red house on a green hill"
    got = _ours(engine, prompt=prompt, width=WIDTH, height=HEIGHT, n=2, num_inference_steps=3, guidance_scale=guidance,
                seed=7)
    ref = reference(prompt=prompt, width=WIDTH, height=HEIGHT, num_images_per_prompt=2, num_inference_steps=3,
                    guidance_scale=guidance, max_sequence_length=MSL, generator=seeded(7), output_type="np").images
    assert got["pixels"].shape == (2, HEIGHT, WIDTH, 3) and got["seed"] == 7
    np.testing.assert_allclose(got["pixels"], ref, atol=ATOL)


@pytest.mark.parametrize("sizes", [[(64, 96)], [(96, 64), (64, 64)]])
def test_edit_with_references_equals_diffusers(engine, reference, sizes):
    """One reference, and two (each its own time offset in the ids); the output takes the first one's size, as
    __call__ sizes it."""
    images = [_reference_image(w, h, seed=k) for k, (w, h) in enumerate(sizes)]
    image = images[0] if len(images) == 1 else images
    got = _ours(engine, prompt="make it blue", task=Task.IMAGE_TO_IMAGE, image=image, num_inference_steps=3, seed=4)
    ref = reference(image=images, prompt="make it blue", num_inference_steps=3, max_sequence_length=MSL,
                    generator=seeded(4), output_type="np").images
    assert got["pixels"].shape == ref.shape == (1, sizes[0][1], sizes[0][0], 3)
    np.testing.assert_allclose(got["pixels"], ref, atol=ATOL)


def test_concurrent_requests_share_forwards_and_equal_diffusers(engine, reference):
    """Three requests of one size at different step counts and guidance share the transformer's forwards (each
    with its own schedule: mu depends on the step count), each equal to its own pipeline call."""
    specs = [dict(prompt="a red door", num_inference_steps=3, seed=1),
             dict(prompt="a blue fox", num_inference_steps=5, seed=2, guidance_scale=2.0),
             dict(prompt="a green cup", num_inference_steps=4, seed=3, n=2)]
    before = engine.metrics.stage.max_batch_size("m/denoise", "m")
    handles = [engine.submit_image("m", ImageRequest(width=WIDTH, height=HEIGHT, extra={"max_sequence_length": MSL},
                                                     **spec)) for spec in specs]
    ours = [h.result(timeout=120)["pixels"] for h in handles]
    assert before < 2 <= engine.metrics.stage.max_batch_size("m/denoise", "m")
    for got, spec in zip(ours, specs):
        ref = reference(prompt=spec["prompt"], width=WIDTH, height=HEIGHT, num_images_per_prompt=spec.get("n", 1),
                        guidance_scale=spec.get("guidance_scale", 4.0), num_inference_steps=spec["num_inference_steps"],
                        max_sequence_length=MSL, generator=seeded(spec["seed"]), output_type="np").images
        np.testing.assert_allclose(got, ref, atol=ATOL)


def test_omitted_fields_take_the_pipelines_defaults(engine):
    """What a request leaves out is Flux2Pipeline.__call__'s default: 50 steps, guidance 4.0 (embedded: one row per
    image), 512 x 512 here (128 latent px x the VAE's factor), max_sequence_length 512; an edit is the first
    reference's size, shrunk to 1024 x 1024 pixels first when larger."""
    family = engine.family("m")
    request = family.validate(ImageRequest(prompt="x"), ImageLimits())
    assert request.num_inference_steps == 50 and request.guidance_scale == 4.0
    assert request.width == request.height == 512
    assert not family.uses_negative(request) and family.request_rows(request) == 1
    assert family.text_options(request) == {"max_sequence_length": 512}
    big = Image.new("RGB", (2048, 1024))
    edit = family.validate(ImageRequest(prompt="x", task=Task.IMAGE_TO_IMAGE, image=[big, Image.new("RGB", (64, 64))]),
                           ImageLimits())
    assert (edit.width, edit.height) == (1448, 720)  # int(2048 * 0.707) = 1448, int(1024 * 0.707) = 724 -> 720


def test_prompts_go_through_the_prompt_cache(engine):
    """A prompt's embeddings are computed once: a repeat is a cache hit; another max_sequence_length is not."""
    family = engine.family("m")
    first = family.cached_text("a cached cat", "t", {"max_sequence_length": MSL})
    assert first["embeds"].shape[1] == MSL
    assert family.cached_text("a cached cat", "t", {"max_sequence_length": MSL}) is first
    assert family.cached_text("a cached cat", "t", {"max_sequence_length": 8}) is not first


@pytest.mark.parametrize("field,request_args", [
    ("max_sequence_length", dict(extra={"max_sequence_length": 0})),
    ("negative_prompt", dict(negative_prompt="blurry")),
    ("true_cfg_scale", dict(extra={"true_cfg_scale": 2.0})),  # FLUX.1's knob: not this family's
    ("image", dict(task=Task.IMAGE_TO_IMAGE, image=Image.new("RGB", (48, 64)))),  # under 64 px a side
    ("image", dict(task=Task.IMAGE_TO_IMAGE, image=Image.new("RGB", (576, 64)))),  # aspect ratio over 8
])
def test_bad_requests_are_rejected_naming_the_field(engine, field, request_args):
    with pytest.raises(RequestError) as info:
        engine.family("m").validate(ImageRequest(prompt="x", **request_args), ImageLimits())
    assert info.value.param == field


def test_step_cache_skips_single_stream_blocks(engine):
    """Threshold 0 equals the uncached output bit for bit; every other step reused changes it, within reason."""
    family = engine.family("m")
    stack = family.denoiser.stacks["transformer"]
    assert stack.spec.blocks == tuple(family.pipe.transformer.single_transformer_blocks)
    common = dict(prompt="a red bicycle", width=WIDTH, height=HEIGHT, num_inference_steps=6, seed=5)
    uncached = _ours(engine, **common)["pixels"]
    for method in ({"method": "teacache", "threshold": 0.0}, {"method": "fbcache", "threshold": 0.0}):
        assert np.array_equal(_ours(engine, **common, step_cache=method)["pixels"], uncached)
    before = skipped(engine, "interval")
    cached = _ours(engine, **common, step_cache={"method": "interval", "interval": 2})["pixels"]
    assert skipped(engine, "interval") - before == 2  # steps 1 and 3 of 0..5 (the last always runs)
    assert not np.array_equal(cached, uncached)
    assert psnr(cached, uncached) >= PSNR_FLOOR_DB
    before = skipped(engine, "teacache")  # a threshold far above one step's change of the modulated input
    cached = _ours(engine, **common, step_cache={"method": "teacache", "threshold": 5.0})["pixels"]
    assert skipped(engine, "teacache") > before
    assert psnr(cached, uncached) >= PSNR_FLOOR_DB


def test_previews_unpack_to_the_request_size(engine):
    handle = engine.submit_image("m", ImageRequest(prompt="a tree", width=WIDTH, height=HEIGHT, num_inference_steps=4,
                                                   seed=1, previews=2, extra={"max_sequence_length": MSL}))
    previews = [e.data["preview"] for e in handle.events(timeout=60)
                if e.kind is EventKind.PROGRESS and "preview" in e.data]
    assert len(previews) == 2 and all(p.size == (WIDTH, HEIGHT) for p in previews)


def test_generation_and_edit_through_the_server(tmp_path_factory, flux2_path, reference):
    """/v1/images/generations and /v1/images/edits with the official openai client: the PNGs are the pipeline's."""
    server = Server(tmp_path_factory.mktemp("flux2-serve"), f'[[models]]\nname = "f2"\npath = "{flux2_path}"\n')
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)
        body = {"num_inference_steps": 2, "seed": 5, "max_sequence_length": MSL}
        result = client.images.generate(model="f2", prompt="a lighthouse", size="32x16", extra_body=body)
        gen = np.asarray(read_image(base64.b64decode(result.data[0].b64_json)).convert("RGB")).astype(np.int16)
        image = _reference_image(64, 80, seed=9)
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        result = client.images.edit(model="f2", image=("in.png", buf.getvalue(), "image/png"), prompt="at night",
                                    extra_body=body)
        edit = np.asarray(read_image(base64.b64decode(result.data[0].b64_json)).convert("RGB")).astype(np.int16)
    finally:
        server.stop()
    common = dict(num_inference_steps=2, max_sequence_length=MSL, output_type="np")
    want_gen = reference(prompt="a lighthouse", width=32, height=16, generator=seeded(5), **common).images[0]
    want_edit = reference(image=[image], prompt="at night", generator=seeded(5), **common).images[0]
    for got, want in ((gen, want_gen), (edit, want_edit)):
        assert got.shape == want.shape
        assert np.abs(got - (want * 255).round().astype(np.int16)).max() <= 1  # float error may round one level apart
