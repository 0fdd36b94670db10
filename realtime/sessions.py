"""What voice and video sessions share: numbered server events with a replay journal, and the registry
that admits sessions, keeps dropped ones for a grace period and hands them back on `session.resume`.

Every server event gets `server_event_seq` (1, 2, ... per session) and is journalled before it is
sent. A client that lost its socket reconnects with `session.resume {session_id, resume_token,
last_received_server_event_seq}` and receives exactly the events after that number, once; if they
have fallen out of the journal the session answers `session.resync_required`. A session whose
socket dropped stays live (its model state pinned) for `resume_grace_s`, then it is closed.

Admission refuses a new session at capacity; it never evicts a live or detached one (evicting
live state silently breaks a stream: notes/realtime.md §1.8).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from pipelines.config import RealtimeConfig

log = logging.getLogger(__name__)
CLOSE_NORMAL = 1000  # the client closing with this ends its session; any other drop keeps it for a resume
CLOSE_POLICY = 1008  # refused: unknown model, bad key
CLOSE_TRY_AGAIN = 1013  # refused at capacity / not ready
REAP_INTERVAL_S = 1.0

Payload = str | bytes  # a text frame (one JSON event) or a binary frame
Sender = Callable[[Payload], Awaitable[None]]


class ProtocolError(Exception):
    """A client event a session cannot apply: it becomes an `error` event naming `code` and `param`, and the
    session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None, error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.error_type = error_type


