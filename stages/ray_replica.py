"""One replica of a ray-backend pool, as it runs inside its Ray actor's process.

The actor loads its stage itself (`load()`, from the model's config) and runs it in a StagePool of one replica, the
same batching window and step loop as the local backend, so a Stage's code does not change between backends. Work
arrives as Packets; what the stage emits (stage_started, progress, deltas) and how each item ended come back as
ReplicaMessages through one long-lived streaming call (`events`). The API process keeps admission, deadlines,
cancellation (it tells the actor to `stop` an item) and the request's event stream.

Nothing here imports ray: the backend wraps this class in `ray.remote` (stages/ray_pool.py).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from stages.events import EventKind, StageError
from stages.metrics import Metrics
from stages.pool import PoolConfig, StagePool
from stages.remote_series import SeriesDiff
from stages.request_state import RequestState
from stages.stage import Stage, WorkItem
from stages.thread_budget import ThreadBudget, default_threads
from stages.tracing import NodeTrace

SERIES_EVERY_S = 0.5  # how often a replica sends what changed in its stage's series


@dataclass(frozen=True)
class Packet:
    """One work item sent to a replica's actor."""

    token: int  # the API process's id of this item (messages about it carry it back)
    request_id: str  # for logs and the stage's events
    model: str  # metric label
    node: str  # graph node name (the events' `stage`)
    inputs: dict[str, Any]  # the item's inputs (tensors travel through Ray's object store)
    piece: int | None = None  # a streamed node's piece
    deadline_in_s: float | None = None  # seconds left until the request's deadline when it was sent
    traced: bool = False  # the API process traces it: its run facts come back with it (ReplicaMessage.trace)


@dataclass(frozen=True)
class ReplicaMessage:
    """What a replica tells the API process about one item."""

    token: int  # the Packet's token
    # "event": the stage emitted `kind` with `data`; "done": finished with outputs `data`; "drop": left; "run": a
    # batch or step ran (token -1; data: seconds, items); "series": the stage's series changed (token -1; data:
    # changes, stages.remote_series.Change)
    what: str
    kind: EventKind | None = None  # the event's kind ("event" only)
    data: dict[str, Any] = field(default_factory=dict)  # the event's data, or the outputs
    error: dict[str, Any] | None = None  # "drop": why, StageError's fields (None: it was stopped)
    trace: dict[str, Any] | None = None  # "done" / "drop" of a traced item: what was measured (NodeTrace.facts)


@dataclass(frozen=True)
class ReplicaInfo:
    """Where a replica's actor runs (for metric labels and tests)."""

    pid: int
    node_id: str  # the Ray node id
    node_ip: str  # the node's address


class RemoteRequest(RequestState):
    """The actor's stand-in for a request: its events go to the outbox, stop() comes from the API process."""

    def __init__(self, packet: Packet, outbox: queue.SimpleQueue):
        deadline = None if packet.deadline_in_s is None else time.monotonic() + packet.deadline_in_s
        super().__init__(packet.request_id, deadline=deadline, model=packet.model)
        self.token = packet.token
        self._outbox = outbox
        self.facts: dict[str, Any] | None = None  # a traced item's measured facts, once its stage let it go

    def emit(self, kind: EventKind, *, stage: str | None = None, **data) -> bool:
        if self.cancelled:
            return False
        self._outbox.put(ReplicaMessage(self.token, "event", kind, data))
        return True


class _ReplicaPool(StagePool):
    """The actor's pool: each batch's (or step's) run time and size also go to the API process's series."""

    def __init__(self, *args, outbox: queue.SimpleQueue, **kwargs):
        super().__init__(*args, **kwargs)
        self._outbox = outbox

    def _observe_run(self, worker: int, seconds: float, items: int) -> None:
        super()._observe_run(worker, seconds, items)
        self._outbox.put(ReplicaMessage(-1, "run", data={"seconds": seconds, "items": items}))

    def _end_trace(self, item: WorkItem, error: StageError | None) -> None:
        """A traced item's facts go back with it (its request keeps them for the done or drop message)."""
        trace, item.trace = item.trace, None
        if trace is not None:
            assert isinstance(item.request, RemoteRequest)
            item.request.facts = trace.facts()


