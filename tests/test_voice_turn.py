"""A voice turn is one graph: [asr ->] llm ⇢ tts with a streaming edge (pipelines/voice_turn.py,
Engine.submit_voice_turn).

Checked against the cascade it replaces: the transcript equals a transcription request for the same audio, the
text equals the chat model's own greedy answer, each phrase's audio equals a speech request for that phrase alone,
and one cancel (or the fence) stops every node.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.asr import TranscriptionRequest
from pipelines.chat import ChatRequest
from pipelines.phrases import PhraseSplitter
from pipelines.tts import SpeechRequest
from pipelines.voice_turn import VOICE_PHRASES, HeardSpeech, VoiceTurnRequest, speakable
from serve.errors import http_status
from stages.events import EventKind, StageError
from stages.llm.params import SamplingParams
from tests.test_realtime_voice_support import ESPEAK, speech, voice_engine, voice_models, voiced  # noqa: F401

MESSAGES = [{"role": "system", "content": "You are a helpful voice assistant."},
            {"role": "user", "content": "Tell me about the sea, please."}]


@pytest.fixture(scope="module")
def engine(voice_models):  # noqa: F811
    engine = voice_engine(voice_models)
    yield engine
    engine.shutdown()


def _turn(max_tokens: int = 40, speech: bool = True) -> VoiceTurnRequest:
    chat = ChatRequest(messages=MESSAGES, params=SamplingParams(temperature=0, max_tokens=max_tokens, seed=0))
    return VoiceTurnRequest(chat, SpeechRequest("", voice=None, sample_rate=24000) if speech else None)


def _count(engine, pool: str, model: str) -> float:
    return engine.metrics.registry.get_sample_value("mmserve_stage_run_seconds_count",
                                                    {"stage": pool, "model": model}) or 0.0


def _nodes(engine, node: str, pool: str) -> float:
    return engine.metrics.registry.get_sample_value("mmserve_graph_nodes_total",
                                                    {"model": "llama-demo", "node": node, "stage": pool}) or 0.0


def test_a_heard_turn_transcribes_then_answers_in_the_same_graph(engine):
    """The asr node decodes the utterance exactly as a transcription request would, publishes its transcript
    before the llm starts, and the llm answers the prompt with that transcript in its message (as the chat model
    alone would); an earlier part of the utterance goes in front of it."""
    audio = speech("Tell me about the sea, please.", 16000) if ESPEAK else voiced(1.5, 16000)
    heard = TranscriptionRequest(audio)
    transcript = engine.submit_transcription("asr", heard).result(timeout=300)["text"]
    before = {node: _nodes(engine, node, pool) for node, pool in
              (("asr", "asr/asr"), ("llm", "llama-demo/llm"), ("tts", "vits-demo/tts"))}
    chat = ChatRequest(messages=[MESSAGES[0], {"role": "user", "content": ""}],
                       params=SamplingParams(temperature=0, max_tokens=24, seed=0))
    request = VoiceTurnRequest(chat, SpeechRequest("", sample_rate=24000), HeardSpeech(heard, 1, ("Hello.",)))
    events = list(engine.submit_voice_turn("voice", request).events(timeout=300))
    after = {node: _nodes(engine, node, pool) - before[node] for node, pool in
             (("asr", "asr/asr"), ("llm", "llama-demo/llm"), ("tts", "vits-demo/tts"))}

    published = [i for i, e in enumerate(events) if e.kind is EventKind.OUTPUTS]
    assert [events[i].stage for i in published] == ["asr"]
    assert events[published[0]].data["outputs"]["text"] == transcript
    llm = [i for i, e in enumerate(events) if e.stage == "llm"]
    assert llm and published[0] < min(llm)  # the llm starts on the final transcript
    text = "".join(events[i].data.get("text", "") for i in llm if events[i].kind is EventKind.DELTA)
    said = " ".join(p for p in ("Hello.", transcript.strip()) if p)
    alone = ChatRequest(messages=[MESSAGES[0], {"role": "user", "content": said}], params=chat.params)
    assert text == engine.submit_chat("llama-demo", alone).result(timeout=300)["choices"][0]["text"]
    assert events[-1].kind is EventKind.FINAL and "pieces" in events[-1].data["outputs"]
    # /metrics shows the turn's whole path: every node, under the request's model, with the pool that ran it
    assert after == {"asr": 1, "llm": 1, "tts": 1 if any(e.stage == "tts" for e in events) else 0}
    assert engine.executor.in_flight() == 0


def test_a_heard_turn_with_nothing_heard_leaves_the_message_out(engine):
    """Silence transcribes to nothing: the empty user message is left out, as a finished empty transcript is."""
    chat = ChatRequest(messages=[MESSAGES[0], {"role": "user", "content": ""}, MESSAGES[1]],
                       params=SamplingParams(temperature=0, max_tokens=8, seed=0))
    silent = HeardSpeech(TranscriptionRequest(np.zeros(16000, np.float32)), 1)
    events = list(engine.submit_voice_turn("voice", VoiceTurnRequest(chat, None, silent)).events(timeout=300))
    heard = next(e for e in events if e.kind is EventKind.OUTPUTS).data["outputs"]["text"]
    text = "".join(e.data.get("text", "") for e in events if e.kind is EventKind.DELTA and e.stage == "llm")
    kept = [MESSAGES[0], {"role": "user", "content": heard.strip()}, MESSAGES[1]] if heard.strip() else MESSAGES
    alone = ChatRequest(messages=kept, params=chat.params)
    assert text == engine.submit_chat("llama-demo", alone).result(timeout=300)["choices"][0]["text"]


def test_a_turn_speaks_the_chat_models_answer_phrase_by_phrase(engine):
    tts_steps = _count(engine, "vits-demo/tts", "vits-demo")
    llm_steps = _count(engine, "llama-demo/llm", "llama-demo")
    events = list(engine.submit_voice_turn("voice", _turn()).events(timeout=300))
    text = "".join(e.data.get("text", "") for e in events if e.kind is EventKind.DELTA and e.stage == "llm")
    alone = engine.submit_chat("llama-demo", _turn().chat).result(timeout=300)
    assert text == alone["choices"][0]["text"]  # the llm node is the chat model's own greedy decode

    splitter = PhraseSplitter(VOICE_PHRASES)
    phrases = [p for p in [*splitter.feed(text), *splitter.flush()] if speakable(p)]
    assert phrases, f"the demo model's answer has nothing to speak: {text!r}"
    audio = [e for e in events if e.kind is EventKind.DELTA and e.stage == "tts"]
    pieces = sorted({e.data["piece"] for e in audio})
    assert [e.data["piece"] for e in audio] == sorted(e.data["piece"] for e in audio)  # in phrase order
    assert pieces == list(range(len(phrases)))
    for piece, phrase in enumerate(phrases):
        chunks = [e for e in audio if e.data["piece"] == piece]
        assert chunks[0].data["text"] == phrase and all("text" not in c.data for c in chunks[1:])
        spoken = np.concatenate([c.data["audio"] for c in chunks])
        reference = engine.submit_speech("vits-demo", SpeechRequest(speakable(phrase), sample_rate=24000))
        np.testing.assert_array_equal(spoken, reference.result(timeout=300)["audio"])

    started = [e.stage for e in events if e.kind is EventKind.STAGE_STARTED]
    assert started[0] == "llm" and started.count("tts") == 1
    first_tts = next(i for i, e in enumerate(events) if e.kind is EventKind.STAGE_STARTED and e.stage == "tts")
    last_llm = max(i for i, e in enumerate(events) if e.kind is EventKind.DELTA and e.stage == "llm")
    if len(phrases) > 1:  # a later phrase was still being written when the first went to the TTS
        assert first_tts < last_llm
    outputs = events[-1].data["outputs"]
    assert events[-1].kind is EventKind.FINAL and len(outputs["pieces"]) == len(phrases)
    usage = outputs["llm"]["usage"]  # (the second request found the prompt in the prefix cache)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (alone["usage"]["prompt_tokens"],
                                                                     alone["usage"]["completion_tokens"])
    # /metrics shows both nodes of the turn
    assert _count(engine, "vits-demo/tts", "vits-demo") >= tts_steps + len(phrases)
    assert _count(engine, "llama-demo/llm", "llama-demo") > llm_steps


def test_a_text_turn_is_the_llm_node_alone(engine):
    events = list(engine.submit_voice_turn("voice", _turn(speech=False)).events(timeout=300))
    assert {e.stage for e in events if e.kind is EventKind.STAGE_STARTED} == {"llm"}
    assert "choices" in events[-1].data["outputs"]


def test_cancel_stops_both_nodes(engine):
    handle = engine.submit_voice_turn("voice", _turn(max_tokens=200))
    seen = []
    for event in handle.events(timeout=300):
        seen.append(event)
        if event.kind is EventKind.STAGE_STARTED and event.stage == "tts":
            handle.cancel()
    assert seen[-1].kind is EventKind.ERROR and seen[-1].data["code"] == "cancelled"
    with pytest.raises(StageError, match="cancelled"):
        handle.result(timeout=30)
    assert engine.executor.in_flight() == 0


def test_a_closed_fence_stops_the_turn_and_silences_it(engine):
    current = [True]
    handle = engine.submit_voice_turn("voice", _turn(max_tokens=200), fence=lambda: current[0])
    after = []
    for event in handle.events(timeout=300):
        if not current[0]:
            after.append(event)
        elif event.kind is EventKind.DELTA:
            current[0] = False  # barge-in: the session's epoch moved on
    assert [e.kind for e in after] == [EventKind.ERROR] and after[0].data["code"] == "cancelled"
    assert engine.executor.in_flight() == 0


def test_unknown_voice_model_is_a_404(engine):
    with pytest.raises(StageError) as info:
        engine.submit_voice_turn("nope", _turn())
    assert (http_status(info.value), info.value.param) == (404, "model")
