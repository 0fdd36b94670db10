"""Tenants take turns in the stages (stages/fair_queue.py): a tenant with a backlog does not hold another tenant's
single request back by more than one batch, in a pool's queue, in the denoise loop's steps and in the llm
scheduler's admissions. Asserted from the schedule each stage ran, never from wall time."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from pipelines.chat import ChatRequest, LLMConfig
from pipelines.config import EngineConfig, ModelSpec
from pipelines.engine import Engine
from pipelines.image_request import ImageRequest
from stages.events import EventKind
from stages.executor import GraphExecutor
from stages.fair_queue import service_order, take_in_turns
from stages.graph import StageGraph
from stages.llm.params import SamplingParams
from stages.pool import PoolConfig, submit_priority, submit_tenant
from stages.stage import Stage, WorkItem
from stages.thread_budget import ThreadBudget
from tests.helpers import demo_path

BACKLOG = 6  # the busy tenant's requests queued before the other's one


@contextmanager
def as_tenant(tenant: str, rank: int = 1) -> Iterator[None]:
    """Submit as serve/quota.py does for a caller of `tenant` (priority class `rank`)."""
    tokens = submit_tenant.set(tenant), submit_priority.set(rank)
    try:
        yield
    finally:
        submit_tenant.reset(tokens[0])
        submit_priority.reset(tokens[1])


def queued(name: str, tenant: str, at: float, rank: int = 1) -> Any:
    return SimpleNamespace(name=name, enqueued_at=at, request=SimpleNamespace(tenant=tenant, priority=rank))


def names(items) -> list[str]:
    return [i.name for i in items]


def test_the_service_order_gives_tenants_turns_within_a_class():
    backlog = [queued(f"a{k}", "a", at=k) for k in range(BACKLOG)]
    one = queued("b0", "b", at=BACKLOG)
    assert names(service_order([*backlog, one], now=10, aging_s=100)) == ["a0", "b0", "a1", "a2", "a3", "a4", "a5"]
    # What a tenant already has in the stage counts: "a" holds two, so "b" goes first.
    assert names(service_order([*backlog, one], now=10, aging_s=100, serving={"a": 2}))[:2] == ["b0", "a0"]
    # Classes still come first: a high (0) tenant's items before the normal ones, however many "a" has queued...
    high = [queued("h0", "h", at=15, rank=0), queued("h1", "h", at=16, rank=0)]
    assert names(service_order([*backlog, one, *high], now=16, aging_s=100))[:3] == ["h0", "h1", "a0"]
    # ... until aging lifts the normal class: at 10 s a class, its oldest (20 s) is ahead of the high one's (5 s).
    assert names(service_order([*backlog, one, *high], now=20, aging_s=10))[0] == "a0"
    # One tenant alone: arrival order.
    assert names(service_order(reversed(backlog), now=10, aging_s=100)) == [f"a{k}" for k in range(BACKLOG)]


def test_a_loop_step_takes_its_rows_in_turns():
    loop = [queued(f"a{k}", "a", at=k) for k in range(4)] + [queued("b0", "b", at=9), queued("c0", "c", at=9)]
    assert names(take_in_turns(loop, 2)) == ["a0", "b0"]
    assert names(take_in_turns(loop, 4)) == ["a0", "b0", "c0", "a1"]
    assert names(take_in_turns(loop[:4], 3)) == ["a0", "a1", "a2"]  # one tenant: the loop's own order


class Batches(Stage):
    """Holds its first batch until released, then records each batch's items."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.inside = threading.Event()
        self.release = threading.Event()

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        self.inside.set()
        assert self.release.wait(30), "the test never released the stage"
        self.batches.append([item.inputs["name"] for item in items])
        return [{} for _ in items]


def test_a_pool_batch_takes_the_other_tenants_request_first():
    ex = GraphExecutor(budget=ThreadBudget(2))
    stage = Batches()
    ex.add_pool("p", stage, PoolConfig(max_batch_size=2))
    ex.start()
    graph = StageGraph.chain(("only", "p"))
    try:
        with as_tenant("a"):
            handles = [ex.submit(graph, {"name": "a-first"})]
            assert stage.inside.wait(30)  # the worker is busy with it: the rest queue up
            handles += [ex.submit(graph, {"name": f"a{k}"}) for k in range(BACKLOG)]
        with as_tenant("b"):
            handles.append(ex.submit(graph, {"name": "b0"}))
        stage.release.set()
        for handle in handles:
            handle.result(timeout=30)
    finally:
        ex.shutdown()
    assert stage.batches[0] == ["a-first"]
    # "a-first" has left when the next batch is taken: each tenant's oldest, in arrival order. Arrival order alone
    # would have run "b0" in the fifth batch.
    assert stage.batches[1] == ["a0", "b0"], stage.batches


