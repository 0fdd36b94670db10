"""The CPU decode steps' mirror (stages/llm/decode_mirror.py): attention over the kept keys and values equals the
gathering path bit for bit, step after step, when it is built, appended to, rebuilt for another set of sequences
and outgrown; the paged cache receives the rows of the steps it continued before it is read again, equal to a cache
written every step; a batch over its budget gathers as before."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from stages.llm.attention import PagedMetadata, paged_attention_forward
from stages.llm.decode_mirror import HEADROOM, DecodeMirror

BLOCK, HEADS, KV_HEADS, DIM, LAYERS = 4, 4, 2, 8, 2


class Caches:
    """A paged cache with room for a few sequences of up to `longest` tokens, blocks handed out shuffled."""

    def __init__(self, seqs: int, longest: int):
        per = -(-longest // BLOCK)
        gen = torch.Generator().manual_seed(0)
        shape = (seqs * per + 2, BLOCK, KV_HEADS, DIM)
        self.k = [torch.randn(shape, generator=gen) * 50 for _ in range(LAYERS)]  # garbage until written
        self.v = [torch.randn(shape, generator=gen) * 50 for _ in range(LAYERS)]
        self.tables = torch.randperm(shape[0], generator=gen)[:seqs * per].view(seqs, per)
        self.gen = gen

    def fill(self, seq: int, length: int) -> None:
        """Write a prompt's keys and values at positions [0, length) of sequence `seq`."""
        pos = torch.arange(length)
        slots = self.tables[seq, pos // BLOCK] * BLOCK + pos % BLOCK
        for layer in range(LAYERS):
            flat_k = self.k[layer].view(-1, KV_HEADS, DIM)
            flat_v = self.v[layer].view(-1, KV_HEADS, DIM)
            flat_k[slots] = torch.randn(length, KV_HEADS, DIM, generator=self.gen)
            flat_v[slots] = torch.randn(length, KV_HEADS, DIM, generator=self.gen)

    def write_row(self, seq: int, length: int) -> None:
        """Write sequence `seq`'s keys and values at position length - 1 (a step outside the mirror's)."""
        gen = torch.Generator().manual_seed(1000 + length)
        slot = self.tables[seq, (length - 1) // BLOCK] * BLOCK + (length - 1) % BLOCK
        for layer in range(LAYERS):
            self.k[layer].view(-1, KV_HEADS, DIM)[slot] = torch.randn(KV_HEADS, DIM, generator=gen)
            self.v[layer].view(-1, KV_HEADS, DIM)[slot] = torch.randn(KV_HEADS, DIM, generator=gen)

    def step(self, seqs: list[int], context_lens: list[int], mirror: DecodeMirror | None) -> list[torch.Tensor]:
        """One decode step of `seqs` (each one new token at position context - 1) through every layer's
        attention; with `mirror`, the mirror serves it if it will. Each layer's output [1, B, Hq, D]."""
        rows = len(seqs)
        ctx = torch.tensor(context_lens)
        slots = self.tables[seqs, (ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK
        meta = PagedMetadata(k_caches=self.k, v_caches=self.v, slot_mapping=slots,
                             query_start_loc=torch.arange(rows + 1), context_lens=ctx, block_tables=self.tables[seqs],
                             all_decode=True, max_query_len=1)
        if mirror is not None and mirror.begin(tuple(seqs), context_lens, slots, BLOCK, torch.float32):
            meta.mirror = mirror
        gen = torch.Generator().manual_seed(sum(context_lens))  # the same new token for both paths
        outs = []
        for layer in range(LAYERS):
            q = torch.randn(1, HEADS, rows, DIM, generator=gen)
            k = torch.randn(1, KV_HEADS, rows, DIM, generator=gen)
            v = torch.randn(1, KV_HEADS, rows, DIM, generator=gen)
            out, _ = paged_attention_forward(SimpleNamespace(layer_idx=layer), q, k, v, None, paged=meta)
            outs.append(out)
        return outs


def test_the_mirror_equals_gathering_step_after_step():
    longest = 3 + 12 + HEADROOM + 8
    mirrored, plain = Caches(seqs=3, longest=longest), Caches(seqs=3, longest=longest)  # the same blocks and values
    lens = {0: 3, 1: 12, 2: 7}
    for seq, n in lens.items():
        mirrored.fill(seq, n)
        plain.fill(seq, n)
    mirror = DecodeMirror(mirrored.k, mirrored.v)
    served = []

    def same_caches() -> bool:
        return all(torch.equal(a, b) for a, b in zip(mirrored.k + mirrored.v, plain.k + plain.v))

    def step(seqs: list[int]) -> None:
        for seq in seqs:
            lens[seq] += 1
        context = [lens[s] for s in seqs]
        with_mirror = mirrored.step(seqs, context, mirror)
        served.append((mirror.fresh, mirror.capacity) if mirror.seq_ids == tuple(seqs) else None)
        without = plain.step(seqs, context, None)  # writes the paged cache, gathers from it
        for a, b in zip(with_mirror, without):
            assert torch.equal(a, b)
        # a step the mirror builds starts from the paged cache made whole, and writes it too; one it continues
        # writes the mirror only
        assert same_caches() == mirror.fresh

    step([0, 1, 2])  # built
    assert served[-1] == (True, -(-(13 + HEADROOM) // BLOCK) * BLOCK)
    for _ in range(3):
        step([0, 1, 2])  # appended
        assert served[-1][0] is False
    assert len(mirror.pending) == 3
    step([0, 2])  # another set of sequences: the 3 steps' rows flushed, then rebuilt
    assert served[-1][0] is True and not mirror.pending
    step([0, 2])
    assert served[-1][0] is False
    step([2, 0])  # the same sequences in another order: rebuilt
    assert served[-1][0] is True
    lens[0] += 1  # sequence 0 computed a token in a step the mirror did not see (a mixed step): rebuilt
    plain.write_row(0, lens[0])  # (that step wrote its row into both paged caches)
    mirrored.write_row(0, lens[0])
    step([2, 0])
    assert served[-1][0] is True
    while lens[2] + 1 <= mirror.capacity:  # appended up to its capacity, then rebuilt larger
        step([2, 0])
        assert served[-1][0] is False
    capacity = mirror.capacity
    step([2, 0])
    assert served[-1][0] is True and mirror.capacity > capacity
    step([2, 0])
    assert not same_caches()
    mirror.flush()  # what the runner does before a step that is not a decode step of these sequences
    assert same_caches() and not mirror.pending
    mirror.flush()  # nothing left to write
    assert same_caches()


def test_a_batch_over_the_budget_gathers_every_step():
    caches = Caches(seqs=2, longest=40)
    caches.fill(0, 9)
    caches.fill(1, 20)
    mirror = DecodeMirror(caches.k, caches.v, budget_bytes=1024)
    slots = torch.tensor([0, 1])
    assert not mirror.begin((0, 1), [10, 21], slots, BLOCK, torch.float32)
    assert mirror.seq_ids == () and mirror.keys == []
    roomy = DecodeMirror(caches.k, caches.v)
    assert roomy.begin((0, 1), [10, 21], slots, BLOCK, torch.float32)
