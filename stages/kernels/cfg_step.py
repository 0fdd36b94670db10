"""The denoise commit's elementwise tail in one pass: CFG combine + Euler / flow-matching update.

    x_next = x + (sigma_next - sigma) * (uncond + scale * (cond - uncond))      (CFG)
    x_next = x + (sigma_next - sigma) * cond                                    (no CFG)

Unfused, torch reads and writes latents-sized tensors about five times (the combine, then the
scheduler's upcast, multiply, add and downcast); the kernel reads x, cond and uncond once and
writes x_next once, all math in float32. It is the update of FlowMatchEulerDiscreteScheduler
(and of Euler-discrete with epsilon prediction, which has the same form in sigma).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stages.kernels._launch import wants_triton

BLOCK = 1024


@triton.jit
def _cfg_euler_kernel(x_ptr, cond_ptr, uncond_ptr, out_ptr, n, scale, dt,
                      HAS_UNCOND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    guided = tl.load(cond_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_UNCOND:
        u = tl.load(uncond_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        guided = u + scale * (guided - u)
    tl.store(out_ptr + offs, (x + dt * guided).to(out_ptr.dtype.element_ty), mask=ok)


def cfg_euler_step_reference(x: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor | None, scale: float,
                             dt: float) -> torch.Tensor:
    """The torch reference: float32 math, the result in x's dtype."""
    guided = cond.float() if uncond is None else uncond.float() + scale * (cond.float() - uncond.float())
    return (x.float() + dt * guided).to(x.dtype)


def cfg_euler_step(x: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor | None, scale: float, dt: float, *,
                   use_triton: bool | None = None) -> torch.Tensor:
    """x, cond, uncond of one shape ([n, ...] latents); `scale` the guidance, `dt` = sigma_next - sigma."""
    if cond.shape != x.shape or (uncond is not None and uncond.shape != x.shape):
        raise ValueError(f"x, cond and uncond must share a shape, got {tuple(x.shape)}, {tuple(cond.shape)}, "
                         f"{None if uncond is None else tuple(uncond.shape)}")
    if not wants_triton(x, use_triton):
        return cfg_euler_step_reference(x, cond, uncond, scale, dt)
    has_uncond = uncond is not None
    x, cond = x.contiguous(), cond.contiguous()
    uncond = uncond.contiguous() if uncond is not None else cond  # unread without HAS_UNCOND
    out = torch.empty_like(x)
    if x.numel():
        _cfg_euler_kernel[(triton.cdiv(x.numel(), BLOCK),)](
            x, cond, uncond, out, x.numel(), float(scale), float(dt), HAS_UNCOND=has_uncond, BLOCK=BLOCK)
    return out
