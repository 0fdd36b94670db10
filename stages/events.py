"""Events that a request streams back to its caller, in order."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class EventKind(str, enum.Enum):
    QUEUED = "queued"
    STAGE_STARTED = "stage_started"
    PROGRESS = "progress"
    DELTA = "delta"
    OUTPUTS = "outputs"  # a node's outputs, for nodes that publish them (the voice turn's asr transcript)
    FINAL = "final"
    ERROR = "error"


TERMINAL = (EventKind.FINAL, EventKind.ERROR)


@dataclass(frozen=True)
class Event:
    kind: EventKind
    request_id: str
    seq: int  # position in the request's stream, from 0
    stage: str | None = None  # node name that produced it, if any
    data: dict[str, Any] = field(default_factory=dict)  # progress: step/total; final: outputs; error: code/message

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL


class ErrorKind(str, enum.Enum):
    """What kind of failure an error is, in terms a caller can act on. serve/ maps kinds to HTTP statuses."""

    INVALID = "invalid"  # the request's own fields are wrong
    NOT_FOUND = "not_found"  # it names a model, voice or file that does not exist here
    TOO_LARGE = "too_large"  # its media pass a byte, pixel, frame or duration limit
    BUSY = "busy"  # admission refused for now (a full queue): retry after the hint
    UNAVAILABLE = "unavailable"  # the server cannot take it now (shutting down, loading, a replica lost): retry
    CANCELLED = "cancelled"  # the caller or its session cancelled it
    DEADLINE = "deadline"  # it ran past its deadline
    INTERNAL = "internal"  # a fault of the server's own

    @property
    def caller_fault(self) -> bool:
        """The request itself is wrong: sending it again unchanged fails again."""
        return self in (ErrorKind.INVALID, ErrorKind.NOT_FOUND, ErrorKind.TOO_LARGE)

    @property
    def retryable(self) -> bool:
        return self in (ErrorKind.BUSY, ErrorKind.UNAVAILABLE)


class StageError(Exception):
    """A failure with an error code a client can act on, and its kind (which serve/ maps to HTTP)."""

    def __init__(self, code: str, message: str, *, param: str | None = None, kind: ErrorKind = ErrorKind.INTERNAL):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.kind = kind

    @classmethod
    def from_event(cls, event: Event) -> StageError:
        """The error an ERROR event carries (its code, message, param and kind)."""
        d = event.data
        return cls(d.get("code", "internal_error"), d.get("message", ""), param=d.get("param"),
                   kind=ErrorKind(d.get("error_kind", ErrorKind.INTERNAL)))


class CapacityError(StageError):
    """Admission refused: the entry queue is full. Carries a retry hint in seconds."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__("queue_full", message, kind=ErrorKind.BUSY)
        self.retry_after_s = retry_after_s
