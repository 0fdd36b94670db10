"""Qwen-Image through the engine: text-to-image equal to diffusers' QwenImagePipeline (true CFG with a negative
prompt included), batched across requests, and the pipeline's own defaults for what a request omits."""

import numpy as np
import pytest
from diffusers import QwenImagePipeline

from pipelines.image_request import ImageLimits, ImageRequest
from tests.helpers import demo_path, running_engine, seeded

# The tiny checkpoint packs 8 px into one token: 48 x 32 is 6 x 4 tokens.
WIDTH, HEIGHT = 48, 32


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory):
    return demo_path(tmp_path_factory, "qwen_image")


@pytest.fixture(scope="module")
def engine(qwen_path):
    with running_engine(qwen_path, max_batch_size=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(qwen_path):
    pipe = QwenImagePipeline.from_pretrained(qwen_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_family_and_tasks(engine):
    info = engine.models["m"]
    assert info.family == "qwen_image"
    assert set(info.tasks) == {"text-to-image"}


@pytest.mark.parametrize("negative,scale", [(None, 4.0), ("blurry, low quality", 3.0), ("x", 1.0)])
def test_text_to_image_equals_diffusers(engine, reference, negative, scale):
    """guidance_scale is the pipeline's true_cfg_scale: with a negative prompt it guides (the negative prompt is
    shorter than the prompt here: one forward holds both, padded and masked), without one it does nothing."""
    prompt = "a small red house on a green hill under a blue sky"
    ours = engine.submit_image("m", ImageRequest(prompt=prompt, negative_prompt=negative, width=WIDTH, height=HEIGHT,
                                                 n=2, num_inference_steps=3, guidance_scale=scale, seed=7))
    ref = reference(prompt=prompt, negative_prompt=negative, true_cfg_scale=scale, width=WIDTH, height=HEIGHT,
                    num_images_per_prompt=2, num_inference_steps=3, generator=seeded(7), output_type="np").images
    got = ours.result(timeout=120)
    assert got["pixels"].shape == (2, HEIGHT, WIDTH, 3) and got["seed"] == 7
    np.testing.assert_allclose(got["pixels"], ref, atol=1e-5)


def test_one_step_is_refused_where_the_schedule_needs_two(engine, reference):
    """The scheduler stretches its sigmas to end at shift_terminal (0.02, as Qwen-Image's own config): a one-step
    schedule is the lone sigma 1.0, which the stretch turns into 0/0, and diffusers returns a NaN image. The engine
    refuses one step with a RequestError naming num_inference_steps; two steps equal diffusers; its warm-up runs two."""
    from pipelines.image_request import RequestError

    common = dict(prompt="a lighthouse", width=WIDTH, height=HEIGHT)
    with pytest.warns(RuntimeWarning, match="invalid value encountered in divide"):
        nan = reference(**common, num_inference_steps=1, generator=seeded(3), output_type="np").images
    assert np.isnan(nan).all()  # what one step gives in diffusers: the reason for the refusal
    with pytest.raises(RequestError) as err:
        engine.submit_image("m", ImageRequest(**common, num_inference_steps=1, seed=3))
    assert err.value.param == "num_inference_steps" and "at least 2" in err.value.message, err.value.message
    got = engine.submit_image("m", ImageRequest(**common, num_inference_steps=2, seed=3)).result(timeout=120)
    ref = reference(**common, num_inference_steps=2, generator=seeded(3), output_type="np").images
    np.testing.assert_allclose(got["pixels"], ref, atol=1e-5)
    assert engine.family("m").warm_request(WIDTH, HEIGHT).num_inference_steps == 2


def test_true_cfg_changes_the_image(engine):
    """A negative prompt with a scale above 1 guides; the same request without it does not."""
    common = dict(prompt="a lighthouse", width=WIDTH, height=HEIGHT, num_inference_steps=2, seed=3)
    plain = engine.submit_image("m", ImageRequest(**common)).result(timeout=120)["pixels"]
    guided = engine.submit_image("m", ImageRequest(negative_prompt="fog", **common)).result(timeout=120)["pixels"]
    assert np.abs(plain - guided).max() > 1e-3


def test_concurrent_requests_share_forwards_and_equal_diffusers(engine, reference):
    """Two requests of the same size and text length at different step counts share the denoiser's forwards, each
    still equal to its own pipeline call."""
    specs = [dict(prompt="a red door", num_inference_steps=3, seed=1),
             dict(prompt="a red door", num_inference_steps=4, seed=2)]
    before = engine.metrics.stage.max_batch_size("m/denoise", "m")
    handles = [engine.submit_image("m", ImageRequest(width=WIDTH, height=HEIGHT, **spec)) for spec in specs]
    ours = [h.result(timeout=120)["pixels"] for h in handles]
    assert before < 2 <= engine.metrics.stage.max_batch_size("m/denoise", "m")
    for got, spec in zip(ours, specs):
        ref = reference(prompt=spec["prompt"], width=WIDTH, height=HEIGHT,
                        num_inference_steps=spec["num_inference_steps"], generator=seeded(spec["seed"]),
                        output_type="np").images
        np.testing.assert_allclose(got, ref, atol=1e-5)


def test_omitted_fields_take_the_pipelines_defaults(engine):
    """What a request leaves out is QwenImagePipeline.__call__'s default: 50 steps, true_cfg_scale 4.0 (as the
    guidance scale), 128 latent px * the VAE's scale factor, max_sequence_length 512."""
    family = engine.family("m")
    request = family.validate(ImageRequest(prompt="x", negative_prompt="y"), ImageLimits())
    assert request.num_inference_steps == 50 and request.guidance_scale == 4.0
    assert request.width == request.height == 128 * family.vae_scale_factor
    assert family.max_sequence_length(request) == 512
    assert family.uses_negative(request) and not family.uses_negative(ImageRequest(prompt="x", guidance_scale=4.0))
