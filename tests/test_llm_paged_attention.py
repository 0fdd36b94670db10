"""Paged attention: write_kv, the torch reference against dense SDPA, and the Triton decode kernel.

Each layout scatters several sequences over shuffled, non-contiguous physical blocks. Dense
per-sequence K/V are the ground truth: they are written into the cache with `write_kv`, and the
paged implementations must agree with plain attention over the dense tensors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from stages.llm.paged_attention import (
    additive,
    batched_layouts,
    decode_attention,
    paged_attention_batched,
    paged_attention_reference,
    paged_decode_torch,
    write_kv,
)


@dataclass
class Layout:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    keys: list[torch.Tensor]  # per sequence [ctx, Hkv, D], the dense truth
    values: list[torch.Tensor]  # per sequence [ctx, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks], padded with `pad`
    context_lens: torch.Tensor  # [B]


def make_layout(
    ctx_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, seed: int, pad: int = -1
) -> Layout:
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(needed) + 3  # spare blocks hold garbage that must never be read
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen) * 100
    v_cache = torch.randn(shape, generator=gen) * 100
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(needed) + 1
    block_tables = torch.full((len(ctx_lens), max_blocks), pad, dtype=torch.long)
    keys, values = [], []
    for b, ctx in enumerate(ctx_lens):
        block_tables[b, : needed[b]] = torch.tensor(perm[: needed[b]])
        perm = perm[needed[b] :]
        keys.append(torch.randn(ctx, num_kv_heads, head_dim, generator=gen))
        values.append(torch.randn(ctx, num_kv_heads, head_dim, generator=gen))
        pos = torch.arange(ctx)
        slots = block_tables[b, pos // block_size] * block_size + pos % block_size
        write_kv(keys[b], values[b], k_cache, v_cache, slots)
    return Layout(k_cache, v_cache, keys, values, block_tables, torch.tensor(ctx_lens))


def dense_attention(
    q: torch.Tensor,  # [q_len, Hq, D]
    k: torch.Tensor,  # [ctx, Hkv, D]
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:  # [q_len, Hq, D]
    """Plain attention over one sequence's dense K/V, its queries being the last q_len positions."""
    q_len, ctx = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, len, D]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    if q_len == ctx and sliding_window is None and soft_cap is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.transpose(0, 1)
    # is_causal aligns the top-left corner; with cached context the diagonal shifts right.
    mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=ctx - q_len)
    if sliding_window is not None:
        mask &= ~torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=ctx - q_len - sliding_window)
    if soft_cap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = soft_cap * torch.tanh(q @ k.transpose(1, 2) * scale / soft_cap)
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    return out.transpose(0, 1)


def check_reference(layout: Layout, q_lens: list[int], num_heads: int, seed: int, attention=paged_attention_reference,
                    **options) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    head_dim = layout.k_cache.shape[3]
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    scale = head_dim**-0.5
    got = attention(
        query, layout.k_cache, layout.v_cache, query_start_loc=starts, context_lens=layout.context_lens,
        block_tables=layout.block_tables, scale=scale, **options,
    )
    for b in range(len(q_lens)):
        rows = slice(starts[b], starts[b + 1])
        want = dense_attention(query[rows], layout.keys[b], layout.values[b], scale, **options)
        torch.testing.assert_close(got[rows], want, atol=1e-5, rtol=1e-5)


# (context_len, q_len): decode at length 1, decode mid-block, full prefill, a prefill chunk after
# cached context, decode on a block boundary + 1.
MIXED = [(1, 1), (9, 1), (13, 13), (20, 6), (33, 1)]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa4/2", "mha4"])
def test_reference_matches_dense_on_mixed_batch(heads, head_dim, block_size):
    num_heads, num_kv_heads = heads
    for seed in range(2):
        ctx, q_lens = zip(*MIXED[seed:] + MIXED[:seed])  # different order per seed
        layout = make_layout(list(ctx), block_size, num_kv_heads, head_dim, seed, pad=seed - 1)
        check_reference(layout, list(q_lens), num_heads, seed)


@pytest.mark.parametrize("options", [{"sliding_window": 5}, {"sliding_window": 1}, {"soft_cap": 3.0}])
def test_reference_window_and_soft_cap(options):
    ctx, q_lens = zip(*MIXED)
    layout = make_layout(list(ctx), 4, 2, 16, seed=7)
    check_reference(layout, list(q_lens), 4, seed=7, **options)


@pytest.mark.parametrize("options", [{}, {"sliding_window": 5}, {"sliding_window": 1}, {"soft_cap": 3.0}])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa4/2", "mha4"])
def test_batched_path_matches_dense(heads, options):
    """The engine's CPU path (one masked SDPA over every sequence, no loop) against dense attention, on mixed
    batches, a pure decode batch (the dense, padding-free layout) and block tables padded with -1."""
    num_heads, num_kv_heads = heads
    for seed, (ctx, q_lens) in enumerate([zip(*MIXED), zip(*MIXED[2:] + MIXED[:2]),
                                          ((5, 17, 32, 40), (1, 1, 1, 1))]):
        layout = make_layout(list(ctx), 4, num_kv_heads, 16, seed, pad=-1 if seed else 0)
        check_reference(layout, list(q_lens), num_heads, seed, attention=paged_attention_batched, **options)


