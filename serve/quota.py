"""QuotaGate: each tenant's quotas, enforced before a request reaches its route (and so before any admission).

For every `/v1/...` request of a known key it

1. refuses a model outside the tenant's `models` with 404 `model_not_found` naming `model` (what OpenAI answers
   for a model the key cannot access), read from the JSON body, the multipart form or the path;
2. takes one request, and the request's images / video seconds / tokens, from the tenant's token buckets, and
   one of its `concurrent` places (realtime sessions hold theirs while open), or answers 429 with code
   `rate_limit_exceeded`, `param` naming the exceeded limit, `Retry-After` and the `x-ratelimit-*` headers;
3. runs the request with the tenant's priority class, which the stage queues order by (stages/pool.py), batch
   lines one class lower than the tenant's own requests;
4. adds the `x-ratelimit-*` headers to the response, and counts the outcome per tenant.

A plain ASGI middleware (as serve.metrics.RequestCounter), inside BodyLimit: the body it reads is already bounded.
"""

from __future__ import annotations

import json
import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.auth import tenant_for_key
from serve.errors import error_body
from serve.tenants import UNIT_LIMITS, Refusal, TenantLimiter, Tenants
from stages.pool import submit_priority, submit_tenant

EXEMPT = ("/v1/files/images/", "/v1/loras")  # signed image links (no key) and admin routes (the admin key)
MULTIPART_MODEL_ROUTES = ("/v1/images/edits", "/v1/audio/transcriptions", "/v1/audio/translations")
TOKEN_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
IMAGE_ROUTES = ("/v1/images/generations", "/v1/images/edits")
DEFAULT_COMPLETION_TOKENS = 256  # charged for a chat or completion request that sets no max_tokens
DEFAULT_VIDEO_SECONDS = 4.0  # charged for a video request that names neither seconds nor num_frames and fps
CHARS_PER_TOKEN = 4  # the prompt's tokens are estimated from its characters, as OpenAI's limiter does
BATCH_HOST = "batch"  # the job runner sends batch lines through the app to http://batch (serve/job_runner.py)
_KEY_PROTOCOL = "openai-insecure-api-key."  # a browser's realtime key (serve/ws.py)


