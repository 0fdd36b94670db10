"""Swap a loaded model's norm modules onto the fused kernels (opt-in: ModelSpec.fused_kernels).

Only modules whose forward the kernels reproduce are touched: transformers' Llama-style RMSNorms
and diffusers' AdaLayerNormZero / AdaLayerNormZeroSingle over a plain LayerNorm (no affine).
The swap sets an instance `forward`; the module's weights stay where they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stages.kernels.adaln import adaln_modulate
from stages.kernels.rmsnorm import rms_norm

# transformers classes whose forward is exactly weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
LLAMA_STYLE_RMSNORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"})


def use_fused_norms(model: nn.Module, *, use_triton: bool | None = None) -> int:
    """Patch every matching module of `model`; returns how many were patched."""
    patched = 0
    for module in model.modules():
        name = type(module).__name__
        if name in LLAMA_STYLE_RMSNORMS:
            module.forward = _rms_forward(module, use_triton)
        elif name in ("AdaLayerNormZero", "AdaLayerNormZeroSingle") and _plain_layer_norm(module.norm) \
                and getattr(module, "emb", None) is None:
            module.forward = _adaln_forward(module, use_triton, chunks=6 if name == "AdaLayerNormZero" else 3)
        else:
            continue
        patched += 1
    return patched


def _plain_layer_norm(norm: object) -> bool:
    return type(norm) is nn.LayerNorm and not norm.elementwise_affine


def _rms_forward(module: Any, use_triton: bool | None):
    # `module`: one of LLAMA_STYLE_RMSNORMS (matched by class name), with `weight` and `variance_epsilon`.
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, module.weight, module.variance_epsilon, use_triton=use_triton)
    return forward


def _adaln_forward(module: Any, use_triton: bool | None, chunks: int):
    """AdaLayerNormZero(Single).forward with the norm and the modulation fused (`module`: matched by class name)."""
    def forward(x: torch.Tensor, *args, emb: torch.Tensor | None = None, **kwargs):
        if args or kwargs.get("timestep") is not None or kwargs.get("class_labels") is not None:
            raise ValueError("the fused adaLN takes `emb` only (no timestep/class-label embedding)")
        parts = module.linear(module.silu(emb)).chunk(chunks, dim=1)
        shift_msa, scale_msa = parts[0], parts[1]
        x = adaln_modulate(x, scale_msa, shift_msa, module.norm.eps, use_triton=use_triton)
        return (x, *parts[2:])
    return forward
