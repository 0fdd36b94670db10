"""Voice sessions in-process (no socket): the OpenAI Realtime events a turn makes, bad input, the epoch fence on
barge-in (book Appendix G, ch.21), truncation to what was heard, pacing, dialects and formats.

The engine serves the tiny voice cascade (Whisper tiny.en when installed, the random llama and VITS).
Nothing here asserts wall-clock thresholds: waits only guard against hangs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import types

import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from pipelines.config import VoiceSessionConfig
from realtime.sessions import Journal, Outbox
from realtime.voice.response import OutputChunk
from realtime.voice.session import VoiceSession
from realtime.voice.vad import VadLoader
from tests.test_realtime_voice_support import (
    ESPEAK,
    Collector,
    append_event,
    needs_speech,
    pcm_b64,
    silence,
    speech,
    stream,
    voice_engine,
    voice_models,
    voiced,
)

__all__ = ["voice_models"]  # the fixture, imported for pytest
EXTENSIONS = {"response.metrics", "session.heartbeat_ack", "session.expired", "session.resync_required"}


@pytest.fixture(scope="module")
def engine(voice_models):
    eng = voice_engine(voice_models, max_output_tokens=24)
    yield eng
    eng.shutdown()


async def open_session(engine, *, vad: str = "energy", **limits) -> tuple[VoiceSession, Collector]:
    collector = Collector()
    outbox = Outbox(Journal(100_000, 1 << 30))
    await outbox.attach(collector.send)
    config = VoiceSessionConfig(vad=vad, **{"max_input_age_ms": 600_000, **limits})
    session = VoiceSession(engine, engine.voice_model("voice"), config, session_id="sess_test", resume_token="tok",
                           outbox=outbox, vad=VadLoader(vad))
    await session.start()
    return session, collector


async def send(session: VoiceSession, event: dict | str) -> None:
    await session.receive(event if isinstance(event, str) else json.dumps(event))


def user_text(text: str, **extra) -> dict:
    return {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                         "content": [{"type": "input_text", "text": text}]}, **extra}


def audio_ms(events: list[dict], rate: int = 24_000, bytes_per_sample: int = 2) -> float:
    return sum(len(base64.b64decode(e["delta"])) / bytes_per_sample for e in events) * 1000 / rate


def sample(engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name) or 0.0


def sdk_check(events: list[dict], beta: bool = False) -> None:
    """Every standard event validates as the official SDK's typed model of its kind (extensions are additive)."""
    if beta:
        from openai.types.beta.realtime.realtime_server_event import RealtimeServerEvent
    else:
        from openai.types.realtime.realtime_server_event import RealtimeServerEvent
    adapter = TypeAdapter(RealtimeServerEvent)
    for event in events:
        if event["type"] in EXTENSIONS:
            continue
        body = dict(event)
        if beta and event["type"] in ("session.created", "session.updated"):
            body["session"] = {k: v for k, v in event["session"].items() if k != "model"}  # OpenAI's names only
        try:
            adapter.validate_python(body)
        except ValidationError as exc:
            raise AssertionError(f"{event['type']} does not validate as the SDK type: {exc}") from None


