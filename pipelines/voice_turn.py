"""A voice turn as one graph: the user's last utterance transcribed, answered by the chat model's llm node,
streamed phrase by phrase into the speech model's tts node.

    asr  ->  llm  ⇢  tts        (->: a plain edge; ⇢: a streaming edge, stages/graph.py)

The asr node is there when the session hands the turn the audio of its last utterance (`HeardSpeech`, the
final decode at the endpoint): its transcript is published to the caller (an OUTPUTS event, so the session
can announce it before the answer) and the llm node's `prepare` puts it into the prompt, at its message,
before the prompt is tokenized and checked. Without it (every transcript already final, a text turn) the
graph starts at the llm, its prompt checked at submit. Either way, a history the model's context cannot
hold loses its oldest turns first (`fit_prompt`).

The LLM's text deltas are cut into phrases as they come (`PhraseSpeech`, the edge's splitter); each phrase
is checked and tokenized and becomes one piece of the tts node, so the first phrase is being spoken while
the LLM still writes the rest. The request's one event stream carries the llm node's text deltas and the
tts node's audio deltas, the audio in phrase order, each phrase's first chunk with the phrase's text
(`text`). A turn without audio has no tts node. One cancel (or the caller's fence: the voice
session's epoch) stops every node.

FINAL outputs: with audio {"pieces": [tts outputs per phrase], "llm": the llm's outputs}; without, the
llm's outputs ({"choices", "usage"}).

With tools (the chat request's `tools`, choice other than none) the reply may be a function call, whose JSON must
never be spoken: a forced call (required, a named function) is grammar-constrained and the turn has no tts node; with
auto the splitter holds the whole reply and speaks it only once it is known not to be a call (the first audio comes
after the LLM's last token). The llm's outputs carry the calls read from the text (`tool_calls`, `content`,
finish_reason "tool_calls"), as a chat completion's do (pipelines/tools.py `with_calls`).
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipelines.asr import TranscriptionRequest
from pipelines.chat import ChatRequest, LanguageModel
from pipelines.image_request import RequestError
from pipelines.phrases import PhraseLimits, PhraseSplitter
from pipelines.tools import Tools, with_calls
from pipelines.tts import SpeechModel, SpeechRequest
from stages.graph import Node, StageGraph, Stream

# The first phrase is short, so the first audio comes soon; later ones may be whole sentences.
VOICE_PHRASES = PhraseLimits(max_chars=200, first_max_chars=60, first_clause_chars=24)  # 24: about four words


@dataclass(frozen=True)
class HeardSpeech:
    """The user's last utterance, still to be transcribed: the turn's asr node decodes it."""

    request: TranscriptionRequest  # its audio (and the session's language and prompt)
    message: int  # the chat message its transcript becomes (a placeholder there until then)
    earlier: tuple[str, ...] = ()  # transcripts of the item's earlier utterances (one cut at the window's end)

    def transcript(self, text: str) -> str:
        return " ".join(part for part in (*self.earlier, text.strip()) if part)


@dataclass(frozen=True)
class VoiceTurnRequest:
    chat: ChatRequest  # what the LLM answers (its `tools`: the functions it may call instead)
    speech: SpeechRequest | None = None  # how to speak it (voice, speed, rate, tenant; its `input` is unused);
    #                                      None: text only (and a forced tool call is never spoken)
    heard: HeardSpeech | None = None  # the utterance the turn transcribes first; None: the chat is complete


class PhraseSpeech:
    """The llm ⇢ tts edge's splitter: text deltas -> phrases -> speech jobs (one piece per phrase)."""

    def __init__(self, model: SpeechModel, speech: SpeechRequest, limits: PhraseLimits = VOICE_PHRASES,
                 hold: Callable[[str], bool] | None = None):
        """`hold`: the reply may be a tool call (tool_choice auto): the text is held whole, then spoken unless
        `hold(text)` says it is a call."""
        self.model = model
        self.speech = speech
        self.splitter = PhraseSplitter(limits)
        self.hold = hold
        self.held: list[str] = []

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        if self.hold is not None:
            self.held.append(delta.get("text", ""))
            return []
        return self._pieces(self.splitter.feed(delta.get("text", "")))

    def flush(self, outputs: dict[str, Any]) -> list[dict[str, Any]]:
        if self.hold is not None:
            text = "".join(self.held)
            if self.hold(text):
                return []  # a call: nothing to say
            return self._pieces(self.splitter.feed(text) + self.splitter.flush())
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