def test_a_mixed_step_keeps_decodes_apart_from_prefill_chunks():
    """A long chunk does not pad the decode rows to its length: decodes and chunks are laid out separately."""
    ctx, q_lens = zip(*MIXED)  # three decodes, two chunks (13 and 6 rows)
    layout = make_layout(list(ctx), 4, 2, 16, seed=5)
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    layouts = batched_layouts(sum(q_lens), 4, query_start_loc=starts, context_lens=layout.context_lens,
                              block_tables=layout.block_tables)
    assert [tuple(g.rows.shape) for g in layouts] == [(3, 1), (2, 13)]
    decode_only = batched_layouts(3, 4, query_start_loc=torch.arange(4), context_lens=torch.tensor([1, 9, 33]),
                                  block_tables=layout.block_tables[:3], max_query_len=1)
    assert len(decode_only) == 1 and decode_only[0].whole


@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa4/2", "mha4"])
def test_whole_prompts_attend_by_is_causal_bit_for_bit(heads):
    """Chunks that all start at position 0 (whole prompts, unequal lengths, tables padded with -1) take SDPA's
    is_causal, with no additive mask built: the same bits as the masked form, and dense attention's values (a soft
    cap's too); beside decode rows (a mixed step) the prompts' group is causal and the decodes' is not; a chunk
    after cached context, or a sliding window, keeps the mask."""
    num_heads, num_kv_heads = heads
    ctx = [13, 5, 16, 2]
    layout = make_layout(ctx, 4, num_kv_heads, 16, seed=11, pad=-1)
    query = torch.randn(sum(ctx), num_heads, 16, generator=torch.Generator().manual_seed(12))
    args = dict(query_start_loc=torch.tensor([0, *ctx]).cumsum(0), context_lens=layout.context_lens,
                block_tables=layout.block_tables)
    (causal,) = batched_layouts(query.shape[0], 4, **args)
    assert causal.causal and causal.bias is None
    masked = dataclasses.replace(causal, causal=False, bias=additive(causal.mask[:, 0])[:, None])
    got = paged_attention_batched(query, layout.k_cache, layout.v_cache, scale=0.25, layouts=(causal,), **args)
    want = paged_attention_batched(query, layout.k_cache, layout.v_cache, scale=0.25, layouts=(masked,), **args)
    assert torch.equal(got, want)
    for cap in (None, 3.0):  # a soft cap (Gemma 2) spells the masked math out over the same layout
        check_reference(layout, ctx, num_heads, seed=11, attention=paged_attention_batched, soft_cap=cap)

    q_lens = [13, 1, 16, 1]  # two prompts and two decodes
    mixed = batched_layouts(sum(q_lens), 4, query_start_loc=torch.tensor([0, *q_lens]).cumsum(0),
                            context_lens=layout.context_lens, block_tables=layout.block_tables)
    assert [(g.rows.shape[1], g.causal) for g in mixed] == [(1, False), (16, True)]
    for lens, window in (([13, 3, 16, 2], None), (ctx, 5)):  # a chunk after 2 cached tokens; a window
        (general,) = batched_layouts(sum(lens), 4, query_start_loc=torch.tensor([0, *lens]).cumsum(0),
                                     context_lens=layout.context_lens, block_tables=layout.block_tables,
                                     sliding_window=window)
        assert not general.causal and general.bias is not None


@pytest.mark.parametrize("window", [None, 5, 1])
def test_the_decode_layout_equals_the_general_one(window):
    """A decode step's layout (max_query_len=1: built in half the ops) is the general layout field for field,
    with a padding row (context 0) and tables padded with -1, whether the longest context comes from the host
    (max_context_len) or is read from the tensor."""
    layout = make_layout([6, 1, 9, 17], 4, 2, 16, seed=6, pad=-1)
    args = dict(query_start_loc=torch.arange(5), context_lens=torch.tensor([6, 0, 9, 17]),
                block_tables=layout.block_tables, sliding_window=window)
    (general,) = batched_layouts(4, 4, **args)
    for longest in (None, 17):
        (decode,) = batched_layouts(4, 4, max_query_len=1, max_context_len=longest, **args)
        for field in dataclasses.fields(general):
            ours, theirs = getattr(decode, field.name), getattr(general, field.name)
            assert torch.equal(ours, theirs) if isinstance(theirs, torch.Tensor) else ours == theirs, field.name