def test_a_text_turn_emits_the_ga_events_in_order(engine):
    async def main():
        s, c = await open_session(engine)
        await send(s, {"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"]}})
        await send(s, user_text("Hello there"))
        await send(s, {"type": "response.create", "event_id": "ev_create"})
        done = await c.wait_event("response.done")
        await c.wait_event("rate_limits.updated")
        await s.close("test")
        return c.events, done

    events, done = asyncio.run(main())
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["session.created", "session.updated", "conversation.item.created"]
    turn = [k for k in kinds[3:] if k != "response.output_text.delta"]
    assert turn[:4] == ["response.created", "response.output_item.added", "conversation.item.created",
                        "response.content_part.added"]
    assert turn[4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.done", "response.metrics", "rate_limits.updated", "session.expired"]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    text = next(e for e in events if e["type"] == "response.output_text.done")["text"]
    assert deltas and "".join(deltas) == text
    assert done["response"]["status"] in ("completed", "incomplete") and done["response"]["usage"]["output_tokens"] > 0
    assert [e["server_event_seq"] for e in events] == list(range(1, len(events) + 1))
    assert len({e["event_id"] for e in events}) == len(events)
    metrics = next(e for e in events if e["type"] == "response.metrics")
    assert metrics["llm_ttft_ms"] is not None and metrics["ttfa_ms"] is None  # text: no audio
    sdk_check(events)


def test_idle_timeout_commits_an_empty_turn_and_answers_it(engine):
    """server_vad idle_timeout_ms: silence past the end of a response starts the next one by itself."""
    async def main():
        s, c = await open_session(engine)
        await send(s, {"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"],
                                                             "audio": {"input": {"turn_detection": {
                                                                 "type": "server_vad", "idle_timeout_ms": 5000}}}}})
        await send(s, user_text("Hello there"))
        await send(s, {"type": "response.create"})
        await c.wait_event("response.done")
        for _ in range(8):  # 0.8 s of silence: appends are activity but not speech, so the timer keeps running
            await send(s, append_event(silence(0.1)))
        timeout = await c.wait_event("input_audio_buffer.timeout_triggered")
        await c.wait_event("response.done", count=2)
        await s.close("test")
        return c.events, timeout

    events, timeout = asyncio.run(main())
    kinds = [e["type"] for e in events]
    at = kinds.index("input_audio_buffer.timeout_triggered")
    assert kinds[at + 1:at + 4] == ["input_audio_buffer.committed", "conversation.item.created", "response.created"]
    assert events[at + 1]["item_id"] == timeout["item_id"] == events[at + 2]["item"]["id"]
    assert events[at + 2]["item"]["role"] == "user"
    assert timeout["audio_end_ms"] - timeout["audio_start_ms"] <= 5000
    assert kinds.count("input_audio_buffer.timeout_triggered") == 1  # the next one waits for the next response to end
    sdk_check(events)


