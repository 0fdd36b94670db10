"""What the realtime WebSocket routes share: API-key auth at the handshake, accept, the not-ready refusal,
the Starlette socket adapter, and the per-app reaper of expired sessions.

Auth as the REST routes (API keys -> tenant): `Authorization: Bearer <key>`, or, for browsers that
cannot set headers, the subprotocol `openai-insecure-api-key.<key>` (as OpenAI's Realtime API).
A refused key closes the handshake (HTTP 403).

A client that takes no frame for `[server] slow_consumer_grace_s` is cut (serve/slow_consumers.py): the send
fails (the session's outbox detaches, as when the socket drops, and keeps journalling for a resume) and the
connection is reset.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from realtime.sessions import CLOSE_TRY_AGAIN, SessionRegistry, error_event, reap_until_empty
from serve.auth import DEFAULT_TENANT
from serve.slow_consumers import SlowConsumer, SlowConsumers

_KEY_PROTOCOL = "openai-insecure-api-key."


async def accept(websocket: WebSocket) -> str | None:
    """Authenticate and accept; the tenant, or None when the socket was refused (and closed)."""
    tenant = _tenant(websocket)
    if tenant is None:
        await websocket.close(code=1008)  # before accept: the handshake answers 403
        return None
    protocols = [p for p in websocket.scope.get("subprotocols", []) if not p.startswith(_KEY_PROTOCOL)]
    await websocket.accept(subprotocol=protocols[0] if protocols else None)
    if not websocket.app.state.engine.ready:
        await websocket.send_text(json.dumps(error_event("model_loading", "the models are still loading; retry shortly",
                                                         error_type="service_unavailable_error")))
        await websocket.close(CLOSE_TRY_AGAIN)
        return None
    return tenant


def ensure_reaper(app, registry: SessionRegistry, gauge) -> None:
    """One task per app and registry closes expired sessions while any exist."""
    attr = f"{registry.kind}_reaper"
    task = getattr(app.state, attr, None)
    if task is None or task.done():
        setattr(app.state, attr, asyncio.create_task(reap_until_empty(registry, gauge)))


def _tenant(websocket: WebSocket) -> str | None:
    keys: dict[str, str] | None = websocket.app.state.api_keys
    if not keys:
        return DEFAULT_TENANT
    scheme, _, token = websocket.headers.get("authorization", "").partition(" ")
    candidates = [token.strip()] if scheme.lower() == "bearer" else []
    candidates += [p[len(_KEY_PROTOCOL):] for p in websocket.scope.get("subprotocols", [])
                   if p.startswith(_KEY_PROTOCOL)]
    for candidate in candidates:
        for key, tenant in keys.items():
            if candidate and hmac.compare_digest(key.encode(), candidate.encode()):
                return tenant
    return None


class StarletteSocket:
    """A Starlette WebSocket as the realtime connections' socket: receive / send / close / close_code."""

    def __init__(self, websocket: WebSocket):
        self.ws = websocket
        self.close_code: int | None = None  # the client's close code once it has gone

    async def receive(self) -> str | bytes | None:
        try:
            message = await self.ws.receive()
        except WebSocketDisconnect as e:
            self.close_code = e.code
            return None
        except RuntimeError:  # receive after the disconnect was seen
            return None
        if message["type"] == "websocket.disconnect":
            self.close_code = message.get("code", 1005)
            return None
        return message["text"] if message.get("text") is not None else message.get("bytes")

    async def send(self, frame: str | bytes) -> None:
        """Send one frame; SlowConsumer (and the connection reset) when the client takes none within the grace."""
        message = {"type": "websocket.send", "text": frame} if isinstance(frame, str) else \
            {"type": "websocket.send", "bytes": frame}
        rule: SlowConsumers | None = getattr(self.ws.app.state, "slow_consumers", None)
        if rule is None:
            await self.ws.send(message)
            return
        try:
            await rule.send_within_grace(self.ws.send, message)
        except SlowConsumer:
            rule.cut(self.ws.scope, "websocket")
            raise

    async def close(self, code: int, reason: str) -> None:
        try:
            await self.ws.close(code, reason)
        except (RuntimeError, WebSocketDisconnect):  # already closed, or the peer has gone
            pass
