"""The per-row LoRA update as two kernels (SGMV / punica style): rows of a batch use different adapters, or several.

    result[n] = out[n] + sum over entries e with rows[e] == n of
                scales[e] * lora_b[slots[e]] @ (lora_a[slots[e]] @ x[n])

x [N, IN] is a linear layer's input and out [N, OUT] its base output (left as it is: the result is a new tensor).
lora_a [S, R, IN] and lora_b [S, OUT, R] stack the A and B matrices of S adapter slots, their ranks zero-padded
up to R (the rank bucket; padding adds exact zeros). Entry e of rows, slots, scales ([E] each) applies slot
slots[e] at scale scales[e] to row rows[e]: a row may have several entries, or none (then it is out's row).

The entries are sorted by row on the device (a stable argsort, no host sync). The shrink kernel, a program per
entry and R block, writes t[e] = A[slot] @ x[row] into a float32 [E, R] buffer, looping over IN in tiles. The
expand kernel, a program per (entry, OUT tile), works only where its entry starts a row's segment: it sums
scale * B[slot] @ t over the segment's entries and writes out[row] + sum once, so no atomics are needed. All
math in float32 (x first rounded to the weights' dtype, as the reference does); the result in out's dtype.
The reference computes in the weights' dtype with torch ops (what stages/lora.py does per adapter).

rows and slots must index x and lora_a: the kernels do not check them (that would sync with the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stages.kernels._launch import wants_triton

BLOCK_IN = 64  # the tile of IN the shrink loops over
BLOCK_OUT = 64  # the tile of OUT an expand program owns
MAX_BLOCK_R = 64  # rank buckets above it are split across shrink programs and looped over in the expand


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, rows_ptr, slots_ptr, t_ptr, dim_in, rank,
                        stride_xn, stride_as, stride_ar, stride_te,
                        BLOCK_R: tl.constexpr, BLOCK_IN: tl.constexpr):
    e = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rank
    row = tl.load(rows_ptr + e)  # int64: the offsets below stay 64-bit
    slot = tl.load(slots_ptr + e)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, dim_in, BLOCK_IN):
        k = start + tl.arange(0, BLOCK_IN)
        k_ok = k < dim_in
        xk = tl.load(x_ptr + row * stride_xn + k, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_IN]
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(t_ptr + e * stride_te + r, acc, mask=r_ok)


@triton.jit
def _lora_expand_kernel(t_ptr, b_ptr, rows_ptr, slots_ptr, scales_ptr, seg_start_ptr, seg_end_ptr, y_ptr,
                        dim_out, rank, stride_te, stride_bs, stride_bo, stride_yn,
                        BLOCK_R: tl.constexpr, BLOCK_OUT: tl.constexpr):
    e = tl.program_id(0)
    start = tl.load(seg_start_ptr + e)
    if start == e:  # the first entry of its row's segment: this program owns the row's OUT tile
        end = tl.load(seg_end_ptr + e)
        row = tl.load(rows_ptr + e)
        o = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        o_ok = o < dim_out
        acc = tl.zeros([BLOCK_OUT], dtype=tl.float32)
        for j in range(start, end):
            slot = tl.load(slots_ptr + j)
            scale = tl.load(scales_ptr + j)
            part = tl.zeros([BLOCK_OUT], dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                r_ok = r < rank
                t = tl.load(t_ptr + j * stride_te + r, mask=r_ok, other=0.0)
                b = tl.load(b_ptr + slot * stride_bs + o[:, None] * stride_bo + r[None, :],
                            mask=o_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_OUT, BLOCK_R]
                part += tl.sum(b * t[None, :], axis=1)
            acc += scale * part
        base = tl.load(y_ptr + row * stride_yn + o, mask=o_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_yn + o, (base + acc).to(y_ptr.dtype.element_ty), mask=o_ok)


def lora_rows_reference(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                        rows: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The torch reference: gathered shrink and expand in the weights' dtype, index_add into a copy of out."""
    rows, slots = rows.long(), slots.long()
    shrunk = torch.einsum("eri,ei->er", lora_a[slots], x.index_select(0, rows).to(lora_a.dtype))  # [E, R]
    update = torch.einsum("eor,er->eo", lora_b[slots], shrunk) * scales.to(lora_b.dtype)[:, None]  # [E, OUT]
    return out.index_add(0, rows, update.to(out.dtype))


