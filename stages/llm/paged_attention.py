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

import functools
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
    """Where some sequences' rows and contexts sit in a padded [B, q_max] x [B, ctx_max] problem. A step's
    layouts are the same for every layer (one set per sliding window), so they are built once per step."""

    tables: torch.Tensor  # [B, >= n] its sequences' block tables
    num_blocks: int  # n = ceil(ctx_max / block_size); positions past a context read a valid block and are masked
    rows: torch.Tensor  # [B, q_max] packed query row of each padded query position
    # [B, 1, q_max, n * block_size] bool: the key is visible to the query (read by the soft cap's attention)
    mask: torch.Tensor | None
    seen: torch.Tensor | None  # [B, q_max] bool: a real query row with a context (the rest come out as zeros)
    # (a DecodeMirror's layout has neither: whole, no soft cap)
    whole: bool  # it covers every packed row, in order, with no padding (a decode step): no scatter
    # the mask as SDPA's additive float32 form (0 / -inf), made once for every layer: SDPA would convert a bool mask
    # in every call. None where the mask is plain causal (`causal`): SDPA's is_causal then needs none
    bias: torch.Tensor | None
    # every sequence's chunk starts at position 0 (a whole prompt, nothing cached), no window: padded query row j
    # sees keys 0..j, SDPA's is_causal (top-left aligned), whose kernel skips the blocks above the diagonal; the
    # same result bit for bit (tests/test_llm_paged_attention.py), ~2x faster at 2,048 tokens on a CPU
    causal: bool = False

    @functools.cached_property
    def blocks(self) -> torch.Tensor:
        """[B * n] the first n blocks of every table (key positions 0 .. n * block_size - 1): made where keys are
        gathered (a decode step whose keys are laid out already gathers none). A -1 padding a table reads block 0,
        masked."""
        return self.tables[:, :self.num_blocks].long().clamp(min=0).reshape(-1)


def batched_layouts(query_rows: int, block_size: int, *, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                    block_tables: torch.Tensor, sliding_window: int | None = None, max_query_len: int | None = None,
                    max_context_len: int | None = None) -> tuple[BatchedLayout, ...]:
    """The step's layouts: one, or two when decodes (one row each) and prefill chunks are mixed, so a long chunk
    does not pad every decode row to its length. `max_query_len` and `max_context_len`, when the caller knows
    them on the host, spare reading them back."""
    if max_query_len == 1 and query_rows == context_lens.shape[0]:
        return (_decode_layout(block_size, context_lens, block_tables, sliding_window, max_context_len),)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [B]
    groups: list[torch.Tensor | None] = [None]  # None: every sequence
    if max_query_len != 1:
        single = q_lens <= 1
        if bool(single.any()) and not bool(single.all()):
            groups = [single.nonzero()[:, 0], (~single).nonzero()[:, 0]]
    return tuple(_layout(query_rows, block_size, query_start_loc[:-1], q_lens, context_lens, block_tables,
                         sliding_window, seqs) for seqs in groups)


def _layout(query_rows: int, block_size: int, starts: torch.Tensor, q_lens: torch.Tensor, context_lens: torch.Tensor,
            block_tables: torch.Tensor, sliding_window: int | None, seqs: torch.Tensor | None) -> BatchedLayout:
    if seqs is not None:
        starts, q_lens, context_lens, block_tables = starts[seqs], q_lens[seqs], context_lens[seqs], block_tables[seqs]
    device = context_lens.device
    q_max, ctx_max = int(q_lens.max()), max(int(context_lens.max()), 1)
    # whole blocks are gathered: position p of sequence b is row p of its first n blocks laid end to end
    n = -(-ctx_max // block_size)
    key_pos = torch.arange(n * block_size, device=device)
    # row j of sequence b is packed row starts[b] + j, at position ctx_b - q_len_b + j
    row = torch.arange(q_max, device=device)
    rows = (starts[:, None] + row).clamp(max=max(query_rows - 1, 0))
    valid_q = row[None, :] < q_lens[:, None]
    query_pos = (context_lens - q_lens)[:, None] + row
    visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None])
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    visible &= valid_q[:, :, None]
    visible[:, :, 0] |= ~visible.any(-1)  # a row that sees nothing (padding) attends to key 0; zeroed below
    seen = valid_q & (context_lens > 0)[:, None]
    whole = seqs is None and q_max * len(context_lens) == query_rows and bool(seen.all())
    # (q_max > 1: a decode row's query heads stand in its query positions in _attend, so is_causal cannot serve it)
    causal = sliding_window is None and q_max > 1 and bool((q_lens == context_lens).all())
    return BatchedLayout(block_tables, n, rows, visible[:, None], seen, whole,
                         None if causal else additive(visible)[:, None], causal)