class ReplicaWorker:
    """The body of a replica's actor: a StagePool of one replica over the stage `load()` returns."""

    def __init__(self, load: Callable[[Metrics], Stage], name: str, config: PoolConfig, replicas: int,
                 node: Callable[[], tuple[str, str]] = lambda: ("local", "127.0.0.1")):
        metrics = Metrics()  # the stage's own series; changes go to the API process every SERIES_EVERY_S
        stage = self._stage = load(metrics)
        self._series = SeriesDiff(metrics.registry)
        # One replica here; its threads are the pool's share of this machine's cores (as the local backend's are).
        threads = config.threads or default_threads(replicas)
        local = dataclasses.replace(config, replicas=1, devices=(), resources=(), num_gpus=0.0, threads=threads)
        self._outbox: queue.SimpleQueue[ReplicaMessage | None] = queue.SimpleQueue()
        self._requests: dict[int, RemoteRequest] = {}
        self._pool = _ReplicaPool(name, stage, local, Metrics(), self._done, self._drop, ThreadBudget(threads),
                                  outbox=self._outbox)
        self._pool.start()
        self._node = node()

    def info(self) -> ReplicaInfo:
        node_id, node_ip = self._node
        return ReplicaInfo(os.getpid(), node_id, node_ip)

    def usage(self) -> dict[str, int]:
        """The stage's usage (Stage.usage) and the items this replica holds."""
        return {**self._stage.usage(), "items": len(self._requests)}

    def submit(self, packets: list[Packet]) -> None:
        for packet in packets:
            request = RemoteRequest(packet, self._outbox)
            self._requests[packet.token] = request
            trace = NodeTrace(None, None) if packet.traced else None  # gathers, never exports
            self._pool.put(WorkItem(request, packet.node, packet.inputs, piece=packet.piece, trace=trace))

    def stop(self, tokens: list[int]) -> None:
        """Those items' requests stopped (cancelled, past their deadline, fenced): drop them at the next boundary."""
        for token in tokens:
            request = self._requests.get(token)
            if request is not None:
                request.request_cancel()
        self._pool.wake()

    def events(self) -> Iterator[list[ReplicaMessage]]:
        """Every message, as it comes, a few at once when several are waiting, and what changed in the stage's series
        at most every SERIES_EVERY_S; ends at `close`."""
        next_series = time.monotonic() + SERIES_EVERY_S
        while True:
            try:
                batch = [self._outbox.get(timeout=max(0.0, next_series - time.monotonic()))]
            except queue.Empty:
                batch = []
            while 0 < len(batch) < 256:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            messages = [m for m in batch if m is not None]
            ending = len(messages) < len(batch)
            if ending or time.monotonic() >= next_series:
                next_series = time.monotonic() + SERIES_EVERY_S
                changes = self._series.changes()
                if changes:
                    messages.append(ReplicaMessage(-1, "series", data={"changes": changes}))
            if messages:
                yield messages
            if ending:
                return

    def close(self) -> None:
        self._pool.stop(timeout=5.0)
        self._stage.close()  # the ranks of a parallel replica end here, not with the actor's kill
        self._outbox.put(None)

    def _done(self, item: WorkItem, outputs: dict[str, Any]) -> None:
        request = self._forget(item)
        self._outbox.put(ReplicaMessage(request.token, "done", data=outputs, trace=request.facts))

    def _drop(self, item: WorkItem, error: StageError | None) -> None:
        request = self._forget(item)
        fields = None if error is None else dict(code=error.code, message=error.message, param=error.param,
                                                 kind=error.kind.value)
        self._outbox.put(ReplicaMessage(request.token, "drop", error=fields, trace=request.facts))

    def _forget(self, item: WorkItem) -> RemoteRequest:
        request = item.request
        assert isinstance(request, RemoteRequest)
        self._requests.pop(request.token, None)
        return request
