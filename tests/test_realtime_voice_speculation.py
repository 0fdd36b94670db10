"""Voice turns that answer sooner (realtime/voice/speculation.py, asr.py's early final, vad.py's adaptive end of
turn and barge-in hold), in-process: the final transcript from the pause's decode, speculative responses kept and
discarded, semantic_vad, and response audio held while a barge-in is being confirmed.

Waits are on events and session state, never on wall-clock thresholds: a speculation is given the time it needs by
holding the rest of the pause back until it has started.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipelines.config import VoiceSessionConfig
from realtime.sessions import Journal, Outbox
from realtime.voice.session import VoiceSession
from realtime.voice.turn_detection import EAGERNESS
from realtime.voice.vad import EnergyModel, TurnDetector, VadLoader, VadParams
from tests.test_realtime_voice_support import (
    Collector,
    needs_speech,
    silence,
    speech,
    stream,
    voice_engine,
    voice_models,
    voiced,
)

__all__ = ["voice_models"]  # the fixture, imported for pytest
PAUSE_S = 0.3  # silence fed first: past early_final_ms (100), short of silence_duration_ms (500)


def said(text: str) -> np.ndarray:
    """espeak-ng reading `text`, its trailing silence (~0.4 s) cut: the tests make the pauses themselves."""
    samples = speech(text)
    return samples[:np.flatnonzero(np.abs(samples) > 0.01)[-1] + 240]


@pytest.fixture(scope="module")
def engine(voice_models):
    eng = voice_engine(voice_models, max_output_tokens=16)
    yield eng
    eng.shutdown()


async def open_session(engine, **limits) -> tuple[VoiceSession, Collector]:
    collector = Collector()
    outbox = Outbox(Journal(100_000, 1 << 30))
    await outbox.attach(collector.send)
    # no pacing wait (a long lead): the tests read whole replies, not their timing
    config = VoiceSessionConfig(vad="energy", **{"max_input_age_ms": 600_000, "max_lead_ms": 600_000, **limits})
    session = VoiceSession(engine, engine.voice_model("voice"), config, session_id="sess_spec", resume_token="tok",
                           outbox=outbox, vad=VadLoader("energy"))
    await session.start()
    return session, collector


def speculations(engine, outcome: str) -> float:
    return engine.metrics.registry.get_sample_value("mmserve_realtime_voice_speculations_total",
                                                    {"model": "voice", "outcome": outcome}) or 0.0


def finals(engine, source: str) -> float:
    return engine.metrics.registry.get_sample_value("mmserve_realtime_voice_final_transcripts_total",
                                                    {"model": "voice", "source": source}) or 0.0


def replies(c: Collector) -> list[tuple[str, str, bool]]:
    """Per response, in order: its transcript, the user's transcript it answered, whether it was speculated."""
    users = [e["transcript"] for e in c.of("conversation.item.input_audio_transcription.completed")]
    metrics = {e["response_id"]: e for e in c.of("response.metrics")}
    out = []
    for k, done in enumerate(c.of("response.done")):
        content = done["response"]["output"][0]["content"][0]
        out.append((content["transcript"], users[k], metrics[done["response"]["id"]]["speculated"]))
    return out


async def speak_turn(s: VoiceSession, c: Collector, words: np.ndarray, *, speculating: bool) -> None:
    """One turn: the words and a pause past early_final_ms, then (speculating: once the speculation has started)
    the rest of the endpointing silence; returns after the reply's response.done."""
    done = len(c.of("response.done"))
    await stream(s.receive, np.concatenate([silence(0.3), words, silence(PAUSE_S)]), realtime=False)
    if speculating:
        await c.wait_for(lambda: s.speculation is not None and s.speculation.handle is not None)
    await stream(s.receive, silence(0.6), realtime=False)
    await c.wait_event("response.done", done + 1)


@needs_speech
def test_speculated_replies_equal_the_turns_own_over_twenty_turns(engine):
    """20 scripted turns twice, on the same audio: with speculation every reply was started in the pause and kept,
    and every reply (text and audio length) equals the one the session without speculation made for the same
    final transcript. The final transcripts are the early finals: no asr decode after the turns ended."""
    lines = ["My brother found a red car.", "The teacher opened the green door.", "Our neighbor bought a new phone.",
             "The little girl painted the big window.", "My friend washed a warm coat."] * 4
    audio = [said(line) for line in lines]

    async def conversation(speculate: bool):
        s, c = await open_session(engine, speculate=speculate)
        # no barge-in truncation (a reply sent whole plays on): each turn's context is the whole conversation
        await s.receive('{"type": "session.update", "session": {"turn_detection": {"interrupt_response": false}}}')
        for words in audio:
            await speak_turn(s, c, words, speculating=speculate)
        await s.close("test")
        return c

    before = {k: speculations(engine, k) for k in ("started", "kept", "discarded")}
    early = finals(engine, "early")
    with_spec = asyncio.run(conversation(True))
    counts = {k: speculations(engine, k) - before[k] for k in before}
    assert finals(engine, "early") - early == 20  # every final was the pause's decode
    without = asyncio.run(conversation(False))
    assert counts == {"started": 20, "kept": 20, "discarded": 0}
    a, b = replies(with_spec), replies(without)
    assert len(a) == len(b) == 20
    assert all(spec for _, _, spec in a) and not any(spec for _, _, spec in b)
    assert [(text, user) for text, user, _ in a] == [(text, user) for text, user, _ in b]
    sent = lambda c: [m["audio_sent_ms"] for m in c.of("response.metrics")]  # noqa: E731
    assert sent(with_spec) == sent(without)
    assert sum("car" in user.lower() for _, user, _ in a) >= 3  # real transcripts, not empty ones
    for c in (with_spec, without):  # every turn: the user's transcript completed before its answer's item opened
        assert all(c.index(t) < c.index(o) for t, o in zip(
            c.of("conversation.item.input_audio_transcription.completed"), c.of("response.output_item.added")))


