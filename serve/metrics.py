"""Counts HTTP requests by route template and status (never by raw path, tenant or request id).

A plain ASGI middleware rather than `@app.middleware("http")`: that one wraps `receive`, which
hides client disconnects from the handlers that watch for them.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CANCELLED_STATUS = 499  # nginx's "client closed request"; the status of the engine's `cancelled` error


class HttpMetrics:
    """The HTTP server's series, on the engine's registry through `engine.metrics.part(HttpMetrics)`."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("mmserve_requests_total", "HTTP requests by route and status", ["route", "status"],
                                registry=registry)


class RequestCounter:
    def __init__(self, app: ASGIApp, counter: Counter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None  # the status answered, once the response starts

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except asyncio.CancelledError:
            # Cancelled before answering (a batch's in-flight lines when the batch is cancelled): nobody saw a
            # 500. Counted as 499, as a client that disconnects is (the engine's `cancelled` error is a 499).
            status = CANCELLED_STATUS if status is None else status
            raise
        finally:
            # If the app raised before answering, the error middleware outside answers 500.
            status = 500 if status is None else status
            # The router writes the matched route into the scope; unmatched paths share one label.
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.counter.labels(route=template, status=str(status)).inc()
