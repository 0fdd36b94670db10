"""Sana through the engine: text-to-image equal to diffusers' SanaPipeline (CFG, the complex human instruction, the
aspect-ratio binning), batched across requests, and the pipeline's own defaults for what a request omits."""

import numpy as np
import pytest
from diffusers import SanaPipeline

from pipelines.image_request import ImageLimits, ImageRequest, RequestError
from tests.helpers import demo_path, running_engine, seeded

# Multiples of 32 (SanaPipeline.check_inputs); the tiny VAE's factor 4 makes 16 x 8 latents.
WIDTH, HEIGHT = 64, 32
NO_BINNING = {"use_resolution_binning": False}


@pytest.fixture(scope="module")
def sana_path(tmp_path_factory):
    return demo_path(tmp_path_factory, "sana")


@pytest.fixture(scope="module")
def engine(sana_path):
    with running_engine(sana_path, max_batch_size=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(sana_path):
    pipe = SanaPipeline.from_pretrained(sana_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_family_and_tasks(engine):
    info = engine.models["m"]
    assert info.family == "sana"
    assert set(info.tasks) == {"text-to-image"}


@pytest.mark.parametrize("negative,scale,binning", [(None, 4.5, False), ("blurry, low quality", 3.0, False),
                                                    (None, 1.0, False), (None, 4.5, True)])
def test_text_to_image_equals_diffusers(engine, reference, negative, scale, binning):
    """CFG (the negative prompt "" unless given, no instruction for it), none at scale 1, and resolution binning:
    generated at the 64:32 bin of the 512 px table (704 x 352) and resized back to 64 x 32."""
    prompt = "A Small red house on a green hill under a blue sky"
    ours = engine.submit_image("m", ImageRequest(prompt=prompt, negative_prompt=negative, width=WIDTH, height=HEIGHT,
                                                 n=2, num_inference_steps=3, guidance_scale=scale, seed=7,
                                                 extra={"use_resolution_binning": binning}))
    ref = reference(prompt=prompt, negative_prompt=negative or "", guidance_scale=scale, width=WIDTH, height=HEIGHT,
                    num_images_per_prompt=2, num_inference_steps=3, generator=seeded(7), output_type="np",
                    use_resolution_binning=binning).images
    got = ours.result(timeout=120)
    assert got["pixels"].shape == (2, HEIGHT, WIDTH, 3) and got["seed"] == 7
    np.testing.assert_allclose(got["pixels"], ref, atol=1e-5)


def test_guidance_and_instruction_change_the_image(engine):
    """Guidance, the negative prompt and the complex human instruction each reach the denoiser."""
    common = dict(prompt="a lighthouse", width=WIDTH, height=HEIGHT, num_inference_steps=2, seed=3)

    def run(**kw):
        extra = {**NO_BINNING, **kw.pop("extra", {})}
        return engine.submit_image("m", ImageRequest(**common, **kw, extra=extra)).result(timeout=120)["pixels"]

    base = run()
    assert np.abs(base - run(guidance_scale=1.0)).max() > 1e-3
    assert np.abs(base - run(negative_prompt="fog")).max() > 1e-3
    assert np.abs(base - run(extra={"complex_human_instruction": []})).max() > 1e-3


def test_concurrent_requests_share_forwards_and_equal_diffusers(engine, reference):
    """Two requests of the same size at different step counts (and different prompt lengths: every row is
    max_sequence_length tokens with its own mask) share the denoiser's forwards, each equal to its own pipeline call."""
    specs = [dict(prompt="a red door", num_inference_steps=3, seed=1),
             dict(prompt="a very tall lighthouse on a rocky shore at night", num_inference_steps=5, seed=2)]
    before = engine.metrics.stage.max_batch_size("m/denoise", "m")
    handles = [engine.submit_image("m", ImageRequest(width=WIDTH, height=HEIGHT, extra=NO_BINNING, **spec))
               for spec in specs]
    ours = [h.result(timeout=120)["pixels"] for h in handles]
    assert before < 2 <= engine.metrics.stage.max_batch_size("m/denoise", "m")
    for got, spec in zip(ours, specs):
        ref = reference(prompt=spec["prompt"], width=WIDTH, height=HEIGHT, use_resolution_binning=False,
                        num_inference_steps=spec["num_inference_steps"], generator=seeded(spec["seed"]),
                        output_type="np").images
        np.testing.assert_allclose(got, ref, atol=1e-5)


def test_omitted_fields_take_the_pipelines_defaults(engine):
    """What a request leaves out is SanaPipeline.__call__'s default: 20 steps, guidance 4.5 (CFG with the "" negative
    prompt), 1024 x 1024 generated at its aspect-ratio bin, max_sequence_length 300, the complex human instruction."""
    family = engine.family("m")
    request = family.validate(ImageRequest(prompt="x"), ImageLimits())
    assert request.num_inference_steps == 20 and request.guidance_scale == 4.5
    assert request.width == request.height == 1024
    assert family.uses_negative(request)
    assert family.binning(request) and family.generation_size(request) == (512, 512)  # the tiny model's 512 px bins
    options = family.text_options(request)
    assert options["max_sequence_length"] == 300
    assert options["instruction"][0].startswith("Given a user prompt, generate an 'Enhanced prompt'")
    assert family.encode_text("x", **options)["embeds"].shape[1] == 300


def test_prompts_go_through_the_prompt_cache(engine):
    """A prompt's embeddings are computed once: a repeat is a cache hit (with a different negative identity)."""
    family = engine.family("m")
    options = family.text_options(family.validate(ImageRequest(prompt="a cached cat"), ImageLimits()))
    first = family.cached_text("a cached cat", "t", options)
    assert family.cached_text("a Cached cat ", "t", options) is first  # same tokens after lower().strip()
    assert family.cached_text("a cached cat", "t", {**options, "instruction": ()}) is not first


@pytest.mark.parametrize("extra", [{"max_sequence_length": 0}, {"use_resolution_binning": "yes"},
                                   {"complex_human_instruction": "x"}])
def test_bad_knobs_are_rejected(engine, extra):
    """Each family knob is checked at the boundary, the error naming it."""
    with pytest.raises(RequestError, match=next(iter(extra))):
        engine.family("m").validate(ImageRequest(prompt="x", extra=extra), ImageLimits())