def turn_graph(chat: str, tts: str | None, speech: SpeechRequest | None, model: SpeechModel | None, *,
               asr: str | None = None, asr_job: Any = None, prepare=None, tools: Tools | None = None,
               form=None) -> StageGraph:
    """The turn's graph over the chat model's llm pool and, with speech, the speech model's tts pool; with
    `asr` (a speech recognition model), an asr node running `asr_job` first, whose outputs `prepare` makes
    into the llm's inputs. With `tools` (`form`: the chat template's tool format) the reply's calls are read into
    the llm's outputs, and no call is spoken (the module's docstring says how)."""
    if tools is not None and tools.choice == "none":
        tools = None
    if tools is not None and tools.forced:
        speech = None  # the reply is a call: nothing to speak
    graph = _turn_graph(chat, tts, speech, model, asr, asr_job, prepare, tools, form)
    if tools is None:
        return graph
    calls, reader = tools, form

    def finish(outputs: dict[str, Any]) -> dict[str, Any]:
        if "llm" in outputs:
            return {**outputs, "llm": with_calls(outputs["llm"], calls, reader)}
        return with_calls(outputs, calls, reader)
    return dataclasses.replace(graph, finish=finish)


def _turn_graph(chat: str, tts: str | None, speech: SpeechRequest | None, model: SpeechModel | None,
                asr: str | None, asr_job: Any, prepare, tools: Tools | None, form) -> StageGraph:
    nodes = []
    if asr is not None:
        nodes.append(Node("asr", f"{asr}/asr", params={"request": asr_job}, publish=True))
        llm = Node("llm", f"{chat}/llm", after=("asr",), prepare=prepare)
    else:
        llm = Node("llm", f"{chat}/llm")
    nodes.append(llm)
    if speech is None:
        return StageGraph(tuple(nodes), "llm")
    assert tts is not None and model is not None
    hold = None if tools is None else (lambda text: bool(tools.read(text, form)[1]))
    split = lambda: PhraseSpeech(model, speech, hold=hold)  # noqa: E731  (a fresh splitter per request)
    nodes.append(Node("tts", f"{tts}/tts", stream=Stream("llm", split, carry=("text",))))
    return StageGraph(tuple(nodes), "tts")


def fit_prompt(model: LanguageModel, chat: ChatRequest):
    """The checked prompt of a turn; when the history outgrows the model's context, the oldest turns (after the
    instructions) are left out until it fits or only the last one is left."""
    messages = list(chat.messages or [])
    while True:
        try:
            return model.generation_request(dataclasses.replace(chat, messages=messages))
        except RequestError as exc:
            if exc.code != "context_length_exceeded" or len(messages) <= 2:
                raise
            messages = messages[:1] + messages[2:]
            while len(messages) > 2 and messages[1]["role"] == "tool":  # a result whose call was left out
                messages = messages[:1] + messages[2:]


def heard_prompt(model: LanguageModel, chat: ChatRequest, heard: HeardSpeech):
    """The llm node's `prepare` for a turn with an asr node: the transcript goes into its message (an empty one
    leaves the message out), then the prompt is fitted and checked."""
    def prepare(inputs: dict[str, Any]) -> dict[str, Any]:
        messages = list(chat.messages or [])
        text = heard.transcript(inputs.get("text", ""))
        if text:
            messages[heard.message] = {**messages[heard.message], "content": text}
        else:
            del messages[heard.message]
        return {"request": fit_prompt(model, dataclasses.replace(chat, messages=messages))}
    return prepare


def speakable(text: str) -> str:
    """The text without control or unassigned characters (a language model may emit any)."""
    kept = "".join(ch if unicodedata.category(ch)[0] not in "CZ" or ch == " " else " " for ch in text
                   if ch != "\ufffd")
    return " ".join(kept.split())
