"""BlockManager bookkeeping: seed 002 D06-D08 numbers, refcounts, copy-on-write, prefix cache, LRU.

The last test drives thousands of random operations against a simulated KV memory: every
position a sequence treats as computed must hold exactly the KV of its own prefix, so a wrong
prefix hit, a missing copy-on-write or a reused referenced block shows up as wrong content.
"""

from __future__ import annotations

import collections
import random

import pytest

from stages.llm import blocks
from stages.llm.blocks import BlockManager, BlockTable, OutOfBlocksError

NS = ("weights-v1", None, "tenant-a")


def alloc(bm: BlockManager, tokens: list[int], ns=NS, *, computed: bool = False) -> BlockTable:
    """Allocate a table; with computed=True also mark every assigned slot written."""
    table = BlockTable()
    bm.allocate(table, tokens, ns)
    if computed:
        bm.mark_computed(table, tokens, len(tokens), ns)
    return table


# -- seed 002 D06-D08 ----------------------------------------------------------------------------
def test_d06_internal_fragmentation():
    m_token = 2 * 2 * 2 * 4 * 2  # 2 * layers * kv_heads * d_head * bytes = 64 B
    bm = BlockManager(8, 4)
    tables = [alloc(bm, list(range(n))) for n in (1, 5)]
    logical = sum(t.num_tokens for t in tables)
    allocated = sum(len(t.block_ids) * bm.block_size for t in tables)
    assert (logical, allocated) == (6, 12)
    assert (logical * m_token, allocated * m_token) == (384, 768)
    assert bm.num_used_blocks == 3


def test_d07_two_way_prefix_sharing():
    bm = BlockManager(8, 4)
    a = alloc(bm, [1, 2, 3, 4, 5, 6], computed=True)
    b = alloc(bm, [1, 2, 3, 4, 7, 8, 9])
    no_share = bm.blocks_needed(6) + bm.blocks_needed(7)
    assert (no_share, b.num_cached_tokens // 4, bm.num_used_blocks) == (4, 1, 3)
    assert b.block_ids[0] == a.block_ids[0] and bm.refcount(a.block_ids[0]) == 2
    assert b.block_ids[1] != a.block_ids[1]


def test_d07_prefix_shorter_than_a_block_shares_nothing():
    bm = BlockManager(8, 4)
    alloc(bm, [1, 2, 3, 10, 11, 12, 13], computed=True)
    b = alloc(bm, [1, 2, 3, 20, 21, 22, 23, 24])
    assert b.num_cached_tokens == 0 and bm.num_used_blocks == 4


def test_d08_three_way_sharing():
    bm = BlockManager(8, 4)
    a = alloc(bm, [1, 2, 3, 4, 5, 6], computed=True)
    b = alloc(bm, [1, 2, 3, 4, 30])
    c = alloc(bm, [1, 2, 3, 4, 31, 32])
    assert bm.num_used_blocks == 6 - 2 * 1
    assert b.num_cached_tokens == c.num_cached_tokens == 4
    assert bm.refcount(a.block_ids[0]) == 3


# -- prefix cache rules ----------------------------------------------------------------------------
def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(16, 4)
    alloc(bm, list(range(8)), computed=True)
    assert alloc(bm, list(range(8))).num_cached_tokens == 4  # a full hit would leave nothing to sample from
    assert alloc(bm, list(range(9))).num_cached_tokens == 8
    assert alloc(bm, list(range(4))).num_cached_tokens == 0


def test_only_computed_full_blocks_are_hits():
    bm = BlockManager(16, 4)
    tokens = list(range(10))
    a = alloc(bm, tokens)
    assert alloc(bm, tokens).num_cached_tokens == 0  # slots assigned, KV not written yet
    bm.mark_computed(a, tokens, 7)  # a chunked prefill wrote 7 of 10
    assert alloc(bm, tokens).num_cached_tokens == 4
    bm.mark_computed(a, tokens, 10)
    assert alloc(bm, tokens).num_cached_tokens == 8


def test_cancelled_prefill_leaves_nothing_cached():
    bm = BlockManager(4, 4)
    a = alloc(bm, list(range(9)))
    bm.free(a)  # cancelled before its forward: its blocks hold no KV
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 4
    assert alloc(bm, list(range(9))).num_cached_tokens == 0


def test_namespaces_are_isolated(monkeypatch):
    bm = BlockManager(16, 4)
    tokens = list(range(9))
    alloc(bm, tokens, ("w1", None, "tenant-a"), computed=True)
    assert alloc(bm, tokens, ("w1", None, "tenant-b")).num_cached_tokens == 0
    assert alloc(bm, tokens, ("w2", None, "tenant-a")).num_cached_tokens == 0
    assert alloc(bm, tokens, ("w1", None, "tenant-a")).num_cached_tokens == 8
    # Even if the hash ignored the namespace, verification keeps tenants apart.
    monkeypatch.setattr(blocks, "block_hash", lambda ns, parent, toks: hash((parent, toks)))
    bm = BlockManager(16, 4)
    alloc(bm, tokens, "tenant-a", computed=True)
    assert alloc(bm, tokens, "tenant-b").num_cached_tokens == 0


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(blocks, "block_hash", lambda ns, parent, toks: 0)  # every block collides
    bm = BlockManager(16, 4)
    a = alloc(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9], computed=True)
    assert bm.refcount(a.block_ids[0]) == 1
    assert alloc(bm, [5, 6, 7, 8, 0]).num_cached_tokens == 0  # same hash, other tokens
    assert alloc(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0]).num_cached_tokens == 4  # block 1 collides with block 0
    bm.check_invariants()


