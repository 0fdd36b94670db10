"""The Stage contract: what a pool needs to know to batch and run work items."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable

from stages.events import EventKind
from stages.placement import Affinity
from stages.request_state import RequestState

if TYPE_CHECKING:
    from stages.tracing import NodeTrace


@dataclass
class WorkItem:
    """One request's invocation of one graph node. Per-request state lives here, never on the stage."""

    request: RequestState  # owner: cancel flag, deadline, event stream
    node: str  # graph node name (also the event's `stage` field)
    inputs: dict[str, Any]  # request parameters plus the outputs of upstream nodes
    state: dict[str, Any] = field(default_factory=dict)  # stage-private per-request state (latents, scheduler, ...)
    enqueued_at: float = field(default_factory=time.monotonic)
    steps_run: int = 0  # loop stages: steps this item took part in
    released: bool = False  # set once its state was freed; release is idempotent
    piece: int | None = None  # a streamed node's piece: its position among the node's pieces
    route: Callable[..., bool] | None = None  # where a piece's events go (they are put in piece order there)
    replica: int | None = None  # a placed pool's replica it was routed to; None: whichever replica is free
    oom_retried: bool = False  # loop stages: its step ran out of memory once and was run again
    in_service: bool = False  # taken from its pool's queue and not yet finished or dropped (its tenant's share)
    trace: NodeTrace | None = None  # its stage span's facts while tracing is on (stages/tracing.py); None: off

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def emit(self, kind: EventKind, **data) -> bool:
        if self.route is not None:
            return self.route(kind, data)
        return self.request.emit(kind, stage=self.node, **data)

    def release(self) -> None:
        """Free per-request state exactly once (tensors, scheduler copies, cache references)."""
        if not self.released:
            self.released = True
            self.state.clear()


class Stage:
    """A stage holds model components and no per-request state.

    Items whose `batch_key` are equal may share one `run_batch` call.
    """

    kind: str = "stage"
    model: str = ""  # metric label
    torch_threads: bool = True  # False: the work runs elsewhere (media worker processes); no CPU thread budget

    def batch_key(self, item: WorkItem) -> Hashable:
        return None

    def affinity(self, item: WorkItem) -> Affinity | None:
        """Which replica of a placed pool an item should go to: a request of a realtime session (its `session`)
        sticks to one replica, since the session's state lives there; None: the least loaded."""
        session = getattr(item.inputs.get("request"), "session", None)
        return None if session is None else Affinity(("session", session), sticky=True)

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        """Run a batch; return one outputs dict per item, in order."""
        raise NotImplementedError

    def usage(self) -> dict[str, int]:
        """What the stage holds for requests now (the llm: KV blocks, sequences); at rest it is the baseline again.
        A ray-backend replica answers it from its actor (leak checks across a lost replica)."""
        return {}

    def close(self) -> None:
        """Stop what the stage runs outside this process (a parallel replica's ranks); a ray-backend replica's actor
        calls it as it stops. The local backend closes the served model instead (pipelines/engine.py)."""


class LoopStage(Stage):
    """A stage that advances its items one step at a time (the denoise loop).

    Items join at a step boundary (`start`), share `step` calls with other items of the same
    batch key, and leave at a step boundary when `is_done` (then `finish`) or when dropped.
    """

    def start(self, item: WorkItem) -> None:
        """Prepare per-item state (stored on item.state) before its first step."""

    def abort(self, item: WorkItem) -> None:
        """Release what `start` acquired for an item that leaves without finishing (cancel,
        deadline, failure). Called between steps, so no forward still uses it."""

    def step(self, items: list[WorkItem]) -> None:
        """Advance every item by one step (items may be at different positions)."""
        raise NotImplementedError

    def ready(self, item: WorkItem) -> bool:
        """Whether a step would advance the item now (the talker's reply may wait on its thinker's next token)."""
        return True

    def wait(self, items: list[WorkItem]) -> None:
        """No item is ready: wait a little for one to become ready (outside the compute threads; new items join
        after it)."""

    def fit(self, items: list[WorkItem]) -> int:
        """How many of `items` (one batch key's, in order) one step may take (at least 1): a memory budget's cap."""
        return len(items)

    def is_done(self, item: WorkItem) -> bool:
        raise NotImplementedError

    def finish(self, item: WorkItem) -> dict[str, Any]:
        raise NotImplementedError
