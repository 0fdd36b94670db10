"""WS /v1/realtime/video in mode img2img against an in-process server: a 30 fps camera feed on a deliberately slow
denoiser (a known sleep per forward), so frames pile up and the bookkeeping (order, drop reasons, deadlines, the
stream batch, overload) is exercised without any assertion on speed."""

from __future__ import annotations

import asyncio
import io
import json
import time

import numpy as np
from PIL import Image

from pipelines.image_request import ImageRequest, Task
from tests.test_realtime_video_support import (  # noqa: F401
    Client,
    Media,
    batches_of_two_or_more,
    decode_jpeg,
    jpeg,
    painted_frame,  # fixtures
    server,
    slow_denoiser,
    video_demo_models,
)

PROMPT = "a watercolour fox"


def _session(**fields) -> dict:
    return {"type": "session.update", "session": {"mode": "img2img", "model": "sd-demo", "prompt": PROMPT, **fields}}


async def _feed(client: Client, seqs, fps: float, *, stale: set[int] = frozenset(), size: int = 64) -> dict[int, bytes]:
    """Send painted frames at `fps`; `stale` ones carry a capture time 10 s in the past. Returns seq -> JPEG."""
    sent = {}
    for seq in seqs:
        sent[seq] = jpeg(painted_frame(seq, size))
        capture = time.time() * 1000 - (10_000 if seq in stale else 0)
        await client.send_frame({"seq": seq, "frame_idx": seq, "content_type": "image/jpeg", "capture_ts_ms": capture,
                                 "pts_ms": seq * 1000 / fps}, sent[seq])
        await asyncio.sleep(1 / fps)
    return sent


def _fates(client: Client) -> tuple[dict[int, Media], dict[int, str]]:
    outputs = {m.header["seq"]: m for m in client.media}
    dropped = {e["seq"]: e["reason"] for e in client.of_type("frame.dropped")}
    return outputs, dropped


async def _until_accounted(client: Client, seqs, timeout: float = 180) -> None:
    """Receive until every frame in `seqs` came back (an output and its chunk.done) or was dropped."""
    deadline = time.monotonic() + timeout

    def accounted() -> set[int]:
        return {e["seq"] for e in client.events if e["type"] in ("chunk.done", "frame.dropped")}

    while not set(seqs) <= accounted():
        await client.receive(max(0.01, deadline - time.monotonic()))


def test_sixty_frames_come_back_in_order_within_their_deadline_and_equal_solo_runs(server):
    deadline_ms, n = 4000, 60
    engine = server.engine
    shared_before = batches_of_two_or_more(engine, "sd-demo/denoise")

    async def main():
        client = await Client.connect(server.url)
        await client.send(_session(steps=4, strength=0.5, seed=7, frame_deadline_ms=deadline_ms, output_quality=90))
        created = await client.until_type("session.created")
        receiver = asyncio.create_task(_until_accounted(client, range(n)))
        sent = await _feed(client, range(n), 30.0, stale={n - 1})  # the last one was captured 10 s ago
        await receiver
        await client.close()
        return created, sent, client

    with slow_denoiser(engine, "sd-demo", 0.08):
        created, sent, client = asyncio.run(main())
    assert created["session"]["lookahead"] == 2  # int(4 * 0.5) denoise steps: two frames in flight
    outputs, dropped = _fates(client)
    # Every frame has exactly one fate; outputs keep the input order.
    assert not set(outputs) & set(dropped) and set(outputs) | set(dropped) == set(range(n))
    order = [m.header["seq"] for m in client.media]
    assert order == sorted(order) and [m.header["block_idx"] for m in client.media] == list(range(len(order)))
    # Stale input is dropped before GPU work; a newer frame supersedes a waiting one.
    assert set(dropped.values()) <= {"deadline", "superseded"} and "superseded" in dropped.values()
    assert dropped[n - 1] == "deadline"
    # No output leaves the server older than its deadline.
    assert outputs and all(m.header["sent_ts_ms"] - m.header["capture_ts_ms"] <= deadline_ms for m in outputs.values())
    # One forward advanced several frames (the stream batch), and every output got its stats.
    assert batches_of_two_or_more(engine, "sd-demo/denoise") > shared_before
    stats = client.of_type("chunk.done")
    assert [s["seq"] for s in stats] == order and all(s["denoise_ms"] >= 0 and s["decode_ms"] >= 0 for s in stats)
    assert sum(s["dropped_inputs"] for s in stats) <= len(dropped)

    # Each streamed frame equals the same frame run alone through the image-to-image pipeline.
    for seq in order[:3]:
        image = Image.open(io.BytesIO(sent[seq])).convert("RGB")
        solo = engine.submit_image("sd-demo", ImageRequest(PROMPT, task=Task.IMAGE_TO_IMAGE, image=image, strength=0.5,
                                                           num_inference_steps=4, guidance_scale=0.0, seed=7,
                                                           width=64, height=64)).result(timeout=120)
        (solo_jpeg,) = engine.encode_images(solo["images"], "jpeg", 90)
        streamed, alone = decode_jpeg(outputs[seq].payload).astype(int), decode_jpeg(solo_jpeg).astype(int)
        # Usually identical. A frame whose forwards were shared with another frame's can differ by float rounding
        # (CPU kernels block by batch size), which JPEG turns into a few levels on a few pixels (measured: at most
        # 3 levels, mean 0.02); another seed, step or strength differs by tens of levels almost everywhere.
        diff = np.abs(streamed - alone)
        assert diff.max() <= 4 and diff.mean() < 0.1, f"frame {seq} differs from its solo run: {diff.max()}, " \
                                                      f"{diff.mean():.3f}"


