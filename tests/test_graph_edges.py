"""Graphs that are graphs: fan-out and fan-in, and streaming edges (stages/graph.py, stages/streaming.py).

The stages here are small text stages under the real executor and pools: `Words` is a loop stage that
emits one word per step (the shape of an LLM's deltas), `Shout` a batch stage that upper-cases its piece
and may be told to hold a piece (so later pieces finish first). No timing thresholds: every check is on
the events and outputs, and pieces are made to finish out of order with events, not sleeps.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from serve.errors import http_status
from stages.events import ErrorKind, EventKind, StageError
from stages.executor import GraphExecutor
from stages.graph import Node, StageGraph, Stream
from stages.pool import PoolConfig
from stages.stage import LoopStage, Stage, WorkItem


class Words(LoopStage):
    """inputs["text"] -> one DELTA {"text": word + " "} per step; FINAL {"text", "words"}."""

    def __init__(self, gate: threading.Event | None = None, gate_after: int = 0):
        self.gate, self.gate_after = gate, gate_after  # wait on `gate` before step `gate_after`
        self.steps = 0

    def start(self, item: WorkItem) -> None:
        item.state["words"], item.state["i"] = item.inputs["text"].split(), 0

    def step(self, items: list[WorkItem]) -> None:
        for item in items:
            if self.gate is not None and item.state["i"] == self.gate_after:
                assert self.gate.wait(30), "the test never opened the gate"
            item.emit(EventKind.DELTA, text=item.state["words"][item.state["i"]] + " ")
            item.state["i"] += 1
            self.steps += 1

    def is_done(self, item: WorkItem) -> bool:
        return item.state["i"] >= len(item.state["words"])

    def finish(self, item: WorkItem) -> dict[str, Any]:
        return {"text": " ".join(item.state["words"]), "words": len(item.state["words"])}


class Shout(Stage):
    """A piece's inputs["phrase"] -> DELTA {"loud"} then outputs {"loud"}; holds the piece named `held`."""

    def __init__(self, held: str | None = None):
        self.held, self.release, self.seen, self.done = held, threading.Event(), [], []

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        out = []
        for item in items:
            phrase = item.inputs["phrase"]
            self.seen.append(phrase)
            if phrase == self.held:
                assert self.release.wait(30), "the test never released the held piece"
            item.emit(EventKind.DELTA, loud=phrase.upper())
            out.append({"loud": phrase.upper()})
            self.done.append(phrase.upper())
        return out


class Sentences:
    """Pieces: one per sentence ('.'-ended) of the text deltas; the rest at the end."""

    def __init__(self):
        self.buffer = ""

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        self.buffer += delta["text"]
        pieces = []
        while "." in self.buffer:
            sentence, self.buffer = self.buffer.split(".", 1)
            pieces.append({"phrase": sentence.strip() + "."})
        return pieces

    def flush(self, outputs: dict[str, Any]) -> list[dict[str, Any]]:
        rest, self.buffer = self.buffer.strip(), ""
        return [{"phrase": rest}] if rest else []


def streamed(split=Sentences) -> StageGraph:
    return StageGraph((Node("talk", "words"), Node("shout", "shout", stream=Stream("talk", split, carry=("phrase",)))),
                      "shout")


def executor(**pools: Stage) -> GraphExecutor:
    ex = GraphExecutor()
    for name, stage in pools.items():
        ex.add_pool(name, stage, PoolConfig(max_batch_size=1, replicas=2) if name == "shout" else PoolConfig())
    ex.start()
    return ex


@pytest.fixture
def stop():
    made: list[GraphExecutor] = []
    yield made.append
    for ex in made:
        ex.shutdown()


def gated(stop, gate_after: int, held: str):
    """An executor whose source holds before word `gate_after` and whose shout pool holds the piece `held`."""
    gate = threading.Event()
    words, shout = Words(gate, gate_after=gate_after), Shout(held=held)
    ex = executor(words=words, shout=shout)
    stop(ex)
    return ex, words, shout, gate


def wait_for(condition, what: str) -> None:
    done = threading.Event()
    for _ in range(3000):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError(f"never happened within 30 s: {what}")


def collect(handle) -> list:
    """The request's events so far and to come, gathered by a thread (the test reads them without blocking)."""
    seen: list = []
    threading.Thread(target=lambda: seen.extend(handle.events(timeout=60)), daemon=True).start()
    return seen


def test_pieces_start_while_the_source_runs_and_arrive_in_order(stop):
    ex, words, shout, gate = gated(stop, 4, "One two.")
    handle = ex.submit(streamed(), {"text": "One two. Three. Four five six"})
    events = collect(handle)
    wait_for(lambda: "THREE." in shout.done, "piece 1 finished while piece 0 is held")
    assert shout.seen == ["One two.", "Three."] and not handle.done  # TTS-like work began mid-LLM
    assert not [e for e in events if e.stage == "shout" and e.kind is EventKind.DELTA]  # piece 1 waits for 0
    shout.release.set()
    gate.set()
    wait_for(lambda: handle.done, "the request ended")
    deltas = [e for e in events if e.stage == "shout" and e.kind is EventKind.DELTA]
    assert [(d.data["piece"], d.data["loud"], d.data.get("phrase")) for d in deltas] == [
        (0, "ONE TWO.", "One two."), (1, "THREE.", "Three."), (2, "FOUR FIVE SIX", "Four five six")]
    assert len([e for e in events if e.kind is EventKind.STAGE_STARTED and e.stage == "shout"]) == 1
    assert events[-1].kind is EventKind.FINAL
    assert events[-1].data["outputs"] == {
        "pieces": [{"loud": "ONE TWO."}, {"loud": "THREE."}, {"loud": "FOUR FIVE SIX"}],
        "talk": {"text": "One two. Three. Four five six", "words": 6}}
    wait_for(ex.idle, "every pool idle")


