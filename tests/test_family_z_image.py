"""Z-Image through the engine: text-to-image equal to diffusers' ZImagePipeline (CFG with its normalisation and
truncation, no CFG at scale 0), batched across requests, and the pipeline's own defaults for what a request omits."""

import numpy as np
import pytest
from diffusers import ZImagePipeline

from pipelines.image_request import ImageLimits, ImageRequest, RequestError
from tests.helpers import demo_path, running_engine, seeded

# Multiples of 8 (the tiny VAE's factor 4, times the 2x2 patches): 4 x 8 latents, 2 x 4 image tokens.
WIDTH, HEIGHT = 32, 16


@pytest.fixture(scope="module")
def z_image_path(tmp_path_factory):
    return demo_path(tmp_path_factory, "z_image")


@pytest.fixture(scope="module")
def engine(z_image_path):
    with running_engine(z_image_path, max_batch_size=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(z_image_path):
    pipe = ZImagePipeline.from_pretrained(z_image_path)  # offline: the save_pretrained checkpoint reloads
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_family_and_tasks(engine):
    info = engine.models["m"]
    assert info.family == "z_image"
    assert set(info.tasks) == {"text-to-image"}


@pytest.mark.parametrize("negative,scale,extra", [
    (None, 5.0, {}),  # the pipeline's CFG with the "" negative prompt
    ("blurry, low quality", 3.0, {"cfg_normalization": 1.0}),  # each guided sample capped at its prompt's norm
    (None, 0.0, {}),  # no CFG: the prompt rows alone
    (None, 4.0, {"cfg_truncation": 0.3}),  # the later steps run without the negative rows
])
def test_text_to_image_equals_diffusers(engine, reference, negative, scale, extra):
    prompt = "A small red house on a green hill"
    ours = engine.submit_image("m", ImageRequest(prompt=prompt, negative_prompt=negative, width=WIDTH, height=HEIGHT,
                                                 n=2, num_inference_steps=3, guidance_scale=scale, seed=7,
                                                 extra=extra))
    ref = reference(prompt=prompt, negative_prompt=negative, guidance_scale=scale, width=WIDTH, height=HEIGHT,
                    num_images_per_prompt=2, num_inference_steps=3, generator=seeded(7), output_type="np",
                    **extra).images
    got = ours.result(timeout=120)
    assert got["pixels"].shape == (2, HEIGHT, WIDTH, 3) and got["seed"] == 7
    np.testing.assert_allclose(got["pixels"], ref, atol=1e-5)


def test_guidance_knobs_change_the_image(engine):
    """Guidance, the negative prompt, the normalisation and the truncation each reach the denoiser."""
    common = dict(prompt="a lighthouse", width=WIDTH, height=HEIGHT, num_inference_steps=3, seed=3)

    def run(**kw):
        return engine.submit_image("m", ImageRequest(**common, **kw)).result(timeout=120)["pixels"]

    base = run()
    assert np.abs(base - run(guidance_scale=0.0)).max() > 1e-3
    assert np.abs(base - run(negative_prompt="fog")).max() > 1e-3
    assert np.abs(base - run(extra={"cfg_normalization": 0.5})).max() > 1e-3
    assert np.abs(base - run(extra={"cfg_truncation": 0.3})).max() > 1e-3


def test_concurrent_requests_share_forwards_and_equal_diffusers(engine, reference):
    """Two requests of the same size at different step counts (and different prompts: each row keeps its own
    caption in the transformer's lists) share the denoiser's forwards, each equal to its own pipeline call."""
    specs = [dict(prompt="a red door", num_inference_steps=3, seed=1),
             dict(prompt="a blue fox", num_inference_steps=5, seed=2, guidance_scale=2.0)]
    before = engine.metrics.stage.max_batch_size("m/denoise", "m")
    handles = [engine.submit_image("m", ImageRequest(width=WIDTH, height=HEIGHT, **spec)) for spec in specs]
    ours = [h.result(timeout=120)["pixels"] for h in handles]
    assert before < 2 <= engine.metrics.stage.max_batch_size("m/denoise", "m")
    for got, spec in zip(ours, specs):
        ref = reference(prompt=spec["prompt"], width=WIDTH, height=HEIGHT,
                        guidance_scale=spec.get("guidance_scale", 5.0), num_inference_steps=spec["num_inference_steps"],
                        generator=seeded(spec["seed"]), output_type="np").images
        np.testing.assert_allclose(got, ref, atol=1e-5)


def test_omitted_fields_take_the_pipelines_defaults(engine):
    """What a request leaves out is ZImagePipeline.__call__'s default: 50 steps, guidance 5.0 (CFG with the ""
    negative prompt), 1024 x 1024, max_sequence_length 512, no CFG normalisation, CFG truncation 1.0."""
    family = engine.family("m")
    request = family.validate(ImageRequest(prompt="x"), ImageLimits())
    assert request.num_inference_steps == 50 and request.guidance_scale == 5.0
    assert request.width == request.height == 1024
    assert family.uses_negative(request) and family.request_rows(request) == 2
    assert family.text_options(request) == {"max_sequence_length": 512}
    assert family.cfg_normalization(request) == 0.0 and family.cfg_truncation(request) == 1.0


def test_prompts_go_through_the_prompt_cache(engine):
    """A prompt's embeddings are computed once: a repeat is a cache hit; another max_sequence_length is not."""
    family = engine.family("m")
    options = family.text_options(family.validate(ImageRequest(prompt="a cached cat"), ImageLimits()))
    first = family.cached_text("a cached cat", "t", options)
    assert family.cached_text("a cached cat", "t", options) is first
    assert family.cached_text("a cached cat", "t", {"max_sequence_length": 8}) is not first


@pytest.mark.parametrize("extra", [{"max_sequence_length": 0}, {"cfg_normalization": "yes"},
                                   {"cfg_truncation": -1}])
def test_bad_knobs_are_rejected(engine, extra):
    """Each family knob is checked at the boundary, the error naming it."""
    with pytest.raises(RequestError, match=next(iter(extra))):
        engine.family("m").validate(ImageRequest(prompt="x", extra=extra), ImageLimits())
