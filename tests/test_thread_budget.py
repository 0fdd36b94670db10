"""The thread budget: CPU stage workers run with their pool's torch thread count, and busy workers together never
hold more threads than the budget has (stages/thread_budget.py). No timing thresholds: the checks are on thread
counts, on who is inside a stage, and on the order the budget serves its waiters."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from pipelines.config import EngineConfig, ModelSpec
from pipelines.engine import Engine
from pipelines.image_request import ImageRequest
from serve.config import load_config
from stages.executor import GraphExecutor
from stages.graph import StageGraph
from stages.pool import PoolConfig
from stages.stage import LoopStage, Stage, WorkItem
from stages.thread_budget import ThreadBudget, available_cores
from tests.helpers import running_engine


class Recording(Stage):
    """Records the torch thread count it runs with; optionally waits inside until told to leave."""

    def __init__(self, hold: threading.Event | None = None):
        self.threads: list[int] = []
        self.inside = threading.Event()
        self.hold = hold

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        self.threads.append(torch.get_num_threads())
        self.inside.set()
        if self.hold is not None:
            assert self.hold.wait(30), "the test never let the stage finish"
        return [{} for _ in items]


class RecordingLoop(LoopStage):
    def __init__(self):
        self.threads: list[int] = []

    def start(self, item: WorkItem) -> None:
        item.state["i"] = 0

    def step(self, items: list[WorkItem]) -> None:
        self.threads.append(torch.get_num_threads())
        for item in items:
            item.state["i"] += 1

    def is_done(self, item: WorkItem) -> bool:
        return item.state["i"] >= 3

    def finish(self, item: WorkItem) -> dict[str, Any]:
        return {}


def executor_with(budget: int | None):
    return GraphExecutor(budget=ThreadBudget(budget))


@pytest.fixture
def executor():
    ex = executor_with(2)
    yield ex
    ex.shutdown()


def run(ex: GraphExecutor, pool: str) -> None:
    ex.submit(StageGraph.chain(("only", pool)), {}).result(timeout=30)


def test_workers_run_with_their_pools_threads():
    ex = executor_with(None)
    one, default, loop = Recording(), Recording(), RecordingLoop()
    ex.add_pool("one", one, PoolConfig(threads=1))
    ex.add_pool("default", default, PoolConfig())
    ex.add_pool("replicas", Recording(), PoolConfig(replicas=2))
    ex.add_pool("loop", loop, PoolConfig(threads=1))
    ex.start()
    try:
        for pool in ("one", "default", "loop", "one", "default"):
            run(ex, pool)
    finally:
        ex.shutdown()
    assert one.threads == [1, 1]
    assert default.threads == [available_cores()] * 2  # one replica: every core this process may use
    assert loop.threads == [1, 1, 1]
    assert ex.pools["replicas"].threads == max(1, available_cores() // 2)  # two replicas share them


def test_default_budget_is_two_teams_of_every_core():
    assert ThreadBudget().threads == 2 * available_cores()
    assert GraphExecutor().budget.threads == 2 * available_cores()


def test_with_the_default_budget_two_busy_pools_run_and_a_third_waits():
    ex = executor_with(None)
    release = threading.Event()
    stages = [Recording(hold=release), Recording(hold=release), Recording()]
    for i, stage in enumerate(stages):
        ex.add_pool(f"p{i}", stage, PoolConfig())
    ex.start()
    try:
        handles = [ex.submit(StageGraph.chain(("only", "p0")), {}), ex.submit(StageGraph.chain(("only", "p1")), {})]
        assert stages[0].inside.wait(30) and stages[1].inside.wait(30)  # both teams at once
        handles.append(ex.submit(StageGraph.chain(("only", "p2")), {}))
        assert not stages[2].inside.wait(0.3), "a third team ran beside two that hold the whole budget"
        release.set()
        for handle in handles:
            handle.result(timeout=30)
    finally:
        release.set()
        ex.shutdown()
    assert stages[2].threads == [available_cores()]


def test_a_busy_cpu_pool_keeps_the_others_out_until_it_is_done(executor):
    release = threading.Event()
    first, second = Recording(hold=release), Recording()
    executor.add_pool("first", first, PoolConfig(threads=2))
    executor.add_pool("second", second, PoolConfig(threads=2))
    executor.start()
    a = executor.submit(StageGraph.chain(("only", "first")), {})
    assert first.inside.wait(30)
    b = executor.submit(StageGraph.chain(("only", "second")), {})
    assert not second.inside.wait(0.3), "a second pool computed while the first held the whole budget"
    assert executor.budget.free == 0
    release.set()
    a.result(timeout=30), b.result(timeout=30)
    assert second.threads == [2]
    assert executor.budget.free == 2


def test_pools_that_fit_together_run_together(executor):
    release = threading.Event()
    first, second = Recording(hold=release), Recording()
    executor.add_pool("first", first, PoolConfig(threads=1))
    executor.add_pool("second", second, PoolConfig(threads=1))
    executor.start()
    a = executor.submit(StageGraph.chain(("only", "first")), {})
    assert first.inside.wait(30)
    run(executor, "second")  # one thread each: the second does not wait for the first
    release.set()
    a.result(timeout=30)


def test_a_gpu_pool_does_not_take_from_the_cpu_budget(executor):
    release = threading.Event()
    gpu, cpu = Recording(hold=release), Recording()
    executor.add_pool("gpu", gpu, PoolConfig(device="cuda", threads=2))
    executor.add_pool("cpu", cpu, PoolConfig(threads=2))
    executor.start()
    a = executor.submit(StageGraph.chain(("only", "gpu")), {})
    assert gpu.inside.wait(30)
    run(executor, "cpu")
    release.set()
    a.result(timeout=30)


def test_waiters_are_served_in_arrival_order_and_a_releaser_cannot_jump_the_line():
    budget = ThreadBudget(2)
    order: list[str] = []

    def worker(name: str, threads: int):
        with budget.hold(threads):
            order.append(name)

    with budget.hold(2):
        ta = threading.Thread(target=worker, args=("a", 2))
        ta.start()
        _wait_until(lambda: budget.waiting == 1)
        tb = threading.Thread(target=worker, args=("b", 1))  # would fit in one thread, but it is behind a
        tb.start()
        _wait_until(lambda: budget.waiting == 2)
    ta.join(30), tb.join(30)
    assert order == ["a", "b"]
    # A worker that releases and asks again goes behind the one already waiting.
    order.clear()
    with budget.hold(2):
        tb = threading.Thread(target=worker, args=("b", 2))
        tb.start()
        _wait_until(lambda: budget.waiting == 1)
    with budget.hold(2):
        order.append("again")
    tb.join(30)
    assert order == ["b", "again"]


def test_a_team_larger_than_the_budget_takes_all_of_it_and_runs():
    budget, before = ThreadBudget(2), torch.get_num_threads()
    try:
        with budget.hold(3):
            assert budget.free == 0 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)  # this is the test runner's thread
    assert budget.free == 2


def _wait_until(condition, timeout: float = 30.0) -> None:
    pause = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        pause.wait(0.01)
    raise AssertionError("condition never held")


def test_threads_and_cpu_threads_are_validated():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads"):
            PoolConfig(threads=bad)
        with pytest.raises(ValueError, match="cpu_threads"):
            EngineConfig(models=(), cpu_threads=bad)


def test_config_file_sets_pool_threads_and_the_engines_budget(tmp_path):
    path = tmp_path / "mmserve.toml"
    path.write_text('[engine]\ncpu_threads = 3\n[[models]]\nname = "m"\npath = "/x"\ndevice = "cuda"\n'
                    '[models.pools.denoise]\nthreads = 1\n')
    engine_config = load_config(path).engine
    spec = engine_config.models[0]
    assert spec.pool("denoise").threads == 1
    assert spec.pool("denoise").device == "cuda"  # a model's pools run on its device (no CPU budget)
    assert spec.pool("vae_decode").device == "cuda"
    assert Engine(engine_config).executor.budget.threads == 3


def test_cpu_models_decode_at_most_two_images_per_vae_call():
    cpu, gpu = ModelSpec("a", "/x"), ModelSpec("b", "/x", device="cuda")
    assert cpu.pool("vae_decode").max_batch_size == 2
    assert gpu.pool("vae_decode").max_batch_size == 4
    mine = ModelSpec("c", "/x", pools={"vae_decode": PoolConfig(max_batch_size=8)})
    assert mine.pool("vae_decode").max_batch_size == 8


def test_an_image_model_on_a_cpu_keeps_one_vae_decode_replica(sd_path):
    with running_engine(sd_path) as eng:  # only video models get two (pipelines.config.CPU_VIDEO_POOLS)
        config = eng.executor.pools["m/vae_decode"].config
        assert (config.replicas, config.max_batch_size) == (1, 2)


def test_the_stage_workers_of_a_served_model_use_their_pools_threads(sd_path):
    pools = {"denoise": PoolConfig(threads=1), "vae_decode": PoolConfig(threads=2)}
    with running_engine(sd_path, pools=pools) as eng:
        family = eng.family("m")
        seen: dict[str, list[int]] = {"forward": [], "decode": []}
        forward, decode = family.forward, family.decode

        def recording_forward(items):
            seen["forward"].append(torch.get_num_threads())
            return forward(items)

        def recording_decode(items):
            seen["decode"].append(torch.get_num_threads())
            return decode(items)

        family.forward, family.decode = recording_forward, recording_decode
        eng.submit_image("m", ImageRequest(prompt="a", num_inference_steps=2, seed=0)).result(timeout=120)
    assert seen["forward"] == [1, 1]
    assert seen["decode"] == [2]
