"""WS /v1/realtime through a real `mmserve serve` process: the official openai SDK's realtime client, a scripted
conversation of espeak-ng speech streamed at real time (real Whisper tiny.en) with a barge-in, and resume after
a dropped socket. No wall-clock thresholds: timeouts only catch hangs."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import openai
import pytest
from websockets.asyncio.client import connect

from tests.test_realtime_voice_support import (
    append_event,
    needs_speech,
    silence,
    speech,
    stream,
    voice_models,
    voice_server_config,
)
from tests.test_serve_support import Server, metric

__all__ = ["voice_models"]
TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def server(voice_models, tmp_path_factory):
    config = voice_server_config(voice_models, max_output_tokens=24, head="""
[realtime]
max_voice_sessions = 8
[realtime.voice]
max_input_age_ms = 60000
""")
    srv = Server(tmp_path_factory.mktemp("voice-server"), config)
    yield srv
    srv.stop()


def ws_url(server, **query) -> str:
    params = "&".join(f"{k}={v}" for k, v in {"model": "voice-demo", **query}.items())
    return server.url.replace("http://", "ws://") + f"/v1/realtime?{params}"


class Reader:
    """Every event of one socket, as it arrives."""

    def __init__(self, ws):
        self.ws = ws
        self.events: list[dict] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self):
        async for frame in self.ws:
            self.events.append(json.loads(frame))

    def of(self, kind: str, **fields) -> list[dict]:
        return [e for e in self.events if e["type"] == kind and all(e.get(k) == v for k, v in fields.items())]

    async def wait(self, predicate, timeout_s: float = TIMEOUT_S):
        async def poll():
            while not (value := predicate()):
                if self.task.done():
                    raise AssertionError(f"the socket closed; events: {[e['type'] for e in self.events][-20:]}")
                await asyncio.sleep(0.02)
            return value

        return await asyncio.wait_for(poll(), timeout_s)

    async def send(self, event: dict | str) -> None:
        await self.ws.send(event if isinstance(event, str) else json.dumps(event))


def test_the_voice_model_is_listed(server):
    models = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]}
    assert models["voice-demo"]["tasks"] == ["realtime-voice"]


def test_the_openai_sdk_completes_a_text_and_an_audio_turn(server):
    from openai.types.realtime import (
        ConversationItemCreatedEvent,
        ResponseAudioDeltaEvent,
        ResponseDoneEvent,
        ResponseTextDeltaEvent,
        SessionCreatedEvent,
    )

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        seen = []
        async with client.realtime.connect(model="voice-demo") as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hello"}]})
            await conn.response.create()
            async for event in conn:
                seen.append(event)
                if event.type == "response.done":
                    break
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                               "audio": {"input": {"turn_detection": None}}})
            noise = np.random.default_rng(0).standard_normal(24_000).astype(np.float32) * 0.1
            await conn.input_audio_buffer.append(audio=json.loads(append_event(noise))["audio"])
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            async for event in conn:
                seen.append(event)
                if event.type == "response.done":
                    break
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert isinstance(seen[0], SessionCreatedEvent)
    text, audio = [e for e in seen if isinstance(e, ResponseTextDeltaEvent)], \
        [e for e in seen if isinstance(e, ResponseAudioDeltaEvent)]
    dones = [e for e in seen if isinstance(e, ResponseDoneEvent)]
    assert text and audio and len(dones) == 2
    assert all(d.response.status in ("completed", "incomplete") for d in dones)
    assert dones[0].response.output[0].content[0].text == "".join(e.delta for e in text)
    assert all(len(base64.b64decode(e.delta)) % 2 == 0 for e in audio)  # pcm16
    assert any(isinstance(e, ConversationItemCreatedEvent) and e.item.role == "user" for e in seen)
    assert metric(server.url, "mmserve_realtime_voice_time_to_first_audio_seconds_count", model="voice-demo") >= 1


@needs_speech
def test_a_scripted_conversation_at_real_time_with_a_barge_in(server):
    first = speech("My brother bought a red car last night.")
    second = speech("Please tell me about the weather.")

    async def main():
        async with connect(ws_url(server), max_size=None) as ws:
            r = Reader(ws)
            await r.wait(lambda: r.of("session.created"))
            await stream(r.send, np.concatenate([silence(0.5), first, silence(0.8)]), chunk_ms=(20, 40, 60, 100))
            # talk over the reply as soon as its audio flows
            await stream(r.send, silence(30.0), chunk_ms=(100,), until=lambda: r.of("response.output_audio.delta"))
            await stream(r.send, np.concatenate([second, silence(1.0)]), chunk_ms=(100, 60, 40, 20))
            await r.wait(lambda: len(r.of("response.done")) >= 2)
            return r.events

    events = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    of = lambda kind, **f: [e for e in events if e["type"] == kind and all(e.get(k) == v for k, v in f.items())]  # noqa
    starts, stops = of("input_audio_buffer.speech_started"), of("input_audio_buffer.speech_stopped")
    assert len(starts) >= 2 and len(stops) >= 2
    first_item = starts[0]["item_id"]
    heard = " ".join(e["delta"] for e in of("conversation.item.input_audio_transcription.delta", item_id=first_item))
    done_text = of("conversation.item.input_audio_transcription.completed", item_id=first_item)[0]["transcript"]
    assert "brother" in heard.lower() and "car" in heard.lower(), heard  # streamed as it was spoken
    for word in ("brother", "red", "car"):
        assert word in done_text.lower(), done_text
    assert "weather" in " ".join(e["transcript"] for e in of("conversation.item.input_audio_transcription.completed"))
    r1, r2 = [e["response"]["id"] for e in of("response.created")][:2]
    cut = events.index(starts[1])
    assert max(i for i, e in enumerate(events) if e["type"] == "response.output_audio.delta"
               and e["response_id"] == r1) < cut
    done = {e["response"]["id"]: e["response"] for e in of("response.done")}
    assert (done[r1]["status"], done[r1]["status_details"]["reason"]) == ("cancelled", "turn_detected")
    assert done[r2]["status"] in ("completed", "incomplete") and of("response.output_audio.delta", response_id=r2)
    metrics = {e["response_id"]: e for e in of("response.metrics")}
    assert metrics[r1]["interrupt_to_silence_ms"] is not None
    assert all(metrics[r2][k] is not None for k in ("ttfa_ms", "asr_final_ms", "llm_ttft_ms", "tts_first_chunk_ms"))
    assert [e["server_event_seq"] for e in events] == list(range(1, len(events) + 1))


def test_a_dropped_socket_resumes_with_exactly_the_missed_events(server):
    async def main():
        async with connect(ws_url(server), max_size=None) as ws:
            r = Reader(ws)
            created = (await r.wait(lambda: r.of("session.created")))[0]
            await r.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Tell me something"}]}})
            await r.send({"type": "response.create"})
            await r.wait(lambda: len(r.of("response.output_audio.delta")) >= 3)
            ws.transport.abort()  # the network goes away: no close frame
            await asyncio.wait_for(asyncio.gather(r.task, return_exceptions=True), 30)
            before = list(r.events)
        last = before[-1]["server_event_seq"]
        session_id, token = created["session"]["id"], created["resume_token"]
        async with connect(ws_url(server, session_id=session_id), max_size=None) as ws:
            r = Reader(ws)
            await r.send({"type": "session.resume", "session_id": session_id, "resume_token": token,
                          "last_received_server_event_seq": last})
            await r.wait(lambda: r.of("response.done") and r.of("rate_limits.updated"))
            await r.send({"type": "session.heartbeat"})
            await r.wait(lambda: r.of("session.heartbeat_ack"))
            return before, r.events, last

    before, after, last = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert after[0]["type"] == "session.resumed" and after[0]["session_id"] == before[0]["session"]["id"]
    seqs = [e["server_event_seq"] for e in after[1:]]
    assert seqs == list(range(last + 1, last + 1 + len(seqs)))  # all of the missed events, in order, once
    assert not [e for e in after if e["type"] == "session.created"]
    position = 0.0  # the audio arrives whole: no piece twice, none skipped over
    for e in [e for e in before + after if e["type"] == "response.output_audio.delta"]:
        assert e["audio_start_ms"] == pytest.approx(position, abs=1)
        position += len(base64.b64decode(e["delta"])) / 48  # pcm16 at 24 kHz: 48 bytes a millisecond