@contextmanager
def running(spec: ModelSpec) -> Iterator[Engine]:
    engine = Engine(EngineConfig(models=(spec,)))
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


def wait_for_event(handle, kind: EventKind) -> None:
    next(e for e in handle.events(timeout=120) if e.kind is kind)


@pytest.fixture(scope="module")
def sd(tmp_path_factory) -> str:
    return demo_path(tmp_path_factory, "sd")


def test_the_denoise_loop_runs_the_other_tenants_image_in_its_next_step(sd):
    """Two rows a step and "a" has six images in the loop: "b"'s image runs in the first step after it joins, while
    at least two of "a"'s are still there (arrival order would have run those two)."""
    image = dict(width=64, height=64, guidance_scale=1.0)
    with running(ModelSpec("m", sd, pools={"denoise": PoolConfig(max_batch_size=2)})) as engine:
        stage = engine.executor.pools["m/denoise"].stages[0]
        # ("start", tenant) when an item joins, ("step", tenants...) a step, ("finish", tenant) when one leaves
        schedule: list[tuple[str, ...]] = []
        start, step, finish = stage.start, stage.step, stage.finish

        def recorded_start(item):
            schedule.append(("start", item.request.tenant))
            return start(item)

        def recorded_step(items):
            schedule.append(("step", *sorted(item.request.tenant for item in items)))
            return step(items)

        def recorded_finish(item):
            schedule.append(("finish", item.request.tenant))
            return finish(item)

        stage.start, stage.step, stage.finish = recorded_start, recorded_step, recorded_finish
        with as_tenant("a"):  # 60 steps of two rows: "b" joins long before they are done, however slow the machine
            backlog = [engine.submit_image("m", ImageRequest(prompt=f"a {k}", seed=k, num_inference_steps=20, **image))
                       for k in range(BACKLOG)]
        wait_for_event(backlog[0], EventKind.PROGRESS)  # "a" is denoising
        with as_tenant("b"):
            other = engine.submit_image("m", ImageRequest(prompt="b", seed=9, num_inference_steps=4, **image))
        for handle in [*backlog, other]:
            assert handle.result(timeout=300)["pixels"].shape == (1, 64, 64, 3)
    joined = schedule.index(("start", "b"))
    assert BACKLOG - schedule[:joined].count(("finish", "a")) >= 2, schedule  # "a" still fills a step without "b"
    next_step = next(entry for entry in schedule[joined:] if entry[0] == "step")
    assert next_step == ("step", "a", "b"), schedule


def test_the_llm_admits_the_other_tenants_request_at_the_next_free_slot(tmp_path_factory):
    """Two sequences a forward and "a" has six waiting: "b"'s request takes the first slot that frees."""
    llama = demo_path(tmp_path_factory, "llama")
    llm = LLMConfig(kv_cache_mb=8, block_size=4, max_num_seqs=2)
    with running(ModelSpec("m", llama, llm=llm)) as engine:
        scheduler = engine.chat_model("m").stage.scheduler
        admitted: list[list[str]] = []  # per forward that admitted any: the tenants of the sequences it admitted
        seen: set[int] = set()
        schedule = scheduler.schedule

        def recorded_schedule():
            plan = schedule()
            new = [chunk.seq for chunk in plan.chunks if chunk.seq.seq_id not in seen]
            seen.update(seq.seq_id for seq in new)
            if new:
                admitted.append([seq.tenant for seq in new])
            return plan

        scheduler.schedule = recorded_schedule
        params = dict(temperature=0.0, ignore_eos=True)
        with as_tenant("a"):
            backlog = [engine.submit_chat("m", ChatRequest(prompt=[1, 2, 3 + k], params=SamplingParams(
                max_tokens=96, **params))) for k in range(BACKLOG)]
        wait_for_event(backlog[0], EventKind.DELTA)  # two of "a"'s run, four wait
        with as_tenant("b"):
            other = engine.submit_chat("m", ChatRequest(prompt=[1, 2, 99], params=SamplingParams(max_tokens=4,
                                                                                               **params)))
        for handle in [*backlog, other]:
            handle.result(timeout=300)
    # The two slots free together: "b" and "a"'s oldest waiting. First come, first served would have run "b" last.
    assert admitted[:2] == [["a", "a"], ["a", "b"]], admitted
