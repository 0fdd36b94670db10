"""The per-row LoRA kernels (stages/kernels/lora.py) against their torch reference and a dense per-row loop:
interpreted on the CPU with tiny shapes, native on the GPU."""

from __future__ import annotations

import pytest
import torch

from stages.kernels.lora import lora_rows, lora_rows_reference

# IN and OUT over one 64-wide tile (the loops and their masks), R = 6 under a power of two (the rank mask).
N, IN, OUT, S, R = 5, 70, 72, 3, 6
TRUE_RANKS = (2, 3, 6)  # slot i's adapter, zero-padded up to R
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=4e-2, rtol=2e-2)}


def _randn(*shape, seed=0, scale=1.0, device="cpu"):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device)


def _adapters(ranks=TRUE_RANKS, bucket=R, dim_in=IN, dim_out=OUT, device="cpu"):
    """lora_a [S, bucket, IN], lora_b [S, OUT, bucket] with slot i of true rank ranks[i] (the rest zeros)."""
    lora_a = torch.zeros(len(ranks), bucket, dim_in, device=device)
    lora_b = torch.zeros(len(ranks), dim_out, bucket, device=device)
    for i, rank in enumerate(ranks):
        lora_a[i, :rank] = _randn(rank, dim_in, seed=10 + i, scale=0.2, device=device)
        lora_b[i, :, :rank] = _randn(dim_out, rank, seed=20 + i, scale=0.2, device=device)
    return lora_a, lora_b


def _entries(rows, slots, scales, device="cpu"):
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(slots, dtype=torch.long, device=device),
            torch.tensor(scales, dtype=torch.float32, device=device))


# Row 3 has two adapters at different scales, rows 2 and 4 none; the entries are not in row order.
ENTRIES = _entries([3, 0, 3, 1, 0], [2, 0, 1, 2, 1], [0.5, 1.0, -2.0, 0.25, 1.5])


def _dense_loop(x, out, lora_a, lora_b, rows, slots, scales):
    """The semantics written out: a float64 loop over entries, one row's update at a time."""
    result = out.double().clone()
    for row, slot, scale in zip(rows.tolist(), slots.tolist(), scales.tolist()):
        a, b = lora_a[slot].double(), lora_b[slot].double()
        result[row] += scale * (b @ (a @ x[row].to(lora_a.dtype).double()))
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lora_rows_matches_reference_and_dense_loop(dtype):
    x, out = _randn(N, IN, seed=1).to(dtype), _randn(N, OUT, seed=2).to(dtype)
    lora_a, lora_b = (w.to(dtype) for w in _adapters())
    out_before = out.clone()
    got = lora_rows(x, out, lora_a, lora_b, *ENTRIES, use_triton=True)
    assert got.dtype == dtype and got.shape == (N, OUT)
    assert torch.equal(out, out_before)  # out itself untouched: the result is a new tensor
    torch.testing.assert_close(got, lora_rows_reference(x, out, lora_a, lora_b, *ENTRIES), **TOL[dtype])
    torch.testing.assert_close(got.double(), _dense_loop(x, out, lora_a, lora_b, *ENTRIES), **TOL[dtype])
    for row in (2, 4):  # no entry: out's row exactly
        assert torch.equal(got[row], out[row])
    assert not torch.equal(got[3], out[3])


def test_lora_rows_with_float32_activations_and_bfloat16_adapters():
    """x rounded to the adapters' dtype (as the reference and PEFT cast it), then float32 math: the dense loop on
    the same rounded numbers to float32 precision; the result in out's dtype."""
    x, out = _randn(N, IN, seed=1), _randn(N, OUT, seed=2)
    lora_a, lora_b = (w.to(torch.bfloat16) for w in _adapters())
    got = lora_rows(x, out, lora_a, lora_b, *ENTRIES, use_triton=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _dense_loop(x, out, lora_a, lora_b, *ENTRIES), **TOL[torch.float32])
    torch.testing.assert_close(got, lora_rows_reference(x, out, lora_a, lora_b, *ENTRIES), **TOL[torch.bfloat16])


