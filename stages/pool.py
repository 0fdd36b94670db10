"""StagePool: N worker threads running one stage, with a bounded queue and a batching window.

Unplaced (no `devices`), the replicas are threads sharing one stage object on the model's device, and whichever
is free takes the next item. Placed, each replica has its own stage object (its own weights) on its own device,
and each item is routed to one replica when it is queued (stages/placement.py); its inputs move to that device
when the replica takes it.

Queues are ordered by priority with aging, and within a priority class the tenants take turns
(stages/fair_queue.py): a request's class and tenant are `submit_priority` and `submit_tenant` where it was
submitted (serve/quota.py sets them to the caller's tenant's). A loop stage's step takes its rows in the same turns.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable

import torch

from stages.diffusion.memory import is_out_of_memory
from stages.events import ErrorKind, EventKind, StageError
from stages.fair_queue import NORMAL_PRIORITY, service_order, take_in_turns, tenant_of
from stages.metrics import Metrics
from stages.placement import Router, check_device, to_device
from stages.replica_metrics import ReplicaMetrics
from stages.stage import LoopStage, Stage, WorkItem
from stages.thread_budget import ThreadBudget, default_threads

log = logging.getLogger(__name__)
# The priority rank and the tenant of requests submitted from this context: read once, when the request's first item
# is queued (the submitting caller's thread or task), and kept on the request for its later nodes.
submit_priority: ContextVar[int] = ContextVar("submit_priority", default=NORMAL_PRIORITY)
submit_tenant: ContextVar[str] = ContextVar("submit_tenant", default="")


@dataclass(frozen=True)
class PoolConfig:
    replicas: int = 1  # worker threads (one per device replica)
    max_batch_size: int = 1  # items per stage call
    max_delay_ms: float = 0.0  # how long a batch waits for company after its first item
    max_queue: int = 64  # admission bound; a full entry queue answers 429
    device: str = "cpu"  # a "cpu" pool's workers share the executor's thread budget (stages/thread_budget.py)
    # Torch intra-op threads of each worker (its OpenMP team), held from the budget while it runs a batch or a
    # step. None: the cores this process may use (os.sched_getaffinity), shared by the replicas.
    threads: int | None = None
    # One device per replica ("cuda:0", "cuda:1"; "cpu" twice is two copies on the CPU), each replica with its own
    # copy of the stage's weights; items are routed to replicas (stages/placement.py). Empty: every replica on
    # `device`, sharing one stage object. With devices and replicas left at 1, there is one replica per device.
    devices: tuple[str, ...] = ()
    # The ray backend only (pipelines/ray_backend.py): what each replica's actor asks Ray for besides `threads`
    # CPUs. Custom resources pin a pool to the nodes that have them (`{"node_b": 1}`); a fractional GPU shares one.
    resources: tuple[tuple[str, float], ...] = ()  # (name, amount) pairs; a TOML table {name = amount} is taken too
    num_gpus: float = 0.0
    # Seconds of waiting in this pool's queue that lift an item one priority class (aging: nothing starves).
    priority_aging_s: float = 10.0

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.devices:
            if isinstance(self.devices, str) or not all(isinstance(d, str) for d in self.devices):
                raise ValueError(f"devices must be a list of device names, one per replica, got {self.devices!r}")
            object.__setattr__(self, "devices", tuple(self.devices))
            if self.replicas == 1:  # the default: one replica per listed device
                object.__setattr__(self, "replicas", len(self.devices))
            if self.replicas > len(self.devices):
                raise ValueError(f"replicas = {self.replicas} is more replicas than devices ({len(self.devices)}: "
                                 f"{list(self.devices)}); devices needs one entry per replica")
            if self.replicas < len(self.devices):
                raise ValueError(f"devices lists {len(self.devices)} devices for {self.replicas} replicas; devices "
                                 f"needs one entry per replica")
            for i, device in enumerate(self.devices):
                check_device(device, f"devices[{i}]")
        try:
            resources = dict(self.resources)
        except (TypeError, ValueError):
            raise ValueError(f"resources must map resource names to amounts, got {self.resources!r}") from None
        if not all(isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                   for k, v in resources.items()):
            raise ValueError(f"resources must map resource names to amounts > 0, got {self.resources!r}")
        object.__setattr__(self, "resources", tuple(sorted((k, float(v)) for k, v in resources.items())))
        if isinstance(self.num_gpus, bool) or not isinstance(self.num_gpus, (int, float)) or self.num_gpus < 0:
            raise ValueError(f"num_gpus must be a number >= 0 (0.5: half a GPU), got {self.num_gpus!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {self.max_delay_ms}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if isinstance(self.priority_aging_s, bool) or not isinstance(self.priority_aging_s, (int, float)) \
                or not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be a number of seconds > 0, got {self.priority_aging_s!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"threads must be a whole number >= 1 (or unset: the cores shared by the replicas), "
                             f"got {self.threads!r}")


# Called by workers: on_done(item, outputs) when an item finished; on_drop(item, error|None)
# when an item leaves without outputs (error, or None when its request was already stopped).
DoneFn = Callable[[WorkItem, dict[str, Any]], None]
DropFn = Callable[[WorkItem, StageError | None], None]


class StagePool:
    labels_replicas_now = True  # False: a remote pool labels its replicas once it knows their nodes

    def __init__(self, name: str, stage: Stage | Sequence[Stage], config: PoolConfig, metrics: Metrics,
                 on_done: DoneFn, on_drop: DropFn, budget: ThreadBudget | None = None):
        """`stage`: one stage object the replicas share, or (a placed pool) one per replica, on its device."""
        self.name = name
        self.stages: list[Stage] = [stage] * config.replicas if isinstance(stage, Stage) else list(stage)
        if len(self.stages) != config.replicas:
            raise ValueError(f"pool {name}: {len(self.stages)} stage objects for {config.replicas} replicas")
        self.stage = self.stages[0]
        self.config = config
        self.metrics = metrics
        self.placed = bool(config.devices)
        self.devices = [torch.device(d) for d in config.devices] or [torch.device(config.device)] * config.replicas
        self._router = Router(config.replicas)
        # A CPU replica computes only while it holds `threads` of the shared budget; other devices do not wait.
        self._budget = budget if self.stage.torch_threads else None
        self.threads = config.threads or default_threads(config.replicas)  # torch threads per worker
        self._on_done = on_done
        self._on_drop = on_drop
        self._queue: collections.deque[WorkItem] = collections.deque()
        self._cond = threading.Condition()
        self._active: dict[int, int] = {}  # worker index -> items in hand
        self._serving: collections.Counter[str] = collections.Counter()  # tenant -> items taken, not yet done
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._calls = itertools.count()  # stage calls, numbered for traced items' batch ids (stages/tracing.py)
        labels = dict(stage=name, model=self.stage.model)
        self._m_queue_age = metrics.stage.queue_age.labels(**labels)
        self._m_run = metrics.stage.run_time.labels(**labels)
        self._m_batch = metrics.stage.batch_size.labels(**labels)
        self._m_depth = metrics.stage.queue_depth.labels(**labels)
        self._m_active = metrics.stage.active.labels(**labels)
        self._m_thread_wait = metrics.stage.thread_wait.labels(**labels)
        self._m_replica = self._replica_series(["local"] * config.replicas) if self.labels_replicas_now else []

    def _replica_series(self, nodes: Sequence[str]) -> list[dict[str, Any]]:
        """Each replica's series, labelled with its device and node (its Ray node id; "local" in this process)."""
        replica = self.metrics.part(ReplicaMetrics)
        labels = dict(stage=self.name, model=self.stage.model)
        series = [{s: getattr(replica, s).labels(**labels, replica=str(i), device=str(dev), node=node)
                   for s in ("queue_age", "run_time", "batch_size", "items", "live", "transfer_time", "transfer_bytes")}
                  for i, (dev, node) in enumerate(zip(self.devices, nodes, strict=True))]
        for m in series:
            m["live"].set(1)
        return series

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        loop = isinstance(self.stage, LoopStage)
        for i in range(self.config.replicas):
            target = self._loop_worker if loop else self._batch_worker
            t = threading.Thread(target=target, args=(i,), name=f"{self.name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)

    # -- admission ----------------------------------------------------------------------
    def has_room(self) -> bool:
        with self._cond:
            return len(self._queue) < self.config.max_queue

    def put(self, item: WorkItem) -> None:
        """Enqueue without a bound: admitted requests always progress to their next node."""
        item.enqueued_at = time.monotonic()
        if not hasattr(item.request, "priority"):  # the first node of a request: in the submitter's context
            setattr(item.request, "priority", submit_priority.get())
            setattr(item.request, "tenant", submit_tenant.get())
        with self._cond:
            if self.placed:
                affinity = self.stage.affinity(item)
                loads = [self._load(r) for r in range(self.config.replicas)]
                item.replica = (self._router.pick(loads) if affinity is None else
                                self._router.pick(loads, affinity.key, sticky=affinity.sticky))
            self._queue.append(item)
            self._m_depth.set(len(self._queue))
            self._cond.notify_all()

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not any(self._active.values())

    def queue_len(self) -> int:
        with self._cond:
            return len(self._queue)

    def wake(self) -> None:
        """Let waiting workers look again (a request stopped: its queued items are purged now)."""
        with self._cond:
            self._cond.notify_all()

    def live_replicas(self) -> int:
        """Replicas that can take work now (a remote pool's lost ones are not, until they are back)."""
        return self.config.replicas

    def _load(self, replica: int) -> int:
        """Items queued for a replica plus those in its hands (caller holds the lock)."""
        return sum(i.replica == replica for i in self._queue) + self._active.get(replica, 0)

    def _for(self, worker: int, item: WorkItem) -> bool:
        return item.replica is None or item.replica == worker

    def _has_work(self, worker: int) -> bool:
        return any(self._for(worker, i) for i in self._queue)

    def _in_order(self, worker: int):
        """The worker's queued items in service order (stages/fair_queue.py); caller holds the lock."""
        mine = [i for i in self._queue if self._for(worker, i)]
        return service_order(mine, time.monotonic(), self.config.priority_aging_s, self._serving)

    def _popleft(self, worker: int) -> WorkItem:
        item = next(self._in_order(worker))
        self._take(item)
        return item

    def _take(self, item: WorkItem) -> None:
        """The item leaves the queue for a worker: its tenant's share of the stage grows (caller holds the lock)."""
        self._queue.remove(item)
        if not item.in_service:  # a remote pool's item routed again (its replica was lost) counts once
            item.in_service = True
            self._serving[tenant_of(item)] += 1

    def _leave(self, item: WorkItem) -> None:
        """A finished or dropped item gives its tenant's share back."""
        if item.in_service:
            item.in_service = False
            with self._cond:
                tenant = tenant_of(item)
                self._serving[tenant] -= 1
                if not self._serving[tenant]:
                    del self._serving[tenant]

    def _place(self, worker: int, items: list[WorkItem]) -> None:
        """Move the items' input tensors to this replica's device (a placed pool's edge)."""
        if not self.placed:
            return
        m = self._m_replica[worker]
        for item in items:
            m["items"].inc()
            m["queue_age"].observe(time.monotonic() - item.enqueued_at)
            started = time.perf_counter()
            item.inputs, moved = to_device(item.inputs, self.devices[worker])
            if moved:
                m["transfer_time"].observe(time.perf_counter() - started)
                m["transfer_bytes"].inc(moved)

    # -- batch stages -------------------------------------------------------------------
    def _take_batch(self, worker: int) -> list[WorkItem] | None:
        """Block for a first item, then gather items with its batch key until full or the window closes."""
        with self._cond:
            while True:
                self._purge_stopped()
                if self._has_work(worker) or self._stopping:
                    break
                self._cond.wait()
            if self._stopping:
                return None
            first = self._popleft(worker)
            key = self.stages[worker].batch_key(first)
            batch = [first]
            window_end = time.monotonic() + self.config.max_delay_ms / 1000
            while len(batch) < self.config.max_batch_size:
                self._purge_stopped()
                batch += self._pop_matching(worker, key, self.config.max_batch_size - len(batch))
                remaining = window_end - time.monotonic()
                if len(batch) >= self.config.max_batch_size or remaining <= 0 or self._stopping:
                    break
                self._cond.wait(remaining)
            self._active[worker] = len(batch)
            self._m_depth.set(len(self._queue))
            return batch

    def _compute(self, worker: int):
        """The threads for one batch or step: held from the shared budget (waiting in line), or the worker's own."""
        if self._budget is None or self.devices[worker].type != "cpu":
            return contextlib.nullcontext()
        return self._budget.hold(self.threads, on_wait=self._m_thread_wait.observe)

    def _batch_worker(self, worker: int) -> None:
        torch.set_num_threads(self.threads)  # this thread's OpenMP team
        stage = self.stages[worker]
        while (batch := self._take_batch(worker)) is not None:
            self._place(worker, batch)
            now = time.monotonic()
            for item in batch:
                self._m_queue_age.observe(now - item.enqueued_at)
                if item.trace is not None:
                    item.trace.queue_wait_s = now - item.enqueued_at
                item.emit(EventKind.STAGE_STARTED)
            self._m_active.inc(len(batch))
            try:
                with self._compute(worker):
                    started = time.perf_counter()
                    outputs = stage.run_batch(batch)
                    elapsed = time.perf_counter() - started
                    self._observe_run(worker, elapsed, len(batch))
                    self._trace_call(batch, elapsed)
                for item, out in zip(batch, outputs, strict=True):
                    self._finish(item, out)
            except Exception as exc:  # one bad batch fails its items, not the worker
                self._fail_all(batch, exc)
            finally:
                self._m_active.dec(len(batch))
                with self._cond:
                    self._active[worker] = 0
                    self._cond.notify_all()

    # -- loop stages --------------------------------------------------------------------
    def _loop_worker(self, worker: int) -> None:
        stage: LoopStage = self.stages[worker]  # type: ignore[assignment]
        active: list[WorkItem] = []
        turn: dict[Any, int] = {}  # batch key -> last step counter it ran at (round robin)
        oom_caps: dict[Any, int] = {}  # batch key -> items a step may take since one ran out of memory
        counter = 0
        torch.set_num_threads(self.threads)  # this thread's OpenMP team
        while True:
            joining = self._admit_to_loop(worker, active)
            if joining is None:
                break
            if joining:
                self._place(worker, joining)
                self._start_items(worker, stage, joining, active)
            # Leave at a step boundary: cancelled, expired or closed requests.
            for item in [i for i in active if i.request.should_stop()]:
                active.remove(item)
                self._m_active.dec()
                stage.abort(item)
                self._drop(item, None)
            if not active:
                self._set_active(worker, 0)
                continue
            runnable = [item for item in active if stage.ready(item)]
            if not runnable:
                stage.wait(active)
                continue
            # Plan: the batch key that waited longest, then up to max_batch_size of its items.
            groups: dict[Any, list[WorkItem]] = {}
            for item in runnable:
                groups.setdefault(stage.batch_key(item), []).append(item)
            key = min(groups, key=lambda k: turn.get(k, -1))
            batch = take_in_turns(groups[key], min(self.config.max_batch_size,
                                                   oom_caps.get(key, self.config.max_batch_size)))
            batch = batch[: max(1, stage.fit(batch))]
            counter += 1
            turn[key] = counter
            # Run one step, then commit: finished items leave the loop.
            try:
                with self._compute(worker):
                    started = time.perf_counter()
                    stage.step(batch)
                    elapsed = time.perf_counter() - started
                    self._observe_run(worker, elapsed, len(batch))
                    self._trace_call(batch, elapsed)
                for item in batch:
                    item.steps_run += 1
                finished = [i for i in batch if stage.is_done(i)]
                for item in finished:
                    active.remove(item)
                    self._m_active.dec()
                    self._finish(item, stage.finish(item))
            except Exception as exc:
                if is_out_of_memory(exc):  # the step's items run it again, once, in batches half the size
                    batch = self._after_oom(worker, key, batch, oom_caps, exc)
                for item in batch:
                    if item in active:
                        active.remove(item)
                        self._m_active.dec()
                        stage.abort(item)
                self._fail_all(batch, exc)
            self._set_active(worker, len(active))
        for item in active:
            stage.abort(item)
            self._drop(item, StageError("shutting_down", "the server is shutting down", kind=ErrorKind.UNAVAILABLE))

    def _after_oom(self, worker: int, key: Any, batch: list[WorkItem], oom_caps: dict[Any, int],
                   exc: BaseException) -> list[WorkItem]:
        """Free what the failed step held, halve the key's cap, keep the items that have not retried yet in the
        loop (no step was committed: a forward fails before any item's commit); the rest fail."""
        self.metrics.stage.oom.labels(stage=self.name, model=self.stage.model).inc()
        oom_caps[key] = max(1, len(batch) // 2)
        log.warning("%s: out of memory in a step of %d items (%s); the cap is now %d and the items run again",
                    self.name, len(batch), exc, oom_caps[key])
        gc.collect()
        if self.devices[worker].type == "cuda":
            torch.cuda.empty_cache()
        failing = [item for item in batch if item.oom_retried]  # a second time: their requests fail
        for item in batch:
            item.oom_retried = True
        return failing

    def _start_items(self, worker: int, stage: LoopStage, joining: list[WorkItem], active: list[WorkItem]) -> None:
        """Items join the loop at a step boundary (their initial latents, scheduler, ...)."""
        with self._compute(worker):
            for item in joining:
                waited = time.monotonic() - item.enqueued_at
                self._m_queue_age.observe(waited)
                if item.trace is not None:
                    item.trace.queue_wait_s = waited
                item.emit(EventKind.STAGE_STARTED)
                try:
                    stage.start(item)
                    active.append(item)
                    self._m_active.inc()
                except Exception as exc:
                    self._fail_all([item], exc)

    def _admit_to_loop(self, worker: int, active: list[WorkItem]) -> list[WorkItem] | None:
        """Take queued items into the loop. Blocks only when the loop has nothing to do."""
        with self._cond:
            while True:
                self._purge_stopped()
                if self._stopping:
                    return None
                if self._has_work(worker) or active:
                    break
                self._cond.wait()
            joining: list[WorkItem] = []
            while self._has_work(worker) and len(active) + len(joining) < self._loop_capacity():
                joining.append(self._popleft(worker))
            self._active[worker] = len(active) + len(joining)
            self._m_depth.set(len(self._queue))
            return joining

    def _loop_capacity(self) -> int:
        # Items held in one loop: enough for a full batch of each of a few keys.
        return max(self.config.max_batch_size * 4, 4)

    # -- shared helpers -----------------------------------------------------------------
    def _observe_run(self, worker: int, seconds: float, items: int) -> None:
        self._m_run.observe(seconds)
        self._m_batch.observe(items)
        if self.placed:
            self._m_replica[worker]["run_time"].observe(seconds)
            self._m_replica[worker]["batch_size"].observe(items)

    def _trace_call(self, batch: list[WorkItem], seconds: float) -> None:
        """Note one stage call on its traced items, under one batch id (nothing when tracing is off)."""
        traced = [item.trace for item in batch if item.trace is not None]
        if traced:
            batch_id = f"{self.name}-{next(self._calls)}"
            for trace in traced:
                trace.ran(batch_id, len(batch), seconds)

    def _end_trace(self, item: WorkItem, error: StageError | None) -> None:
        """The item leaves this stage: its span is exported, once."""
        trace, item.trace = item.trace, None
        if trace is not None:
            trace.end(item.request_id, item.node, self.name, error)

    def _pop_matching(self, worker: int, key, limit: int) -> list[WorkItem]:
        taken: list[WorkItem] = []
        for item in self._in_order(worker):
            if len(taken) >= limit:
                break
            if self.stages[worker].batch_key(item) == key:
                self._take(item)
                taken.append(item)
        return taken

    def _purge_stopped(self) -> None:
        """Drop queued items whose request was cancelled, expired or closed (caller holds the lock)."""
        for item in [i for i in self._queue if i.request.should_stop()]:
            self._queue.remove(item)
            self._drop(item, None)

    def _set_active(self, worker: int, n: int) -> None:
        with self._cond:
            self._active[worker] = n
            self._cond.notify_all()

    def _finish(self, item: WorkItem, outputs: dict[str, Any]) -> None:
        self._leave(item)
        item.release()
        if item.trace is not None:
            self._end_trace(item, None)
        self._on_done(item, outputs)

    def _drop(self, item: WorkItem, error: StageError | None) -> None:
        self._leave(item)
        item.release()
        if item.trace is not None:
            self._end_trace(item, error)
        self._on_drop(item, error)

    def _fail_all(self, items: list[WorkItem], exc: Exception) -> None:
        if isinstance(exc, StageError):
            error = exc
        else:
            log.exception("stage %s failed", self.name)
            error = StageError("internal_error", f"stage {self.name} failed: {type(exc).__name__}: {exc}")
        for item in items:
            self._drop(item, error)
