"""Stable Diffusion 3 through the engine: equal to diffusers for every task, batched across requests."""

import time

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline, StableDiffusion3Pipeline

from pipelines.image_request import ImageRequest, RequestError, Task
from tests.helpers import half_mask, noise_image, running_engine, seeded, variant


@pytest.fixture(scope="module")
def sd3_path(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return str(build_demo_model("sd3", tmp_path_factory.mktemp("sd3") / "sd3"))


@pytest.fixture(scope="module")
def reference(sd3_path):
    # The demo checkpoint has no T5: model_index.json lists text_encoder_3 / tokenizer_3 as null.
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_path, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def engine(sd3_path):
    """Batching on (up to 4 requests per denoiser forward); solo requests run alone anyway."""
    with running_engine(sd3_path, max_batch_size=4) as eng:
        yield eng


def test_family_facts(engine):
    info = engine.models["m"]
    assert info.family == "sd3"
    assert set(info.tasks) == {"text-to-image", "image-to-image", "inpainting"}
    assert info.size_factor == 16 and info.default_size == 64  # vae factor 8 x patch 2; sample_size 8 x 8
    fam = engine.family("m")
    assert fam.pipe.text_encoder_3 is None and fam.pipe.tokenizer_3 is None


def test_text_to_image_equals_diffusers(engine, reference):
    ours = engine.submit_image("m", ImageRequest(prompt="a red bicycle", negative_prompt="blurry", n=2,
                                                 num_inference_steps=4, guidance_scale=6.0, seed=11)).result()
    ref = reference("a red bicycle", negative_prompt="blurry", num_images_per_prompt=2, num_inference_steps=4,
                    guidance_scale=6.0, generator=seeded(11), output_type="np").images
    assert ours["pixels"].shape == ref.shape == (2, 64, 64, 3)
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_defaults_and_empty_negative_equal_diffusers(engine, reference):
    # Default size, guidance 7.0 with no negative prompt: the pipeline's negative is "".
    ours = engine.submit_image("m", ImageRequest(prompt="a boat", num_inference_steps=3, seed=5)).result()
    ref = reference("a boat", num_inference_steps=3, generator=seeded(5), output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_no_guidance_non_square_equals_diffusers(engine, reference):
    ours = engine.submit_image("m", ImageRequest(prompt="a boat", width=96, height=48, num_inference_steps=3,
                                                 guidance_scale=1.0, seed=5)).result()
    ref = reference("a boat", width=96, height=48, num_inference_steps=3, guidance_scale=1.0, generator=seeded(5),
                    output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_max_sequence_length_equals_diffusers(engine, reference):
    ours = engine.submit_image("m", ImageRequest(prompt="a boat", num_inference_steps=2, seed=5,
                                                 extra={"max_sequence_length": 77})).result()
    ref = reference("a boat", num_inference_steps=2, max_sequence_length=77, generator=seeded(5),
                    output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)
    with pytest.raises(RequestError) as err:
        engine.submit_image("m", ImageRequest(prompt="x", extra={"max_sequence_length": 513}))
    assert err.value.param == "max_sequence_length"


def test_image_to_image_equals_diffusers(engine, reference):
    pipe = variant(reference, StableDiffusion3Img2ImgPipeline)
    image = noise_image()
    ours = engine.submit_image("m", ImageRequest(prompt="a cat", task=Task.IMAGE_TO_IMAGE, image=image, strength=0.6,
                                                 negative_prompt="dark", num_inference_steps=5, n=2,
                                                 seed=3)).result()
    ref = pipe("a cat", image=image, strength=0.6, negative_prompt="dark", num_inference_steps=5,
               num_images_per_prompt=2, generator=seeded(3), output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_inpainting_equals_diffusers(engine, reference):
    pipe = variant(reference, StableDiffusion3InpaintPipeline)
    image, mask = noise_image(), half_mask()
    for strength in (0.75, 1.0):
        ours = engine.submit_image("m", ImageRequest(prompt="a cat", task=Task.INPAINTING, image=image, mask=mask,
                                                     strength=strength, num_inference_steps=5, seed=3)).result()
        ref = pipe("a cat", image=image, mask_image=mask, strength=strength, num_inference_steps=5,
                   generator=seeded(3), height=64, width=64, output_type="np").images
        np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_concurrent_requests_share_forwards_and_equal_solo(engine):
    specs = [dict(seed=1, num_inference_steps=8), dict(seed=2, num_inference_steps=5),
             dict(seed=3, num_inference_steps=6, guidance_scale=3.0, n=2)]
    solo = [engine.submit_image("m", ImageRequest(prompt=f"prompt {i}", **s)).result()["pixels"]
            for i, s in enumerate(specs)]
    assert engine.metrics.stage.max_batch_size("m/denoise", "m") <= 1  # solo runs never shared a forward
    handles = []
    for i, s in enumerate(specs):  # staggered arrivals: later requests join at a step boundary
        handles.append(engine.submit_image("m", ImageRequest(prompt=f"prompt {i}", **s)))
        time.sleep(0.02)
    batched = [h.result(timeout=120)["pixels"] for h in handles]
    assert engine.metrics.stage.max_batch_size("m/denoise", "m") > 1
    for got, want in zip(batched, solo):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_with_t5_and_dynamic_shifting_equals_diffusers(sd3_path, reference, tmp_path_factory):
    """The T5 path (real embeddings instead of zeros) and `mu` from the image's token count."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    from pipelines.demo import _t5_tokenizer

    tokenizer_3 = _t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        text_encoder_3 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_3), d_model=reference.transformer.config.joint_attention_dim, d_kv=8, d_ff=64,
            num_layers=1, num_heads=4, relative_attention_num_buckets=8, pad_token_id=tokenizer_3.pad_token_id,
            eos_token_id=tokenizer_3.eos_token_id, decoder_start_token_id=tokenizer_3.pad_token_id))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    path = tmp_path_factory.mktemp("sd3-t5")
    StableDiffusion3Pipeline(**{**reference.components, "text_encoder_3": text_encoder_3,
                                "tokenizer_3": tokenizer_3, "scheduler": scheduler}).save_pretrained(path)
    pipe = StableDiffusion3Pipeline.from_pretrained(path)  # reloaded: eval mode, as the engine loads it
    pipe.set_progress_bar_config(disable=True)
    with running_engine(str(path), name="t5") as eng:
        assert eng.family("t5").pipe.text_encoder_3 is not None
        ours = eng.submit_image("t5", ImageRequest(prompt="a red bicycle", negative_prompt="blurry", width=96,
                                                   height=64, num_inference_steps=3, seed=7,
                                                   extra={"max_sequence_length": 40})).result()
    ref = pipe("a red bicycle", negative_prompt="blurry", width=96, height=64, num_inference_steps=3,
               max_sequence_length=40, generator=seeded(7), output_type="np").images
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)
