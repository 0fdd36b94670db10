"""RequestObserver: each HTTP request's id, span and log line.

* Request id: a client's `x-request-id` (1 to 128 printable ASCII characters, no spaces) is accepted, else answered
  400 naming the header; without one, an id is made up. It becomes the engine request id where the route names
  none (images, videos), and is always what comes back as `x-request-id`.
* Span (tracing on, stages/tracing.py): one per request, the parent of its node spans; the tenant and request id
  are attributes (never metric labels, DESIGN §10).
* Log line (`[server] log_format = "json"`): one JSON object per request on the `mmserve.requests` logger, with the
  request id, tenant, model, route, status, duration and, where known, queue wait and time to first delta.

A plain ASGI middleware (like serve/metrics.py's RequestCounter), so the route runs in its context: the engine
request it submits finds the request's tag (`current_request`) and span there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.auth import DEFAULT_TENANT, tenant_for_key
from serve.errors import error_body
from serve.metrics import CANCELLED_STATUS
from stages.redact import RedactingFormatter
from stages.tracing import RequestTag, Tracing, current_request

LOG_FORMATS = ("text", "json")
MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_HEADER = "x-request-id"
request_log = logging.getLogger("mmserve.requests")


def valid_request_id(value: str) -> bool:
    """1 to MAX_REQUEST_ID_CHARS printable ASCII characters without spaces: safe in headers, logs and span ids."""
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and all("!" <= c <= "~" for c in value)


class JsonFormatter(RedactingFormatter):
    """Every record as one JSON line (URL secrets masked): time, level, logger, message, and a request line's
    fields (`extra={"fields": {...}}`)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                                "message": record.getMessage()}
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return super().format(_with_message(json.dumps(line), record))


def _with_message(text: str, record: logging.LogRecord) -> logging.LogRecord:
    """A copy of `record` whose whole message is `text` (the base formatter then only masks it)."""
    copy = logging.makeLogRecord(record.__dict__)
    copy.msg, copy.args, copy.exc_info, copy.exc_text = text, None, None, None
    return copy


class RequestObserver:
    def __init__(self, app: ASGIApp, *, keys: dict[str, str], tracing: Tracing | None, log_json: bool):
        """`keys`: API key -> tenant (the tenant of a request's span and log line); `tracing`: None is off."""
        self.app = app
        self.keys = keys
        self.tracing = tracing
        self.log_json = log_json

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        sent = _header(scope, REQUEST_ID_HEADER.encode())
        if sent is not None and not valid_request_id(sent):
            body = error_body(400, f"The {REQUEST_ID_HEADER} header must be 1 to {MAX_REQUEST_ID_CHARS} printable "
                              "ASCII characters without spaces; send another or none.", param=REQUEST_ID_HEADER,
                              code="invalid_request_id")
            await _send_json(send, 400, body)
            return
        tag = RequestTag(sent or f"req_{uuid.uuid4().hex[:24]}", client_sent=sent is not None, timed=self.log_json)
        tag_token = current_request.set(tag)
        span = otel_token = None
        if self.tracing is not None:
            span = self.tracing.tracer.start_span(f"{scope['method']} {scope['path']}", kind=SpanKind.SERVER,
                                                  attributes={"mmserve.request_id": tag.request_id})
            otel_token = otel_context.attach(trace.set_span_in_context(span))
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = _with_request_id(message.get("headers", []), tag)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:
            status = CANCELLED_STATUS if status is None else status
            raise
        finally:
            status = 500 if status is None else status  # the error middleware outside answers what raised
            current_request.reset(tag_token)
            fields = self._fields(scope, tag, status, time.monotonic() - started)
            if span is not None and otel_token is not None:
                otel_context.detach(otel_token)
                _end_span(span, fields)
            if self.log_json:
                request_log.info("%s %s %d", scope["method"], fields["route"], status, extra={"fields": fields})

    def _fields(self, scope: Scope, tag: RequestTag, status: int, seconds: float) -> dict[str, Any]:
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        fields: dict[str, Any] = {"request_id": tag.request_id, "tenant": self._tenant(scope), "model": tag.model,
                                  "route": route, "method": scope["method"], "status": status,
                                  "duration_ms": round(seconds * 1000, 3)}
        if tag.engine_request_id and tag.engine_request_id != tag.request_id:
            fields["engine_request_id"] = tag.engine_request_id
        if tag.queue_s is not None:
            fields["queue_ms"] = round(tag.queue_s * 1000, 3)
        if tag.ttft_s is not None:
            fields["ttft_ms"] = round(tag.ttft_s * 1000, 3)
        return fields

    def _tenant(self, scope: Scope) -> str:
        """The tenant of the request's bearer key ("" when keys are configured and it sends none of them)."""
        if not self.keys:
            return DEFAULT_TENANT
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        token = token.strip()
        return (tenant_for_key(self.keys, token) or "") if scheme.lower() == "bearer" and token else ""


def _end_span(span: trace.Span, fields: dict[str, Any]) -> None:
    span.set_attributes({f"mmserve.{k}": v for k, v in fields.items() if k not in ("method",)})
    span.set_attribute("http.route", fields["route"])
    span.set_attribute("http.response.status_code", fields["status"])
    if fields["status"] >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _with_request_id(headers: Any, tag: RequestTag) -> list[tuple[bytes, bytes]]:
    """The response's headers with `x-request-id`: the client's always; else the route's own (which then names the
    request in its span and log line too), else the tag's."""
    headers = list(headers)
    name = REQUEST_ID_HEADER.encode()
    own = [v for k, v in headers if k.lower() == name]
    has = bool(own)
    if has and not tag.client_sent:
        tag.request_id = own[0].decode("latin-1")
    if tag.client_sent:
        headers = [(k, v) for k, v in headers if k.lower() != name]
    if tag.client_sent or not has:
        headers.append((name, tag.request_id.encode()))
    return headers


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
