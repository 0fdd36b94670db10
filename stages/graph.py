"""A StageGraph: named nodes, each run by a pool, connected by the data they pass on."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Node:
    name: str  # unique in the graph; events name it as their stage
    pool: str  # the StagePool that runs it
    after: tuple[str, ...] = ()  # nodes whose outputs this node reads
    params: dict = field(default_factory=dict, hash=False, compare=False)  # node-specific inputs


@dataclass(frozen=True)
class StageGraph:
    nodes: tuple[Node, ...]
    output: str  # the node whose outputs end the request

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate node names in graph: {names}")
        known: set[str] = set()
        for node in self.nodes:  # nodes are listed in an order where deps come first
            missing = [d for d in node.after if d not in known]
            if missing:
                raise ValueError(f"node {node.name!r} depends on {missing}, which are not listed before it")
            known.add(node.name)
        if self.output not in known:
            raise ValueError(f"output node {self.output!r} is not in the graph")

    @classmethod
    def chain(cls, *nodes: tuple[str, str] | Node) -> "StageGraph":
        """A linear graph: each node reads the one before it."""
        built: list[Node] = []
        for spec in nodes:
            node = spec if isinstance(spec, Node) else Node(name=spec[0], pool=spec[1])
            if built and not node.after:
                node = Node(node.name, node.pool, (built[-1].name,), node.params)
            built.append(node)
        return cls(tuple(built), built[-1].name)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def ready(self, done: set[str], started: set[str]) -> list[Node]:
        return [n for n in self.nodes if n.name not in started and all(d in done for d in n.after)]