def test_lora_rows_sums_a_rows_adapters_in_any_entry_order():
    """Row 3's two adapters, each at its scale, equal the sum of the two single-adapter updates; the entry order
    does not matter."""
    x, out = _randn(N, IN, seed=1), _randn(N, OUT, seed=2)
    lora_a, lora_b = _adapters()
    both = lora_rows(x, out, lora_a, lora_b, *_entries([3, 3], [2, 1], [0.5, -2.0]), use_triton=True)
    swapped = lora_rows(x, out, lora_a, lora_b, *_entries([3, 3], [1, 2], [-2.0, 0.5]), use_triton=True)
    first = lora_rows(x, out, lora_a, lora_b, *_entries([3], [2], [0.5]), use_triton=True)
    second = lora_rows(x, out, lora_a, lora_b, *_entries([3], [1], [-2.0]), use_triton=True)
    torch.testing.assert_close(both, swapped, **TOL[torch.float32])
    torch.testing.assert_close(both - out, (first - out) + (second - out), **TOL[torch.float32])
    shuffled = [ENTRIES[0][[4, 2, 0, 3, 1]], ENTRIES[1][[4, 2, 0, 3, 1]], ENTRIES[2][[4, 2, 0, 3, 1]]]
    torch.testing.assert_close(lora_rows(x, out, lora_a, lora_b, *shuffled, use_triton=True),
                               lora_rows(x, out, lora_a, lora_b, *ENTRIES, use_triton=True), **TOL[torch.float32])


def test_lora_rows_without_entries_is_a_copy_of_out():
    x, out = _randn(N, IN, seed=1), _randn(N, OUT, seed=2)
    got = lora_rows(x, out, *_adapters(), *_entries([], [], []), use_triton=True)
    assert torch.equal(got, out) and got.data_ptr() != out.data_ptr()
    assert torch.equal(lora_rows_reference(x, out, *_adapters(), *_entries([], [], [])), out)


def test_zero_padded_rank_equals_the_unpadded_adapter():
    """The rank bucket's zero padding adds exact zeros: slot 1 (rank 3) padded to 6 and to 16 (more than a
    power of two) is the rank-3 adapter. Its padded ranks shrink to exact zeros; the sums over 3, 6 and 16 ranks
    may round apart by an ulp, as the CPU's matmul kernel for each length orders its additions its own way."""
    x, out = _randn(N, IN, seed=1), _randn(N, OUT, seed=2)
    entries = _entries([0, 4, 1], [1, 1, 1], [1.0, 0.5, -1.0])
    unpadded = lora_rows_reference(x, out, *_adapters(ranks=(3, 3, 3), bucket=3), *entries)
    for bucket in (R, 16):
        padded = _adapters(bucket=bucket)
        assert torch.equal(padded[0][1, 3:] @ x.T, torch.zeros(bucket - 3, N))
        torch.testing.assert_close(lora_rows_reference(x, out, *padded, *entries), unpadded, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lora_rows(x, out, *padded, *entries, use_triton=True), unpadded,
                                   **TOL[torch.float32])


def test_lora_rows_with_a_rank_bucket_over_one_r_block():
    """A bucket of 72 is two R blocks of 64: two shrink programs per entry, two expand steps per entry."""
    x, out = _randn(N, IN, seed=1), _randn(N, OUT, seed=2)
    lora_a, lora_b = _adapters(ranks=(70, 3, 66), bucket=72)
    got = lora_rows(x, out, lora_a, lora_b, *ENTRIES, use_triton=True)
    torch.testing.assert_close(got, lora_rows_reference(x, out, lora_a, lora_b, *ENTRIES), **TOL[torch.float32])
    torch.testing.assert_close(got.double(), _dense_loop(x, out, lora_a, lora_b, *ENTRIES), **TOL[torch.float32])


