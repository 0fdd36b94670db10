"""One request's streaming edge at run time: pieces cut from the source's deltas, their events put in order.

The executor makes one `StreamedNode` per streamed node of a run. `feed` and `flush` cut pieces (in the
thread that wrote the source's delta, or finished it); each piece becomes a work item whose events come
here (`emit`). The pieces may run at once (a TTS pool synthesises several phrases per step), so a piece's
events wait until every earlier piece has finished: the request's stream shows piece 0's events, then
piece 1's, and so on. Every DELTA carries its `piece`; a piece's first DELTA also carries the edge's
`carry` keys of the piece's inputs (the phrase a chunk of audio speaks). The node's STAGE_STARTED is the
moment its first piece is handed to its pool (the pool's own per-piece starts are not repeated).
"""

from __future__ import annotations

import threading
from typing import Any

from stages.events import EventKind
from stages.graph import Node
from stages.request_state import RequestState


class StreamedNode:
    def __init__(self, state: RequestState, node: Node):
        assert node.stream is not None
        self.state = state
        self.node = node
        self.splitter = node.stream.split()
        self.pieces: list[dict[str, Any]] = []  # inputs of every piece cut so far
        self.outputs: dict[int, dict[str, Any]] = {}  # piece -> its outputs, once finished
        self.source_done = False
        self._head = 0  # the piece whose events go out as they come; later ones wait in _held
        self._held: dict[int, list[tuple[EventKind, dict[str, Any]]]] = {}
        self._sent_delta: set[int] = set()  # pieces whose first DELTA has gone out
        self._lock = threading.RLock()

    # -- cutting ------------------------------------------------------------------------
    def feed(self, delta: dict[str, Any]) -> list[int]:
        """The source wrote a delta: the pieces it completes (their indices; inputs in `self.pieces`)."""
        with self._lock:
            return self._add(self.splitter.feed(delta))

    def flush(self, outputs: dict[str, Any]) -> list[int]:
        """The source is done: its last pieces."""
        with self._lock:
            added = self._add(self.splitter.flush(outputs))
            self.source_done = True
            return added

    def _add(self, pieces: list[dict[str, Any]]) -> list[int]:
        start = len(self.pieces)
        self.pieces += pieces
        if pieces and start == 0:
            self.state.emit(EventKind.STAGE_STARTED, stage=self.node.name)
        return list(range(start, len(self.pieces)))

    # -- events and completion ----------------------------------------------------------
    def emit(self, piece: int, kind: EventKind, data: dict[str, Any]) -> bool:
        if kind is EventKind.STAGE_STARTED:
            return True  # the node's start was written when its first piece was cut
        data = {**data, "piece": piece}
        with self._lock:
            if kind is EventKind.DELTA and piece not in self._sent_delta:
                self._sent_delta.add(piece)
                carry = self.node.stream.carry if self.node.stream else ()
                data |= {key: self.pieces[piece][key] for key in carry if key in self.pieces[piece]}
            if piece != self._head:
                self._held.setdefault(piece, []).append((kind, data))
                return not self.state.should_stop()
            return self.state.emit(kind, stage=self.node.name, **data)

    def finish(self, piece: int, outputs: dict[str, Any]) -> None:
        """A piece is done: the next pieces' held events go out, in order, up to the first unfinished one."""
        with self._lock:
            self.outputs[piece] = outputs
            while self._head in self.outputs:
                self._head += 1
                for kind, data in self._held.pop(self._head, []):
                    self.state.emit(kind, stage=self.node.name, **data)

    @property
    def done(self) -> bool:
        with self._lock:
            return self.source_done and len(self.outputs) == len(self.pieces)

    def result(self, source_outputs: dict[str, Any]) -> dict[str, Any]:
        """The node's outputs: every piece's, in order, and its source's under the source's name."""
        assert self.node.stream is not None
        with self._lock:
            return {"pieces": [self.outputs[i] for i in range(len(self.pieces))],
                    self.node.stream.source: source_outputs}
