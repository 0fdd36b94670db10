"""The wire of `WS /v1/realtime/video`: client events, session settings, media frame headers, errors.

Text frames carry one JSON event each, told apart by `type`. Binary frames (both directions) are a
4-byte big-endian header length, a UTF-8 JSON header, then the payload (realtime.sessions.pack_frame):

    header {seq, block_idx, frame_idx, pts_ms, capture_ts_ms, content_type}

Client events: `session.update {session: {...}}`, `session.resume {session_id, resume_token,
last_received_server_event_seq}`, `control {kind: "prompt" | "params", payload, event_id}`,
`credit {n}`, `session.heartbeat`, `session.event_ack {server_event_seq}`. Everything here checks
shapes and ranges only; what depends on the model (sizes, tasks) is checked by realtime/video/session.py.
Nothing here touches the engine or a tensor.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from realtime.sessions import ProtocolError, error_event, unpack_frame  # noqa: F401  (importers take them here)

MODES = ("img2img", "t2v")
OUTPUT_FORMATS = ("jpeg", "webp", "fmp4")
OUTPUT_CONTENT_TYPES = {"jpeg": "image/jpeg", "webp": "image/webp", "fmp4": 'video/mp4; codecs="avc1"'}
INPUT_CONTENT_TYPES = {"image/jpeg": "jpeg", "image/webp": "webp", "image/png": "png"}
CONTINUATIONS = ("auto", "i2v", "none")  # t2v: how chunk k > 0 follows chunk k - 1
MAX_CREDIT_GRANT = 10_000  # one `credit` event; more is a client bug, not a need
MAX_CREDITS_HELD = 100_000  # credits granted and not yet spent
MAX_LOOKAHEAD = 16
_SIZE = re.compile(r"^\s*(\d{1,5})\s*x\s*(\d{1,5})\s*$")
_CLIENT_EVENTS = ("session.update", "session.resume", "control", "credit", "session.heartbeat", "session.event_ack")
# Fields a running session may not change: a different model or mode is a different session.
FIXED_AFTER_CREATE = ("mode", "model")


@dataclass(frozen=True)
class VideoSettings:
    """One session's effective settings: the defaults, then each `session.update` (and overload) on top."""

    mode: str = "img2img"  # img2img: camera frames in, stylised frames out; t2v: chunk-by-chunk generation
    model: str | None = None  # None: the first served model that does the mode
    size: str | None = None  # "WxH"; None: the model's default
    fps: float | None = None  # img2img: the camera's rate; t2v: the output rate (None: the model's)
    steps: int = 4  # num_inference_steps of the pipeline (img2img runs int(steps * strength) of them)
    strength: float = 0.5  # img2img: how far from the input frame
    guidance_scale: float = 0.0  # <= 1: no classifier-free guidance (turbo / LCM style), one denoiser row a frame
    prompt: str | None = None  # required before the first frame or chunk
    negative_prompt: str | None = None
    seed: int = 0  # img2img: every frame starts from this seed's noise (StreamDiffusion's fixed noise)
    output_format: str = "jpeg"  # jpeg | webp (a frame a message) | fmp4 (fragmented-MP4 segments)
    output_quality: int = 85  # jpeg / webp quality, 1..100
    frame_deadline_ms: float = 1000.0  # img2img: capture to send; older frames are dropped, never sent
    lookahead: int | None = None  # frames (img2img) or chunks (t2v) in flight; None: img2img the denoise steps
    #                               a frame runs (the stream batch), t2v 2. 1 turns the stream batch off.
    similarity_threshold: float | None = None  # img2img: skip an input this close (cosine) to the last one
    max_similar_skip: int = 10  # ... but never more than this many in a row
    chunk_frames: int | None = None  # t2v: frames a chunk generates (frame_factor * k + 1); None: 2 * factor + 1
    continuation: str = "auto"  # t2v: i2v (chunk k starts from chunk k-1's last frame), none (seed + k), auto
    max_chunks: int | None = None  # t2v: stop after this many chunks (None: until the session ends)
    credits: int = 30  # the first grant of output credits (one credit = one binary message)
    block_idx: int | None = None  # t2v: 0 starts a new epoch; k > 0 continues at block k (state must exist)

    def apply(self, update: dict[str, Any], *, created: bool) -> "VideoSettings":
        """These settings with `update` on top, checked. Raises ProtocolError naming the field."""
        if not isinstance(update, dict):
            raise ProtocolError("invalid_value", "session must be a JSON object of settings", "session")
        known = {f.name for f in fields(self)}
        unknown = sorted(set(update) - known)
        if unknown:
            raise ProtocolError("unknown_field", f"unknown session field(s) {unknown}; known: {sorted(known)}",
                                f"session.{unknown[0]}")
        if created:
            for key in FIXED_AFTER_CREATE:
                if key in update and update[key] != getattr(self, key):
                    raise ProtocolError("immutable_field", f"{key} is fixed once the session exists; open a new "
                                                           "session for another", f"session.{key}")
        out = replace(self, **update)
        out.check()
        return out

    def check(self) -> None:
        _choice("mode", self.mode, MODES)
        _optional_str("model", self.model, 200)
        if self.size is not None:
            parse_size(self.size)
        if self.fps is not None:
            _number("fps", self.fps, 0, 120, low_open=True)
        _integer("steps", self.steps, 1, 100)
        _number("strength", self.strength, 0, 1, low_open=True)
        _number("guidance_scale", self.guidance_scale, 0, 50)
        _optional_str("prompt", self.prompt, 4000)
        _optional_str("negative_prompt", self.negative_prompt, 4000)
        _integer("seed", self.seed, 0, 2**63 - 1)
        _choice("output_format", self.output_format, OUTPUT_FORMATS)
        _integer("output_quality", self.output_quality, 1, 100)
        _number("frame_deadline_ms", self.frame_deadline_ms, 1, 600_000)
        if self.lookahead is not None:
            _integer("lookahead", self.lookahead, 1, MAX_LOOKAHEAD)
        if self.similarity_threshold is not None:
            _number("similarity_threshold", self.similarity_threshold, 0, 1, low_open=True)
        _integer("max_similar_skip", self.max_similar_skip, 0, 1000)
        if self.chunk_frames is not None:
            _integer("chunk_frames", self.chunk_frames, 1, 1000)
        _choice("continuation", self.continuation, CONTINUATIONS)
        if self.max_chunks is not None:
            _integer("max_chunks", self.max_chunks, 1, 1_000_000)
        _integer("credits", self.credits, 0, MAX_CREDIT_GRANT)
        if self.block_idx is not None:
            _integer("block_idx", self.block_idx, 0, 2**31)

    def public(self) -> dict[str, Any]:
        """The settings as `session.created` / `session.updated` report them (block_idx is a command, not state)."""
        out = asdict(self)
        out.pop("block_idx")
        return out