@needs_speech
def test_a_speculation_the_speaker_talks_past_is_discarded_unheard(engine):
    """The speaker pauses (a speculation starts on the first half), then goes on: the speculation is cancelled and
    nothing of it is ever sent; the one response answers the whole utterance, as without speculation."""
    first, second = said("My brother found a red car"), said("and the teacher opened the green door.")

    async def turn(speculate: bool):
        s, c = await open_session(engine, speculate=speculate)
        await stream(s.receive, np.concatenate([silence(0.3), first, silence(PAUSE_S)]), realtime=False)
        if speculate:
            await c.wait_for(lambda: s.speculation is not None and s.speculation.handle is not None)
            spec = s.speculation
        await stream(s.receive, np.concatenate([second, silence(0.8)]), realtime=False)
        await c.wait_event("response.done")
        await s.drain()
        await s.close("test")
        return c, spec.handle.done if speculate else None

    before = {k: speculations(engine, k) for k in ("started", "kept", "discarded")}
    c, cancelled = asyncio.run(turn(True))
    counts = {k: speculations(engine, k) - before[k] for k in before}
    plain, _ = asyncio.run(turn(False))
    assert counts == {"started": 1, "kept": 0, "discarded": 1} and cancelled
    created = c.of("response.created")
    assert len(created) == 1  # the speculation never showed itself
    rid = created[0]["response"]["id"]
    stop = c.index(c.of("input_audio_buffer.speech_stopped")[-1])
    assert c.index(created[0]) > stop
    deltas = [e for e in c.events if e["type"].startswith("response.") and "delta" in e]
    assert deltas and all(e["response_id"] == rid for e in deltas) and c.index(deltas[0]) > stop
    transcript = c.of("conversation.item.input_audio_transcription.completed")[0]["transcript"].lower()
    assert "car" in transcript and "door" in transcript  # the final covers both halves
    assert replies(c) == [(*replies(plain)[0][:2], False)]  # the same reply as without speculation


@needs_speech
def test_semantic_vad_ends_a_finished_sentence_sooner(engine):
    """The adaptive end of turn: with sentence_silence_ms, a pause after a transcript that ends a sentence ends the
    turn once that much silence has passed; without it, the same audio has not ended the turn (silence_duration_ms
    is 3 s). semantic_vad maps onto it and says so in session.updated."""
    words = said("The teacher opened the green door.")

    async def turn(detection: dict):
        s, c = await open_session(engine, speculate=False)
        await s.receive('{"type": "session.update", "session": {"turn_detection": %s}}' % detection)
        await c.wait_event("session.updated")
        await stream(s.receive, np.concatenate([silence(0.3), words, silence(PAUSE_S)]), realtime=False)
        await c.wait_for(lambda: s.input.detector.sentence_ended)  # the early final: "... door."
        await stream(s.receive, silence(0.2), realtime=False)
        await s.drain()
        stopped = c.of("input_audio_buffer.speech_stopped")
        await s.close("test")
        return c.of("session.updated")[-1]["session"]["turn_detection"], stopped

    wire, stopped = asyncio.run(turn('{"type": "server_vad", "silence_duration_ms": 3000, "sentence_silence_ms": 200}'))
    assert wire["sentence_silence_ms"] == 200 and len(stopped) == 1
    _, stopped = asyncio.run(turn('{"type": "server_vad", "silence_duration_ms": 3000}'))
    assert stopped == []
    wire, stopped = asyncio.run(turn('{"type": "semantic_vad", "eagerness": "high"}'))
    assert wire == {"type": "semantic_vad", "eagerness": "high", "create_response": True, "interrupt_response": True}
    assert EAGERNESS["high"][1] <= 200 and len(stopped) == 1


def test_speech_that_may_be_a_barge_in_holds_the_reply_until_it_is_refuted(engine):
    """A response is sending audio; a click of speech (one window, shorter than min_speech_ms) closes the audio gate,
    and the silence after it opens it again: the reply goes on, not cancelled. Unit check of the detector's
    `suspecting` and of the stop event's speech_end."""
    async def main():
        s, c = await open_session(engine, min_speech_ms=200, max_lead_ms=1000)
        await s.receive('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", '
                        '"content": [{"type": "input_text", "text": "Tell me a long story."}]}}')
        await s.receive('{"type": "response.create"}')
        await c.wait_event("response.output_audio.delta")
        await stream(s.receive, voiced(0.1), chunk_ms=(100,), realtime=False)
        await s.drain()
        held = not s.audio_gate.is_set()
        await stream(s.receive, silence(0.3), chunk_ms=(100,), realtime=False)
        await s.drain()
        opened = s.audio_gate.is_set()
        done = await c.wait_event("response.done")
        await s.close("test")
        return held, opened, done, c.of("input_audio_buffer.speech_started")

    held, opened, done, started = asyncio.run(main())
    assert held and opened and started == []
    assert done["response"]["status"] in ("completed", "incomplete")

    detector = TurnDetector(EnergyModel(), VadParams(min_speech_ms=64, silence_duration_ms=160))
    tone = voiced(0.5, rate=16000)
    assert detector.feed(tone[:512]) == [] and detector.suspecting  # one speech window: not yet a start
    events = detector.feed(tone[512:])
    assert [e.kind for e in events] == ["start"] and not detector.suspecting
    events = detector.feed(np.zeros(16000, np.float32))
    assert [e.kind for e in events] == ["stop"] and events[0].speech_end == -(-len(tone) // 512) * 512
