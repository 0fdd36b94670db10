"""A StageGraph: named nodes, each run by a pool, connected by the data they pass on.

An edge is plain (`after`: the node starts once those nodes are done and reads their outputs) or streaming
(`stream`: the node consumes its source's deltas while the source still runs). A streamed node runs once per
*piece*: the edge's splitter turns the source's deltas into the inputs of pieces (an LLM's text deltas into
phrases for the TTS), each piece is one work item of the node's pool, and the pieces' events reach the
request's stream in piece order. The node is done when its source is done and every piece is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class Splitter(Protocol):
    """One request's cut of a source's deltas into pieces (a fresh one per request)."""

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A DELTA event's data -> the inputs of the pieces it completes (often none)."""
        ...

    def flush(self, outputs: dict[str, Any]) -> list[dict[str, Any]]:
        """The source is done (its final outputs) -> the inputs of the last pieces."""
        ...


@dataclass(frozen=True)
class Stream:
    """A streaming edge into a node: pieces cut from `source`'s deltas while it runs."""

    source: str  # the node whose DELTA events feed this one
    split: Callable[[], Splitter]  # makes the request's splitter
    carry: tuple[str, ...] = ()  # keys of a piece's inputs copied onto its first DELTA (the phrase it speaks)


@dataclass(frozen=True)
class Node:
    name: str  # unique in the graph; events name it as their stage
    pool: str  # the StagePool that runs it
    after: tuple[str, ...] = ()  # nodes whose outputs this node reads
    params: dict = field(default_factory=dict, hash=False, compare=False)  # node-specific inputs
    stream: Stream | None = field(default=None, hash=False, compare=False)  # a streaming edge into it
    # The node's inputs, once gathered, made into the ones its stage reads (the voice turn's llm builds its prompt
    # from the asr node's transcript); a StageError it raises fails the request.
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = field(default=None, hash=False, compare=False)
    publish: bool = False  # its outputs go to the caller as an OUTPUTS event when it is done (not only the output's)


@dataclass(frozen=True)
class StageGraph:
    nodes: tuple[Node, ...]
    output: str  # the node whose outputs end the request
    # the request's outputs made from the output node's (a streamed output node's pieces joined); None: those
    finish: Callable[[dict[str, Any]], dict[str, Any]] | None = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate node names in graph: {names}")
        known: set[str] = set()
        upstream: dict[str, set[str]] = {}  # node -> every node it waits for or streams from, transitively
        for node in self.nodes:  # nodes are listed in an order where deps come first
            missing = [d for d in node.after if d not in known]
            if node.stream is not None:
                if node.stream.source not in known:
                    missing = [node.stream.source]
                # Its pieces read the request's inputs, their own, and `after` nodes' outputs: only nodes its source
                # waits for, done before the source's first delta, so nothing waits for them.
                elif not set(node.after) <= upstream[node.stream.source]:
                    raise ValueError(f"node {node.name!r} streams from {node.stream.source!r}; it can read only nodes "
                                     f"that {node.stream.source!r} waits for, not {list(node.after)}")
            if missing:
                raise ValueError(f"node {node.name!r} depends on {missing}, which are not listed before it")
            deps = (*node.after, *((node.stream.source,) if node.stream is not None else ()))
            upstream[node.name] = set(deps).union(*(upstream[d] for d in deps))
            known.add(node.name)
        if self.output not in known:
            raise ValueError(f"output node {self.output!r} is not in the graph")

    @classmethod
    def chain(cls, *nodes: tuple[str, str] | Node) -> "StageGraph":
        """A linear graph: each node reads the one before it."""
        built: list[Node] = []
        for spec in nodes:
            node = spec if isinstance(spec, Node) else Node(name=spec[0], pool=spec[1])
            if built and not node.after and node.stream is None:
                node = dataclasses.replace(node, after=(built[-1].name,))
            built.append(node)
        return cls(tuple(built), built[-1].name)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def ready(self, done: set[str], started: set[str]) -> list[Node]:
        """Plain nodes whose inputs are all there (streamed nodes are fed piece by piece instead)."""
        return [n for n in self.nodes if n.stream is None and n.name not in started and all(d in done for d in n.after)]

    def streamed_from(self, source: str) -> list[Node]:
        return [n for n in self.nodes if n.stream is not None and n.stream.source == source]
