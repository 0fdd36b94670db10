"""The CPU decode steps' mirror (stages/llm/decode_mirror.py): attention over the kept keys and values equals the
gathering path bit for bit, step after step, when it is built, appended to, rebuilt for another set of sequences
and outgrown; a batch over its budget gathers as before."""

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

    def step(self, seqs: list[int], context_lens: list[int], mirror: DecodeMirror | None) -> list[torch.Tensor]:
        """One decode step of `seqs` (each one new token at position context - 1) through every layer's
        attention; with `mirror`, the mirror serves it if it will. Each layer's output [1, B, Hq, D]."""
        rows = len(seqs)
        ctx = torch.tensor(context_lens)
        slots = self.tables[seqs, (ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK
        meta = PagedMetadata(k_caches=self.k, v_caches=self.v, slot_mapping=slots,
                             query_start_loc=torch.arange(rows + 1), context_lens=ctx, block_tables=self.tables[seqs],
                             all_decode=True, max_query_len=1)
        if mirror is not None and mirror.begin(tuple(seqs), context_lens, BLOCK, (KV_HEADS, DIM), torch.float32,
                                               torch.device("cpu")):
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
    caches = Caches(seqs=3, longest=3 + 12 + HEADROOM + 8)
    lens = {0: 3, 1: 12, 2: 7}
    for seq, n in lens.items():
        caches.fill(seq, n)
    mirror = DecodeMirror(LAYERS)
    served = []

    def step(seqs: list[int]) -> None:
        for seq in seqs:
            lens[seq] += 1
        context = [lens[s] for s in seqs]
        with_mirror = caches.step(seqs, context, mirror)
        served.append((mirror.fresh, mirror.capacity) if mirror.seq_ids == tuple(seqs) else None)
        without = caches.step(seqs, context, None)  # writes the same new keys and values again
        for a, b in zip(with_mirror, without):
            assert torch.equal(a, b)

    step([0, 1, 2])  # built
    assert served[-1] == (True, -(-(13 + HEADROOM) // BLOCK) * BLOCK)
    for _ in range(3):
        step([0, 1, 2])  # appended
        assert served[-1][0] is False
    step([0, 2])  # another set of sequences: rebuilt
    assert served[-1][0] is True
    step([0, 2])
    assert served[-1][0] is False
    step([2, 0])  # the same sequences in another order: rebuilt
    assert served[-1][0] is True
    lens[0] += 1  # sequence 0 computed a token in a step the mirror did not see (a mixed step): rebuilt
    step([2, 0])
    assert served[-1][0] is True
    while lens[2] + 1 <= mirror.capacity:  # appended up to its capacity, then rebuilt larger
        step([2, 0])
        assert served[-1][0] is False
    capacity = mirror.capacity
    step([2, 0])
    assert served[-1][0] is True and mirror.capacity > capacity


def test_a_batch_over_the_budget_gathers_every_step():
    caches = Caches(seqs=2, longest=40)
    caches.fill(0, 9)
    caches.fill(1, 20)
    mirror = DecodeMirror(LAYERS, budget_bytes=1024)
    assert not mirror.begin((0, 1), [10, 21], BLOCK, (KV_HEADS, DIM), torch.float32, torch.device("cpu"))
    assert mirror.seq_ids == () and mirror.keys == []
    roomy = DecodeMirror(LAYERS)
    assert roomy.begin((0, 1), [10, 21], BLOCK, (KV_HEADS, DIM), torch.float32, torch.device("cpu"))
