"""adaLN modulation fused with its LayerNorm: y = LN(x) * (1 + scale) + shift, one pass per token.

DiT blocks (Flux, SD3) normalise every token and modulate it with per-sample scale and shift
from the timestep embedding (diffusers' AdaLayerNormZero / AdaLayerNormZeroSingle). Unfused
that is a LayerNorm plus three broadcast elementwise ops over [B, T, D]; the kernel reads each
token once and writes it once, statistics in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stages.kernels._launch import wants_triton


@triton.jit
def _adaln_kernel(x_ptr, scale_ptr, shift_ptr, out_ptr, tokens, dim, eps,
                  stride_xb, stride_xt, stride_sb, stride_ob, stride_ot,
                  NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    b = row // tokens
    t = row % tokens
    cols = tl.arange(0, BLOCK_D)
    ok = cols < dim
    x = tl.load(x_ptr + b * stride_xb + t * stride_xt + cols, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        mean = tl.sum(x, axis=0) / dim
        centered = tl.where(ok, x - mean, 0.0)
        x = centered / tl.sqrt(tl.sum(centered * centered, axis=0) / dim + eps)
    scale = tl.load(scale_ptr + b * stride_sb + cols, mask=ok, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + b * stride_sb + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * stride_ob + t * stride_ot + cols, (x * (1.0 + scale) + shift).to(out_ptr.dtype.element_ty),
             mask=ok)


def adaln_modulate_reference(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6,
                             norm: bool = True) -> torch.Tensor:
    """x [B, T, D]; scale, shift [B, D]. Float32 math, the result in x's dtype."""
    h = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), eps=eps) if norm else x.float()
    return (h * (1 + scale.float()[:, None]) + shift.float()[:, None]).to(x.dtype)


def adaln_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6, *, norm: bool = True,
                   use_triton: bool | None = None) -> torch.Tensor:
    """LN(x) * (1 + scale[:, None]) + shift[:, None] (norm=False: the modulation alone)."""
    if x.dim() != 3 or scale.shape != (x.shape[0], x.shape[2]) or shift.shape != scale.shape:
        raise ValueError(f"x must be [B, T, D] and scale, shift [B, D]; got {tuple(x.shape)}, {tuple(scale.shape)}, "
                         f"{tuple(shift.shape)}")
    if not wants_triton(x, use_triton):
        return adaln_modulate_reference(x, scale, shift, eps, norm)
    batch, tokens, dim = x.shape
    x = x if x.stride(2) == 1 else x.contiguous()
    scale, shift = scale.contiguous(), shift.contiguous()
    out = torch.empty((batch, tokens, dim), dtype=x.dtype, device=x.device)
    if out.numel():
        _adaln_kernel[(batch * tokens,)](x, scale, shift, out, tokens, dim, float(eps), x.stride(0), x.stride(1),
                                         scale.stride(0), out.stride(0), out.stride(1), NORM=norm,
                                         BLOCK_D=triton.next_power_of_2(dim))
    return out
