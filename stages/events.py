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


class StageError(Exception):
    """A failure with an error code a client can act on (mapped to HTTP by serve/)."""

    def __init__(self, code: str, message: str, *, param: str | None = None, status: int = 500):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status = status

    @classmethod
    def from_event(cls, event: Event) -> StageError:
        """The error an ERROR event carries (its code, message, param and status)."""
        d = event.data
        return cls(d.get("code", "internal_error"), d.get("message", ""), param=d.get("param"),
                   status=d.get("status", 500))


class CapacityError(StageError):
    """Admission refused: the entry queue is full. Carries a retry hint in seconds."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__("queue_full", message, status=429)
        self.retry_after_s = retry_after_s
