"""Attention over the paged KV cache: the KV write, the torch reference, the batched torch path and the decode
dispatcher.

Cache layout, per layer: `k_cache`, `v_cache` are [num_blocks, block_size, num_kv_heads,
head_dim]; token position p of a sequence lives in physical slot
`block_table[p // block_size] * block_size + p % block_size` of the flattened cache.

Semantics shared by every implementation here (and by the Triton kernel):
* a batch is packed varlen: sequence b owns query rows `query_start_loc[b]:query_start_loc[b+1]`;
* `context_lens[b]` counts the sequence's tokens in the cache *including* this step's new ones
  (written by `write_kv` before attention runs), so query row j of a q_len-row sequence sits at
  position `context_len - q_len + j` and sees the positions <= that (causal);
* `sliding_window` W keeps keys with position > query position - W (the query itself plus
  W - 1 earlier tokens, as transformers' sliding masks do);
* `soft_cap` c maps each scaled score s to c * tanh(s / c) before the softmax (Gemma 2);
* GQA: query head h reads kv head h // (Hq // Hkv), the `repeat_kv` convention of transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")


def _check_options(scale: float, sliding_window: int | None, soft_cap: float | None) -> None:
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be None or > 0, got {soft_cap}")


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, -1 = padding row, not written
    *,
    all_valid: bool = False,  # the caller guarantees no -1: skip the filter (it syncs, so no graph could hold it)
) -> None:
    """Store this step's keys and values in their physical slots, in place."""
    _check_cache(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [T, {num_kv_heads}, {head_dim}] to match the cache, "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [T] = [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    # view, not reshape: a copy would silently swallow the write.
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    if not all_valid:
        keep = slots >= 0
        # Boolean indexing syncs on CUDA; padding rows are rare enough that clarity wins here.
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def _gather_positions(
    cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:  # [len(positions), Hkv, D]
    """One sequence's cached rows at `positions`, read through its block table."""
    block_size = cache.shape[1]
    blocks = block_table[positions // block_size].long()
    slots = blocks * block_size + positions % block_size
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots]


def paged_attention_reference(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    *,
    query_start_loc: torch.Tensor,  # [B + 1] cumulative query lengths
    context_lens: torch.Tensor,  # [B] cached tokens incl. this step's
    block_tables: torch.Tensor,  # [B, max_blocks], padding entries unread
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D], query dtype
    """Causal attention of a packed mixed prefill/decode batch over the paged cache, in float32.

    Plain per-sequence math, chosen for being obviously right rather than fast; it is the
    yardstick for the kernels and the fallback on devices without them.
    """
    _check_cache(k_cache, v_cache)
    _check_options(scale, sliding_window, soft_cap)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(
            f"query must be [T, Hq, {head_dim}] with Hq a multiple of num_kv_heads={num_kv_heads}, "
            f"got {tuple(query.shape)}"
        )
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc must be [B + 1] and block_tables [B, max_blocks] for B={num_seqs} "
            f"context_lens, got {tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}"
        )
    groups = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    device = k_cache.device
    for b in range(num_seqs):
        q_start, q_end, ctx = starts[b], starts[b + 1], lens[b]
        q_len = q_end - q_start
        if q_len == 0 or ctx == 0 and q_len == 1:  # no rows, or a padding row (graph buckets): zeros, as the kernel
            continue
        if not 0 < q_len <= ctx:
            raise ValueError(
                f"context_lens[{b}]={ctx} must be >= the sequence's query length {q_len} "
                "(the new tokens are written to the cache before attention)"
            )
        if (ctx + k_cache.shape[1] - 1) // k_cache.shape[1] > block_tables.shape[1]:
            raise ValueError(f"block_tables[{b}] has {block_tables.shape[1]} blocks, too few for {ctx} tokens")
        key_pos = torch.arange(ctx, device=device)
        table = block_tables[b].to(device)
        k = _gather_positions(k_cache, table, key_pos).float()  # [ctx, Hkv, D]
        v = _gather_positions(v_cache, table, key_pos).float()
        q = query[q_start:q_end].float().reshape(q_len, num_kv_heads, groups, head_dim)
        # [Hkv, G, q_len, D] @ [Hkv, 1, D, ctx] -> [Hkv, G, q_len, ctx]
        scores = q.permute(1, 2, 0, 3) @ k.permute(1, 2, 0).unsqueeze(1) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        query_pos = torch.arange(ctx - q_len, ctx, device=device)
        visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, ctx]
        if sliding_window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        # [Hkv, G, q_len, ctx] @ [Hkv, 1, ctx, D] -> [Hkv, G, q_len, D]
        attn = probs @ v.permute(1, 0, 2).unsqueeze(1)
        out[q_start:q_end] = attn.permute(2, 0, 1, 3).reshape(q_len, -1, head_dim).to(query.dtype)
    return out


@dataclass(frozen=True)
class BatchedLayout:
    """Where a packed batch's rows and contexts sit in the padded [B, q_max] x [B, ctx_max] problem; the same for
    every layer of a step (one per sliding window), so it is built once per step."""

    slots: torch.Tensor  # [B, ctx_max] physical cache slot of each key position (masked ones read a valid slot)
    rows: torch.Tensor  # [B, q_max] packed query row of each padded query position
    mask: torch.Tensor  # [B, 1, q_max, ctx_max] bool: the key is visible to the query
    seen: torch.Tensor  # [B, q_max] bool: a real query row with a context (the rest come out as zeros)
    dense: bool = False  # every sequence has q_max real rows and a context: no padding to drop (a decode step)


