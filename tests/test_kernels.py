"""Triton kernels against their torch references: interpreted on the CPU (tiny shapes), native on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.kernels.adaln import adaln_modulate, adaln_modulate_reference
from stages.kernels.cfg_step import cfg_euler_step, cfg_euler_step_reference
from stages.kernels.patch import use_fused_norms
from stages.kernels.rmsnorm import rms_norm, rms_norm_reference

# One ulp of bfloat16 at the magnitudes below: the interpreter rounds its casts its own way.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=4e-2, rtol=2e-2)}


def _randn(*shape, dtype=torch.float32, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [True, False])
def test_cfg_euler_step_matches_reference(dtype, cfg):
    x, cond, uncond = (_randn(2, 4, 3, 5, dtype=dtype, seed=s) for s in range(3))
    uncond = uncond if cfg else None
    got = cfg_euler_step(x, cond, uncond, 4.5, -0.07, use_triton=True)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, cfg_euler_step_reference(x, cond, uncond, 4.5, -0.07), **TOL[dtype])


def test_cfg_euler_step_is_the_flow_match_scheduler_step():
    """The fused update equals diffusers' guide + FlowMatchEulerDiscreteScheduler.step in float32."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(6)
    x, cond, uncond = (_randn(1, 16, 8, seed=s) for s in range(3))
    t = scheduler.timesteps[2]
    scheduler._step_index = 2
    want = scheduler.step(uncond + 3.0 * (cond - uncond), t, x, return_dict=False)[0]
    dt = float(scheduler.sigmas[3] - scheduler.sigmas[2])
    torch.testing.assert_close(cfg_euler_step(x, cond, uncond, 3.0, dt, use_triton=True), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [24, 64])
def test_rms_norm_matches_reference(dtype, dim):
    x, w = _randn(3, 5, dim, dtype=dtype), _randn(dim, seed=1)
    got = rms_norm(x, w, 1e-6, use_triton=True)
    want = rms_norm_reference(x, w, 1e-6)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_adaln_modulate_matches_reference(dtype, norm):
    x = _randn(2, 7, 40, dtype=dtype)
    scale, shift = _randn(2, 40, dtype=dtype, seed=1), _randn(2, 40, dtype=dtype, seed=2)
    got = adaln_modulate(x, scale, shift, 1e-6, norm=norm, use_triton=True)
    torch.testing.assert_close(got, adaln_modulate_reference(x, scale, shift, 1e-6, norm), **TOL[dtype])


def test_kernels_refuse_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        rms_norm(_randn(2, 8), _randn(8), 1e-6, use_triton=True)
    # The default dispatch on CPU tensors is the reference.
    torch.testing.assert_close(rms_norm(_randn(2, 8), _randn(8), 1e-6), rms_norm_reference(_randn(2, 8), _randn(8),
                                                                                         1e-6))


def test_patched_modules_give_the_same_outputs():
    """A Llama RMSNorm and diffusers' AdaLayerNormZero(Single) on the interpreted kernels."""
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"rms": LlamaRMSNorm(32), "zero": AdaLayerNormZero(32),
                                 "single": AdaLayerNormZeroSingle(32)})
    x, emb = torch.randn(2, 5, 32), torch.randn(2, 32)
    want = (model["rms"](x), model["zero"](x, emb=emb), model["single"](x, emb=emb))
    assert use_fused_norms(model, use_triton=True) == 3
    got = (model["rms"](x), model["zero"](x, emb=emb), model["single"](x, emb=emb))
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for g, w in zip(got[1] + got[2], want[1] + want[2]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_fused_commit_path_keeps_flux_equal(tmp_path, monkeypatch):
    """fused_kernels on: the flow-matching commit and the adaLN norms take the fused path (the reference math
    on the CPU) and the image stays equal to the default path."""
    from pipelines.demo import build_demo_model
    from pipelines.image_request import ImageRequest
    from tests.helpers import running_engine

    path = str(build_demo_model("flux", tmp_path / "flux"))
    request = dict(prompt="a boat", negative_prompt="fog", width=32, height=32, num_inference_steps=3, seed=2,
                   extra={"true_cfg_scale": 2.0})
    with running_engine(path) as plain:
        want = plain.submit_image("m", ImageRequest(**request)).result()["pixels"]
    import stages.kernels.cfg_step as cfg_step

    calls = []
    monkeypatch.setattr(cfg_step, "cfg_euler_step", lambda *a, **k: calls.append(a[2] is not None) or
                        cfg_step.cfg_euler_step_reference(*a))
    with running_engine(path, fused_kernels=True) as fused:
        got = fused.submit_image("m", ImageRequest(**request)).result()["pixels"]
        assert "forward" in vars(fused.family("m").pipe.transformer.transformer_blocks[0].norm1)  # patched
    assert calls[-3:] == [True, True, True]  # every step of the request, with its true-CFG branch
    np.testing.assert_allclose(got, want, atol=1e-5)


# -- native on the GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_kernels_match_references(dtype):
    x, cond, uncond = (_randn(2, 16, 128, 64, dtype=dtype, seed=s, device="cuda") for s in range(3))
    torch.testing.assert_close(cfg_euler_step(x, cond, uncond, 3.5, -0.04), cfg_euler_step_reference(
        x, cond, uncond, 3.5, -0.04), atol=1e-2, rtol=1e-2)
    h, w = _randn(64, 4096, dtype=dtype, device="cuda"), _randn(4096, device="cuda")
    torch.testing.assert_close(rms_norm(h, w, 1e-5), rms_norm_reference(h, w, 1e-5), atol=1e-2, rtol=1e-2)
    t = _randn(2, 1024, 3072, dtype=dtype, device="cuda")
    scale = _randn(2, 3072, dtype=dtype, seed=1, device="cuda")
    shift = _randn(2, 3072, dtype=dtype, seed=2, device="cuda")
    torch.testing.assert_close(adaln_modulate(t, scale, shift), adaln_modulate_reference(t, scale, shift),
                               atol=2e-2, rtol=2e-2)
