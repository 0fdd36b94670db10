"""RMSNorm as one kernel: a program per row reads it once, reduces in float32 and writes it scaled.

Semantics of transformers' Llama-family RMSNorm, so a patched module gives the same numbers:
normalise in float32, cast back to the input dtype, then multiply by the weight
(y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), in the promoted dtype of the two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stages.kernels._launch import wants_triton


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, dim, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # the reference's cast before the weight
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: bool | None = None) -> torch.Tensor:
    """x [..., D], weight [D]."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}] for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    if not wants_triton(x, use_triton):
        return rms_norm_reference(x, weight, eps)
    dim = x.shape[-1]
    rows = x.reshape(-1, dim).contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, rows.stride(0), out.stride(0), dim,
                                           float(eps), BLOCK_D=triton.next_power_of_2(dim))
    return out.reshape(*x.shape[:-1], dim)