def batched_layout(query_rows: int, block_size: int, *, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                   block_tables: torch.Tensor, sliding_window: int | None = None, max_query_len: int | None = None,
                   max_context_len: int | None = None) -> BatchedLayout:
    device = context_lens.device
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [B]
    q_max = max_query_len if max_query_len is not None else int(q_lens.max())
    ctx_max = max(max_context_len if max_context_len is not None else int(context_lens.max()), 1)
    # position p of sequence b: slot block_tables[b, p // bs] * bs + p % bs (past its table: a masked read)
    key_pos = torch.arange(ctx_max, device=device)
    columns = (key_pos // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables[:, columns].long().clamp(min=0) * block_size + key_pos % block_size  # (-1: padding)
    # row j of sequence b is packed row query_start_loc[b] + j, at position ctx_b - q_len_b + j
    row = torch.arange(q_max, device=device)
    rows = (query_start_loc[:-1, None] + row).clamp(max=max(query_rows - 1, 0))
    valid_q = row[None, :] < q_lens[:, None]
    query_pos = (context_lens - q_lens)[:, None] + row
    visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None])
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    visible &= valid_q[:, :, None]
    visible[:, :, 0] |= ~visible.any(-1)  # a row that sees nothing (padding) attends to key 0; zeroed below
    seen = valid_q & (context_lens > 0)[:, None]
    dense = q_max * len(context_lens) == query_rows and bool(seen.all())
    return BatchedLayout(slots, rows, visible[:, None], seen, dense)


def paged_attention_batched(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    *,
    query_start_loc: torch.Tensor,  # [B + 1] cumulative query lengths
    context_lens: torch.Tensor,  # [B] cached tokens incl. this step's
    block_tables: torch.Tensor,  # [B, max_blocks]
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_query_len: int | None = None,  # max(query lengths), when the caller knows it (saves a device sync)
    max_context_len: int | None = None,  # max(context_lens), likewise
    layout: BatchedLayout | None = None,  # built by the caller once per step (it must match the arguments)
) -> torch.Tensor:  # [T, Hq, D], query dtype
    """The reference's semantics in one batched call, no Python loop over sequences: every sequence's keys and
    values are gathered through its block table into a padded [B, ctx_max] batch, the queries into [B, q_max],
    and one masked scaled_dot_product_attention runs over all of them (GQA by the kernel's grouping). A soft
    cap has no SDPA form: the same masked math is then spelled out. Padding rows (a graph bucket's, with
    context 0) come out as zeros, as the reference's do."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if layout is None:
        layout = batched_layout(query.shape[0], k_cache.shape[1], query_start_loc=query_start_loc,
                                context_lens=context_lens, block_tables=block_tables, sliding_window=sliding_window,
                                max_query_len=max_query_len, max_context_len=max_context_len)
    k = k_cache.view(-1, num_kv_heads, head_dim)[layout.slots].transpose(1, 2)  # [B, Hkv, ctx_max, D]
    v = v_cache.view(-1, num_kv_heads, head_dim)[layout.slots].transpose(1, 2)
    q = query[layout.rows].transpose(1, 2)  # [B, Hq, q_max, D]
    if soft_cap is None:
        out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=layout.mask,
                                                               scale=scale, enable_gqa=True)
    else:
        groups = q.shape[1] // num_kv_heads
        k, v = k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
        scores = q.float() @ k.transpose(-1, -2) * scale
        scores = soft_cap * torch.tanh(scores / soft_cap)
        out = scores.masked_fill(~layout.mask, float("-inf")).softmax(-1) @ v
    out = out.transpose(1, 2)  # [B, q_max, Hq, D]
    if layout.dense:  # the packed rows are the padded ones in order
        return out.reshape(query.shape).to(query.dtype)
    result = torch.zeros_like(query)
    result[layout.rows[layout.seen]] = out[layout.seen].to(query.dtype)
    return result


def paged_decode_torch(
    query: torch.Tensor,  # [B, Hq, D], one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention in torch: the batched path with every sequence's q_len = 1."""
    starts = torch.arange(query.shape[0] + 1, dtype=torch.long, device=query.device)
    return paged_attention_batched(
        query,
        k_cache,
        v_cache,
        query_start_loc=starts,
        context_lens=context_lens,
        block_tables=block_tables,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        max_query_len=1,
    )


def decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention with the Triton kernel on CUDA tensors, torch elsewhere.

    `use_triton=None` decides by device; True forces the kernel (CPU tensors then need the
    Triton interpreter, `TRITON_INTERPRET=1` set before triton is imported); False forces torch.
    """
    if use_triton is None:
        use_triton = query.is_cuda
    if not use_triton:
        return paged_decode_torch(
            query, k_cache, v_cache, block_tables, context_lens, scale,
            sliding_window=sliding_window, soft_cap=soft_cap,
        )
    # Imported here so the torch path works where triton is not installed.
    from stages.llm.triton_decode import paged_decode

    return paged_decode(
        query, k_cache, v_cache, block_tables, context_lens, scale,
        sliding_window=sliding_window, soft_cap=soft_cap,
    )
