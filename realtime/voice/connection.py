"""One WebSocket of `WS /v1/realtime?model=<voice model>`, from the handshake to hang-up.

As OpenAI's server does, a connection opens a session at once (`session.created` is the first
event), unless admission refuses it: at capacity the client gets an `error` event
(`session_limit_reached`) and the socket closes (1013) at its next event, or after 5 s; live
sessions are never evicted.

Resume (an extension): a client that lost its socket reconnects with `session.resume
{session_id, resume_token, last_received_server_event_seq}` as its first event and gets
`session.resumed` (unnumbered), then exactly the numbered events it missed, once; or
`session.resync_required` when they have fallen out of the journal. Connecting with
`?session_id=<id>` in the URL says "I am resuming": no new session is opened, so the reply holds
nothing but the missed events. (Without it, the fresh session opened on connect is dropped
silently when the resume succeeds.) The client's normal close (1000) ends its session; any other
drop detaches it for `resume_grace_s`, after which the registry reaps it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from pipelines.image_request import RequestError
from realtime.sessions import (
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_TRY_AGAIN,
    Journal,
    Outbox,
    SessionRefused,
    SessionRegistry,
    SessionSocket,
    error_event,
)
from realtime.voice.items import new_id
from realtime.voice.metrics import VoiceMetrics
from realtime.voice.session import VoiceSession
from realtime.voice.vad import VadLoader

log = logging.getLogger(__name__)
REFUSED_WAIT_S = 5.0  # a connection refused at capacity may still send session.resume this long


def error_frame(code: str, message: str, *, param: str | None = None, error_type: str = "invalid_request_error",
                event_id: str | None = None) -> str:
    """An `error` event outside any session's numbered stream (before a session exists)."""
    return json.dumps({**error_event(code, message, param=param, event_id=event_id, error_type=error_type),
                       "event_id": new_id("event")})