def test_similar_frames_are_skipped_at_most_max_skip_in_a_row(server):
    async def main():
        client = await Client.connect(server.url)
        await client.send(_session(similarity_threshold=0.98, max_similar_skip=2, frame_deadline_ms=60_000))
        await client.until_type("session.created")
        frame = jpeg(painted_frame(3))
        for seq in range(7):  # one at a time: nothing is superseded, every frame meets the filter
            await client.send_frame({"seq": seq, "content_type": "image/jpeg"}, frame)
            await _until_accounted(client, [seq])
        await client.close()
        return client

    client = asyncio.run(main())
    outputs, dropped = _fates(client)
    assert sorted(outputs) == [0, 3, 6] and dropped == {1: "similar", 2: "similar", 4: "similar", 5: "similar"}
    assert sum(s["skipped_inputs"] for s in client.of_type("chunk.done")) == 4


def test_two_sessions_share_denoiser_batches(server):
    engine, n = server.engine, 16
    before = batches_of_two_or_more(engine, "sd-demo/denoise")

    async def main():
        a, b = await Client.connect(server.url), await Client.connect(server.url)
        for c in (a, b):  # lookahead 1: a session alone never has two frames in one forward
            await c.send(_session(lookahead=1, frame_deadline_ms=60_000))
            await c.until_type("session.created")
        await asyncio.gather(_until_accounted(a, range(n)), _until_accounted(b, range(n)),
                             _feed(a, range(n), 15.0), _feed(b, range(n), 15.0))
        await a.close()
        await b.close()
        return a, b

    with slow_denoiser(engine, "sd-demo", 0.08):
        a, b = asyncio.run(main())
    assert a.media and b.media
    # Any forward with two or more items held frames of both sessions.
    assert batches_of_two_or_more(engine, "sd-demo/denoise") > before


def test_a_late_session_degrades_in_order_and_never_stalls_another(server):
    engine = server.engine

    async def feed_until(client: Client, done: asyncio.Event) -> None:
        seq = 0
        while not done.is_set():
            await client.send_frame({"seq": seq, "content_type": "image/jpeg", "capture_ts_ms": time.time() * 1000},
                                    jpeg(painted_frame(seq)))
            seq += 1
            await asyncio.sleep(1 / 20)

    async def watch_degradations(client: Client, done: asyncio.Event) -> list[dict]:
        seen = []
        while len(seen) < 3:
            event = await client.until(lambda e: e["type"] == "session.updated", timeout=180)
            seen.append(event)
        done.set()
        return seen

    async def main():
        late, fine = await Client.connect(server.url), await Client.connect(server.url)
        # 100 ms is less than two 100 ms forwards: every frame of `late` misses its deadline.
        await late.send(_session(steps=4, strength=0.5, frame_deadline_ms=100))
        await fine.send(_session(lookahead=1, frame_deadline_ms=60_000))
        for c in (late, fine):
            await c.until_type("session.created")
        done = asyncio.Event()
        updates, *_ = await asyncio.gather(watch_degradations(late, done), feed_until(late, done),
                                           feed_until(fine, done), _drain(fine, done))
        await late.close()
        await fine.close()
        return updates, late, fine

    with slow_denoiser(engine, "sd-demo", 0.1):
        updates, late, fine = asyncio.run(main())
    assert [u["degraded"]["knob"] for u in updates] == ["lookahead", "steps", "resolution"]
    assert [u["reason"] for u in updates] == ["overload"] * 3
    final = updates[-1]["session"]
    assert (final["lookahead"], final["steps"], final["size"]) == (1, 2, "32x32")
    assert "deadline" in {e["reason"] for e in late.of_type("frame.dropped")}
    assert fine.media, "the healthy session was stalled by the late one"


async def _drain(client: Client, done: asyncio.Event) -> None:
    while not done.is_set():
        try:
            await client.receive(0.2)
        except asyncio.TimeoutError:
            pass


def test_overload_gives_back_its_notches_in_reverse_order_once_on_time(server):
    """The session's own ladder, fed outcomes directly (no clock involved): 3 notches down, then back up."""
    from pipelines.config import RealtimeConfig
    from realtime.video.session import VideoSession

    async def main():
        session = VideoSession.open(server.engine, {"mode": "img2img", "model": "sd-demo", "prompt": PROMPT, "steps": 4,
                                                    "strength": 0.5, "lookahead": 2, "size": "64x64"},
                                    tenant="default", config=RealtimeConfig())
        events = []

        async def collect(frame):
            events.append(json.loads(frame))

        await session.outbox.attach(collect)
        window = session.ladder.window
        for _ in range(3 * window):
            await session.overloaded(True)
        down = (session.settings.lookahead, session.settings.steps, session.settings.size)
        for _ in range(3 * session.ladder.calm_after):
            await session.overloaded(False)
        up = (session.settings.lookahead, session.settings.steps, session.settings.size)
        await session.close("test")
        return events, down, up

    events, down, up = asyncio.run(main())
    updates = [e for e in events if e["type"] == "session.updated"]
    assert [(u["reason"], (u.get("degraded") or u["restored"])["knob"]) for u in updates] == [
        ("overload", "lookahead"), ("overload", "steps"), ("overload", "resolution"),
        ("recovered", "resolution"), ("recovered", "steps"), ("recovered", "lookahead")]
    assert down == (1, 2, "32x32") and up == (2, 4, "64x64")
    assert server.engine.metrics.registry.get_sample_value("mmserve_realtime_video_restored_total",
                                                           {"knob": "lookahead"}) >= 1
