"""One WebSocket of `/v1/realtime/video`, from its first event to hang-up.

Before a session exists the socket takes `session.update` (create: admission may refuse at capacity,
never evicting a live session) or `session.resume` (take over a dropped session within its grace
period, replaying what was missed). Errors before that are plain `error` events; the socket stays
open for another try. A client that closes its socket normally (code 1000) ends its session; when
the socket drops any other way the session is detached, not closed: it waits `resume_grace_s` for
a resume, then the registry reaps it (as it reaps idle and over-long sessions).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from realtime.sessions import CLOSE_NORMAL, CLOSE_TRY_AGAIN, SessionRefused, SessionRegistry, SessionSocket
from realtime.video.metrics import VideoMetrics
from realtime.video.protocol import ProtocolError, error_event, only, parse_event
from realtime.video.session import VideoSession

log = logging.getLogger(__name__)


class VideoConnection:
    def __init__(self, socket: SessionSocket, engine, registry: SessionRegistry, *, tenant: str,
                 model: str | None = None, on_admit: Callable[[], None] | None = None):
        self.socket = socket
        self.engine = engine
        self.metrics = engine.metrics.part(VideoMetrics)
        self.registry = registry
        self.tenant = tenant
        self.model = model  # the `?model=` of the URL: the default of the first session.update
        self.on_admit = on_admit  # called once a session is admitted (the server starts its reaper)
        self.session: VideoSession | None = None

    async def run(self) -> None:
        try:
            while (frame := await self.socket.receive()) is not None:
                if self.session is not None and self.session.closed:
                    break
                await self._dispatch(frame)
        finally:
            session = self.session
            if session is not None and session.socket_owner is self and session.closed is None:
                if self.socket.close_code == CLOSE_NORMAL:  # the client ended the session: free its place now
                    await self.registry.remove(session.id, "client_closed")
                else:  # the connection dropped: keep the session for a resume
                    self.registry.detach(session.id)
                self.metrics.sessions.set(len(self.registry))

    async def _dispatch(self, frame: str | bytes) -> None:
        event_id = None
        try:
            if isinstance(frame, bytes):
                if self.session is None:
                    raise ProtocolError("no_session", "send session.update before media frames", "frame")
                self.registry.touch(self.session.id)
                return await self.session.handle_media(frame)
            event = parse_event(frame)
            event_id = event.get("event_id")
            if self.session is None:
                return await self._open(event)
            self.registry.touch(self.session.id)
            if event["type"] == "session.resume":
                raise ProtocolError("invalid_event", "this socket already carries a session", "type")
            await self.session.handle_event(event)
        except ProtocolError as e:
            await self._send_error(error_event(e.code, e.message, param=e.param, event_id=event_id))

    async def _send_error(self, event: dict[str, Any]) -> None:
        if self.session is not None:
            await self.session.emit(event)
        else:
            await self.socket.send(json.dumps(event))

    async def _open(self, event: dict[str, Any]) -> None:
        if event["type"] == "session.resume":
            return await self._resume(event)
        if event["type"] != "session.update":
            raise ProtocolError("no_session", f"send session.update (or session.resume) before {event['type']}",
                                "type")
        only(event, ("session",))
        update = event.get("session", {})
        if isinstance(update, dict) and self.model is not None:
            update = {"model": self.model, **update}
        session = VideoSession.open(self.engine, update, tenant=self.tenant, config=self.engine.config.realtime)
        try:
            self.registry.admit(session)
        except SessionRefused as e:
            self.metrics.refused.labels(reason=e.code).inc()
            await self.socket.send(json.dumps(error_event(e.code, e.message, event_id=event.get("event_id"),
                                                          error_type="rate_limit_error")))
            await self.socket.close(CLOSE_TRY_AGAIN, e.code)
            return
        self.metrics.sessions.set(len(self.registry))
        if self.on_admit is not None:
            self.on_admit()
        await self._attach(session)
        await session.start()

    async def _resume(self, event: dict[str, Any]) -> None:
        only(event, ("session_id", "resume_token", "last_received_server_event_seq"))
        last = event.get("last_received_server_event_seq", 0)
        if isinstance(last, bool) or not isinstance(last, int) or last < 0:
            raise ProtocolError("invalid_value", "last_received_server_event_seq must be a non-negative integer",
                                "last_received_server_event_seq")
        try:
            session = self.registry.resume(str(event.get("session_id")), str(event.get("resume_token")))
        except SessionRefused as e:
            if e.code != "session_expired":
                raise ProtocolError(e.code, e.message, "resume_token") from None
            # Video sessions hold model state (latents, the last frame) that cannot be rebuilt.
            raise ProtocolError("session_state_lost", f"{e.message}: its stream state is gone (the grace period "
                                                      "passed or the server restarted); start a new session at "
                                                      "block_idx 0", "session_id") from None
        resumed = {"type": "session.resumed", "session_id": session.id,
                   "last_server_event_seq": session.outbox.journal.last_seq}
        if not await self._attach(session, last, lambda: session.outbox.send_unnumbered(resumed)):
            await session.emit({"type": "session.resync_required", "session_id": session.id,
                                "message": f"events after {last} are no longer kept"})

    async def _attach(self, session: VideoSession, last_seq: int | None = None, before_replay=None) -> bool:
        self.session = session
        session.socket_owner = self
        session.on_close = self._closed_by_server
        return await session.outbox.attach(self.socket.send, last_seq, before_replay)

    async def _closed_by_server(self, reason: str) -> None:
        try:
            await self.socket.close(1000, reason)
        except Exception as e:  # already gone
            log.debug("closing a video socket: %s", e)