class VoiceConnection:
    def __init__(self, socket: SessionSocket, engine, registry: SessionRegistry, vad: VadLoader, *, tenant: str,
                 model: str | None, resume_id: str | None = None, beta: bool = False, on_admit=None):
        self.socket, self.engine, self.registry, self.vad = socket, engine, registry, vad
        self.metrics = engine.metrics.part(VoiceMetrics)
        self.tenant, self.model, self.resume_id, self.beta = tenant, model, resume_id, beta
        self.on_admit = on_admit or (lambda: None)
        self.session: VoiceSession | None = None

    async def run(self) -> None:
        try:
            spec = self.engine.voice_model(self.model or "")
        except RequestError as exc:
            await self.socket.send(error_frame(exc.code, exc.message, param="model"))
            return await self.socket.close(CLOSE_POLICY, "unknown voice model")
        refused = None
        if self.resume_id is None:
            try:
                await self._open(spec)
            except SessionRefused as exc:
                refused = exc
                self.metrics.refused.labels(reason=exc.code).inc()
                await self.socket.send(error_frame(exc.code, exc.message, error_type="rate_limit_error"))
        first = True
        try:
            while (frame := await self._next(first and refused is not None)) is not None:
                if first and _is_resume(frame):
                    await self._resume(json.loads(frame))
                elif refused is not None or self.session is None:
                    reason = "session_limit_reached" if refused is not None else "send session.resume first"
                    if refused is None:
                        await self.socket.send(error_frame("no_session", "this connection asked to resume "
                                                           "(?session_id=): its first event must be session.resume"))
                    return await self.socket.close(CLOSE_TRY_AGAIN if refused else CLOSE_POLICY, reason)
                else:
                    self.registry.touch(self.session.id)
                    await self.session.receive(frame)
                first = False
        finally:
            await self._hang_up()

    async def _next(self, refused_first: bool) -> str | bytes | None:
        """The next client frame. A refused connection waits a little for a `session.resume` (taking over a session
        needs no free place), then it is closed."""
        if not refused_first:
            return await self.socket.receive()
        try:
            return await asyncio.wait_for(self.socket.receive(), REFUSED_WAIT_S)
        except TimeoutError:
            await self.socket.close(CLOSE_TRY_AGAIN, "session_limit_reached")
            return None

    async def _open(self, spec) -> None:
        session_id, token = self.registry.new_ids()
        limits = self.engine.config.realtime
        outbox = Outbox(Journal(limits.journal_max_events, limits.journal_max_bytes))
        session = VoiceSession(self.engine, spec, limits.voice, session_id=session_id, resume_token=token,
                               outbox=outbox, vad=self.vad, tenant=self.tenant, beta=self.beta)
        self.registry.admit(session)  # raises SessionRefused at capacity
        self.metrics.sessions.set(len(self.registry))
        self.on_admit()
        await self._attach(session)
        await session.start()

    async def _attach(self, session: VoiceSession, last_seq: int | None = None, before_replay=None) -> bool:
        previous = getattr(session, "transport", None)
        session.transport = self.socket  # the socket that owns it now (a stale one must not detach it)
        session.on_close[:] = [self._closed_by_server]
        self.session = session
        if previous is not None and previous is not self.socket:  # the client came back before we saw it go
            await previous.close(CLOSE_NORMAL, "resumed on another connection")
        return await session.outbox.attach(self.socket.send, last_seq, before_replay)

    async def _resume(self, event: dict[str, Any]) -> None:
        sid, token = event.get("session_id"), event.get("resume_token")
        last = event.get("last_received_server_event_seq", 0)
        if not isinstance(sid, str) or not isinstance(token, str) or isinstance(last, bool) \
                or not isinstance(last, int) or last < 0:
            await self.socket.send(error_frame("invalid_value", "session.resume needs session_id and resume_token "
                                               "(strings) and last_received_server_event_seq (an integer >= 0)",
                                               param="session_id", event_id=event.get("event_id")))
            return
        if self.resume_id is not None and sid != self.resume_id:
            await self.socket.send(error_frame("invalid_value", "session_id differs from the URL's ?session_id=",
                                               param="session_id", event_id=event.get("event_id")))
            return
        try:
            session = self.registry.resume(sid, token)
        except SessionRefused as exc:
            await self.socket.send(error_frame(exc.code, exc.message, param="session_id",
                                               event_id=event.get("event_id")))
            return
        fresh = self.session
        if fresh is not None and fresh is not session:  # the session opened on connect is not wanted: drop it quietly
            fresh.outbox.detach()
            fresh.on_close.clear()
            await self.registry.remove(fresh.id, "replaced_by_resume")
        resumed = {"type": "session.resumed", "event_id": new_id("event"), "session_id": session.id,
                   "last_server_event_seq": session.outbox.journal.last_seq, "replay_after": last}
        if not await self._attach(session, last, lambda: session.outbox.send_unnumbered(resumed)):
            await session.emit({"type": "session.resync_required", "session_id": session.id,
                                "reason": "the events after last_received_server_event_seq are no longer kept",
                                "last_server_event_seq": session.outbox.journal.last_seq})

    async def _hang_up(self) -> None:
        session = self.session
        if session is None or getattr(session, "transport", None) is not self.socket or session.closed:
            return
        if self.socket.close_code == CLOSE_NORMAL:
            await self.registry.remove(session.id, "client_closed")
        else:  # the connection dropped: keep the session for a resume
            self.registry.detach(session.id)
            session.transport = None
        self.metrics.sessions.set(len(self.registry))

    async def _closed_by_server(self, reason: str) -> None:
        if getattr(self.session, "transport", None) is self.socket:
            await self.socket.close(CLOSE_NORMAL, reason[:120])


def _is_resume(frame: str | bytes) -> bool:
    if not isinstance(frame, str) or '"session.resume"' not in frame:
        return False
    try:
        event = json.loads(frame)
    except ValueError:
        return False
    return isinstance(event, dict) and event.get("type") == "session.resume"