def error_event(code: str, message: str, *, param: str | None = None, event_id: Any = None,
                error_type: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's `error` event; `event_id` names the client event that caused it."""
    return {"type": "error", "error": {"type": error_type, "code": code, "message": message, "param": param,
                                       "event_id": event_id}}


class Journal:
    """Sent frames by sequence number, oldest dropped first past `max_events` or `max_bytes`."""

    def __init__(self, max_events: int, max_bytes: int):
        self.max_events = max_events
        self.max_bytes = max_bytes
        self._frames: deque[tuple[int, Payload]] = deque()
        self._bytes = 0
        self.last_seq = 0  # the newest number given out

    def next_seq(self) -> int:
        self.last_seq += 1
        return self.last_seq

    def add(self, seq: int, frame: Payload) -> None:
        self._frames.append((seq, frame))
        self._bytes += len(frame)
        while self._frames and (len(self._frames) > self.max_events or self._bytes > self.max_bytes):
            self._bytes -= len(self._frames.popleft()[1])

    def ack(self, seq: int) -> None:
        """The client has everything up to `seq`: those frames need no replay."""
        while self._frames and self._frames[0][0] <= seq:
            self._bytes -= len(self._frames.popleft()[1])

    def after(self, seq: int) -> list[Payload] | None:
        """The frames after `seq`, in order; None when some of them are no longer kept."""
        if seq >= self.last_seq:
            return []
        oldest = self._frames[0][0] if self._frames else self.last_seq + 1
        if seq + 1 < oldest:
            return None
        return [frame for s, frame in self._frames if s > seq]


class Outbox:
    """A session's one writer: numbers, journals and sends its frames in order, behind one lock.

    The socket may come and go (`attach` / `detach`); frames emitted while detached are journalled
    and replayed on the next `attach`.
    """

    def __init__(self, journal: Journal):
        self.journal = journal
        self._sender: Sender | None = None
        self._lock = asyncio.Lock()
        self.sent_frames = 0

    @property
    def attached(self) -> bool:
        return self._sender is not None

    async def emit(self, event: dict[str, Any], guard: Callable[[], bool] | None = None) -> int | None:
        """Send one JSON event (a text frame); it gets `server_event_seq`. Returns the number.

        `guard` is the generation fence: it runs under the lock just before the event is numbered, and
        False drops the event (None is returned). Because every frame goes through this lock in order, a
        guard that checks a session epoch sees every bump made before the frame's turn came; it may also
        record bookkeeping (and edit `event`) for a frame it lets through."""
        async with self._lock:
            if guard is not None and not guard():
                return None
            seq = self.journal.next_seq()
            event["server_event_seq"] = seq
            frame = json.dumps(event, separators=(",", ":"))
            self.journal.add(seq, frame)
            await self._send(frame)
            return seq

    async def emit_binary(self, header: dict[str, Any], payload: bytes) -> int:
        """Send one binary frame: 4-byte big-endian header length, the UTF-8 JSON header (which gets
        `server_event_seq`), then the payload."""
        async with self._lock:
            seq = self.journal.next_seq()
            header["server_event_seq"] = seq
            frame = pack_frame(header, payload)
            self.journal.add(seq, frame)
            await self._send(frame)
            return seq

    async def attach(self, sender: Sender, last_seq: int | None = None,
                     before_replay: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Take a (new) socket. With `last_seq`, first replay what came after it; False when that is no
        longer possible (the caller then tells the client to resync). `before_replay` runs under the
        lock first, so e.g. `session.resumed` precedes the replayed frames."""
        async with self._lock:
            self._sender = sender
            if before_replay is not None:
                await before_replay()
            if last_seq is None:
                return True
            frames = self.journal.after(last_seq)
            if frames is None:
                return False
            for frame in frames:
                await self._send(frame)
            return True

    def detach(self) -> None:
        self._sender = None

    async def send_unnumbered(self, event: dict[str, Any]) -> None:
        """A frame outside the numbered stream (e.g. `session.resumed`); call it from `before_replay` only."""
        await self._send(json.dumps(event, separators=(",", ":")))

    async def _send(self, frame: Payload) -> None:
        if self._sender is None:
            return
        try:
            await self._sender(frame)
            self.sent_frames += 1
        except Exception as exc:  # the socket is gone: keep journalling, the client may resume
            log.debug("send failed, detaching: %s", exc)
            self._sender = None


def pack_frame(header: dict[str, Any], payload: bytes) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return len(head).to_bytes(4, "big") + head + payload


def unpack_frame(frame: bytes, max_header_bytes: int = 64 << 10) -> tuple[dict[str, Any], bytes]:
    """The inverse of pack_frame. Raises ValueError naming what is wrong."""
    if len(frame) < 4:
        raise ValueError("a binary frame starts with a 4-byte big-endian header length")
    size = int.from_bytes(frame[:4], "big")
    if size > max_header_bytes or 4 + size > len(frame):
        raise ValueError(f"header length {size} is larger than the frame or the limit ({max_header_bytes} bytes)")
    try:
        header = json.loads(frame[4:4 + size].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the frame header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("the frame header must be a JSON object")
    return header, frame[4 + size:]


class SessionSocket(Protocol):
    """What the serving layer hands a connection: a WebSocket reduced to three calls."""

    close_code: int | None  # the client's close code, once receive() said it has gone

    async def receive(self) -> str | bytes | None:
        """The next text or binary frame; None once the client has gone."""

    async def send(self, frame: str | bytes) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


class Session(Protocol):
    id: str
    resume_token: str
    outbox: Outbox

    async def close(self, reason: str) -> None: ...


class SessionRefused(Exception):
    """Admission said no; `code` is the error code for the client."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class SessionRegistry:
    """Live sessions of one kind (voice or video): admission, detach with a grace period, resume, reaping."""

    def __init__(self, kind: str, max_sessions: int, *, resume_grace_s: float, idle_timeout_s: float,
                 max_duration_s: float, clock: Callable[[], float] = time.monotonic):
        self.kind = kind
        self.max_sessions = max_sessions
        self.resume_grace_s = resume_grace_s
        self.idle_timeout_s = idle_timeout_s
        self.max_duration_s = max_duration_s
        self.clock = clock
        self._sessions: dict[str, Session] = {}
        self._started: dict[str, float] = {}
        self._touched: dict[str, float] = {}
        self._detached: dict[str, float] = {}  # session id -> when its socket dropped

    def __len__(self) -> int:
        return len(self._sessions)

    @staticmethod
    def new_ids() -> tuple[str, str]:
        """A fresh (session id, resume token)."""
        return f"sess_{secrets.token_hex(12)}", secrets.token_urlsafe(24)

    def admit(self, session: Session) -> None:
        """Count the session in, or raise SessionRefused at capacity (detached sessions count: their state is held)."""
        if len(self._sessions) >= self.max_sessions:
            raise SessionRefused("session_limit_reached",
                                 f"the server holds its maximum of {self.max_sessions} live {self.kind} sessions; "
                                 "retry later")
        now = self.clock()
        self._sessions[session.id] = session
        self._started[session.id] = now
        self._touched[session.id] = now

    def touch(self, session_id: str) -> None:
        """The client did something: the idle clock restarts."""
        if session_id in self._touched:
            self._touched[session_id] = self.clock()

    def detach(self, session_id: str) -> None:
        """The socket dropped: keep the session for `resume_grace_s`."""
        if session_id in self._sessions:
            self._sessions[session_id].outbox.detach()
            self._detached[session_id] = self.clock()

    def resume(self, session_id: str, token: str) -> Session:
        """The detached (or still attached: a client that reconnects first) session, if the token matches."""
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionRefused("session_expired", f"session {session_id!r} does not exist or has expired")
        if not secrets.compare_digest(session.resume_token, str(token)):
            raise SessionRefused("invalid_resume_token", "resume_token does not match the session")
        self._detached.pop(session_id, None)
        self.touch(session_id)
        return session

    async def remove(self, session_id: str, reason: str) -> None:
        session = self._sessions.pop(session_id, None)
        for table in (self._started, self._touched, self._detached):
            table.pop(session_id, None)
        if session is not None:
            await session.close(reason)

    def expired(self) -> list[tuple[str, str]]:
        """(session id, reason) for every session past its grace period, idle timeout or maximum duration."""
        now, out = self.clock(), []
        for sid in list(self._sessions):
            if sid in self._detached and now - self._detached[sid] > self.resume_grace_s:
                out.append((sid, "resume_grace_expired"))
            elif now - self._touched[sid] > self.idle_timeout_s:
                out.append((sid, "idle_timeout"))
            elif now - self._started[sid] > self.max_duration_s:
                out.append((sid, "max_duration"))
        return out

    async def reap(self) -> list[str]:
        """Close what `expired()` names; returns their ids."""
        gone = self.expired()
        for sid, reason in gone:
            log.info("%s session %s closed: %s", self.kind, sid, reason)
            await self.remove(sid, reason)
        return [sid for sid, _ in gone]

    async def announce_closing(self, reason: str, *, closes_in_s: float) -> None:
        """Tell every session the server will close it (a drain, serve/drain.py): a numbered `session.closing`
        event with what a client needs to resume it (its id and resume token) and how long it has."""
        for session in list(self._sessions.values()):
            await session.outbox.emit({"type": "session.closing", "event_id": f"event_{secrets.token_hex(8)}",
                                       "reason": reason, "session_id": session.id,
                                       "resume_token": session.resume_token, "closes_in_s": closes_in_s})

    async def close_all(self, reason: str = "server_shutdown") -> None:
        for sid in list(self._sessions):
            await self.remove(sid, reason)


def registry_for(kind: str, config: RealtimeConfig) -> SessionRegistry:
    """The `kind` ("voice" or "video") sessions of one server, limited by `[realtime]`."""
    return SessionRegistry(kind, getattr(config, f"max_{kind}_sessions"), resume_grace_s=config.resume_grace_s,
                           idle_timeout_s=config.idle_timeout_s, max_duration_s=config.max_duration_s)


async def reap_until_empty(registry: SessionRegistry, gauge, interval_s: float = REAP_INTERVAL_S) -> None:
    """Close sessions past their grace period, idle timeout or maximum duration, keeping `gauge` (a Prometheus
    gauge of live sessions) in step; ends when none is left."""
    while len(registry):
        await asyncio.sleep(interval_s)
        await registry.reap()
        gauge.set(len(registry))
