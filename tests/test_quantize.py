"""Quantized weights per component ([models.quantize], pipelines/quantize.py): torchao int8 weight-only on SD and
FLUX stays within 25 dB PSNR of the float output and shrinks the weights as int8 should; a GGUF file of FLUX's
transformer (written here with the `gguf` package) loads: F32 equals the safetensors model exactly, Q8_0 is close.
Methods that need CUDA, unknown components and files are refused at start, naming them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.demo.gguf import write_gguf
from pipelines.image_request import ImageRequest
from tests.helpers import demo_path, running_engine

CALL = {"sd": dict(width=64, height=64, guidance_scale=5.0), "flux": dict(width=32, height=32)}
PROMPTS = ("a red bicycle", "a lighthouse on a cliff")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {family: demo_path(tmp_path_factory, family) for family in ("sd", "flux")}


def images(path: str, family: str, **spec) -> tuple[list[np.ndarray], object, object]:
    """The prompts' images from an engine serving `path` with ModelSpec fields `spec`; its /v1/models info and
    the loaded family."""
    with running_engine(path, **spec) as eng:
        out = [eng.submit_image("m", ImageRequest(prompt=p, num_inference_steps=3, seed=i, **CALL[family]))
               .result(timeout=120)["pixels"] for i, p in enumerate(PROMPTS)]
        return out, eng.models["m"], eng.family("m")


def linear_weight_bytes(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in module.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("family, components", [("sd", ("unet", "text_encoder")), ("flux", ("transformer",))])
def test_int8_weight_only(paths, family, components):
    """int8wo on the denoiser (and SD's text encoder): every image within 25 dB of the float one and not equal to
    it; /v1/models reports the methods; each Linear weight's 4 bytes become 1 (plus a float scale per row)."""
    plain, plain_info, plain_family = images(paths[family], family)
    quantized, info, _ = images(paths[family], family, quantize={c: "int8wo" for c in components})
    for a, b in zip(plain, quantized):
        assert psnr(a, b) >= 25 and not np.array_equal(a, b), psnr(a, b)
    assert info.quantization == {c: "int8wo" for c in components} and plain_info.quantization is None
    linear = sum(linear_weight_bytes(getattr(plain_family.pipe, c)) for c in components)
    saved = plain_info.resident_bytes - info.resident_bytes
    assert 0.70 * linear <= saved <= 0.75 * linear, (saved, linear)


def test_gguf_transformer_files(paths, tmp_path):
    """FLUX's transformer from GGUF files: F32 gives the safetensors model's outputs exactly (its weights copied to
    memory of their own, as the loader does: matmuls on CPU round by the weights' alignment), through the engine
    within 1e-5; Q8_0 within 25 dB and smaller."""
    from diffusers import FluxTransformer2DModel

    from pipelines.quantize import Quantization

    flux = paths["flux"]
    f32 = write_gguf(flux, "transformer", tmp_path / "t-f32.gguf", "F32")
    q8 = write_gguf(flux, "transformer", tmp_path / "t-q8.gguf", "Q8_0")
    reference = FluxTransformer2DModel.from_pretrained(flux, subfolder="transformer")
    for param in reference.parameters():
        param.data = param.data.clone()
    loaded = Quantization({"transformer": f"gguf:{f32}"}).load_kwargs(flux, torch.float32)["transformer"]
    gen = torch.Generator().manual_seed(0)
    c = reference.config
    inputs = dict(hidden_states=torch.randn(1, 16, c.in_channels, generator=gen),
                  encoder_hidden_states=torch.randn(1, 8, c.joint_attention_dim, generator=gen),
                  pooled_projections=torch.randn(1, c.pooled_projection_dim, generator=gen),
                  timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3),
                  guidance=torch.tensor([3.5]))
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).sample, reference(**inputs).sample)

    plain, _, _ = images(flux, "flux")
    from_f32, info, _ = images(flux, "flux", quantize={"transformer": f"gguf:{f32}"})
    from_q8, q8_info, _ = images(flux, "flux", quantize={"transformer": f"gguf:{q8}"})
    for a, b, q in zip(plain, from_f32, from_q8):
        np.testing.assert_allclose(b, a, atol=1e-5)
        assert psnr(a, q) >= 25 and not np.array_equal(a, q)
    assert info.quantization == {"transformer": "gguf"} and q8_info.resident_bytes < info.resident_bytes


