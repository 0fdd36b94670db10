"""A realtime video session (`WS /v1/realtime/video`): settings, credits, outbox, and the stream of its mode.

The session is created by the first `session.update` (realtime/video/connection.py) and answers
`session.created {session, resume_token, capabilities}`. After that it takes client events (settings
updates, controls, credits, heartbeats, acks) and binary media frames, and its stream (img2img:
realtime/video/img2img.py; t2v: realtime/video/t2v.py) produces numbered server events and binary
frames through the outbox (realtime/sessions.py), which journals them for resume.

Overload (frames or chunks late) degrades the session one notch at a time in the order of
realtime/video/degrade.py (lookahead, steps, resolution), each change announced by
`session.updated {reason: "overload", degraded}`; a long run of on-time outputs brings the notches back
in the reverse order (`session.updated {reason: "recovered", restored}`). Bad input is an `error` event; the
session goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from pipelines.config import RealtimeConfig
from realtime.sessions import Journal, Outbox, SessionRegistry
from realtime.video.credits import CreditGate
from realtime.video.degrade import Degradation, OverloadLadder, next_degradation
from realtime.video.img2img import Img2ImgStream
from realtime.video.metrics import VideoMetrics
from realtime.video.models import min_steps, resolve, size_of
from realtime.video.output import OutputEncoder
from realtime.video.protocol import (
    INPUT_CONTENT_TYPES,
    MAX_CREDIT_GRANT,
    MAX_CREDITS_HELD,
    MAX_LOOKAHEAD,
    MODES,
    OUTPUT_FORMATS,
    ProtocolError,
    VideoSettings,
    error_event,
    only,
    parse_control,
    parse_credit,
    parse_media,
)
from realtime.video.t2v import ChunkStream

log = logging.getLogger(__name__)
LADDER_WINDOW = {"img2img": 8, "t2v": 2}  # frames / chunks whose lateness decides a degradation
MIN_SIDE = 32  # resolution never degrades below this many pixels a side


class VideoSession:
    def __init__(self, engine, requested: VideoSettings, settings: VideoSettings, *, tenant: str, journal: Journal):
        self.id, self.resume_token = SessionRegistry.new_ids()
        self.outbox = Outbox(journal)
        self.engine = engine
        self.metrics = engine.metrics.part(VideoMetrics)
        self.tenant = tenant  # enters every cache identity of its requests
        self.requested = requested  # what the client chose (and overload changed): re-resolved on update
        self.settings = settings  # the effective settings, every default filled
        self.info = engine.models[settings.model]
        self.credits = CreditGate(settings.credits, on_change=self._wake)
        self.output = OutputEncoder(engine, settings.output_format, settings.output_quality)
        self.ladder = OverloadLadder(LADDER_WINDOW[settings.mode])
        self.degraded: list[Degradation] = []  # notches overload took, newest last; a client update forgets them
        self.stream = Img2ImgStream(self) if settings.mode == "img2img" else ChunkStream(self)
        self.closed: str | None = None  # the reason, once closed
        self.socket_owner: object | None = None  # the connection whose socket the outbox sends to
        self.on_close: Callable[[str], Awaitable[None]] | None = None  # closes that socket

    @classmethod
    def open(cls, engine, update: Any, *, tenant: str, config: RealtimeConfig) -> VideoSession:
        """A session from the client's first `session.update`. Raises ProtocolError naming the field."""
        requested = VideoSettings().apply(update, created=False)
        settings = resolve(engine, requested)
        if settings.mode == "t2v" and (settings.block_idx or 0) > 0:
            raise ProtocolError("session_state_lost", f"no stream state for block {settings.block_idx - 1}: a new "
                                                      "session (or a restarted server) holds none; start again at "
                                                      "block_idx 0", "session.block_idx")
        journal = Journal(config.journal_max_events, config.journal_max_bytes)
        return cls(engine, _without_block(requested), _without_block(settings), tenant=tenant, journal=journal)

    # -- events to the client -------------------------------------------------------------------
    def created_event(self) -> dict[str, Any]:
        return {"type": "session.created", "session": {"id": self.id, **self.settings.public()},
                "resume_token": self.resume_token, "capabilities": self.capabilities()}

    def capabilities(self) -> dict[str, Any]:
        info, media = self.info, self.engine.config.media.image
        caps = {"modes": list(MODES), "output_formats": list(OUTPUT_FORMATS),
                "input_content_types": sorted(INPUT_CONTENT_TYPES), "max_input_bytes": media.max_bytes,
                "size_factor": info.size_factor, "max_lookahead": MAX_LOOKAHEAD, "max_credit": MAX_CREDIT_GRANT,
                "max_credits_held": MAX_CREDITS_HELD, "supports_resume": True, "supports_credits": True,
                "similarity_filter": self.settings.mode == "img2img"}
        if self.settings.mode == "t2v":
            video = info.video_defaults or {}
            caps.update(block_frames=self.settings.chunk_frames, frame_factor=video.get("frame_factor", 1),
                        fps=self.settings.fps, continuation=self.settings.continuation)
        return caps

    async def emit(self, event: dict[str, Any]) -> int:
        return await self.outbox.emit(event)

    async def emit_media(self, header: dict[str, Any], payload: bytes) -> int:
        return await self.outbox.emit_binary(header, payload)

    async def error(self, code: str, message: str, *, param: str | None = None, event_id: Any = None,
                    kind: str = "invalid_request_error") -> None:
        await self.emit(error_event(code, message, param=param, event_id=event_id, error_type=kind))

    def count(self, *, frame_outcome: str, frames: int = 1, latency_s: float | None = None) -> None:
        metrics, labels = self.metrics, dict(model=self.settings.model, mode=self.settings.mode)
        metrics.frames.labels(outcome=frame_outcome, **labels).inc(frames)
        if latency_s is not None:
            metrics.latency.labels(**labels).observe(latency_s)

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self.engine.media().start()  # the codec workers spawn now, not when the first frame is due
        await self.emit(self.created_event())
        self.stream.start()

    async def close(self, reason: str) -> None:
        if self.closed is not None:
            return
        self.closed = reason
        await self.stream.stop()
        await self.emit({"type": "session.closed", "reason": reason})
        if self.on_close is not None:
            await self.on_close(reason)

    def _wake(self) -> None:
        self.stream.wake()

    # -- events from the client -------------------------------------------------------------------
    async def handle_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "session.update":
            return await self.update(event)
        if kind == "control":
            control, settings = parse_control(event, self.requested)
            await self._apply(settings)
            if control.kind == "params":  # the client chose these knobs: what overload took is not given back
                self.degraded.clear()
            applies = {"block_idx": self.stream.control(control)} if isinstance(self.stream, ChunkStream) else {}
            return await self.emit({"type": "control.accepted", "event_id": control.event_id, "kind": control.kind,
                                    **applies})
        if kind == "credit":
            return self.credits.grant(parse_credit(event, self.credits.available))
        if kind == "session.heartbeat":
            only(event, ())
            return await self.emit({"type": "session.heartbeat_ack", "event_id": event.get("event_id")})
        if kind == "session.event_ack":
            only(event, ("server_event_seq",))
            seq = event.get("server_event_seq")
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
                raise ProtocolError("invalid_value", "server_event_seq must be a non-negative integer",
                                    "server_event_seq")
            return self.outbox.journal.ack(seq)
        raise ProtocolError("invalid_event", f"{kind} is not accepted inside a session", "type")

    async def handle_media(self, frame: bytes) -> None:
        if self.settings.mode != "img2img":
            raise ProtocolError("unexpected_media", "t2v sessions take no media frames; send control events", "frame")
        header, payload = parse_media(frame, self.engine.config.media.image.max_bytes)
        await self.stream.offer(header, payload)

    async def update(self, event: dict[str, Any]) -> None:
        only(event, ("session",))
        update = event.get("session")
        requested = self.requested.apply(update, created=True)
        block_idx = requested.block_idx
        if block_idx is not None and self.settings.mode != "t2v":
            raise ProtocolError("invalid_value", "block_idx belongs to t2v sessions", "session.block_idx")
        if block_idx:
            self.stream.check_continue(block_idx)  # continuing: nothing to reset
        await self._apply(_without_block(requested))
        self.degraded.clear()  # the client chose these settings: overload does not give back what it took before
        if block_idx == 0:
            await self.stream.restart()
        await self.emit({"type": "session.updated", "session": {"id": self.id, **self.settings.public()},
                         "reason": "client", "event_id": event.get("event_id")})

    async def _apply(self, requested: VideoSettings) -> None:
        """Make `requested` the session's settings (resolved and checked first: on error nothing changes)."""
        settings = resolve(self.engine, requested)
        if (settings.output_format, settings.output_quality) != (self.settings.output_format,
                                                                   self.settings.output_quality):
            self.output = OutputEncoder(self.engine, settings.output_format, settings.output_quality)
        self.requested, self.settings = requested, settings
        self.stream.wake()

    async def overloaded(self, late: bool) -> None:
        """One frame's (or chunk's) lateness; past the ladder's threshold, degrade one notch and say so; after a
        long run on time, restore the newest notch taken."""
        if self.ladder.observe(late):
            return await self._degrade()
        if self.degraded and self.ladder.calm():
            await self._restore(self.degraded.pop())

    async def _restore(self, step: Degradation) -> None:
        field = {"lookahead": "lookahead", "steps": "steps", "resolution": "size"}[step.knob]
        try:
            await self._apply(self.requested.apply({field: step.before}, created=True))
        except ProtocolError as e:
            log.info("video session %s: cannot restore %s to %s: %s", self.id, step.knob, step.before, e.message)
            return
        self.metrics.restored.labels(knob=step.knob).inc()
        await self.emit({"type": "session.updated", "session": {"id": self.id, **self.settings.public()},
                         "reason": "recovered", "restored": {"knob": step.knob, "from": step.after, "to": step.before}})

    async def _degrade(self) -> None:
        s = self.settings
        width, height = size_of(s)
        step = next_degradation(lookahead=s.lookahead, steps=s.steps, min_steps=min_steps(s), width=width,
                                height=height, size_factor=self.info.size_factor, min_side=MIN_SIDE)
        if step is None:
            return
        field = {"lookahead": "lookahead", "steps": "steps", "resolution": "size"}[step.knob]
        try:
            await self._apply(self.requested.apply({field: step.after}, created=True))
        except ProtocolError as e:  # the model refuses the smaller setting: stay where we are
            log.info("video session %s: cannot degrade %s to %s: %s", self.id, step.knob, step.after, e.message)
            return
        self.degraded.append(step)
        self.metrics.degraded.labels(knob=step.knob).inc()
        await self.emit({"type": "session.updated", "session": {"id": self.id, **self.settings.public()},
                         "reason": "overload", "degraded": step.event()})


def _without_block(settings: VideoSettings) -> VideoSettings:
    """block_idx is a one-off command, not a setting that stays."""
    return replace(settings, block_idx=None)