def test_bad_input_is_answered_with_an_error_and_the_session_survives(engine):
    async def main():
        s, c = await open_session(engine, max_append_bytes=1000, max_event_bytes=4096)
        await send(s, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        await send(s, user_text("Say something"))
        await send(s, {"type": "response.create"})
        await send(s, {"type": "response.create", "event_id": "e_busy"})  # one active response at a time
        done = await c.wait_event("response.done")
        item_id = done["response"]["output"][0]["id"]
        sent = audio_ms(c.of("response.output_audio.delta"))
        bad = [("{oops", None), (json.dumps({"type": "response.explode", "event_id": "e1"}), "e1"),
               (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%not-base64", "event_id": "e2"}), "e2"),
               (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 2000, "event_id": "e3"}), "e3"),
               (json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "e4"}), "e4"),
               (json.dumps({"type": "conversation.item.truncate", "item_id": "item_nope", "content_index": 0,
                            "audio_end_ms": 10, "event_id": "e5"}), "e5"),
               (json.dumps({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                            "audio_end_ms": int(sent) + 1000, "event_id": "e6"}), "e6"),
               (json.dumps({"type": "conversation.item.delete", "item_id": "item_nope", "event_id": "e7"}), "e7"),
               (json.dumps({"type": "conversation.item.retrieve", "item_id": "item_nope", "event_id": "e8"}), "e8"),
               (json.dumps({"type": "response.cancel", "event_id": "e9"}), "e9"),
               (json.dumps({"type": "input_audio_buffer.commit", "event_id": "e10"}), "e10"),
               (json.dumps({"type": "conversation.item.create", "previous_item_id": "item_nope", "event_id": "e11",
                            "item": {"type": "message", "role": "user",
                                     "content": [{"type": "input_text", "text": "x"}]}}), "e11"),
               (json.dumps({"type": "session.update", "session": {"voice": "nova"}, "event_id": "e12"}), "e12"),
               (json.dumps({"type": "session.update", "pad": "x" * 5000, "event_id": "e13"}), "e13"),
               (b"\x00binary", None)]
        for message, _ in bad:
            await s.receive(message)
        await send(s, {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                       "audio_end_ms": int(sent) // 2})
        await send(s, {"type": "session.heartbeat"})
        await c.wait_event("session.heartbeat_ack")
        item = s.conversation.get(item_id)
        await s.close("test")
        return c, [event_id for _, event_id in bad], item, sent

    c, event_ids, item, sent = asyncio.run(main())
    errors = c.of("error")
    busy, errors = errors[0], errors[1:]
    assert (busy["error"]["code"], busy["error"]["event_id"]) == ("conversation_already_has_active_response", "e_busy")
    expected = [("invalid_json", None), ("invalid_event_type", "type"), ("invalid_audio", "audio"),
                ("audio_too_large", "audio"), ("invalid_audio", "audio"), ("item_not_found", "item_id"),
                ("invalid_value", "audio_end_ms"), ("item_not_found", "item_id"), ("item_not_found", "item_id"),
                ("response_cancel_not_active", None), ("input_audio_buffer_commit_empty", None),
                ("item_not_found", "previous_item_id"), ("invalid_value", "session.voice"), ("event_too_large", None),
                ("invalid_frame", None)]
    assert [(e["error"]["code"], e["error"]["param"]) for e in errors] == expected
    assert [e["error"]["event_id"] for e in errors] == event_ids
    assert all(e["error"]["type"] == "invalid_request_error" and e["error"]["message"] for e in errors)
    truncated = c.of("conversation.item.truncated")[-1]
    assert truncated["audio_end_ms"] == int(sent) // 2 and item.heard_ms == int(sent) // 2
    sdk_check(c.events)


def test_barge_in_fences_the_old_response(engine):
    """Appendix G's worked example: speech over a response bumps the epoch; no audio of the old epoch leaves after
    the interruption (not even a late chunk handed in afterwards), the response ends cancelled / turn_detected
    and the history keeps only what was heard."""
    first = speech("My brother bought a red car last night.") if ESPEAK else voiced(2.0, seed=1)
    second = speech("Stop. Tell me about the weather instead.") if ESPEAK else voiced(1.5, seed=2)

    async def main():
        s, c = await open_session(engine)
        receive = s.receive
        await stream(receive, np.concatenate([silence(0.4), first, silence(0.7)]))
        created = await c.wait_event("response.created")
        r1 = created["response"]["id"]
        # silence until the reply's audio flows, then talk over it
        await stream(receive, silence(30.0), chunk_ms=(100,), until=lambda: c.of("response.output_audio.delta"))
        await stream(receive, np.concatenate([second, silence(1.0)]))
        await c.wait_for(lambda: [e for e in c.of("response.done") if e["response"]["id"] == r1])
        # a chunk of the old epoch that shows up late (a slow TTS worker, say) is dropped at the fence
        stale_before, count_before = len(c.events), sample(engine, "mmserve_realtime_voice_stale_chunks_dropped_total")
        item_id = c.of("response.output_item.added", response_id=r1)[0]["item"]["id"]
        sent_late = await s.sink_audio(created["response"]["epoch"],
                                       OutputChunk(r1, item_id, np.ones(2400, np.float32)))
        late = (sent_late, len(c.events) - stale_before,
                sample(engine, "mmserve_realtime_voice_stale_chunks_dropped_total") - count_before)
        await c.wait_event("response.done", 2)  # the reply to the interrupting turn
        context = await s.context_for(types.SimpleNamespace(params=s._default_params()))
        item = s.conversation.get(item_id)
        items = list(s.conversation)
        await s.close("test")
        return c, r1, item, late, context, s.stale_chunks_dropped, items

    c, r1, item, late, context, dropped, items = asyncio.run(main())
    events = c.events
    starts = c.of("input_audio_buffer.speech_started")
    assert len(starts) >= 2 and len(c.of("input_audio_buffer.speech_stopped")) >= 1
    cut = c.index(starts[1])
    old_deltas = [i for i, e in enumerate(events)
                  if e["type"] == "response.output_audio.delta" and e["response_id"] == r1]
    assert old_deltas and max(old_deltas) < cut  # the fence: nothing of the old response after the interruption
    assert all(e["epoch"] == 0 for e in c.of("response.output_audio.delta", response_id=r1))
    done = next(e for e in events if e["type"] == "response.done" and e["response"]["id"] == r1)
    assert c.index(done) > cut
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected", "error": None}
    assert late == (False, 0, 1) and dropped == 1  # the late chunk: not sent, counted
    metrics = next(e for e in c.of("response.metrics") if e["response_id"] == r1)
    assert metrics["status"] == "cancelled" and metrics["interrupt_to_silence_ms"] is not None
    # history keeps only what was heard: truncated to the played milliseconds, never past what was sent
    truncated = c.of("conversation.item.truncated", item_id=item.id)
    sent = audio_ms([events[i] for i in old_deltas])
    assert len(truncated) == 1 and truncated[0]["audio_end_ms"] == int(item.heard_ms)
    assert 0 <= item.heard_ms <= sent + 1e-6 and item.audio_ms == pytest.approx(sent)
    heard_words = item.history_text.split()
    assert len(" ".join(heard_words)) < len(" ".join(item.text.split()))  # the unheard rest is not in the history
    assert done["response"]["output"][0]["content"][0]["transcript"] == item.history_text
    assistant = [m["content"] for m in context if m["role"] == "assistant"]  # what the next LLM call sees
    later = [i.history_text for i in items if i.role == "assistant" and i.id != item.id]  # the reply to the new turn
    heard = [item.history_text] if item.history_text.strip() else []  # nothing heard: the item is left out
    assert assistant == heard + [text for text in later if text.strip()]
    replies = [e for e in c.of("response.created") if e["response"]["id"] != r1]
    assert replies and replies[0]["response"]["epoch"] == 1
    sdk_check(events)


def test_cancel_ack_and_client_truncate(engine):
    async def main():
        s, c = await open_session(engine)
        await send(s, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        await send(s, user_text("Tell me a story"))
        await send(s, {"type": "response.create"})
        first = await c.wait_event("response.output_audio.delta")
        await send(s, {"type": "playback.ack", "item_id": first["item_id"], "played_ms": 40})
        await send(s, {"type": "response.cancel", "response_id": first["response_id"]})
        done = await c.wait_event("response.done")
        truncated = await c.wait_event("conversation.item.truncated")
        await send(s, {"type": "conversation.item.truncate", "item_id": first["item_id"], "content_index": 0,
                       "audio_end_ms": 20})
        again = await c.wait_event("conversation.item.truncated", 2)
        await send(s, {"type": "conversation.item.retrieve", "item_id": first["item_id"]})
        retrieved = await c.wait_event("conversation.item.retrieved")
        await send(s, {"type": "conversation.item.delete", "item_id": first["item_id"]})
        deleted = await c.wait_event("conversation.item.deleted")
        item_ids = [i.id for i in s.conversation]
        await send(s, {"type": "response.create"})  # a client that cuts playback off itself
        second = (await c.wait_event("response.created", 2))["response"]["id"]
        await c.wait_for(lambda: c.of("response.output_audio.delta", response_id=second))
        await send(s, {"type": "output_audio_buffer.clear"})
        cleared = await c.wait_event("output_audio_buffer.cleared")
        await s.close("test")
        return c, first, done, truncated, again, retrieved, deleted, item_ids, (second, cleared)

    c, first, done, truncated, again, retrieved, deleted, item_ids, (second, cleared) = asyncio.run(main())
    assert cleared["response_id"] == second
    assert [e["response"]["status_details"]["reason"] for e in c.of("response.done")] == ["client_cancelled"] * 2
    assert done["response"]["status_details"]["reason"] == "client_cancelled"
    sent = audio_ms(c.of("response.output_audio.delta"))
    assert 40 <= truncated["audio_end_ms"] <= sent  # the ack, plus what played since, never past what was sent
    assert again["audio_end_ms"] == 20
    assert retrieved["item"]["id"] == first["item_id"] and retrieved["item"]["status"] == "incomplete"
    assert deleted["item_id"] == first["item_id"] and first["item_id"] not in item_ids
    sdk_check(c.events)


def test_pacing_bounds_the_lead_over_playback_and_g711_output(engine):
    async def main():
        s, c = await open_session(engine, max_lead_ms=300, delta_ms=40)
        await send(s, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None},
                                                                       "output": {"format": {"type": "audio/pcmu"}}}}})
        arrivals = []
        original = c.send

        async def timed(frame):
            await original(frame)
            arrivals.append(time.monotonic())

        s.outbox.detach()
        await s.outbox.attach(timed)
        await send(s, user_text("Talk for a while"))
        await send(s, {"type": "response.create"})
        await c.wait_event("response.done")
        await s.close("test")
        return c, arrivals

    c, arrivals = asyncio.run(main())
    deltas = [(i, e) for i, e in enumerate(c.events) if e["type"] == "response.output_audio.delta"]
    assert deltas and all(e["sample_rate_hz"] == 8000 for _, e in deltas)
    t0, total = arrivals[deltas[0][0]], 0.0
    for i, e in deltas:
        assert e["audio_start_ms"] == pytest.approx(total, abs=1)
        total += len(base64.b64decode(e["delta"])) * 1000 / 8000  # μ-law: one byte a sample
        assert total - (arrivals[i] - t0) * 1000 <= 300 + 40  # at most max_lead_ms ahead (+ a delta: scheduling)
        assert len(base64.b64decode(e["delta"])) <= 8000 * 40 // 1000
    assert arrivals[deltas[-1][0]] - t0 >= (total - 300 - 40) / 1000  # paced: no faster than real time


