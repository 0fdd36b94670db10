"""Video sessions as sessions: /v1/models lists who serves them, bad input is an error event and the session goes
on, admission refuses at capacity (never evicting), idle and over-long sessions are closed, a dropped socket
resumes with a replay, and API keys guard the handshake."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import websockets

from pipelines.config import MediaConfig, RealtimeConfig
from realtime.sessions import registry_for
from realtime.video.metrics import VideoMetrics
from stages.media.image import ImageDecodeLimits
from tests.test_realtime_video_support import (
    Client,
    InProcessServer,
    jpeg,
    painted_frame,
    start_engine,
    video_demo_models,  # noqa: F401  (a fixture)
)
from tests.test_serve_support import png_bytes

IMG2IMG = {"type": "session.update", "session": {"mode": "img2img", "model": "sd-demo", "prompt": "neon city",
                                                 "frame_deadline_ms": 60_000}}


@pytest.fixture(scope="module")
def engine(video_demo_models):  # noqa: F811
    # Small decode limits, so a frame over the pixel limit is cheap to make.
    eng = start_engine(video_demo_models, media=MediaConfig(image=ImageDecodeLimits(max_pixels=128 * 128)),
                       realtime=RealtimeConfig(max_video_sessions=2))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    srv = InProcessServer(engine)
    yield srv
    srv.stop()


def _serve(engine, **realtime) -> InProcessServer:
    """Another server on the same engine whose registry has its own [realtime] limits."""
    srv = InProcessServer(engine)
    srv.app.state.video_sessions = registry_for("video", RealtimeConfig(**realtime))
    return srv


def test_models_that_serve_sessions_list_realtime_video(server):
    models = {m["id"]: m["tasks"] for m in httpx.get(f"{server.http}/v1/models").json()["data"]}
    assert all("realtime-video" in models[name] for name in ("sd-demo", "ltx-demo", "wan-demo"))


def test_bad_input_is_an_error_event_and_the_session_survives(server):
    async def main():
        c = await Client.connect(server.url)
        await c.send({"type": "control", "kind": "prompt", "payload": {"prompt": "x"}})  # no session yet
        errors = [await c.until_type("error")]
        await c.send({"type": "session.update", "session": {**IMG2IMG["session"], "size": "60x60"}})
        errors.append(await c.until_type("error"))
        await c.send({"type": "session.update", "session": {**IMG2IMG["session"], "size": "2048x2048"}})
        errors.append(await c.until_type("error"))
        await c.send(IMG2IMG)
        await c.until_type("session.created")
        bad = [
            b"\x00\x00\x00\x05{oops",  # a header that is not JSON
            *[(header, payload) for header, payload in (
                ({"seq": 1, "content_type": "image/gif"}, b"GIF89a"),  # a content type it does not take
                ({"seq": 2, "content_type": "image/jpeg"}, b"not a jpeg at all"),  # fails to decode
                ({"seq": 3, "content_type": "image/jpeg"}, png_bytes(16, 16)),  # labelled wrong
                ({"seq": 4, "content_type": "image/png"}, png_bytes(512, 512)),  # over the pixel limit
            )],
        ]
        for item in bad:
            if isinstance(item, bytes):
                await c.ws.send(item)
            else:
                await c.send_frame(*item)
            errors.append(await c.until_type("error"))
        for event in ({"type": "credit", "n": -3}, {"type": "credit", "n": 10**9}, {"type": "credit", "n": "many"},
                      {"type": "control", "kind": "prompt", "payload": {"prompt": "x", "mood": "dark"}},
                      {"type": "session.update", "session": {"strenght": 0.3}},
                      {"type": "session.update", "session": {"mode": "t2v"}},
                      {"type": "no.such.event"}):
            await c.send({**event, "event_id": f"ev-{len(errors)}"})
            errors.append(await c.until_type("error"))
        await c.send_frame({"seq": 9, "content_type": "image/jpeg"}, jpeg(painted_frame(9)))  # and it still works
        out = await c.until(lambda e: e["type"] in ("chunk.done", "frame.dropped"))
        await c.close()
        return errors, out

    errors, out = asyncio.run(main())
    got = [(e["error"]["code"], e["error"]["param"]) for e in errors]
    assert got == [
        ("no_session", "type"), ("unsupported_size", "session.size"), ("unsupported_size", "session.size"),
        ("invalid_frame", "frame"), ("unsupported_content_type", "frame.content_type"), ("media_corrupt", "frame"),
        ("content_type_mismatch", "frame.content_type"), ("media_pixels", "frame"),
        ("invalid_value", "n"), ("invalid_value", "n"), ("invalid_value", "n"), ("unknown_field", "payload.mood"),
        ("unknown_field", "session.strenght"), ("immutable_field", "session.mode"), ("unknown_event", "type")]
    assert all(e["error"]["type"] == "invalid_request_error" and e["error"]["message"] for e in errors)
    assert errors[8]["error"]["event_id"] == "ev-8"
    assert out == {**out, "type": "chunk.done", "seq": 9}


def test_t2v_sessions_refuse_media_frames_and_go_on_when_max_chunks_rises(server):
    async def main():
        c = await Client.connect(server.url)
        await c.send({"type": "session.update", "session": {"mode": "t2v", "model": "wan-demo", "prompt": "a",
                                                            "steps": 1, "max_chunks": 1, "chunk_frames": 5}})
        await c.until_type("session.created")
        await c.send_frame({"seq": 0, "content_type": "image/jpeg"}, jpeg(painted_frame(0)))
        error = await c.until_type("error")
        done = await c.until_type("stream.done")
        await c.send({"type": "session.update", "session": {"max_chunks": 2}})  # a raised limit: the stream goes on
        more = await c.until_type("stream.done")
        await c.close()
        return error, done, more, c

    error, done, more, c = asyncio.run(main())
    assert error["error"]["code"] == "unexpected_media" and done["blocks"] == 1 and more["blocks"] == 2
    assert [e["block_idx"] for e in c.of_type("chunk.done")] == [0, 1]


def test_admission_refuses_at_capacity_without_evicting_and_admits_again_after_a_close(server):
    async def main():
        live = []
        for _ in range(2):
            c = await Client.connect(server.url)
            await c.send(IMG2IMG)
            await c.until_type("session.created")
            live.append(c)
        refused = await Client.connect(server.url)
        await refused.send(IMG2IMG)
        error = await refused.until_type("error")
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await refused.receive(30)
        # The live sessions are untouched: both still answer.
        for c in live:
            await c.send({"type": "session.heartbeat"})
            await c.until_type("session.heartbeat_ack")
        await live[0].close()  # a normal close ends the session and frees its place
        for _ in range(200):
            c = await Client.connect(server.url)
            await c.send(IMG2IMG)
            event = await c.until(lambda e: e["type"] in ("session.created", "error"))
            if event["type"] == "session.created":
                break
            await asyncio.sleep(0.05)
        for c2 in (c, live[1]):
            await c2.close()
        return error, closed.value, event

    error, closed, admitted = asyncio.run(main())
    assert (error["error"]["code"], error["error"]["type"]) == ("session_limit_reached", "rate_limit_error")
    assert closed.rcvd.code == 1013
    assert admitted["type"] == "session.created"
    assert server.engine.metrics.part(VideoMetrics).refused.labels(reason="session_limit_reached")._value.get() >= 1


def test_idle_and_over_long_sessions_are_closed(engine):
    idle, long = _serve(engine, idle_timeout_s=0.5), _serve(engine, max_duration_s=0.5)

    async def closed_reason(srv: InProcessServer, heartbeat: bool) -> str:
        c = await Client.connect(srv.url)
        await c.send(IMG2IMG)
        await c.until_type("session.created")
        while True:
            if heartbeat:  # keeps it from idling: only the maximum duration can end it
                await c.send({"type": "session.heartbeat"})
            try:
                event = await c.until(lambda e: e["type"] == "session.closed", timeout=0.1)
                return event["reason"]
            except asyncio.TimeoutError:
                continue

    try:
        assert asyncio.run(closed_reason(idle, heartbeat=False)) == "idle_timeout"
        assert asyncio.run(closed_reason(long, heartbeat=True)) == "max_duration"
    finally:
        idle.stop()
        long.stop()


def test_a_dropped_socket_resumes_with_the_missed_events(server):
    async def main():
        c = await Client.connect(server.url)
        await c.send(IMG2IMG)
        created = await c.until_type("session.created")
        await c.send({"type": "session.heartbeat", "event_id": "hb"})
        ack = await c.until_type("session.heartbeat_ack")
        c.ws.transport.abort()  # no close frame: the session is kept for a resume
        again = await Client.connect(server.url)
        await again.send({"type": "session.resume", "session_id": created["session"]["id"],
                          "resume_token": created["resume_token"],
                          "last_received_server_event_seq": created["server_event_seq"]})
        resumed = await again.until_type("session.resumed")
        replayed = await again.until_type("session.heartbeat_ack")
        await again.send({"type": "session.resume", "session_id": "sess_x", "resume_token": "y"})
        refused = await again.until_type("error")
        await again.close()
        return ack, resumed, replayed, refused

    ack, resumed, replayed, refused = asyncio.run(main())
    assert resumed["last_server_event_seq"] >= ack["server_event_seq"]
    assert replayed == ack  # the same numbered event, once more
    assert refused["error"]["code"] == "invalid_event"  # this socket already carries a session


def test_api_keys_guard_the_handshake(engine):
    srv = InProcessServer(engine, api_keys={"sk-video": "alice"})

    async def main():
        with pytest.raises(websockets.InvalidStatus) as refused:
            await Client.connect(srv.url)
        by_header = await Client.connect(srv.url, additional_headers={"Authorization": "Bearer sk-video"})
        by_protocol = await Client.connect(srv.url, subprotocols=["realtime", "openai-insecure-api-key.sk-video"])
        for c in (by_header, by_protocol):
            await c.send(IMG2IMG)
            await c.until_type("session.created")
            await c.close()
        return refused.value, by_protocol.ws.subprotocol

    try:
        refused, protocol = asyncio.run(main())
    finally:
        srv.stop()
    assert refused.response.status_code == 403 and protocol == "realtime"