def additive(visible: torch.Tensor) -> torch.Tensor:
    """A bool mask as SDPA's additive float32 one: 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, float("-inf"))


def _decode_layout(block_size: int, context_lens: torch.Tensor, block_tables: torch.Tensor,
                   sliding_window: int | None, max_context_len: int | None) -> BatchedLayout:
    """`_layout` of a step where every sequence feeds one token, packed row b being sequence b's query at position
    context_len - 1: the same layout in half the ops (a decode step builds it on the host every step)."""
    device = context_lens.device
    n = -(-max(int(context_lens.max()) if max_context_len is None else max_context_len, 1) // block_size)
    key_pos = torch.arange(n * block_size, device=device)
    lens = context_lens[:, None]  # [B, 1]
    visible = key_pos < lens  # [B, n * block_size]: keys 0 .. context_len - 1
    if sliding_window is not None:
        visible &= key_pos > lens - 1 - sliding_window
    seen = lens > 0  # a padding row (context 0) sees nothing: it attends to key 0 and comes out as zeros
    whole = bool(seen.all())
    if not whole:
        visible[:, 0] |= ~seen[:, 0]
    rows = torch.arange(context_lens.shape[0], device=device)[:, None]
    return BatchedLayout(block_tables, n, rows, visible[:, None, None], seen, whole, additive(visible)[:, None, None])


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
    max_query_len: int | None = None,  # max(query lengths), when the caller knows it (1: a decode step)
    layouts: tuple[BatchedLayout, ...] | None = None,  # built by the caller once per step (matching the arguments)
    dense: tuple[torch.Tensor, torch.Tensor] | None = None,  # a decode step's keys and values laid out (_attend)
) -> torch.Tensor:  # [T, Hq, D], query dtype
    """The reference's semantics without a Python loop over sequences: every sequence's keys and values are
    gathered, whole blocks through its block table, into a padded [B, ctx_max] batch, the queries into
    [B, q_max], and one masked scaled_dot_product_attention runs over all of them (GQA by the kernel's grouping;
    decodes and prefill chunks of a mixed step are two such calls). A soft cap has no SDPA form: the same masked
    math is then spelled out. Padding rows (a graph bucket's, with context 0) come out as zeros, as the
    reference's do."""
    if layouts is None:
        layouts = batched_layouts(query.shape[0], k_cache.shape[1], query_start_loc=query_start_loc,
                                  context_lens=context_lens, block_tables=block_tables, sliding_window=sliding_window,
                                  max_query_len=max_query_len)
    if len(layouts) == 1 and layouts[0].whole:  # the padded rows are the packed ones, in order
        return _attend(query, k_cache, v_cache, layouts[0], scale, soft_cap, dense).reshape(query.shape).to(
            query.dtype)
    assert dense is None, "laid-out keys and values serve a decode step's one whole layout"
    result = torch.zeros_like(query)
    for layout in layouts:
        out = _attend(query, k_cache, v_cache, layout, scale, soft_cap)
        assert layout.seen is not None
        result[layout.rows[layout.seen]] = out[layout.seen].to(query.dtype)
    return result


def gathered(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BatchedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's keys and values of the layout, whole blocks through its table: [B, n * block_size, Hkv, D]."""
    shape = (layout.rows.shape[0], layout.num_blocks * k_cache.shape[1], k_cache.shape[2], k_cache.shape[3])
    return k_cache.index_select(0, layout.blocks).view(shape), v_cache.index_select(0, layout.blocks).view(shape)


def _attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BatchedLayout, scale: float,
            soft_cap: float | None, dense: tuple[torch.Tensor, torch.Tensor] | None = None,
            ) -> torch.Tensor:  # [B, q_max, Hq, D] float32
    """`dense`: the layout's keys and values already laid out head-major, [B, Hkv, >= n * block_size, D] (a
    DecodeMirror's)."""
    num_kv_heads = k_cache.shape[2]
    if dense is None:
        keys, values = gathered(k_cache, v_cache, layout)
        k, v = keys.transpose(1, 2).float(), values.transpose(1, 2).float()  # [B, Hkv, n * bs, D]
    else:
        width = layout.num_blocks * k_cache.shape[1]
        k, v = dense[0][:, :, :width].float(), dense[1][:, :, :width].float()
    rows = query.view(*layout.rows.shape, *query.shape[1:]) if layout.whole else query[layout.rows]  # [B, q_max, ...]
    if soft_cap is None and rows.shape[1] == 1:  # decode rows: each kv head's query heads are its rows
        batch, _, heads, dim = rows.shape  # [B, 1, Hq, D] -> [B, Hkv, Hq / Hkv, D]: every key is read once, where
        q = rows.reshape(batch, num_kv_heads, heads // num_kv_heads, dim).float()  # GQA would read it per head
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.bias, scale=scale)
        return out.reshape(batch, 1, heads, dim)  # (-25 % a decode layer's attention on a CPU, measured)
    q = rows.transpose(1, 2).float()  # [B, Hq, q_max, D]
    if soft_cap is None:
        if layout.causal:  # no chunk reads past its own rows: as many keys as queries, every backend's square case
            k, v = k[:, :, :q.shape[2]], v[:, :, :q.shape[2]]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.bias, scale=scale,
                                                               is_causal=layout.causal, enable_gqa=True)
    else:
        groups = q.shape[1] // num_kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = soft_cap * torch.tanh(q @ k.transpose(-1, -2) * scale / soft_cap)
        assert layout.mask is not None
        out = scores.masked_fill(~layout.mask, float("-inf")).softmax(-1) @ v
    return out.transpose(1, 2)


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
