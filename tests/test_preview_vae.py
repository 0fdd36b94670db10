"""preview_vae: a model's previews (partial images) decoded with a tiny VAE (AutoencoderTiny, TAESD); finals keep
the full VAE, bit for bit."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderTiny, StableDiffusionPipeline

from pipelines.image_request import ImageRequest
from stages.events import EventKind
from tests.helpers import demo_path, running_engine, seeded

REQUEST = {"prompt": "a lighthouse", "num_inference_steps": 4, "guidance_scale": 6.0, "seed": 3}


def tiny_vae(sd_path: str, out: Path, latent_channels: int) -> str:
    """A random-weight AutoencoderTiny that upsamples as much as the demo SD's VAE, saved with save_pretrained."""
    blocks = len(json.loads((Path(sd_path) / "vae" / "config.json").read_text())["block_out_channels"])
    torch.manual_seed(0)
    AutoencoderTiny(encoder_block_out_channels=(8,) * blocks, decoder_block_out_channels=(8,) * blocks,
                    num_encoder_blocks=(1,) * blocks, num_decoder_blocks=(1,) * blocks,
                    latent_channels=latent_channels).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def taesd(sd_path, tmp_path_factory):
    return tiny_vae(sd_path, tmp_path_factory.mktemp("taesd") / "taesd", 4)


@pytest.fixture(scope="module")
def engine(sd_path, taesd):
    with running_engine(sd_path, max_batch_size=1, preview_vae=taesd) as eng:
        yield eng


def spy(module, calls: list):
    """Record each decode's input latents and output on `module` (an instance attribute over the method)."""
    decode = module.decode

    def recorded(latents, *args, **kwargs):
        out = decode(latents, *args, **kwargs)
        calls.append((latents.clone(), out[0].clone() if isinstance(out, tuple) else out.sample.clone()))
        return out
    module.decode = recorded
    return decode


def step_latents(sd_path: str, steps: set[int]) -> dict[int, torch.Tensor]:
    """diffusers' own UNet latents after each step in `steps` (1-based: steps done) for REQUEST."""
    pipe = StableDiffusionPipeline.from_pretrained(sd_path, safety_checker=None, feature_extractor=None,
                                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    seen: dict[int, torch.Tensor] = {}

    def keep(p, i, t, kwargs):
        if i + 1 in steps:
            seen[i + 1] = kwargs["latents"].clone()
        return kwargs
    pipe(REQUEST["prompt"], num_inference_steps=REQUEST["num_inference_steps"],
         guidance_scale=REQUEST["guidance_scale"], generator=seeded(REQUEST["seed"]), output_type="latent",
         callback_on_step_end=keep)
    return seen


def test_previews_decode_with_the_tiny_vae(engine, sd_path, taesd):
    family = engine._served["m"].model
    tiny_calls: list = []
    full_calls: list = []
    tiny_decode, full_decode = spy(family.preview_vae, tiny_calls), spy(family.pipe.vae, full_calls)
    try:
        handle = engine.submit_image("m", ImageRequest(**REQUEST, previews=2))
        previews = [e.data["preview"] for e in handle.events(timeout=60)
                    if e.kind is EventKind.PROGRESS and "preview" in e.data]
        handle.result()
    finally:
        family.preview_vae.decode, family.pipe.vae.decode = tiny_decode, full_decode
    # two previews, each through the tiny VAE; the full VAE decodes the final only
    assert len(previews) == 2 and len(tiny_calls) == 2 and len(full_calls) == 1
    # the tiny VAE reads the UNet's latents as they are (TAESD's scaling_factor 1.0), as diffusers' pipelines feed it
    expected_latents = step_latents(sd_path, {1, 2})
    reference = AutoencoderTiny.from_pretrained(taesd).eval()
    for (latents, _), step, preview in zip(tiny_calls, (1, 2), previews, strict=True):
        torch.testing.assert_close(latents, expected_latents[step], atol=1e-5, rtol=1e-5)
        with torch.inference_mode():
            image = reference.decode(latents).sample  # [-1, 1]
        want = ((image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()[0] * 255).round().astype("uint8")
        assert preview.size == (want.shape[1], want.shape[0])
        np.testing.assert_array_equal(np.asarray(preview), want)


def test_the_final_image_is_the_full_vaes(engine, sd_path):
    with_tiny = engine.submit_image("m", ImageRequest(**REQUEST, previews=2)).result()
    with running_engine(sd_path, max_batch_size=1) as plain:
        without = plain.submit_image("m", ImageRequest(**REQUEST, previews=2)).result()
    np.testing.assert_array_equal(with_tiny["pixels"], without["pixels"])
    assert np.asarray(with_tiny["images"][0]).tobytes() == np.asarray(without["images"][0]).tobytes()


@pytest.mark.parametrize("family", ["sdxl", "flux", "sd3"])
def test_other_families_preview_with_the_tiny_vae(demo_models, tmp_path, family):
    """SDXL's latents as they are; Flux's unpacked from its token sequence first (16 channels); SD3's 16."""
    path = str(demo_models[family])
    channels = json.loads((Path(path) / "vae" / "config.json").read_text())["latent_channels"]
    with running_engine(path, preview_vae=tiny_vae(path, tmp_path / "tiny", channels)) as eng:
        calls: list = []
        spy(eng._served["m"].model.preview_vae, calls)
        handle = eng.submit_image("m", ImageRequest(prompt="a kite", width=64, height=48, num_inference_steps=3,
                                                    seed=1, previews=1))
        previews = [e.data["preview"] for e in handle.events(timeout=60)
                    if e.kind is EventKind.PROGRESS and "preview" in e.data]
    assert [p.size for p in previews] == [(64, 48)] and len(calls) == 1
    assert calls[0][0].shape[1] == channels and calls[0][0].ndim == 4  # [N, C, h, w]


def test_refused_at_start(sd_path, tmp_path, tmp_path_factory):
    from pipelines.config import ModelSpec
    from serve.config import _model

    wide = tiny_vae(sd_path, tmp_path / "wide", 16)
    with pytest.raises(ValueError, match=r"preview_vae .*wide has 16 latent channels, the model's VAE 4"):
        with running_engine(sd_path, preview_vae=wide):
            pass
    with pytest.raises(ValueError, match=r"preview_vae is not supported by family qwen_image"):
        with running_engine(demo_path(tmp_path_factory, "qwen_image"), preview_vae=wide):
            pass
    with pytest.raises(ValueError, match=r"preview_vae .*missing.* is not a directory"):
        ModelSpec("m", sd_path, preview_vae=str(tmp_path / "missing"))
    # in a config file, the path is relative to the file
    spec = _model({"name": "m", "path": sd_path, "preview_vae": "wide"}, 0, tmp_path)
    assert spec.preview_vae == str(tmp_path / "wide")