def _check_shapes(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  rows: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [N, IN], got {tuple(x.shape)}")
    if out.dim() != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(f"out must be [N, OUT] with N = {x.shape[0]} (x's rows), got {tuple(out.shape)}")
    dim_in, dim_out = x.shape[1], out.shape[1]
    if lora_a.dim() != 3 or lora_a.shape[2] != dim_in:
        raise ValueError(f"lora_a must be [S, R, IN] with IN = {dim_in} (x's features), got {tuple(lora_a.shape)}")
    slot_count, rank = lora_a.shape[0], lora_a.shape[1]
    if lora_b.shape != (slot_count, dim_out, rank):
        raise ValueError(f"lora_b must be [S, OUT, R] = [{slot_count}, {dim_out}, {rank}] (S, R from lora_a, OUT "
                         f"from out), got {tuple(lora_b.shape)}")
    if lora_b.dtype != lora_a.dtype:
        raise ValueError(f"lora_a and lora_b must share a dtype, got {lora_a.dtype} and {lora_b.dtype}")
    if rows.dim() != 1 or slots.shape != rows.shape or scales.shape != rows.shape:
        raise ValueError(f"rows, slots and scales must be [E] of one length, got {tuple(rows.shape)}, "
                         f"{tuple(slots.shape)}, {tuple(scales.shape)}")
    if rows.is_floating_point() or slots.is_floating_point():
        raise ValueError(f"rows and slots must be integer tensors, got {rows.dtype} and {slots.dtype}")


def lora_rows(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: torch.Tensor,
              slots: torch.Tensor, scales: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """x [N, IN], out [N, OUT], lora_a [S, R, IN], lora_b [S, OUT, R]; rows, slots, scales [E]. A new tensor."""
    _check_shapes(x, out, lora_a, lora_b, rows, slots, scales)
    if not wants_triton(x, use_triton):
        return lora_rows_reference(x, out, lora_a, lora_b, rows, slots, scales)
    result = out.clone(memory_format=torch.contiguous_format)  # rows without entries stay as they are
    rank, dim_out = lora_a.shape[1], out.shape[1]
    if rows.numel() == 0 or rank == 0 or dim_out == 0:
        return result
    order = torch.argsort(rows.long(), stable=True)  # the entries grouped by row, their order kept within a row
    rows_sorted = rows.long()[order].contiguous()
    slots_sorted = slots.long()[order].contiguous()
    scales_sorted = scales.to(torch.float32)[order].contiguous()
    seg_start = torch.searchsorted(rows_sorted, rows_sorted)  # [E] the first entry of each entry's row
    seg_end = torch.searchsorted(rows_sorted, rows_sorted, right=True)  # [E] one past its row's last entry
    # x rounded to the weights' dtype as the reference does (here: torch's rounding, the interpreter's differs)
    x, lora_a, lora_b = x.to(lora_a.dtype).contiguous(), lora_a.contiguous(), lora_b.contiguous()
    entries = rows_sorted.numel()
    block_r = min(triton.next_power_of_2(rank), MAX_BLOCK_R)
    shrunk = torch.empty((entries, rank), dtype=torch.float32, device=x.device)  # [E, R]
    _lora_shrink_kernel[(entries, triton.cdiv(rank, block_r))](
        x, lora_a, rows_sorted, slots_sorted, shrunk, x.shape[1], rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0), BLOCK_R=block_r, BLOCK_IN=BLOCK_IN)
    _lora_expand_kernel[(entries, triton.cdiv(dim_out, BLOCK_OUT))](
        shrunk, lora_b, rows_sorted, slots_sorted, scales_sorted, seg_start, seg_end, result, dim_out, rank,
        shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), result.stride(0), BLOCK_R=block_r, BLOCK_OUT=BLOCK_OUT)
    return result
