"""One voice WebSocket's life in-process (a fake socket): admission that refuses rather than evicts, resume with
replay of exactly the missed events, resync when they are gone, and expiry (idle, grace period)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipelines.config import RealtimeConfig
from realtime.sessions import reap_until_empty, registry_for
from realtime.voice.connection import VoiceConnection
from realtime.voice.metrics import VoiceMetrics
from realtime.voice.vad import VadLoader
from tests.test_realtime_voice_support import voice_engine, voice_models

__all__ = ["voice_models"]


@pytest.fixture(scope="module")
def engine(voice_models):
    eng = voice_engine(voice_models, max_output_tokens=24)
    yield eng
    eng.shutdown()


class FakeSocket:
    """The client's end: frames it sends go in `inbox`, frames the server sends land in `events`."""

    def __init__(self):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.events: list[dict] = []
        self.close_code: int | None = None
        self.closed_by_server: tuple[int, str] | None = None
        self._hangup_code = 1000

    async def receive(self):
        frame = await self.inbox.get()
        if frame is None:
            self.close_code = self._hangup_code
        return frame

    async def send(self, frame):
        if self.closed_by_server is not None or self.close_code is not None:
            raise ConnectionError("closed")
        self.events.append(json.loads(frame))

    async def close(self, code, reason):
        self.closed_by_server = (code, reason)
        self.inbox.put_nowait(None)

    def say(self, event: dict) -> None:
        self.inbox.put_nowait(json.dumps(event))

    def hang_up(self, code: int = 1006) -> None:
        self._hangup_code = code
        self.inbox.put_nowait(None)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    async def wait(self, predicate, timeout_s: float = 120.0):
        async def poll():
            while not (value := predicate()):
                await asyncio.sleep(0.02)
            return value

        return await asyncio.wait_for(poll(), timeout_s)


def connect(engine, registry, *, model: str = "voice", resume_id: str | None = None, on_admit=None):
    socket = FakeSocket()
    connection = VoiceConnection(socket, engine, registry, VadLoader("energy"), tenant="default", model=model,
                                 resume_id=resume_id, on_admit=on_admit)
    task = asyncio.create_task(connection.run())
    return socket, task


async def ended(task: asyncio.Task) -> None:
    await asyncio.wait_for(task, 60)  # only guards against a hang


def test_admission_refuses_at_capacity_and_never_evicts(engine):
    async def main():
        registry = registry_for("voice", RealtimeConfig(max_voice_sessions=2))
        before = engine.metrics.registry.get_sample_value("mmserve_realtime_voice_refused_total",
                                                          {"reason": "session_limit_reached"}) or 0
        a, ta = connect(engine, registry)
        b, tb = connect(engine, registry)
        await a.wait(lambda: a.of("session.created"))
        await b.wait(lambda: b.of("session.created"))
        c, tc = connect(engine, registry)
        refused = await c.wait(lambda: c.of("error"))
        c.say({"type": "session.update", "session": {}})
        await ended(tc)
        a.say({"type": "session.heartbeat"})  # the live sessions were not touched
        await a.wait(lambda: a.of("session.heartbeat_ack"))
        a.hang_up(1000)  # a normal close ends the session: room for one more
        await ended(ta)
        d, td = connect(engine, registry)
        await d.wait(lambda: d.of("session.created"))
        refused_count = engine.metrics.registry.get_sample_value("mmserve_realtime_voice_refused_total",
                                                                 {"reason": "session_limit_reached"}) - before
        for sock, task in ((b, tb), (d, td)):
            sock.hang_up(1000)
            await ended(task)
        return refused, c, refused_count, len(registry)

    refused, c, refused_count, left = asyncio.run(main())
    assert refused[0]["error"]["code"] == "session_limit_reached" and refused[0]["error"]["type"] == "rate_limit_error"
    assert not c.of("session.created") and c.closed_by_server[0] == 1013
    assert refused_count == 1 and left == 0


def test_resume_replays_exactly_the_missed_events_once(engine):
    async def main():
        registry = registry_for("voice", RealtimeConfig())
        a, ta = connect(engine, registry)
        created = (await a.wait(lambda: a.of("session.created")))[0]
        a.say({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                            "content": [{"type": "input_text", "text": "Hi"}]}})
        a.say({"type": "response.create"})
        await a.wait(lambda: len(a.of("response.output_audio.delta")) >= 3)
        a.hang_up(1006)  # the network dropped
        await ended(ta)
        last = a.events[-1]["server_event_seq"]
        session = registry._sessions[created["session"]["id"]]
        await a.wait(lambda: session.outbox.journal.last_seq > last + 5)  # the session goes on without a socket
        # a wrong token is refused; the right one resumes (the URL said: resuming, so no new session opens)
        b, tb = connect(engine, registry, resume_id=created["session"]["id"])
        b.say({"type": "session.resume", "session_id": created["session"]["id"], "resume_token": "wrong",
               "last_received_server_event_seq": last})
        await b.wait(lambda: b.of("error"))
        c, tc = connect(engine, registry, resume_id=created["session"]["id"])
        c.say({"type": "session.resume", "session_id": created["session"]["id"],
               "resume_token": created["resume_token"], "last_received_server_event_seq": last})
        await c.wait(lambda: c.of("response.done") and c.of("rate_limits.updated"))
        c.say({"type": "session.heartbeat"})
        await c.wait(lambda: c.of("session.heartbeat_ack"))
        b.hang_up(1000)
        c.hang_up(1000)
        await asyncio.wait_for(asyncio.gather(tc, tb), 60)
        return a, b, c, last, len(registry)

    a, b, c, last, left = asyncio.run(main())
    assert b.of("error")[0]["error"]["code"] == "invalid_resume_token"
    assert c.events[0]["type"] == "session.resumed" and "server_event_seq" not in c.events[0]
    assert c.events[0]["replay_after"] == last
    seqs = [e["server_event_seq"] for e in c.events[1:]]
    assert seqs == list(range(last + 1, last + 1 + len(seqs)))  # every missed event, in order, once
    assert not c.of("session.created") and left == 0
    assert {e["server_event_seq"] for e in a.events}.isdisjoint(seqs)