def test_collision_deeper_in_the_chain_checks_the_parent(monkeypatch):
    # A hash that forgets the parent: block [5..8] after [9,9,9,9] files under the same key as after [1..4].
    monkeypatch.setattr(blocks, "block_hash", lambda ns, parent, toks: hash((ns, toks)))
    bm = BlockManager(16, 4)
    alloc(bm, [1, 2, 3, 4, 0], computed=True)
    alloc(bm, [9, 9, 9, 9, 5, 6, 7, 8, 0], computed=True)
    b = alloc(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert b.num_cached_tokens == 4  # block 1's tokens match, but its KV was computed after [9,9,9,9]


def test_stats_count_tokens():
    bm = BlockManager(16, 4)
    alloc(bm, list(range(9)), computed=True)
    alloc(bm, list(range(9)))
    assert (bm.stats.queries, bm.stats.hits) == (18, 8)
    assert bm.stats.hit_rate == pytest.approx(8 / 18)


def test_prefix_cache_disabled():
    bm = BlockManager(8, 4, enable_prefix_cache=False)
    a = alloc(bm, list(range(9)), computed=True)
    assert alloc(bm, list(range(9))).num_cached_tokens == 0
    bm.free(a)
    assert bm.num_cached_blocks == 0 and bm.stats.queries == 0


def test_invalidate_and_reset():
    bm = BlockManager(16, 4)
    live = alloc(bm, list(range(9)), "old", computed=True)
    bm.free(alloc(bm, list(range(100, 109)), "old", computed=True))
    bm.free(alloc(bm, list(range(9)), "new", computed=True))
    assert bm.num_cached_blocks == 4
    assert bm.invalidate(lambda ns: ns == "old") == 4  # 2 referenced by `live`, 2 unreferenced
    assert bm.num_cached_blocks == 2 and bm.num_used_blocks == 3
    assert alloc(bm, list(range(9)), "old").num_cached_tokens == 0
    bm.free(live)  # its blocks are no longer cached: straight to the free list
    assert bm.num_cached_blocks == 2
    assert bm.reset_prefix_cache() == 2 and bm.num_cached_blocks == 0
    bm.check_invariants()


# -- refcounts, copy-on-write, fork, free ------------------------------------------------------
def test_fork_then_append_copies_the_shared_partial_tail():
    bm = BlockManager(8, 4)
    tokens = [1, 2, 3, 4, 5]
    parent = alloc(bm, tokens, computed=True)
    child = BlockTable()
    bm.fork(parent, child)
    assert child.block_ids == parent.block_ids and all(bm.refcount(b) == 2 for b in parent.block_ids)
    assert bm.num_used_blocks == 2
    src = parent.block_ids[1]
    copies = bm.append(child, tokens + [7], 1)  # the child writes position 5 into a private copy
    assert copies == [(src, child.block_ids[1])] and child.block_ids[1] != src
    assert (bm.refcount(src), bm.refcount(child.block_ids[1]), bm.refcount(parent.block_ids[0])) == (1, 1, 2)
    assert bm.append(parent, tokens + [8], 1) == []  # the parent is the last holder: writes in place
    assert parent.block_ids[1] == src and bm.num_used_blocks == 3
    assert bm.slot_mapping(child, 4, 6) == [child.block_ids[1] * 4, child.block_ids[1] * 4 + 1]


def test_fork_with_a_full_tail_needs_no_copy():
    bm = BlockManager(8, 4)
    tokens = list(range(8))
    parent = alloc(bm, tokens, computed=True)
    child = BlockTable()
    bm.fork(parent, child)
    assert bm.append(child, tokens + [9], 1) == [] and bm.append(parent, tokens + [10], 1) == []
    assert child.block_ids[:2] == parent.block_ids[:2] and child.block_ids[2] != parent.block_ids[2]
    assert bm.num_used_blocks == 4


def test_refcounts_through_fork_append_free():
    bm = BlockManager(16, 4)
    tokens = list(range(6))
    parent = alloc(bm, tokens, computed=True)
    children = [BlockTable() for _ in range(3)]
    for child in children:
        bm.fork(parent, child)
    assert bm.refcount(parent.block_ids[0]) == 4
    for i, child in enumerate(children):
        bm.append(child, tokens + [100 + i], 1)
    assert bm.num_used_blocks == 2 + 3 and bm.refcount(parent.block_ids[1]) == 1
    bm.free(parent)
    assert bm.refcount(children[0].block_ids[0]) == 3
    for child in children:
        bm.free(child)
        bm.free(child)  # idempotent
    assert bm.num_free_blocks == 16 and bm.num_used_blocks == 0
    assert bm.num_cached_blocks == 1  # block [0..3] stays cached for later prompts
    bm.check_invariants()


def test_append_and_can_append_count_the_copy():
    bm = BlockManager(3, 4)
    tokens = [1, 2, 3, 4, 5]
    parent = alloc(bm, tokens, computed=True)
    child = BlockTable()
    bm.fork(parent, child)
    assert bm.can_append(child, 1) and not bm.can_append(child, 4)  # the copy plus one new block
    bm.append(child, tokens + [6], 1)
    assert not bm.can_append(parent, 4) and bm.can_append(parent, 3) and bm.can_append(parent, 0)
    with pytest.raises(OutOfBlocksError):
        bm.append(parent, tokens + [0] * 4, 4)
    assert parent.num_tokens == 5 and len(parent.block_ids) == 2  # a refused append changes nothing


def test_append_slot_is_append_where_it_answers():
    """The scheduler's decode path: one slot in a last block of the table's own, else None and nothing changed
    (a full last block needs a new one; a shared tail a copy; an assigned position no append)."""
    bm = BlockManager(8, 4)
    tokens = [1, 2, 3, 4, 5]
    table, twin = alloc(bm, tokens, computed=True), alloc(bm, tokens, computed=True)
    assert not bm.appends_in_place(table, 4) and bm.appends_in_place(table, 5)  # (what append_slot answers)
    assert bm.append_slot(table, 4) is None  # position 4 has its slot already (allocate assigned the prompt's)
    slot = bm.append_slot(table, 5)
    assert bm.append(twin, tokens + [6], 1) == [] and table.num_tokens == twin.num_tokens == 6  # what append does
    assert [slot] == bm.slot_mapping(table, 5, 6) == [table.block_ids[1] * 4 + 1]
    before = (list(table.block_ids), table.num_tokens)
    for position in (6, 7):
        assert bm.append_slot(table, position) == table.block_ids[1] * 4 + position % 4
    assert not bm.appends_in_place(table, 8)
    assert bm.append_slot(table, 8) is None and (table.num_tokens, len(table.block_ids)) == (8, 2)  # block full
    assert before[0] == table.block_ids
    child = BlockTable()
    bm.fork(twin, child)
    assert not bm.appends_in_place(child, 6)
    assert bm.append_slot(child, 6) is None and child.num_tokens == 6  # the tail is shared: append copies it
    assert bm.append(child, tokens + [6, 7], 1) != []
    bm.check_invariants()


# -- LRU eviction ------------------------------------------------------------------------------
def test_lru_evicts_least_recently_freed_first():
    bm = BlockManager(6, 4)
    prompts = {name: [base] * 4 + [0] for name, base in (("a", 10), ("b", 20), ("c", 30))}
    tables = {name: alloc(bm, p, computed=True) for name, p in prompts.items()}
    heads = {name: t.block_ids[0] for name, t in tables.items()}
    for name in "abc":
        bm.free(tables[name])
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 6
    alloc(bm, list(range(100, 112)))  # three uncached blocks come back from the free list first
    assert bm.stats.evictions == 0
    revived = alloc(bm, prompts["a"])  # a hit revives a's block: it leaves the LRU
    assert revived.block_ids[0] == heads["a"] and bm.stats.evictions == 1  # its fresh block evicted b
    assert alloc(bm, list(range(200, 203))).block_ids == [heads["c"]]
    assert bm.stats.evictions == 2 and bm.num_free_blocks == 0


def test_a_prefix_is_evicted_tail_first():
    bm = BlockManager(3, 4)
    tokens = list(range(9))
    a = alloc(bm, tokens, computed=True)
    first, second, partial = a.block_ids
    bm.free(a)
    small = alloc(bm, [50, 51])
    assert small.block_ids == [partial]  # the uncached block goes first
    assert alloc(bm, [60, 61]).block_ids == [second]  # then the deeper cached block
    assert bm.can_allocate(tokens, NS) is False
    bm.free(small)  # no longer referenced: back to the free list
    assert alloc(bm, tokens[:5]).num_cached_tokens == 4  # block 0 survived


def test_eviction_never_touches_referenced_blocks():
    bm = BlockManager(4, 4)
    tokens = list(range(9))
    live = alloc(bm, tokens, computed=True)  # 3 blocks, the first two cached and referenced
    assert not bm.can_allocate(list(range(100, 109)), NS)
    with pytest.raises(OutOfBlocksError):
        alloc(bm, list(range(100, 109)))
    assert all(bm.refcount(b) == 1 for b in live.block_ids) and bm.num_used_blocks == 3
    shared = alloc(bm, tokens)  # 2 hits + 1 fresh block
    assert shared.num_cached_tokens == 8 and bm.num_free_blocks == 0
    with pytest.raises(OutOfBlocksError):
        alloc(bm, [43])
    bm.free(live)  # its cached blocks stay referenced by `shared`; only its tail is freed
    assert bm.num_free_blocks == 1 and bm.num_cached_blocks == 0
    alloc(bm, [43])
    with pytest.raises(OutOfBlocksError):
        alloc(bm, [44])
    assert bm.stats.evictions == 0 and all(bm.refcount(b) == 1 for b in shared.block_ids)
    bm.check_invariants()


def test_can_allocate_counts_revived_hits():
    bm = BlockManager(4, 4)
    bm.free(alloc(bm, list(range(9)), computed=True))  # 2 cached + 2 free
    assert bm.can_allocate(list(range(9)), NS)  # 2 hits + 1 fresh
    # 1 hit + 4 fresh: the free count says 4, but reviving the hit takes one of them.
    assert not bm.can_allocate(list(range(4)) + list(range(50, 63)), NS)


# -- bad input ---------------------------------------------------------------------------------
def test_errors_name_the_field():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError, match="token_ids"):
        bm.allocate(BlockTable(), [], NS)
    table = alloc(bm, [1, 2, 3])
    with pytest.raises(ValueError, match="empty BlockTable"):
        bm.allocate(table, [1], NS)
    with pytest.raises(ValueError, match="allocate first"):
        bm.append(BlockTable(), [1], 1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.append(table, [1, 2, 3], -1)
    with pytest.raises(ValueError, match="token_ids has 3 tokens"):
        bm.append(table, [1, 2, 3], 1)
    with pytest.raises(ValueError, match="empty child"):
        bm.fork(table, table)
    with pytest.raises(ValueError, match=r"positions \[2, 4\)"):
        bm.slot_mapping(table, 2, 4)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        bm.mark_computed(table, [1, 2, 3], 4)
    with pytest.raises(ValueError, match="namespace"):
        bm.mark_computed(table, [1, 2, 3], 3, "another-tenant")
    with pytest.raises(ValueError, match="num_tokens"):
        bm.blocks_needed(-1)


# -- randomized: thousands of operations against a simulated KV memory ------------------------------
class _Sim:
    """Live sequences plus a fake KV memory: slot -> (namespace, prefix ending at that position)."""

    def __init__(self, rng: random.Random, bm: BlockManager):
        self.rng, self.bm = rng, bm
        self.mem: dict[int, tuple] = {}
        self.seqs: list[dict] = []  # {"tokens", "table", "computed", "ns"}
        self.prefixes = [[rng.randrange(8) for _ in range(12)] for _ in range(3)]

    def expect(self, seq: dict, pos: int) -> tuple:
        return (seq["ns"], tuple(seq["tokens"][:pos + 1]))

    def check_content(self, seq: dict) -> None:
        for pos, slot in enumerate(self.bm.slot_mapping(seq["table"], 0, seq["computed"])):
            assert self.mem.get(slot) == self.expect(seq, pos), (pos, slot)

    def new(self) -> dict | None:
        rng = self.rng
        prefix = rng.choice(self.prefixes)[:rng.randrange(13)]
        tokens = prefix + [rng.randrange(8) for _ in range(rng.randrange(1, 10))]
        ns = rng.choice(["a", "a", "b"])
        if not self.bm.can_allocate(tokens, ns):
            with pytest.raises(OutOfBlocksError):
                self.bm.allocate(BlockTable(), tokens, ns)
            return None
        seq = {"tokens": tokens, "table": BlockTable(), "ns": ns}
        self.bm.allocate(seq["table"], tokens, ns)
        seq["computed"] = seq["table"].num_cached_tokens
        assert seq["computed"] % self.bm.block_size == 0 and seq["computed"] < len(tokens)
        self.seqs.append(seq)
        return seq

    def compute(self, seq: dict) -> None:
        """The runner's forward: write KV at the next uncomputed positions (never into a shared block)."""
        table, bm = seq["table"], self.bm
        end = self.rng.randint(seq["computed"] + 1, table.num_tokens)
        for pos, slot in zip(range(seq["computed"], end), bm.slot_mapping(table, seq["computed"], end)):
            assert bm.refcount(slot // bm.block_size) == 1, "a write into a shared block"
            self.mem[slot] = self.expect(seq, pos)
        seq["computed"] = end
        bm.mark_computed(table, seq["tokens"], end, seq["ns"])

    def append(self, seq: dict) -> None:
        k = self.rng.randint(1, 3)
        tokens = seq["tokens"] + [self.rng.randrange(8) for _ in range(k)]
        if not self.bm.can_append(seq["table"], k):
            with pytest.raises(OutOfBlocksError):
                self.bm.append(seq["table"], tokens, k)
            return
        seq["tokens"] = tokens
        size = self.bm.block_size
        for src, dst in self.bm.append(seq["table"], tokens, k):
            assert self.bm.refcount(dst) == 1 and self.bm.refcount(src) >= 1
            for off in range(size):  # the runner copies the whole block
                if src * size + off in self.mem:
                    self.mem[dst * size + off] = self.mem[src * size + off]

    def fork(self, seq: dict) -> dict:
        child = {"tokens": list(seq["tokens"]), "table": BlockTable(), "computed": seq["computed"], "ns": seq["ns"]}
        self.bm.fork(seq["table"], child["table"])
        self.seqs.append(child)
        return child

    def free(self, seq: dict) -> None:
        self.seqs = [s for s in self.seqs if s is not seq]  # by identity: a fresh fork equals its parent
        self.bm.free(seq["table"])
        self.bm.free(seq["table"])  # a racing cancel/finish: idempotent

    def check_counts(self) -> None:
        bm = self.bm
        bm.check_invariants()
        held = collections.Counter(b for seq in self.seqs for b in seq["table"].block_ids)
        assert all(bm.refcount(b) == held[b] for b in range(bm.num_blocks))
        assert sum(held.values()) == sum(len(seq["table"].block_ids) for seq in self.seqs)
        assert bm.num_used_blocks == len(held)
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        assert 0 <= bm.num_cached_blocks <= bm.num_free_blocks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    bm = BlockManager(24, 4)
    sim = _Sim(rng, bm)
    for step in range(2500):
        op = rng.random()
        seq = rng.choice(sim.seqs) if sim.seqs else None
        if seq is None or op < 0.2:
            seq = sim.new()
        elif op < 0.5 and seq["computed"] < seq["table"].num_tokens:
            sim.compute(seq)
        elif op < 0.7:
            sim.append(seq)
        elif op < 0.78 and seq["computed"] == seq["table"].num_tokens:
            seq = sim.fork(seq)
        elif op < 0.995:
            sim.free(seq)
            seq = None
        else:
            bm.invalidate(lambda ns: ns == "b") if op < 0.998 else bm.reset_prefix_cache()
        if seq is not None:
            sim.check_content(seq)
        sim.check_counts()
        if step % 50 == 0:
            for live in sim.seqs:
                sim.check_content(live)
    assert bm.stats.hits > 0 and bm.stats.evictions > 0  # the run exercised the cache
    for seq in list(sim.seqs):
        sim.free(seq)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    bm.check_invariants()


def test_tokens_read_prompt_and_outputs_as_one_list():
    """Sequence.tokens (what a step's bookkeeping reads) is token_ids without the copy: the same length, items
    and slices, across the prompt's end too."""
    from stages.llm.sequence import Tokens

    prompt, output = [5, 6, 7, 8], [9, 10, 11]
    tokens, whole = Tokens(prompt, output), prompt + output
    assert len(tokens) == len(whole) and [tokens[i] for i in range(-7, 7)] == [whole[i] for i in range(-7, 7)]
    for start in range(8):
        for stop in range(start, 9):
            assert tokens[start:stop] == whole[start:stop]
    output.append(12)  # a view: a token sampled since is in it
    assert len(tokens) == 8 and tokens[6:8] == [11, 12]