@dataclass(frozen=True)
class MediaHeader:
    """The JSON header of a binary media frame."""

    seq: int  # the client's frame number (outputs echo it; frame.dropped names it)
    content_type: str  # image/jpeg | image/webp | image/png
    block_idx: int = 0
    frame_idx: int = 0
    pts_ms: float | None = None  # presentation time in the client's stream
    capture_ts_ms: float | None = None  # Unix time (ms) the camera took it; the deadline counts from here


def parse_media(frame: bytes, max_bytes: int) -> tuple[MediaHeader, bytes]:
    """A client binary frame -> (header, payload). Cheap checks only: the payload is decoded later."""
    try:
        raw, payload = unpack_frame(frame)
    except ValueError as e:
        raise ProtocolError("invalid_frame", str(e), "frame") from None
    unknown = sorted(set(raw) - {f.name for f in fields(MediaHeader)})
    if unknown:
        raise ProtocolError("unknown_field", f"unknown frame header field(s) {unknown}", f"frame.{unknown[0]}")
    if "seq" not in raw or "content_type" not in raw:
        raise ProtocolError("invalid_frame", "a media frame header needs seq and content_type", "frame.seq")
    _integer("frame.seq", raw["seq"], 0, 2**63 - 1)
    for key in ("block_idx", "frame_idx"):
        if key in raw:
            _integer(f"frame.{key}", raw[key], 0, 2**63 - 1)
    for key in ("pts_ms", "capture_ts_ms"):
        if raw.get(key) is not None:
            _number(f"frame.{key}", raw[key], -1e15, 1e15)
    header = MediaHeader(**raw)
    if header.content_type not in INPUT_CONTENT_TYPES:
        raise ProtocolError("unsupported_content_type", f"content_type {header.content_type!r} is not accepted; "
                                                        f"send one of {sorted(INPUT_CONTENT_TYPES)}",
                            "frame.content_type")
    if not payload:
        raise ProtocolError("invalid_frame", f"frame {header.seq} has no payload", "frame")
    if len(payload) > max_bytes:
        raise ProtocolError("media_bytes", f"frame {header.seq} is {len(payload)} bytes; the limit is {max_bytes}",
                            "frame")
    return header, payload


