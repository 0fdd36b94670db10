"""Graceful drain: on SIGTERM the server stops taking work, lets what it holds finish, then exits.

The sequence (`Drain.run`), all within `[server] drain_grace_s` (default 30):

1. at once: /ready answers 503 (`status: draining`) and every new request 503 with `Retry-After` (code
   `server_draining`), new realtime sockets are refused (close 1013); the listener stays open;
2. the job runner stops: batch lines and videos in flight are cancelled, nothing of theirs recorded (each finished
   batch line's result is already a committed row, serve/jobs.py), and the next start resumes them (batches after
   their committed lines, videos from the beginning);
3. every realtime session gets `session.closing` with its `session_id`, `resume_token` and `closes_in_s`;
4. requests in flight finish; those still running at the end of the grace are cancelled (their engine requests
   stop at the next step; the client sees its connection close);
5. realtime sessions are closed (`server_draining`) and the server exits (code 0).

A second SIGTERM, or SIGINT, exits at once as uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Gauge
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from serve.errors import error_response
from serve.quota import BATCH_HOST

log = logging.getLogger(__name__)
DEFAULT_GRACE_S = 30.0
ALWAYS_ANSWERED = ("/health", "/ready", "/metrics")  # probes and scrapes keep working while draining
CLOSE_TRY_AGAIN = 1013


class DrainMetrics:
    """The drain's series, on the engine's registry (`engine.metrics.part(DrainMetrics)`)."""

    def __init__(self, registry: CollectorRegistry):
        self.in_flight = Gauge("mmserve_http_requests_in_flight", "HTTP requests being answered (batch lines and "
                               "realtime sessions not counted): what a drain waits for", registry=registry)
        self.draining = Gauge("mmserve_draining", "1 while the server drains (SIGTERM), else 0", registry=registry)


class Drain:
    """The drain state of one app (`app.state.drain`) and the requests it waits for."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, metrics: DrainMetrics | None = None):
        if not grace_s > 0:
            raise ValueError(f"server.drain_grace_s must be a number of seconds > 0, got {grace_s!r}")
        self.grace_s = grace_s
        self.draining = False
        self.deadline: float | None = None  # time.monotonic() at which the grace ends, once draining
        self.in_flight: set[asyncio.Task] = set()  # the tasks of HTTP requests being answered
        self.finished = 0  # requests that were in flight when the drain began and finished in it
        self.cancelled = 0  # requests cancelled at the end of the grace
        self.metrics = metrics

    def retry_after_s(self) -> float:
        """What a refused caller is told: the grace left (the server is back after a restart at the earliest)."""
        return max(1.0, (self.deadline or time.monotonic()) - time.monotonic())

    async def run(self, app: FastAPI) -> None:
        """The drain sequence (module docstring); returns when the server may exit."""
        self.draining = True
        self.deadline = time.monotonic() + self.grace_s
        if self.metrics is not None:
            self.metrics.draining.set(1)
        waiting = set(self.in_flight)
        log.warning("draining: %d requests in flight, grace %.0f s", len(waiting), self.grace_s)
        await app.state.job_runner.stop()
        registries = (app.state.voice_sessions, app.state.video_sessions)
        for registry in registries:
            await registry.announce_closing("server_draining", closes_in_s=self.grace_s)
        if waiting:
            _, pending = await asyncio.wait(waiting, timeout=self.grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)
            self.cancelled = len(pending)
            self.finished = len(waiting) - len(pending)
        for registry in registries:
            await registry.close_all("server_draining")
        log.warning("drained: %d requests finished, %d cancelled at the end of the grace", self.finished,
                    self.cancelled)


class DrainGate:
    """Counts the HTTP requests in flight (their tasks) and refuses new work once draining."""

    def __init__(self, app: ASGIApp, *, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in ALWAYS_ANSWERED:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": CLOSE_TRY_AGAIN})
                return
            reply = error_response(503, "the server is shutting down (draining); retry on another replica or after "
                                        "it restarts", code="server_draining", retry_after_s=self.drain.retry_after_s())
            await reply(scope, receive, send)
            return
        if scope["type"] == "websocket" or Headers(scope=scope).get("host") == BATCH_HOST:
            # Not waited for: sessions are told to resume, batch lines stop with the job runner and rerun after it
            await self.app(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None  # an ASGI call runs in a task
        self.drain.in_flight.add(task)
        self._observe()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight.discard(task)
            self._observe()

    def _observe(self) -> None:
        if self.drain.metrics is not None:
            self.drain.metrics.in_flight.set(len(self.drain.in_flight))


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM drains `app.state.drain` before the usual shutdown."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        await super().main_loop()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        drain: Drain = self.app.state.drain
        if sig != signal.SIGTERM or drain.draining or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        drain.draining = True  # now, in the handler: no request slips in before the task starts
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.app.state.drain.run(self.app)
        finally:
            self.should_exit = True
