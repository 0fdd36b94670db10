"""Paged decode attention as a Triton kernel: one new query token per sequence.

One program per (sequence, kv head). It loads the group of query heads that share that kv
head once, then walks the sequence's blocks through its block table with an online softmax,
so every cached K/V row is read from memory exactly once per step (decode is bandwidth-bound).
Scores are a broadcast multiply-and-sum rather than `tl.dot`, whose 16-row minimum would waste
most of the work on GQA groups of 1-8 heads. Semantics are those of
`stages.llm.paged_attention` (causal, sliding window, soft cap, GQA), in float32.

Runs natively on CUDA and, with `TRITON_INTERPRET=1` set before triton is imported, on CPU
tensors (slowly: keep interpreted shapes tiny).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from stages.llm.paged_attention import _check_cache, _check_options


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates cleanly to +-1 at both ends, no tanh intrinsic needed.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_tables_ptr, context_lens_ptr,
    scale, soft_cap, sliding_window,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_oh, stride_od,
    stride_tb, stride_ti,
    GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_SIZE_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq).to(tl.int32)

    g = tl.arange(0, GROUPS_PAD)
    s = tl.arange(0, BLOCK_SIZE_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    g_ok = g < GROUPS
    d_ok = d < HEAD_DIM
    q_heads = kv_head * GROUPS + g
    q = tl.load(
        q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :], other=0.0,
    ).to(tl.float32)  # [G, D]

    # The query sits at position ctx_len - 1; the window keeps positions >= first_pos.
    first_pos = 0
    if USE_WINDOW:
        first_pos = tl.maximum(ctx_len - sliding_window, 0)

    m_i = tl.full([GROUPS_PAD], float("-inf"), tl.float32)  # running max score
    l_i = tl.zeros([GROUPS_PAD], tl.float32)  # running softmax denominator
    acc = tl.zeros([GROUPS_PAD, HEAD_DIM_PAD], tl.float32)  # running weighted V sum
    # Every visited block holds at least one visible position, so m_i is finite after the
    # first iteration and exp(m_i - m_new) never sees -inf - -inf.
    for i in range(first_pos // BLOCK_SIZE, tl.cdiv(ctx_len, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + seq * stride_tb + i * stride_ti).to(tl.int64)
        pos = i * BLOCK_SIZE + s
        visible = (s < BLOCK_SIZE) & (pos < ctx_len) & (pos >= first_pos)  # [S]
        row_mask = visible[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + block_id * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :] * stride_kd,
            mask=row_mask, other=0.0,
        ).to(tl.float32)  # [S, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, S]
        if USE_SOFT_CAP:
            scores = soft_cap * _tanh(scores / soft_cap)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])  # [G, S]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + block_id * stride_vb + s[:, None] * stride_vs + kv_head * stride_vh + d[None, :] * stride_vd,
            mask=row_mask, other=0.0,
        ).to(tl.float32)  # [S, D]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    # context_len 0 (a padding row) visits nothing: write zeros rather than 0/0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + d[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )


def paged_decode(
    query: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    context_lens: torch.Tensor,  # [B] int32/int64, 0 = padding row (output zeros)
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:  # [B, Hq, D], query dtype
    """Decode attention over the paged cache with the Triton kernel (CUDA, or the interpreter on CPU)."""
    _check_cache(k_cache, v_cache)
    _check_options(scale, sliding_window, soft_cap)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(
            f"query must be [B, Hq, {head_dim}] with Hq a multiple of num_kv_heads={num_kv_heads}, "
            f"got {tuple(query.shape)}"
        )
    num_seqs = query.shape[0]
    if context_lens.shape != (num_seqs,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"context_lens must be [B] and block_tables [B, max_blocks] for B={num_seqs}, "
            f"got {tuple(context_lens.shape)} and {tuple(block_tables.shape)}"
        )
    tensors = (query, k_cache, v_cache, block_tables, context_lens)
    if any(t.device != query.device for t in tensors):
        raise ValueError("query, caches, block_tables and context_lens must be on one device")
    if not query.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "paged_decode on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before importing triton, or use paged_decode_torch"
        )
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    groups = query.shape[1] // num_kv_heads
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        query, k_cache, v_cache, out, block_tables, context_lens,
        float(scale), float(soft_cap or 1.0), int(sliding_window or 0),
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *block_tables.stride(),
        GROUPS=groups, GROUPS_PAD=triton.next_power_of_2(groups),
        BLOCK_SIZE=block_size, BLOCK_SIZE_PAD=triton.next_power_of_2(block_size),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        USE_SOFT_CAP=soft_cap is not None, USE_WINDOW=sliding_window is not None,
    )
    return out
