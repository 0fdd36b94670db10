"""Request and stage tracing (OpenTelemetry), and the HTTP request's tag that reaches the executor.

Off by default: no Tracing object exists, work items carry no NodeTrace, and the pools' hooks are one `is None`
test each. On (`[server] tracing`): the HTTP request span (serve/tracing.py) is the parent of one span per graph
node the request passes through, with its queue wait, run time, batch size and batch id (one id per stage call,
shared by that call's items). A loop stage's item takes part in many calls (steps): its span has the run time of
all of them, the largest batch, the first call's id and the number of steps. Stages that look things up in a cache
add what they found: encoder caches' hits and misses (`cache_hit` when all hit), the llm's prefix-cached tokens.

The spans go through the Tracing's own provider, never OpenTelemetry's global one (nothing changes at import).
"""

from __future__ import annotations

import os
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from stages.events import Event, EventKind, StageError

TRACING_MODES = ("off", "otlp", "memory")


@dataclass
class RequestTag:
    """One HTTP request's identity and timings, shared with the engine requests it submits (`current_request`)."""

    request_id: str  # the client's x-request-id (validated), or one made up for it
    client_sent: bool  # the client named the id: it becomes the engine request id where the route names none
    timed: bool = False  # note the engine request's queue wait and first output (for the request's log line)
    model: str = ""  # the model of the last engine request it submitted
    engine_request_id: str = ""  # that request's id in the executor
    submitted_at: float = 0.0  # monotonic, when it was submitted
    queue_s: float | None = None  # submit -> its first stage started
    ttft_s: float | None = None  # submit -> its first streamed delta

    def note(self, event: Event) -> None:
        """An event of its engine request (in the writing thread): the first stage start and the first delta."""
        if event.kind is EventKind.STAGE_STARTED and self.queue_s is None:
            self.queue_s = time.monotonic() - self.submitted_at
        elif event.kind is EventKind.DELTA and self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.submitted_at


# The HTTP request being served in this context (set by serve/tracing.py's middleware; read by the executor's
# submit, which runs in the route's task or a thread that copied its context).
current_request: ContextVar[RequestTag | None] = ContextVar("current_request", default=None)


# The facts a Ray replica measures for an item it ran and sends back with it (stages/ray_replica.py); the API
# process's pool notes the queue wait itself and exports the span.
REPLICA_FACTS = ("run_time_s", "batch_size", "batch_id", "calls", "cache_hits", "cache_misses", "cached_tokens")


@dataclass
class NodeTrace:
    """One work item's stage span in the making: its pool notes the facts, and it is exported once, when it ends.
    Without a tracer it only gathers them: a Ray replica's record, sent back with the item."""

    tracer: trace.Tracer | None
    parent: otel_context.Context | None  # the request span's context
    queued_ns: int = field(default_factory=time.time_ns)  # wall clock: the span starts when the item is queued
    queue_wait_s: float = 0.0  # queued -> its stage started it
    run_time_s: float = 0.0  # the stage calls it took part in, together
    batch_size: int = 0  # the largest of those calls
    batch_id: str = ""  # the first of those calls
    calls: int = 0  # 1 for a batch stage; a loop stage's steps
    cache_hits: int = 0  # its lookups in the prompt or encoder-output cache that found the value (or its flight)
    cache_misses: int = 0  # ... and those it computed
    cached_tokens: int | None = None  # the llm stage: prompt tokens its prefix cache served

    def cache(self, hits: int, misses: int) -> None:
        """Its stage looked values up for it in an encoder cache."""
        self.cache_hits += hits
        self.cache_misses += misses

    def facts(self) -> dict[str, Any]:
        """What a replica measured, to send back (REPLICA_FACTS)."""
        return {name: getattr(self, name) for name in REPLICA_FACTS}

    def took(self, facts: dict[str, Any]) -> None:
        """What the replica that ran it measured."""
        for name in REPLICA_FACTS:
            setattr(self, name, facts[name])

    def ran(self, batch_id: str, batch_size: int, seconds: float) -> None:
        """It took part in one stage call."""
        if not self.calls:
            self.batch_id = batch_id
        self.calls += 1
        self.run_time_s += seconds
        self.batch_size = max(self.batch_size, batch_size)

    def end(self, request_id: str, node: str, stage: str, error: StageError | None) -> None:
        """Export the span (the item left its stage: finished, dropped or failed)."""
        assert self.tracer is not None, "a replica's record is sent back, not exported"
        attributes: dict[str, Any] = {
            "mmserve.request_id": request_id, "mmserve.node": node, "mmserve.stage": stage,
            "mmserve.queue_wait_s": self.queue_wait_s, "mmserve.run_time_s": self.run_time_s,
            "mmserve.batch_size": self.batch_size, "mmserve.batch_id": self.batch_id, "mmserve.calls": self.calls}
        if self.cache_hits or self.cache_misses:  # cache_hit: every lookup hit
            attributes.update({"mmserve.cache_hit": not self.cache_misses, "mmserve.cache_hits": self.cache_hits,
                               "mmserve.cache_misses": self.cache_misses})
        if self.cached_tokens is not None:
            attributes["mmserve.cached_tokens"] = self.cached_tokens
        span = self.tracer.start_span(node, context=self.parent, start_time=self.queued_ns, attributes=attributes)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error.code))
        span.end()


class Tracing:
    """The spans' provider and tracer. Build one with `from_mode`; None is tracing off."""

    def __init__(self, provider: Any, exporter: Any = None):
        """`provider`: an SDK TracerProvider with its span processor; `exporter`: the in-memory one, for tests."""
        self.provider = provider
        self.exporter = exporter
        self.tracer = provider.get_tracer("mmserve")

    @classmethod
    def from_mode(cls, mode: str) -> Tracing | None:
        """"off": None. "otlp": spans exported in batches over OTLP, configured by the standard OTEL_EXPORTER_OTLP_*
        environment (OTEL_EXPORTER_OTLP_PROTOCOL "grpc", else HTTP/protobuf). "memory": kept in an in-memory
        exporter (`exporter.get_finished_spans()`), for tests."""
        if mode not in TRACING_MODES:
            raise ValueError(f"tracing must be one of {TRACING_MODES}, got {mode!r}")
        if mode == "off":
            return None
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": "mmserve"}))
        if mode == "memory":
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

            exporter = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            return cls(provider, exporter)
        if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").startswith("grpc"):
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider)

    @staticmethod
    def parent() -> otel_context.Context:
        """This context (the submitting route's): its span, the HTTP request's, is the parent of the node spans."""
        return otel_context.get_current()

    def node_trace(self, parent: otel_context.Context) -> NodeTrace:
        """A span in the making for a work item queued now."""
        return NodeTrace(self.tracer, parent)

    def shutdown(self) -> None:
        """Export what is buffered and stop."""
        self.provider.shutdown()