class TenantMetrics:
    """Requests per tenant and outcome: admitted, model_not_allowed, or over_<limit> (over_requests_per_min, ...)."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("mmserve_tenant_requests_total", "Requests of configured tenants by outcome",
                                ["tenant", "outcome"], registry=registry)


class QuotaGate:
    def __init__(self, app: ASGIApp, *, tenants: Tenants, metrics: TenantMetrics | None):
        self.app = app
        self.tenants = tenants
        self.keys = tenants.keys
        self.limiters = {name: TenantLimiter(t) for name, t in tenants.tenants.items()}
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        limiter = self._limiter(scope) if scope["type"] in ("http", "websocket") else None
        if limiter is None or not path.startswith("/v1/") or path.startswith(EXEMPT):
            await self.app(scope, receive, send)
            return
        tenant = limiter.tenant
        # The body is read only when a rule needs it (a model list, a unit quota): plain keys cost nothing here.
        reads_body = scope["type"] == "http" and (tenant.models is not None or
                                                  any(getattr(tenant, name) for name in UNIT_LIMITS))
        body, fields = await _read_fields(scope, receive) if reads_body else (None, {})
        if body is not None:
            receive = _replay(body, receive)
        model = _model(scope, path, fields)
        if model is not None and not tenant.may_use(model):
            self._count(tenant.name, "model_not_allowed")
            await _refuse(scope, receive, send, 404, f"The model '{model}' does not exist or you do not have access "
                                                    f"to it.", param="model", code="model_not_found")
            return
        refusal = limiter.admit(_units(scope, path, fields))
        if refusal is not None:
            self._count(tenant.name, f"over_{refusal.limit}")
            await self._refuse_limit(scope, receive, send, limiter, refusal, path)
            return
        self._count(tenant.name, "admitted")
        batch_line = Headers(scope=scope).get("host") == BATCH_HOST
        token = submit_priority.set(tenant.rank + int(batch_line))
        tenant_token = submit_tenant.set(tenant.name)
        tokens = path in TOKEN_ROUTES

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *limiter.headers(tokens)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            submit_priority.reset(token)
            submit_tenant.reset(tenant_token)
            limiter.release()

    def _limiter(self, scope: Scope) -> TenantLimiter | None:
        """The limiter of the caller's tenant; None without keys or for an unknown key (auth answers 401)."""
        if not self.keys:
            return None
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        candidates = [token.strip()] if scheme.lower() == "bearer" and token.strip() else []
        if scope["type"] == "websocket":
            candidates += [p[len(_KEY_PROTOCOL):] for p in scope.get("subprotocols", []) if p.startswith(_KEY_PROTOCOL)]
        for candidate in candidates:
            name = tenant_for_key(self.keys, candidate)
            if name is not None:
                return self.limiters[name]
        return None

    def _count(self, tenant: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(tenant=tenant, outcome=outcome).inc()

    async def _refuse_limit(self, scope: Scope, receive: Receive, send: Send, limiter: TenantLimiter,
                            refusal: Refusal, path: str) -> None:
        retry = str(max(1, math.ceil(min(refusal.retry_after_s, 60.0))))
        headers = [(b"retry-after", retry.encode()), *limiter.headers(path in TOKEN_ROUTES)]
        await _refuse(scope, receive, send, 429, refusal.message, param=refusal.limit, code="rate_limit_exceeded",
                      headers=headers)


async def _read_fields(scope: Scope, receive: Receive) -> tuple[bytes | None, dict[str, Any]]:
    """The whole body (to replay to the route) and the fields quotas read: a JSON object's, or a multipart form's
    text fields on the routes whose model comes in a form. (None, {}) for a body that is neither."""
    headers = Headers(scope=scope)
    content_type = headers.get("content-type", "").lower()
    is_multipart = content_type.startswith("multipart/form-data") and scope["path"] in MULTIPART_MODEL_ROUTES
    if scope["method"] != "POST" or not (content_type.startswith("application/json") or is_multipart):
        return None, {}
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    if is_multipart:
        form = await Request(scope, _replay(body, receive)).form()
        try:
            return body, {k: v for k, v in form.items() if isinstance(v, str)}
        finally:
            await form.close()
    try:
        data = json.loads(body)
    except ValueError:  # the route answers the parse error
        return body, {}
    return body, data if isinstance(data, dict) else {}


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the route the body read here, then the client's own messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def _model(scope: Scope, path: str, fields: dict[str, Any]) -> str | None:
    """The model a request names: its `model` field, `?model=` (realtime) or /v1/models/{model}."""
    if path.startswith("/v1/models/"):
        return path[len("/v1/models/"):] or None
    model = fields.get("model")
    if model is None:
        from urllib.parse import parse_qs

        model = (parse_qs(scope.get("query_string", b"").decode()).get("model") or [None])[0]
    return model if isinstance(model, str) and model else None


def _units(scope: Scope, path: str, fields: dict[str, Any]) -> dict[str, float]:
    """What the request takes from the tenant's unit buckets (their names -> amounts)."""
    if scope["type"] != "http" or scope.get("method") != "POST":
        return {}
    if path in IMAGE_ROUTES:
        return {"images_per_min": float(_number(fields.get("n"), 1))}
    if path == "/v1/videos":
        seconds = _number(fields.get("seconds"), 0)
        frames, fps = _number(fields.get("num_frames"), 0), _number(fields.get("fps"), 0)
        if not seconds and frames and fps:
            seconds = frames / fps
        return {"video_seconds_per_min": float(seconds or DEFAULT_VIDEO_SECONDS)}
    if path in TOKEN_ROUTES:
        prompt = fields.get("messages", fields.get("prompt", fields.get("input", "")))
        tokens = math.ceil(len(json.dumps(prompt)) / CHARS_PER_TOKEN)
        if path != "/v1/embeddings":
            tokens += int(_number(fields.get("max_completion_tokens", fields.get("max_tokens")),
                                  DEFAULT_COMPLETION_TOKENS))
        return {"tokens_per_min": float(tokens)}
    return {}


def _number(value: Any, default: float) -> float:
    """A positive number from a JSON or form field; `default` for anything else (the route refuses bad values)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return number if math.isfinite(number) and number > 0 else default


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str, *, param: str | None,
                  code: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An OpenAI error object over HTTP; a WebSocket handshake is answered the same way when the server can send a
    response there, else closed with 1013 (try again) or 1008 (policy: the model)."""
    body = json.dumps(error_body(status, message, param=param, code=code)).encode()
    start = {"status": status, "headers": [(b"content-type", b"application/json"),
                                           (b"content-length", str(len(body)).encode()), *(headers or [])]}
    if scope["type"] == "http":
        await send({"type": "http.response.start", **start})
        await send({"type": "http.response.body", "body": body})
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", **start})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.close", "code": 1013 if status == 429 else 1008})