def test_lora_rows_takes_non_contiguous_inputs():
    x, out = _randn(IN, N, seed=1).t(), _randn(OUT, N, seed=2).t()  # transposed views
    lora_a, lora_b = _adapters()
    lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)  # [S, OUT, R] laid out as [S, R, OUT]
    assert not (x.is_contiguous() or out.is_contiguous() or lora_b.is_contiguous())
    got = lora_rows(x, out, lora_a, lora_b, *ENTRIES, use_triton=True)
    torch.testing.assert_close(got, lora_rows_reference(x, out, lora_a, lora_b, *ENTRIES), **TOL[torch.float32])


def test_lora_rows_default_on_cpu_is_the_reference():
    x, out = _randn(N, IN, seed=1), _randn(N, OUT, seed=2)
    lora_a, lora_b = _adapters()
    assert torch.equal(lora_rows(x, out, lora_a, lora_b, *ENTRIES),
                       lora_rows_reference(x, out, lora_a, lora_b, *ENTRIES))


def _bad_arguments():
    x, out = _randn(N, IN), _randn(N, OUT)
    lora_a, lora_b = _adapters()
    rows, slots, scales = ENTRIES
    yield "lora_a must be", (x, out, _adapters(dim_in=IN + 1)[0], lora_b, rows, slots, scales)  # IN of x
    yield "lora_b must be", (x, out, lora_a, _adapters(dim_out=OUT + 1)[1], rows, slots, scales)  # OUT of out
    yield "lora_b must be", (x, out, lora_a, _adapters(bucket=R + 2)[1], rows, slots, scales)  # R of lora_a
    yield "out must be", (x, out[:-1], lora_a, lora_b, rows, slots, scales)  # N of x
    yield "rows, slots and scales", (x, out, lora_a, lora_b, rows, slots[:-1], scales)
    yield "rows, slots and scales", (x, out, lora_a, lora_b, rows, slots, scales[:-1])
    yield "x must be", (x[None], out, lora_a, lora_b, rows, slots, scales)
    yield "lora_a and lora_b must share", (x, out, lora_a, lora_b.double(), rows, slots, scales)  # dtype


@pytest.mark.parametrize("use_triton", [True, False])
def test_lora_rows_rejects_mismatched_shapes(use_triton):
    for message, args in _bad_arguments():
        with pytest.raises(ValueError, match=message):
            lora_rows(*args, use_triton=use_triton)


# -- native on the GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_lora_rows_matches_reference(dtype):
    """A decode-sized batch of a 4096-wide layer: 256 rows, 200 with an adapter and 40 of those with a second, 4
    adapters of ranks 8 to 128 in one bucket of 128 (over one R block: the expand loops over R)."""
    ranks, tokens = (8, 16, 64, 128), 256
    x, out = _randn(tokens, 4096, seed=1, device="cuda").to(dtype), _randn(tokens, 4096, seed=2, device="cuda")
    lora_a, lora_b = _adapters(ranks=ranks, bucket=128, dim_in=4096, dim_out=4096, device="cuda")
    pick = torch.Generator().manual_seed(3)
    rows = torch.cat([torch.randperm(tokens, generator=pick)[:200], torch.randperm(tokens, generator=pick)[:40]])
    slots = torch.randint(0, len(ranks), (rows.numel(),), generator=pick)
    scales = torch.rand(rows.numel(), generator=pick) * 2 - 1
    args = (x, out.to(dtype), lora_a.to(dtype) * 0.1, lora_b.to(dtype) * 0.1, rows.cuda(), slots.cuda(),
            scales.cuda())
    got = lora_rows(*args)
    torch.testing.assert_close(got.double(), _dense_loop(*args), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, lora_rows_reference(*args), atol=3e-2, rtol=3e-2)
