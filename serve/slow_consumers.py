"""Slow consumers: a streaming client that stops reading is cut after a grace, and its request cancelled.

uvicorn's send waits while a connection's buffers are full (flow control), so a client that stops reading
stalls whoever sends to it. Without a bound, an SSE body stops being iterated while its engine request keeps
its pool slot, and the connection lives as long as the client keeps it open.

A streamed body (SSE events, streamed audio: `stream_response`) is pulled from the engine into a bounded
outbox (`[server] slow_consumer_outbox_bytes`) by one task and sent from it by another. A send that has not
completed within `[server] slow_consumer_grace_s` means the client has taken nothing for that long while data
waited: it is cut. Its body is closed, which cancels its engine request on the path a disconnect takes (the
pool lets go at the next step); the connection is reset; the reason is logged (route, client, request id)
and counted in `mmserve_slow_consumers_total{route, transport}`.

Realtime WebSockets keep their one writer per session (realtime/sessions.py `Outbox`, whose lock lets one
frame wait at a time) and apply the same rule to each send (serve/ws.py `StarletteSocket.send`): a cut
socket is reset, and its session is kept for a resume as after any dropped socket. No close frame can reach
a client whose buffers are full; the reason is in the log and the counter.

Resetting needs the server's connections (`connections`, wired by serve/cli.py from uvicorn's server
state); without them (another ASGI server, a test client) the response just ends.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import deque
from collections.abc import AsyncIterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Scope, Send

log = logging.getLogger(__name__)
DEFAULT_GRACE_S = 30.0
DEFAULT_OUTBOX_BYTES = 2**20
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, dropping what the client never took


class SlowConsumer(Exception):
    """A send did not complete within the grace: the client has stopped reading."""


class SlowConsumerMetrics:
    """The cut clients, on the engine's registry (`engine.metrics.part(SlowConsumerMetrics)`)."""

    def __init__(self, registry: CollectorRegistry):
        self.cut = Counter("mmserve_slow_consumers_total", "Streaming clients cut for taking no data within "
                           "[server] slow_consumer_grace_s (transport: sse, http_stream or websocket)",
                           ["route", "transport"], registry=registry)