def test_a_source_with_nothing_to_cut_still_ends_the_node(stop):
    ex = executor(words=Words(), shout=Shout())
    stop(ex)

    class Nothing(Sentences):
        def feed(self, delta):
            return []

        def flush(self, outputs):
            return []

    out = ex.submit(streamed(Nothing), {"text": "a b c"}).result(timeout=30)
    assert out == {"pieces": [], "talk": {"text": "a b c", "words": 3}}


def test_cancel_stops_every_node_of_a_streaming_graph(stop):
    ex, words, shout, gate = gated(stop, 2, "A.")
    handle = ex.submit(streamed(), {"text": "A. B. C. D. E."})
    wait_for(lambda: shout.seen, "the first piece reached its pool")
    handle.cancel()
    shout.release.set()
    gate.set()
    events = list(handle.events(timeout=30))
    assert events[-1].kind is EventKind.ERROR and events[-1].data["code"] == "cancelled"
    assert not any(e.stage == "shout" and e.kind is EventKind.DELTA for e in events)
    wait_for(ex.idle, "every pool idle")
    assert words.steps <= 3  # the source left at its next step boundary: D and E were never said
    assert ex.in_flight() == 0


def test_a_fence_that_closes_stops_the_request_and_silences_it(stop):
    ex, words, shout, gate = gated(stop, 1, "A.")
    current = [True]
    handle = ex.submit(streamed(), {"text": "A. B. C."}, fence=lambda: current[0])
    wait_for(lambda: shout.seen, "the first piece reached its pool")
    current[0] = False  # the session's epoch moved on: nobody may hear more of this request
    shout.release.set()
    gate.set()
    events = list(handle.events(timeout=30))
    assert [e.data["text"] for e in events if e.kind is EventKind.DELTA] == ["A. "]  # only what came before
    assert events[-1].kind is EventKind.ERROR and events[-1].data["code"] == "cancelled"
    wait_for(ex.idle, "every pool idle")
    assert words.steps <= 2 and ex.in_flight() == 0


def test_a_splitter_error_fails_the_request_with_its_code(stop):
    ex = executor(words=Words(), shout=Shout())
    stop(ex)

    class Refuses(Sentences):
        def feed(self, delta):
            if "bad" in delta["text"]:
                raise StageError("unspeakable_input", "cannot say that", param="input", kind=ErrorKind.INVALID)
            return super().feed(delta)

    with pytest.raises(StageError) as info:
        ex.submit(streamed(Refuses), {"text": "fine. bad. words."}).result(timeout=30)
    assert (info.value.code, info.value.param, http_status(info.value)) == ("unspeakable_input", "input", 400)
    assert ex.in_flight() == 0


class Tag(Stage):
    """outputs {name: inputs seen}: which upstream outputs reached it."""

    def __init__(self, name: str):
        self.name = name

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        return [{self.name: sorted(k for k in item.inputs if k != "request")} for item in items]


def test_fan_out_then_fan_in(stop):
    ex = executor(a=Tag("a"), b=Tag("b"), c=Tag("c"), d=Tag("d"))
    stop(ex)
    graph = StageGraph((Node("a", "a"), Node("b", "b", ("a",)), Node("c", "c", ("a",)), Node("d", "d", ("b", "c"))),
                       "d")
    handle = ex.submit(graph, {"request": 1})
    events = list(handle.events(timeout=30))
    started = [e.stage for e in events if e.kind is EventKind.STAGE_STARTED]
    assert started[0] == "a" and set(started[1:3]) == {"b", "c"} and started[3] == "d"  # b and c both after a
    assert events[-1].data["outputs"] == {"d": ["b", "c"]}  # d read both branches


class Heard(Stage):
    """A piece's phrase and the `prefix` an upstream node (not its stream's source) wrote: outputs {"heard"}."""

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        return [{"heard": f"{item.inputs['prefix']}{item.inputs['phrase']}"} for item in items]


class Prefix(Stage):
    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        return [{"prefix": "> ", "text": item.inputs["text"]} for item in items]


def test_a_streamed_node_reads_what_its_source_waited_for(stop):
    """A streamed node may read nodes its stream's source waits for (done before the source's first delta): its
    pieces carry their outputs, as Qwen3-Omni's talker reads the prompt's media features while streaming."""
    ex = GraphExecutor()
    for name, stage in (("prefix", Prefix()), ("words", Words()), ("heard", Heard())):
        ex.add_pool(name, stage, PoolConfig())
    ex.start()
    stop(ex)
    graph = StageGraph((Node("prefix", "prefix"), Node("talk", "words", ("prefix",)),
                        Node("heard", "heard", ("prefix",), stream=Stream("talk", Sentences))), "heard")
    handle = ex.submit(graph, {"text": "One two. Three."})
    assert [p["heard"] for p in handle.result(timeout=30)["pieces"]] == ["> One two.", "> Three."]


def test_graph_shapes_are_checked():
    with pytest.raises(ValueError, match="can read only nodes that 'a' waits for"):
        StageGraph((Node("a", "a"), Node("b", "b", ("a",), stream=Stream("a", Sentences))), "b")
    with pytest.raises(ValueError, match="can read only nodes that 'a' waits for"):
        StageGraph((Node("x", "x"), Node("a", "a"), Node("b", "b", ("x",), stream=Stream("a", Sentences))), "b")
    with pytest.raises(ValueError, match="not listed before"):
        StageGraph((Node("b", "b", stream=Stream("a", Sentences)), Node("a", "a")), "a")
    ex = GraphExecutor()
    with pytest.raises(ValueError, match="unknown pools"):
        ex.submit(streamed(), {"text": "x"})