def test_batched_path_zeroes_padding_rows_as_the_reference():
    layout = make_layout([6, 1, 9], 4, 2, 16, seed=3)
    context = torch.tensor([6, 0, 9])  # the middle row: a graph bucket's padding (no context)
    query = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(4))
    args = dict(query_start_loc=torch.arange(4), context_lens=context, block_tables=layout.block_tables, scale=0.25)
    got = paged_attention_batched(query, layout.k_cache, layout.v_cache, **args)
    want = paged_attention_reference(query, layout.k_cache, layout.v_cache, **args)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_keeps_query_dtype_and_rejects_short_context():
    layout = make_layout([5], 4, 1, 16, seed=3)
    query = torch.randn(2, 2, 16, dtype=torch.bfloat16)
    kwargs = dict(block_tables=layout.block_tables, scale=0.25, query_start_loc=torch.tensor([0, 2]))
    out = paged_attention_reference(query, layout.k_cache, layout.v_cache, context_lens=torch.tensor([5]), **kwargs)
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention_reference(query, layout.k_cache, layout.v_cache, context_lens=torch.tensor([1]), **kwargs)


def test_write_kv_places_tokens_and_skips_padding():
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    key = torch.randn(4, 2, 8)
    value = torch.randn(4, 2, 8)
    slots = torch.tensor([9, -1, 0, 6])  # block 2 offset 1, padding, block 0 offset 0, block 1 offset 2
    write_kv(key, value, k_cache, v_cache, slots)
    for row, (block, offset) in zip([0, 2, 3], [(2, 1), (0, 0), (1, 2)]):
        assert torch.equal(k_cache[block, offset], key[row])
        assert torch.equal(v_cache[block, offset], value[row])
    assert int((k_cache.abs().sum(dim=(2, 3)) > 0).sum()) == 3  # the padding row wrote nothing
    with pytest.raises(ValueError, match="key and value"):
        write_kv(key[:, :1], value[:, :1], k_cache, v_cache, slots)


def test_write_kv_casts_to_cache_dtype():
    k_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(1, 1, 8)
    write_kv(key, key, k_cache, v_cache, torch.tensor([5]))
    assert torch.equal(k_cache[1, 1], key[0].to(torch.bfloat16))


def decode_case(ctx_lens, block_size, num_kv_heads, groups, head_dim, seed, pad=-1, **options):
    layout = make_layout(ctx_lens, block_size, num_kv_heads, head_dim, seed, pad=pad)
    gen = torch.Generator().manual_seed(seed + 100)
    query = torch.randn(len(ctx_lens), num_kv_heads * groups, head_dim, generator=gen)
    args = (query, layout.k_cache, layout.v_cache, layout.block_tables, layout.context_lens, head_dim**-0.5)
    return args, options


# Lengths 1, block multiples and not, one sequence much longer than the rest.
DECODE_LENS = [[1, 4, 7, 16, 21], [33, 1, 12], [5]]


@pytest.mark.parametrize(
    "block_size, num_kv_heads, groups, head_dim",
    [(4, 2, 2, 16), (16, 1, 4, 32), (4, 3, 1, 16), (16, 2, 3, 16)],
    ids=["gqa2-bs4", "gqa4-bs16-d32", "mha-bs4", "groups3"],
)
def test_triton_decode_matches_reference(block_size, num_kv_heads, groups, head_dim):
    for seed, lens in enumerate(DECODE_LENS):
        args, _ = decode_case(lens, block_size, num_kv_heads, groups, head_dim, seed, pad=seed % 2 - 1)
        want = paged_decode_torch(*args)
        got = decode_attention(*args, use_triton=True)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options", [{"sliding_window": 6}, {"sliding_window": 1}, {"soft_cap": 2.0}])
def test_triton_decode_window_and_soft_cap(options):
    args, options = decode_case([1, 6, 19], 4, 2, 2, 16, seed=11, **options)
    torch.testing.assert_close(
        decode_attention(*args, use_triton=True, **options), paged_decode_torch(*args, **options), atol=1e-4, rtol=1e-4
    )


def test_triton_decode_odd_shapes_int32_tables_and_empty_rows():
    # Head dim and block size that are not powers of two exercise the kernel's padding masks.
    args, _ = decode_case([3, 10, 1], 6, 2, 2, 24, seed=5)
    query, k_cache, v_cache, tables, lens, scale = args
    got = decode_attention(query, k_cache, v_cache, tables.int(), lens.int(), scale, use_triton=True)
    torch.testing.assert_close(got, paged_decode_torch(*args), atol=1e-4, rtol=1e-4)
    # A context length of 0 marks a padding row: zeros, not NaN.
    lens = torch.tensor([3, 0, 1])
    got = decode_attention(query, k_cache, v_cache, tables, lens, scale, use_triton=True)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_decode_dispatch_on_cpu_uses_torch_and_kernel_needs_interpreter(monkeypatch):
    args, _ = decode_case([2, 9], 4, 1, 2, 16, seed=2)
    torch.testing.assert_close(decode_attention(*args), paged_decode_torch(*args))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        decode_attention(*args, use_triton=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_on_cuda(dtype):
    ctx_lens = [1, 15, 16, 17, 300, 1000]
    args, _ = decode_case(ctx_lens, 16, 8, 4, 128, seed=9)
    args = [t.to("cuda", dtype) if t.is_floating_point() else t.cuda() for t in args[:5]] + [args[5]]
    got = decode_attention(*args)  # CUDA tensors choose the kernel
    want = paged_decode_torch(*args)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