def test_speech_over_a_finished_reply_still_playing_truncates_it(engine):
    """All of the reply was sent (a long lead), the response is done, the client is still playing it: new
    speech truncates the item to what was played; nothing is cancelled."""
    async def main():
        s, c = await open_session(engine, max_lead_ms=60_000)
        await send(s, user_text("Hello"))
        await send(s, {"type": "response.create"})
        done = await c.wait_event("response.done")
        await stream(s.receive, np.concatenate([voiced(0.6), silence(0.2)]), chunk_ms=(40,))
        truncated = await c.wait_event("conversation.item.truncated")
        item = s.conversation.get(truncated["item_id"])
        await s.close("test")
        return done, truncated, item

    done, truncated, item = asyncio.run(main())
    assert done["response"]["status"] in ("completed", "incomplete")
    assert truncated["item_id"] == done["response"]["output"][0]["id"]
    assert truncated["audio_end_ms"] == int(item.heard_ms) and item.heard_ms < item.audio_ms


@needs_speech
def test_a_manual_turn_transcribes_real_speech(engine):
    words = speech("My friend painted the kitchen table yesterday.")

    async def main():
        s, c = await open_session(engine)
        await send(s, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        await stream(s.receive, np.concatenate([words, silence(0.3)]), realtime=False)
        await send(s, {"type": "input_audio_buffer.commit"})
        completed = await c.wait_event("conversation.item.input_audio_transcription.completed")
        await send(s, append_event(silence(0.5)))
        await send(s, {"type": "input_audio_buffer.clear"})
        await send(s, {"type": "input_audio_buffer.commit", "event_id": "empty"})
        await send(s, {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": pcm_b64(words)}]}})
        oneshot = await c.wait_event("conversation.item.input_audio_transcription.completed", 2)
        await send(s, {"type": "response.create"})
        done = await c.wait_event("response.done")
        context = await s.context_for(types.SimpleNamespace(params=s._default_params()))
        await s.close("test")
        return c, completed, oneshot, done, context

    c, completed, oneshot, done, context = asyncio.run(main())
    for result in (completed, oneshot):
        assert {"friend", "painted", "kitchen", "table"} <= set(result["transcript"].lower().replace(".", "").split())
    assert c.of("input_audio_buffer.cleared") and c.of("error")[0]["error"]["code"] == "input_audio_buffer_commit_empty"
    assert done["response"]["status"] in ("completed", "incomplete") and c.of("response.output_audio.delta")
    assert [m["content"] for m in context if m["role"] == "user"][:2] == [completed["transcript"],
                                                                          oneshot["transcript"]]


def test_stale_input_audio_is_dropped_by_age(engine):
    async def main():
        s, c = await open_session(engine, max_input_age_ms=500)
        before = sample(engine, "mmserve_realtime_voice_input_dropped_total")
        await s.receive(append_event(voiced(1.0)), received_at=s.clock() - 5.0)  # waited 5 s in the mailbox
        await s.receive(append_event(silence(0.1)))
        await s.drain()
        dropped = (s.input_chunks_dropped, sample(engine, "mmserve_realtime_voice_input_dropped_total") - before)
        await s.close("test")
        return c, dropped

    c, dropped = asyncio.run(main())
    assert dropped == (1, 1) and not c.of("input_audio_buffer.speech_started")


def test_the_beta_dialect_is_spoken_when_asked(engine):
    async def main():
        s, c = await open_session(engine)
        await send(s, {"type": "session.update", "session": {"modalities": ["text", "audio"], "turn_detection": None,
                                                             "output_audio_format": "g711_alaw"}})
        await send(s, user_text("Hi"))
        await send(s, {"type": "response.create", "response": {"modalities": ["text"]}})
        await c.wait_event("response.done")
        await send(s, {"type": "response.create"})
        await c.wait_event("response.done", 2)
        await s.close("test")
        return c

    c = asyncio.run(main())
    kinds = {e["type"] for e in c.events}
    assert {"response.text.delta", "response.text.done", "response.audio.delta", "response.audio_transcript.delta",
            "response.audio.done"} <= kinds
    assert not kinds & {"response.output_text.delta", "response.output_audio.delta"}
    assert c.of("session.updated")[0]["session"]["output_audio_format"] == "g711_alaw"
    sdk_check(c.events, beta=True)


def _nodes(engine, node: str, pool: str) -> float:
    return engine.metrics.registry.get_sample_value("mmserve_graph_nodes_total",
                                                    {"model": "llama-demo", "node": node, "stage": pool}) or 0.0


@needs_speech
def test_a_turn_ended_by_the_vad_transcribes_in_the_responses_graph(engine):
    """The response that starts at speech_stopped runs the utterance's final decode as its graph's asr node: the
    transcript is announced as usual (completed, before the answer's item), and it is what the LLM was given;
    a response cancelled at once hands the decode back, and the lane still finishes the transcript. (No early final
    here: it would start once a pause has lasted early_final_ms, and the turn ends before that.)"""
    words = speech("My friend painted the kitchen table yesterday.")

    async def main():
        s, c = await open_session(engine, early_final_ms=1000)
        before = _nodes(engine, "asr", "asr/asr")
        await stream(s.receive, np.concatenate([silence(0.3), words, silence(0.8)]), realtime=False)
        done = await c.wait_event("response.done")
        ran = _nodes(engine, "asr", "asr/asr") - before
        context = await s.context_for(types.SimpleNamespace(params=s._default_params()))
        await stream(s.receive, np.concatenate([words, silence(0.8)]), realtime=False)
        created = await c.wait_event("response.created", 2)
        await send(s, {"type": "response.cancel"})
        cancelled = await c.wait_event("response.done", 2)
        second = await c.wait_event("conversation.item.input_audio_transcription.completed", 2)
        await s.close("test")
        return c, done, ran, context, created, cancelled, second

    c, done, ran, context, created, cancelled, second = asyncio.run(main())
    completed = c.of("conversation.item.input_audio_transcription.completed")[0]
    assert {"friend", "painted", "kitchen", "table"} <= set(completed["transcript"].lower().replace(".", "").split())
    assert ran == 1  # the final decode was the turn graph's asr node
    assert done["response"]["status"] in ("completed", "incomplete")
    added = c.of("response.output_item.added", response_id=done["response"]["id"])[0]
    assert c.index(completed) < c.index(added)  # the transcript first, then the answer
    assert [m["content"] for m in context if m["role"] == "user"] == [completed["transcript"]]
    assert cancelled["response"]["id"] == created["response"]["id"]
    assert cancelled["response"]["status"] == "cancelled"
    assert {"friend", "painted", "kitchen", "table"} <= set(second["transcript"].lower().replace(".", "").split())
    sdk_check(c.events)