def parse_event(text: str) -> dict[str, Any]:
    """One text frame -> a client event with a known `type`."""
    try:
        event = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProtocolError("invalid_json", f"a text frame must be one JSON object: {e}") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise ProtocolError("invalid_event", "an event is a JSON object with a string `type`", "type")
    if event["type"] not in _CLIENT_EVENTS:
        raise ProtocolError("unknown_event", f"unknown event type {event['type']!r}; known: {list(_CLIENT_EVENTS)}",
                            "type")
    return event


def only(event: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """Reject fields an event does not define (besides type and event_id)."""
    unknown = sorted(set(event) - {"type", "event_id", *allowed})
    if unknown:
        raise ProtocolError("unknown_field", f"{event['type']} has unknown field(s) {unknown}; it takes "
                                             f"{sorted(allowed) or 'none'}", unknown[0])


def parse_credit(event: dict[str, Any], held: int) -> int:
    only(event, ("n",))
    n = event.get("n")
    _integer("n", n, 1, MAX_CREDIT_GRANT)
    if held + n > MAX_CREDITS_HELD:
        raise ProtocolError("invalid_value", f"credit would hold {held + n} unspent credits; the limit is "
                                             f"{MAX_CREDITS_HELD}", "n")
    return n


@dataclass(frozen=True)
class Control:
    """A mid-stream change; it applies from the next frame (img2img) or the next unstarted chunk (t2v)."""

    kind: str  # "prompt" | "params"
    changes: dict[str, Any]  # settings fields
    event_id: Any = None  # echoed by the chunk that applies it


CONTROL_FIELDS = {"prompt": ("prompt", "negative_prompt"),
                  "params": ("steps", "strength", "guidance_scale", "seed", "output_quality", "frame_deadline_ms")}


def parse_control(event: dict[str, Any], settings: VideoSettings) -> tuple[Control, VideoSettings]:
    only(event, ("kind", "payload"))
    kind = event.get("kind")
    if kind not in CONTROL_FIELDS:
        raise ProtocolError("invalid_value", f"control kind must be one of {sorted(CONTROL_FIELDS)}; got {kind!r}",
                            "kind")
    payload = event.get("payload")
    if not isinstance(payload, dict) or not payload:
        raise ProtocolError("invalid_value", "control payload must be a non-empty JSON object", "payload")
    unknown = sorted(set(payload) - set(CONTROL_FIELDS[kind]))
    if unknown:
        raise ProtocolError("unknown_field", f"control {kind} has unknown field(s) {unknown}; it takes "
                                             f"{list(CONTROL_FIELDS[kind])}", f"payload.{unknown[0]}")
    return Control(kind, dict(payload), event.get("event_id")), settings.apply(payload, created=True)


def parse_size(size: str) -> tuple[int, int]:
    m = _SIZE.match(size) if isinstance(size, str) else None
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ProtocolError("invalid_size", f"size must be 'WIDTHxHEIGHT' (for example '512x512'); got {size!r}",
                            "session.size")
    return int(m.group(1)), int(m.group(2))


# -- field checks ----------------------------------------------------------------------------------


def _param(name: str) -> str:
    return name if "." in name or name == "n" else f"session.{name}"


def _integer(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError("invalid_value", f"{name} must be an integer in [{low}, {high}]; got {value!r}",
                            _param(name))


def _number(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or not (low < value if low_open else low <= value) or value > high:
        bracket = "(" if low_open else "["
        raise ProtocolError("invalid_value", f"{name} must be a number in {bracket}{low}, {high}]; got {value!r}",
                            _param(name))


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ProtocolError("invalid_value", f"{name} must be one of {list(choices)}; got {value!r}", _param(name))


def _optional_str(name: str, value: Any, max_chars: int) -> None:
    if value is not None and (not isinstance(value, str) or len(value) > max_chars):
        raise ProtocolError("invalid_value", f"{name} must be a string of at most {max_chars} characters",
                            _param(name))
