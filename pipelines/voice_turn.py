"""A voice turn as one graph: the chat model's llm node streaming into the speech model's tts node.

    llm  ⇢  tts        (⇢: a streaming edge, stages/graph.py)

The LLM's text deltas are cut into phrases as they come (`PhraseSpeech`, the edge's splitter); each phrase
is checked and tokenized and becomes one piece of the tts node, so the first phrase is being spoken while
the LLM still writes the rest. The request's one event stream carries the llm node's text deltas and the
tts node's audio deltas, the audio in phrase order, each phrase's first chunk with the phrase's text
(`text`). A turn without audio is the llm node alone. One cancel (or the caller's fence: the voice
session's epoch) stops both nodes.

FINAL outputs: with audio {"pieces": [tts outputs per phrase], "llm": the llm's outputs}; without, the
llm's outputs ({"choices", "usage"}).
"""

from __future__ import annotations

import dataclasses
import unicodedata
from dataclasses import dataclass
from typing import Any

from pipelines.chat import ChatRequest
from pipelines.image_request import RequestError
from pipelines.phrases import PhraseLimits, PhraseSplitter
from pipelines.tts import SpeechModel, SpeechRequest
from stages.graph import Node, StageGraph, Stream

# The first phrase is short, so the first audio comes soon; later ones may be whole sentences.
VOICE_PHRASES = PhraseLimits(max_chars=200, first_max_chars=60)


@dataclass(frozen=True)
class VoiceTurnRequest:
    chat: ChatRequest  # what the LLM answers
    speech: SpeechRequest | None = None  # how to speak it (voice, speed, rate, tenant; its `input` is unused);
    #                                      None: text only


class PhraseSpeech:
    """The llm ⇢ tts edge's splitter: text deltas -> phrases -> speech jobs (one piece per phrase)."""

    def __init__(self, model: SpeechModel, speech: SpeechRequest, limits: PhraseLimits = VOICE_PHRASES):
        self.model = model
        self.speech = speech
        self.splitter = PhraseSplitter(limits)

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        return self._pieces(self.splitter.feed(delta.get("text", "")))

    def flush(self, outputs: dict[str, Any]) -> list[dict[str, Any]]:
        return self._pieces(self.splitter.flush())

    def _pieces(self, phrases: list[str]) -> list[dict[str, Any]]:
        pieces = []
        for phrase in phrases:
            text = speakable(phrase)
            if not text:
                continue
            try:
                job = self.model.job(dataclasses.replace(self.speech, input=text))
            except RequestError as exc:
                if exc.code == "unspeakable_input":  # the TTS vocabulary knows none of its characters
                    continue
                raise
            pieces.append({"request": job, "text": phrase})
        return pieces


def turn_graph(chat: str, tts: str | None, speech: SpeechRequest | None, model: SpeechModel | None) -> StageGraph:
    """The turn's graph over the chat model's llm pool and, with speech, the speech model's tts pool."""
    llm = Node("llm", f"{chat}/llm")
    if speech is None:
        return StageGraph((llm,), "llm")
    assert tts is not None and model is not None
    split = lambda: PhraseSpeech(model, speech)  # noqa: E731  (a fresh splitter per request)
    return StageGraph((llm, Node("tts", f"{tts}/tts", stream=Stream("llm", split, carry=("text",)))), "tts")


def speakable(text: str) -> str:
    """The text without control or unassigned characters (a language model may emit any)."""
    kept = "".join(ch if unicodedata.category(ch)[0] not in "CZ" or ch == " " else " " for ch in text
                   if ch != "\ufffd")
    return " ".join(kept.split())
