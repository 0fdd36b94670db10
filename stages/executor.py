"""GraphExecutor: admits requests, dispatches ready graph nodes to pools, streams events, cancels."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from stages.events import CapacityError, ErrorKind, EventKind, StageError
from stages.graph import StageGraph
from stages.metrics import Metrics
from stages.pool import PoolConfig, StagePool
from stages.request_state import RequestHandle, RequestState
from stages.stage import Stage, WorkItem
from stages.streaming import StreamedNode
from stages.thread_budget import ThreadBudget
from stages.tracing import NodeTrace, RequestTag, Tracing, current_request


class _Run:
    """The executor's view of one request: its graph and which nodes have started or finished."""

    def __init__(self, state: RequestState, graph: StageGraph, inputs: dict[str, Any], tracing: Tracing | None):
        self.state = state
        self.graph = graph
        self.inputs = inputs
        self.tracing = tracing
        self.trace_parent = tracing.parent() if tracing is not None else None  # the request span (submitter's)
        self.started: set[str] = set()
        self.done: set[str] = set()
        self.streams = {n.name: StreamedNode(state, n) for n in graph.nodes if n.stream is not None}


class GraphExecutor:
    def __init__(self, metrics: Metrics | None = None, budget: ThreadBudget | None = None):
        self.metrics = metrics or Metrics()
        self.budget = budget or ThreadBudget()  # torch threads all CPU pools' workers share (stages/thread_budget.py)
        self.pools: dict[str, StagePool] = {}
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._started = False
        # Spans per request and node (stages/tracing.py): set once before requests come; None: tracing off.
        self.tracing: Tracing | None = None

    # -- set-up -------------------------------------------------------------------------
    def add_pool(self, name: str, stage: Stage | Sequence[Stage], config: PoolConfig | None = None, *,
                 pool_class: Callable[..., StagePool] = StagePool) -> StagePool:
        """`pool_class`: StagePool (threads here), or one with StagePool's signature (the ray backend's)."""
        if name in self.pools:
            raise ValueError(f"pool {name!r} already exists")
        pool = pool_class(name, stage, config or PoolConfig(), self.metrics, self._on_done, self._on_drop, self.budget)
        self.pools[name] = pool
        if self._started:
            pool.start()
        return pool

    def start(self) -> None:
        self._started = True
        for pool in self.pools.values():
            pool.start()

    def shutdown(self) -> None:
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.state.request_cancel()
            run.state.fail(StageError("shutting_down", "the server is shutting down", kind=ErrorKind.UNAVAILABLE))
        for pool in self.pools.values():
            pool.stop()

    # -- requests -----------------------------------------------------------------------
    def submit(self, graph: StageGraph, inputs: dict[str, Any], *, request_id: str | None = None,
               deadline_s: float | None = None, model: str = "", max_inflight: int | None = None,
               fence=None) -> RequestHandle:
        """Admit a request and start its first nodes.

        Raises CapacityError when the entry pool's queue is full or `model` already has
        `max_inflight` requests admitted (the long denoise loop is bounded here, at the door).
        `fence` (a callable, e.g. "this voice response's epoch is still the session's") is checked by every
        node's workers at their boundaries: once it is False, the whole request stops and emits nothing more.
        """
        unknown = [n.pool for n in graph.nodes if n.pool not in self.pools]
        if unknown:
            raise ValueError(f"graph names unknown pools {unknown}")
        for node in graph.ready(set(), set()):
            pool = self.pools[node.pool]
            if not pool.has_room():
                raise CapacityError(f"stage {node.pool} has {pool.config.max_queue} requests waiting; retry shortly")
        tag = current_request.get()  # the HTTP request submitting it, if any (serve/tracing.py)
        rid = request_id or self._client_id(tag) or f"req_{uuid.uuid4().hex[:24]}"
        deadline = time.monotonic() + deadline_s if deadline_s else None
        state = RequestState(rid, deadline=deadline, model=model, fence=fence)
        run = _Run(state, graph, inputs, self.tracing)
        if run.streams:
            state.observe(lambda event: self._on_event(run, event))
        if tag is not None:
            tag.model, tag.engine_request_id, tag.submitted_at = model, rid, time.monotonic()
            if tag.timed:
                state.observe(tag.note)
        with self._lock:
            if rid in self._runs:
                raise ValueError(f"request id {rid!r} is already in flight")
            if max_inflight is not None and sum(r.state.model == model for r in self._runs.values()) >= max_inflight:
                raise CapacityError(f"model {model} has {max_inflight} requests in flight; retry shortly")
            self._runs[rid] = run
        state.on_close(lambda: self._forget(rid))
        state.emit(EventKind.QUEUED)
        self._dispatch(run)
        return RequestHandle(state, self)

    def _client_id(self, tag: RequestTag | None) -> str | None:
        """The client's x-request-id as the engine request id, unless a request with that id is in flight (then the
        engine names it; the client's id still names the HTTP request's span and log line)."""
        if tag is None or not tag.client_sent:
            return None
        with self._lock:
            return None if tag.request_id in self._runs else tag.request_id

    def cancel(self, request_id: str) -> bool:
        """Stop a request: workers drop its items at their next boundary; one terminal event."""
        with self._lock:
            run = self._runs.get(request_id)
        if run is None:
            return False
        run.state.request_cancel()
        if not run.state.fail(StageError("cancelled", "the request was cancelled", kind=ErrorKind.CANCELLED)):
            return False
        self.metrics.stage.graph_requests.labels(model=run.state.model, outcome="cancelled").inc()
        return True

    def in_flight(self) -> int:
        with self._lock:
            return len(self._runs)

    def idle(self) -> bool:
        return self.in_flight() == 0 and all(p.idle for p in self.pools.values())

    # -- internals ----------------------------------------------------------------------
    def _dispatch(self, run: _Run) -> None:
        with self._lock:
            ready = run.graph.ready(run.done, run.started)
            for node in ready:
                run.started.add(node.name)
        for node in ready:
            inputs = dict(run.inputs)
            inputs.update(node.params)
            for dep in node.after:
                inputs.update(run.state.outputs.get(dep, {}))
            if node.prepare is not None:
                try:
                    inputs = node.prepare(inputs)
                except StageError as exc:
                    self._fail(run.state, exc)
                    return
                except Exception as exc:  # a bug in the graph's own code: the request fails, the thread goes on
                    self._fail(run.state, StageError("internal_error", f"{type(exc).__name__}: {exc}"))
                    return
                if run.state.should_stop():
                    return
            self._count_node(run, node.name, node.pool)
            self.pools[node.pool].put(WorkItem(run.state, node.name, inputs, trace=self._node_trace(run)))

    def _on_event(self, run: _Run, event) -> None:
        """A source's delta: the pieces it completes go to their streamed nodes' pools at once."""
        if event.kind is not EventKind.DELTA or event.stage is None:
            return
        for node in run.graph.streamed_from(event.stage):
            self._cut(run, node.name, lambda stream: stream.feed(event.data))

    def _cut(self, run: _Run, name: str, cut) -> None:
        """Cut pieces for a streamed node and hand each to its pool (a splitter's error fails the request)."""
        stream = run.streams[name]
        try:
            pieces = cut(stream)
        except StageError as exc:
            self._fail(run.state, exc)
            return
        except Exception as exc:  # a bug in the splitter: the request fails, the worker that wrote the delta goes on
            self._fail(run.state, StageError("internal_error", f"{type(exc).__name__}: {exc}"))
            return
        if run.state.should_stop():
            return
        pool = self.pools[stream.node.pool]
        if pieces and pieces[0] == 0:
            self._count_node(run, name, stream.node.pool)
        read = {k: v for dep in stream.node.after for k, v in run.state.outputs.get(dep, {}).items()}
        for i in pieces:
            inputs = {**run.inputs, **stream.node.params, **read, **stream.pieces[i]}
            route = lambda kind, data, i=i: stream.emit(i, kind, data)  # noqa: E731
            pool.put(WorkItem(run.state, name, inputs, piece=i, route=route, trace=self._node_trace(run)))

    @staticmethod
    def _node_trace(run: _Run) -> NodeTrace | None:
        """A traced request's work item gets its span in the making; None when tracing is off."""
        return None if run.tracing is None or run.trace_parent is None else run.tracing.node_trace(run.trace_parent)

    def _count_node(self, run: _Run, node: str, pool: str) -> None:
        self.metrics.stage.graph_nodes.labels(model=run.state.model, node=node, stage=pool).inc()

    def _on_done(self, item: WorkItem, outputs: dict[str, Any]) -> None:
        state = item.request
        if state.should_stop():
            self._on_drop(item, None)
            return
        with self._lock:
            run = self._runs.get(state.request_id)
        if run is None:
            return
        if item.piece is not None:  # one piece of a streamed node
            stream = run.streams[item.node]
            stream.finish(item.piece, outputs)
            self._stream_done(run, stream)
            return
        self._node_done(run, item.node, outputs)

    def _stream_done(self, run: _Run, stream: StreamedNode) -> None:
        assert stream.node.stream is not None
        with self._lock:  # the last piece and the source's end may finish in two threads at once: one wins
            if not stream.done or stream.node.name in run.done or run.state.should_stop():
                return
            run.done.add(stream.node.name)
        self._node_done(run, stream.node.name, stream.result(run.state.outputs.get(stream.node.stream.source, {})))

    def _node_done(self, run: _Run, name: str, outputs: dict[str, Any]) -> None:
        state = run.state
        state.outputs[name] = outputs
        with self._lock:
            run.done.add(name)
        if name == run.graph.output:
            if run.graph.finish is not None:
                try:
                    outputs = run.graph.finish(outputs)
                except Exception as exc:  # a bug in the graph's own code: the request fails, the thread goes on
                    self._fail(state, StageError("internal_error", f"{type(exc).__name__}: {exc}"))
                    return
            if state.emit(EventKind.FINAL, stage=name, outputs=outputs):
                self.metrics.stage.graph_requests.labels(model=state.model, outcome="ok").inc()
            return
        if run.graph.node(name).publish:
            state.emit(EventKind.OUTPUTS, stage=name, outputs=outputs)
        self._dispatch(run)
        for node in run.graph.streamed_from(name):  # its streams end: their last pieces (a chain of streams too)
            self._cut(run, node.name, lambda stream: stream.flush(outputs))
            self._stream_done(run, run.streams[node.name])

    def _fail(self, state: RequestState, error: StageError) -> None:
        if state.fail(error):
            self.metrics.stage.graph_requests.labels(model=state.model, outcome=error.code).inc()

    def _on_drop(self, item: WorkItem, error: StageError | None) -> None:
        state = item.request
        if error is None and state.expired() and not state.closed:
            error = StageError("deadline_exceeded", "the request passed its deadline", kind=ErrorKind.DEADLINE)
        if error is None and state.fenced() and not state.closed:
            error = StageError("cancelled", "the request's session moved on (its epoch passed)",
                               kind=ErrorKind.CANCELLED)
        if error is not None:
            self._fail(state, error)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._runs.pop(request_id, None)