def test_resume_past_the_journal_asks_for_a_resync_and_grace_expiry(engine):
    async def main():
        registry = registry_for("voice", RealtimeConfig(resume_grace_s=0.5))
        reaper = []
        a, ta = connect(engine, registry)
        created = (await a.wait(lambda: a.of("session.created")))[0]
        session = registry._sessions[created["session"]["id"]]
        session.outbox.journal.max_events = 2  # a tiny journal: older events fall out
        for _ in range(5):
            a.say({"type": "session.heartbeat"})
        await a.wait(lambda: len(a.of("session.heartbeat_ack")) == 5)
        a.hang_up(1006)
        await ended(ta)
        b, tb = connect(engine, registry)  # resume as the first event of a plain connection
        await b.wait(lambda: b.of("session.created"))
        b.say({"type": "session.resume", "session_id": session.id, "resume_token": created["resume_token"],
               "last_received_server_event_seq": 1})
        await b.wait(lambda: b.of("session.resync_required"))
        fresh_left = len(registry)  # the session opened on connect was dropped
        b.hang_up(1006)
        await ended(tb)
        reaper.append(asyncio.create_task(reap_until_empty(registry, engine.metrics.part(VoiceMetrics).sessions,
                                                           interval_s=0.05)))
        await b.wait(lambda: len(registry) == 0)  # the grace period passed: reaped
        c, tc = connect(engine, registry, resume_id=session.id)
        c.say({"type": "session.resume", "session_id": session.id, "resume_token": created["resume_token"],
               "last_received_server_event_seq": 1})
        await c.wait(lambda: c.of("error"))
        c.hang_up(1000)
        await ended(tc)
        return b, c, fresh_left

    b, c, fresh_left = asyncio.run(main())
    assert b.events[1]["type"] == "session.resumed" and fresh_left == 1
    assert c.of("error")[0]["error"]["code"] == "session_expired"


def test_idle_sessions_expire_and_unknown_models_are_refused(engine):
    async def main():
        registry = registry_for("voice", RealtimeConfig(idle_timeout_s=0.3))
        reaper, live = [], engine.metrics.part(VoiceMetrics).sessions
        a, ta = connect(engine, registry, on_admit=lambda: reaper.append(
            asyncio.create_task(reap_until_empty(registry, live, interval_s=0.05))))
        await a.wait(lambda: a.of("session.expired"))
        await ended(ta)
        x, tx = connect(engine, registry, model="no-such-voice")
        await ended(tx)
        return a, x, len(registry)

    a, x, left = asyncio.run(main())
    assert a.of("session.expired")[0]["reason"] == "idle_timeout" and a.closed_by_server[0] == 1000 and left == 0
    assert x.of("error")[0]["error"]["code"] == "model_not_found" and x.closed_by_server[0] == 1008


def test_the_route_authenticates_like_rest_and_speaks_beta_on_request(engine):
    from fastapi.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from serve.app import create_app

    app = create_app(engine, api_keys={"sk-alice": "alice"})
    with TestClient(app) as client:
        with pytest.raises(WebSocketDisconnect) as refused:  # no key: the handshake is refused
            with client.websocket_connect("/v1/realtime?model=voice"):
                pass
        assert refused.value.code == 1008
        with client.websocket_connect("/v1/realtime?model=voice", headers={"Authorization": "Bearer sk-alice",
                                                                           "OpenAI-Beta": "realtime=v1"}) as ws:
            created = ws.receive_json()
            ws.send_json({"type": "session.update", "session": {"turn_detection": None}})
            updated = ws.receive_json()
            ws.close(1000)
        with client.websocket_connect("/v1/realtime?model=voice",
                                      subprotocols=["realtime", "openai-insecure-api-key.sk-alice"]) as ws:
            assert ws.accepted_subprotocol == "realtime" and ws.receive_json()["type"] == "session.created"
            ws.close(1000)
    assert created["type"] == "session.created" and "input_audio_format" in created["session"]  # the beta shape
    assert updated["type"] == "session.updated" and updated["session"]["turn_detection"] is None