def test_what_cannot_run_is_refused_at_start(paths, tmp_path):
    from pipelines.config import ModelSpec

    sd = paths["sd"]
    with pytest.raises(ValueError, match=r"quantize.unet = 'fp8' needs a CUDA device"):
        ModelSpec("m", sd, quantize={"unet": "fp8"})
    with pytest.raises(ValueError, match=r"quantize.unet = 'int3': unknown method"):
        ModelSpec("m", sd, quantize={"unet": "int3"})
    with pytest.raises(ValueError, match=r"no such GGUF file"):
        ModelSpec("m", sd, quantize={"unet": f"gguf:{tmp_path / 'missing.gguf'}"})
    with pytest.raises(ValueError, match=r"\['transformer'\], which are not weight components.*'text_encoder', "
                                         r"'unet', 'vae'"):
        with running_engine(sd, quantize={"transformer": "int8wo"}):
            pass
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF but not really")
    with pytest.raises(ValueError, match=r"quantize.unet: .*junk.gguf does not load as UNet2DConditionModel"):
        with running_engine(sd, quantize={"unet": f"gguf:{junk}"}):
            pass
    with pytest.raises(ValueError, match=r"CLIPTextModel does not load from a single GGUF file"):
        with running_engine(sd, quantize={"text_encoder": f"gguf:{junk}"}):
            pass


def test_the_config_file_and_v1_models(paths, tmp_path):
    """[models.quantize] in a config file (a GGUF path relative to it) and what /v1/models says."""
    from fastapi.testclient import TestClient

    from serve.app import create_app
    from serve.config import load_config

    write_gguf(paths["flux"], "transformer", tmp_path / "weights" / "t.gguf", "Q8_0")
    config = tmp_path / "mmserve.toml"
    config.write_text(f'[[models]]\nname = "m"\npath = "{paths["flux"]}"\n[models.quantize]\n'
                      f'transformer = "gguf:weights/t.gguf"\ntext_encoder = "int8wo"\n')
    spec = load_config(config).engine.models[0]
    assert spec.quantize == {"transformer": f"gguf:{tmp_path / 'weights' / 't.gguf'}", "text_encoder": "int8wo"}
    with running_engine(paths["flux"], quantize=spec.quantize) as eng:
        model = TestClient(create_app(eng)).get("/v1/models").json()["data"][0]
    assert model["quantization"] == {"transformer": "gguf", "text_encoder": "int8wo"}
    assert model["resident_bytes"] > 0


@pytest.mark.parametrize("family, offload", [("sd", {"unet": "block", "text_encoder": "model", "vae": "leaf"}),
                                             ("flux", {"transformer": "block", "text_encoder_2": "leaf"})])
def test_group_offload_equals_the_resident_model(paths, family, offload):
    """[models.offload]: diffusers' group offloading hooks on the components (weights kept on the CPU, moved to the
    device around each group's forward; on this CPU-only machine, CPU to CPU): the same images exactly, batched."""
    plain, _, _ = images(paths[family], family)
    offloaded, _, loaded = images(paths[family], family, offload=offload)
    for a, b in zip(plain, offloaded):
        np.testing.assert_array_equal(a, b)
    for component, kind in offload.items():
        module = getattr(loaded.pipe, component)
        if kind == "model":  # on the CPU between forwards, every forward out
            assert module._mmserve_offload.running == 0 and module.device.type == "cpu"
            continue
        assert any(getattr(m, "_diffusers_hook", None) is not None
                   and m._diffusers_hook.get_hook("group_offloading") is not None for m in module.modules())


def test_offload_refusals(paths):
    from pipelines.config import LoraSpec, ModelSpec

    with pytest.raises(ValueError, match=r"offload.unet = 'disk': expected one of \['block', 'leaf', 'model'\]"):
        ModelSpec("m", paths["sd"], offload={"unet": "disk"})
    with pytest.raises(ValueError, match="offload with loras"):
        ModelSpec("m", paths["sd"], offload={"unet": "block"}, loras=(LoraSpec("a", "x"),))
    with pytest.raises(ValueError, match=r"offload names \['transformer'\], which are not modules"):
        with running_engine(paths["sd"], offload={"transformer": "block"}):
            pass
