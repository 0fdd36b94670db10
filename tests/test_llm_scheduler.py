"""The scheduler's step without a plan (`Scheduler.decoding`): offered exactly where `schedule` would plan the running
sequences one decode token each, in their last blocks, and nothing else; its slots are the ones that plan gives."""

from __future__ import annotations

import torch

from stages.llm.blocks import BlockManager, BlockTable
from stages.llm.scheduler import Scheduler, SchedulerConfig
from stages.llm.sequence import Sequence


def _seq(seq_id: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, index=0, prompt_ids=list(prompt), params=None, namespace=("ns",),
                    generator=torch.Generator())


def _decoding_pair(count: int = 3, prompt_len: int = 5, num_blocks: int = 64) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler whose `count` sequences have prefilled their prompts (one step) and sampled one token each."""
    scheduler = Scheduler(BlockManager(num_blocks, 4), SchedulerConfig())
    seqs = [_seq(i, [10 + i] * prompt_len) for i in range(count)]
    for seq in seqs:
        scheduler.add(seq)
    plan = scheduler.schedule()
    assert all(chunk.sample for chunk in plan.chunks) and len(plan.chunks) == count
    scheduler.commit(plan)
    for seq in seqs:
        seq.output_ids.append(7)
    return scheduler, seqs


def _twin_slots(prompt_len: int) -> list[int]:
    """The slots `schedule` plans for the same state (a twin scheduler driven the same way)."""
    twin, _ = _decoding_pair(prompt_len=prompt_len)
    return [chunk.slots[0] for chunk in twin.schedule().chunks]


def test_decoding_offers_the_running_sequences_with_the_planned_slots():
    for prompt_len in (5, 8):  # position 5: inside each sequence's second block, held alone; 8: a new block each
        scheduler, seqs = _decoding_pair(prompt_len=prompt_len)
        assert scheduler.decoding() == seqs
        free = scheduler.blocks.num_free_blocks
        slots = scheduler.append_slots(seqs)
        assert slots == _twin_slots(prompt_len)
        assert free - scheduler.blocks.num_free_blocks == (3 if prompt_len == 8 else 0)
        scheduler.commit_decode(seqs)
        assert [seq.num_computed_tokens for seq in seqs] == [prompt_len + 1] * 3
        assert [seq.block_table.num_tokens for seq in seqs] == [prompt_len + 1] * 3
        scheduler.blocks.check_invariants()


def test_decoding_declines_what_the_plan_must_decide():
    scheduler, seqs = _decoding_pair(prompt_len=8, num_blocks=8)  # position 8 needs a third block each: 2 free
    assert scheduler.decoding() is None  # (the plan preempts one)
    assert scheduler.schedule().preempted
    scheduler, seqs = _decoding_pair()
    scheduler.add(_seq(9, [3, 4, 5]))  # someone waits: the plan admits it
    assert scheduler.decoding() is None
    scheduler, seqs = _decoding_pair()
    scheduler.config = SchedulerConfig(max_num_batched_tokens=2)  # 3 decodes, a budget of 2
    assert scheduler.decoding() is None
    scheduler, seqs = _decoding_pair()
    seqs[1].output_ids.append(8)  # two tokens to compute: not a decode step
    assert scheduler.decoding() is None
    scheduler, seqs = _decoding_pair()
    child = _seq(5, seqs[0].prompt_ids)
    child.output_ids = list(seqs[0].output_ids)
    child.block_table = BlockTable(block_ids=[])
    scheduler.blocks.fork(seqs[0].block_table, child.block_table)  # n > 1: the tail block is shared
    child.num_computed_tokens = seqs[0].num_computed_tokens
    scheduler.add_running(child)
    assert scheduler.decoding() is None  # (the plan copies the shared tail first)
    assert scheduler.schedule().copies
