"""Iteration-level scheduling: which sequences run this step, with how many tokens (policy only).

Each step: running sequences first (one decode token each, or their next prefill chunk), then
waiting ones while the sequence cap, the token budget and free blocks allow: FCFS within a tenant, and the
tenant with the fewest running sequences first, so one tenant's backlog cannot hold another's request out of
the batch for longer than the next free slot. Blocks are
allocated when a sequence is picked, not when it is admitted (admission only checks that it
can ever fit). When a running sequence cannot get a block, the most recently admitted running
sequence is preempted by recompute: its blocks are freed and it waits at the front of the queue.

The Plan a step returns is the launch record: immutable rows (sequence, positions, slots, a
frozen copy of the block table). The runner and the commit read the plan, never the live lists.
One step has no Plan: where every running sequence just decodes its next token and nothing waits
(`decoding`), the running list and the slots `append_slots` assigns are the record; the stage runs,
commits (`commit_decode`) and samples it in one go, with nothing changed in between.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from stages.llm.blocks import BlockManager, BlockTable
from stages.llm.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one forward
    max_num_batched_tokens: int = 2048  # tokens in one forward (prefill chunks + one per decode)
    max_prefill_chunk: int | None = None  # cap on one sequence's prefill chunk (None: the token budget)

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1 or None, got {self.max_prefill_chunk}")


@dataclass(frozen=True)
class Chunk:
    """One row group of a forward: tokens [start, start + len(token_ids)) of one sequence."""

    seq: Sequence
    start: int  # first position computed in this forward
    token_ids: tuple[int, ...]  # the tokens fed at those positions
    slots: tuple[int, ...]  # physical KV slot of each position
    block_ids: tuple[int, ...]  # frozen copy of the block table at launch
    sample: bool  # the chunk reaches the last known token: its logits give the next token

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class Plan:
    chunks: tuple[Chunk, ...]  # rows of this forward, in order
    copies: tuple[tuple[int, int], ...]  # copy-on-write block copies (src, dst) to apply before the forward
    preempted: tuple[Sequence, ...]  # sequences that lost their blocks this step

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig):
        self.blocks = blocks
        self.config = config
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- admission and removal ----------------------------------------------------------------
    def check_fits(self, num_tokens: int) -> None:
        """Phase-2 admission: a sequence that could never fit in the whole cache is refused now."""
        need = self.blocks.blocks_needed(num_tokens)
        total = self.blocks.num_free_blocks + self.blocks.num_used_blocks
        if need > total:
            raise ValueError(f"{num_tokens} tokens need {need} KV blocks; the cache has {total}")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_tokens + 1)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Leave the scheduler and release blocks (idempotent). Call only between forwards."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table is not None:
            self.blocks.free(seq.block_table)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def add_running(self, seq: Sequence) -> None:
        """A forked sequence (n > 1) that already shares its parent's blocks."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> Plan:
        budget = self.config.max_num_batched_tokens
        chunks: list[Chunk] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []

        # 1. running sequences, in admission order: a decode token or the next prefill chunk
        for seq in list(self.running):
            if budget <= 0 or seq.status is not SeqStatus.RUNNING:
                continue
            if seq.num_uncomputed == 1:  # a decode whose slot fits its last block: the Chunk at once (the hot path)
                position = seq.num_computed_tokens
                slot = self.blocks.append_slot(seq.block_table, position)
                if slot is not None:
                    chunks.append(Chunk(seq, position, (seq.tokens[position],), (slot,),
                                        tuple(seq.block_table.block_ids), sample=True))
                    budget -= 1
                    continue
            n = self._chunk_len(seq, budget)
            while not self.blocks.can_append(seq.block_table, self._new_slots(seq, n)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            copies += self.blocks.append(seq.block_table, seq.tokens, self._new_slots(seq, n))
            chunks.append(self._chunk(seq, n))
            budget -= n

        # 2. waiting sequences, tenants in turn, while a slot, the budget and blocks allow (none after a preemption)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            seq = self._next_waiting()
            if not self.blocks.can_allocate(seq.token_ids, seq.namespace):
                break
            self.waiting.remove(seq)
            seq.block_table = BlockTable(block_ids=[])
            self.blocks.allocate(seq.block_table, seq.token_ids, seq.namespace)
            seq.num_computed_tokens = seq.block_table.num_cached_tokens
            if not seq.output_ids:  # a resumed (preempted) sequence keeps its first count
                seq.num_cached_tokens = seq.block_table.num_cached_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = self._chunk_len(seq, budget)
            chunks.append(self._chunk(seq, n))
            budget -= n
        return Plan(tuple(chunks), tuple(copies), tuple(preempted))

    def commit(self, plan: Plan) -> None:
        """After the forward completed: the chunks' KV is written (sequences still alive only)."""
        for chunk in plan.chunks:
            self._computed(chunk.seq, chunk.context_len)

    # -- a step without a plan: the running sequences, each one token further ----------------------
    def decoding(self) -> list[Sequence] | None:
        """The running sequences when this step is what `schedule` would plan for them with nothing to decide:
        nothing waits, and every one decodes its next token, into its last block (held alone) or into a new
        block the free ones can give (the common decode step). None otherwise: `schedule` plans the step (an
        admission, a prefill chunk, a preemption, a copy-on-write)."""
        if self.waiting or not self.running or len(self.running) > self.config.max_num_batched_tokens:
            return None
        size = self.blocks.block_size
        new_blocks = 0
        for seq in self.running:
            table, position = seq.block_table, seq.num_computed_tokens
            if seq.status is not SeqStatus.RUNNING or seq.num_uncomputed != 1:
                return None
            if not self.blocks.appends_in_place(table, position):
                if position != table.num_tokens or position % size:  # (a shared tail: the plan copies it)
                    return None
                new_blocks += 1  # its blocks are full: the next one (any full ones shared stay shared)
        return list(self.running) if new_blocks <= self.blocks.num_free_blocks else None

    def append_slots(self, seqs: list[Sequence]) -> list[int]:
        """The new token's slot of each of `seqs` (from `decoding`, nothing changed since), assigned as
        `schedule` assigns it: in place, or in a new block."""
        slots = []
        for seq in seqs:
            table, position = seq.block_table, seq.num_computed_tokens
            slot = self.blocks.append_slot(table, position)
            if slot is None:
                copies = self.blocks.append(table, seq.tokens, 1)
                assert not copies, "decoding() takes no copy-on-write"
                slot = self.blocks.slot_mapping(table, position, position + 1)[0]
            slots.append(slot)
        return slots

    def commit_decode(self, seqs: list[Sequence]) -> None:
        """`commit` of a step of `append_slots`: each sequence's next token's KV is written."""
        for seq in seqs:
            self._computed(seq, seq.num_computed_tokens + 1)

    def _computed(self, seq: Sequence, context_len: int) -> None:
        table = seq.block_table
        if seq.status is SeqStatus.RUNNING and table is not None:
            seq.num_computed_tokens = max(seq.num_computed_tokens, context_len)
            if seq.num_computed_tokens // self.blocks.block_size > len(table.block_hashes):  # a block filled
                self.blocks.mark_computed(table, seq.tokens, seq.num_computed_tokens, seq.namespace)

    # -- helpers --------------------------------------------------------------------------------
    def _next_waiting(self) -> Sequence:
        """The first waiting sequence of the tenant with the fewest running (the queue's first among equals)."""
        running = collections.Counter(seq.tenant for seq in self.running)
        return min(self.waiting, key=lambda seq: running[seq.tenant])  # min keeps the first of equals
    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed, budget)
        if self.config.max_prefill_chunk is not None and seq.num_uncomputed > 1:
            n = min(n, self.config.max_prefill_chunk)
        return max(n, 1)

    @staticmethod
    def _new_slots(seq: Sequence, n: int) -> int:
        return max(0, seq.num_computed_tokens + n - seq.block_table.num_tokens)

    def _chunk(self, seq: Sequence, n: int) -> Chunk:
        start = seq.num_computed_tokens
        table = seq.block_table
        return Chunk(seq, start, tuple(seq.tokens[start:start + n]),
                     tuple(self.blocks.slot_mapping(table, start, start + n)), tuple(table.block_ids),
                     sample=start + n == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free every block; the sequence re-prefills prompt + outputs later."""
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.block_table = None
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