class SlowConsumers:
    """One app's rule (`app.state.slow_consumers`): how long a send may wait, how much a stream buffers."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, outbox_bytes: int = DEFAULT_OUTBOX_BYTES,
                 metrics: SlowConsumerMetrics | None = None):
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not grace_s > 0:
            raise ValueError(f"server.slow_consumer_grace_s must be a number of seconds > 0, got {grace_s!r}")
        if isinstance(outbox_bytes, bool) or not isinstance(outbox_bytes, int) or outbox_bytes < 1:
            raise ValueError(f"server.slow_consumer_outbox_bytes must be a whole number of bytes >= 1, "
                             f"got {outbox_bytes!r}")
        self.grace_s = float(grace_s)
        self.outbox_bytes = outbox_bytes
        self.metrics = metrics
        # uvicorn's open connections (protocol objects with `client` and `transport`): serve/cli.py sets them
        self.connections: set[Any] | None = None

    async def send_within_grace(self, send, message: Any) -> None:
        """`await send(message)`, or SlowConsumer when it has not completed within the grace."""
        try:
            async with asyncio.timeout(self.grace_s):  # no task per send, unlike wait_for
                await send(message)
        except TimeoutError:
            raise SlowConsumer(f"the client took no data for {self.grace_s:g} s") from None

    def cut(self, scope: Scope, transport: str, request_id: str | None = None) -> bool:
        """Log and count a client cut for not reading, and reset its connection (True when it was found)."""
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        if self.metrics is not None:
            self.metrics.cut.labels(route=route, transport=transport).inc()
        client = scope.get("client")
        log.warning("slow consumer cut: %s %s from %s took no data for %g s (request %s); its request is "
                    "cancelled and the connection reset", transport, route, _peer(client), self.grace_s,
                    request_id or "-")
        return self.reset(client)

    def reset(self, client: Any) -> bool:
        """Reset (RST) the connection from `client` (host, port): a client that does not read learns at once."""
        if self.connections is None or client is None:
            return False
        for connection in list(self.connections):
            if getattr(connection, "client", None) == tuple(client):
                transport = connection.transport
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                    except OSError:  # already gone
                        pass
                transport.abort()
                return True
        return False


def stream_response(request: Request, body: AsyncIterable[str | bytes], *, media_type: str,
                    headers: Mapping[str, str]) -> StreamingResponse:
    """A streamed reply whose client is cut when it stops reading (the app's `slow_consumers` rule)."""
    rule: SlowConsumers | None = getattr(request.app.state, "slow_consumers", None)
    if rule is None:  # an app built without create_app
        return StreamingResponse(body, media_type=media_type, headers=headers)
    return GuardedStream(body, rule, request.scope, media_type=media_type, headers=headers)


class GuardedStream(StreamingResponse):
    """StreamingResponse with the body pulled into a bounded outbox and every send bounded by the grace."""

    def __init__(self, body: AsyncIterable[str | bytes], rule: SlowConsumers, scope: Scope, *, media_type: str,
                 headers: Mapping[str, str]):
        super().__init__(body, media_type=media_type, headers=headers)
        self.rule = rule
        self.scope = scope
        self.transport = "sse" if media_type == "text/event-stream" else "http_stream"  # the counter's label

    async def stream_response(self, send: Send) -> None:
        outbox = StreamOutbox(self.rule.outbox_bytes)
        pull = asyncio.create_task(self._pull(outbox))
        try:
            await self.rule.send_within_grace(send, {"type": "http.response.start", "status": self.status_code,
                                                     "headers": self.raw_headers})
            while (chunk := await outbox.get()) is not None:
                await self.rule.send_within_grace(send, {"type": "http.response.body", "body": chunk,
                                                         "more_body": True})
            await self.rule.send_within_grace(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except SlowConsumer:
            await _stop(pull)  # closes the body first: its request is cancelled before the connection goes
            if self.rule.cut(self.scope, self.transport, self.headers.get("x-request-id")):
                await asyncio.sleep(0)  # uvicorn sees the connection lost (not a response left incomplete)
        finally:
            await _stop(pull)

    async def _pull(self, outbox: StreamOutbox) -> None:
        body = self.body_iterator
        try:
            async for chunk in body:
                await outbox.put(chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset))
        except Exception as exc:  # the sender raises it, as StreamingResponse would have
            outbox.finish(exc)
        else:
            outbox.finish()
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:  # stopped while the body waited at a yield: its `finally` cancels the request
                await aclose()


async def _stop(task: asyncio.Task) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class StreamOutbox:
    """Chunks between the puller and the sender, at most `max_bytes` of them queued (one chunk always fits)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._chunks: deque[bytes | memoryview] = deque()
        self._bytes = 0
        self._done = False
        self._error: BaseException | None = None
        self._changed = asyncio.Event()

    async def put(self, chunk: bytes | memoryview) -> None:
        """Queue `chunk`; waits while the outbox is full (the sender has not taken enough)."""
        while self._chunks and self._bytes + len(chunk) > self.max_bytes:
            await self._wait()
        self._chunks.append(chunk)
        self._bytes += len(chunk)
        self._changed.set()

    def finish(self, error: BaseException | None = None) -> None:
        """No more chunks; the sender raises `error` once it has sent the queued ones."""
        self._done, self._error = True, error
        self._changed.set()

    async def get(self) -> bytes | None:
        """Everything queued, joined (one send); None once finished and empty."""
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                return None
            await self._wait()
        chunks, self._chunks, self._bytes = self._chunks, deque(), 0
        self._changed.set()
        return b"".join(chunks)

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "-"

