"""WS /v1/realtime/video in mode t2v: chunks stream in order and equal the non-streamed video pipeline's output,
a prompt change applies at the next chunk, block_idx 0 starts a new epoch, and a continuation without its state
(a restarted server) is `session_state_lost`, never a silently fresh stream."""

from __future__ import annotations

import asyncio

import numpy as np
from PIL import Image

from pipelines.video import VideoRequest
from stages.media.video_encode import encode_fmp4_segment
from tests.test_realtime_video_support import Client, decode_jpeg, decode_mp4, server, video_demo_models  # noqa: F401  (fixtures)

PROMPT, OTHER = "a lighthouse at dusk", "a forest in the rain"


def _t2v(**fields) -> dict:
    return {"type": "session.update", "session": {"mode": "t2v", "model": "ltx-demo", "prompt": PROMPT, "steps": 2,
                                                  "seed": 5, "output_format": "fmp4", **fields}}


def _chunks(engine, model: str, prompts: list[str], *, seed: int, frames: int, continuation: bool) -> list[np.ndarray]:
    """The same chunks run one by one through the (non-streamed) video pipeline."""
    out, last = [], None
    for k, prompt in enumerate(prompts):
        image = Image.fromarray(last) if continuation and last is not None else None
        clip = engine.submit_video(model, VideoRequest(prompt, width=64, height=64, num_frames=frames, fps=25.0,
                                                       num_inference_steps=2, guidance_scale=0.0, seed=seed + k,
                                                       image=image)).result(timeout=300)["frames"]
        last = clip[-1]
        out.append(clip[1:] if continuation and k else clip)  # a continued chunk repeats the last frame first
    return out


def _as_stream(chunks: list[np.ndarray], fps: float = 25.0) -> bytes:
    """The chunks encoded as the session encodes them (one fMP4 segment each, one timeline)."""
    data, frame, fragment = b"", 0, 1
    for i, chunk in enumerate(chunks):
        seg = encode_fmp4_segment(chunk, fps, first_frame=frame, first_fragment=fragment, with_init=i == 0)
        data, frame, fragment = data + seg.data, frame + seg.frames, fragment + seg.fragments
    return data


async def _until_done(client: Client) -> dict:
    return await client.until(lambda e: e["type"] in ("stream.done", "error"))


def test_chunks_arrive_in_order_and_decode_to_the_non_streamed_video(server):
    async def main():
        client = await Client.connect(server.url)
        await client.send(_t2v(max_chunks=3, fps=25))
        created = await client.until_type("session.created")
        done = await _until_done(client)
        await client.close()
        return created, done, client

    created, done, client = asyncio.run(main())
    assert created["session"]["continuation"] == "i2v" and created["capabilities"]["block_frames"] == 9
    assert done == {**done, "type": "stream.done", "blocks": 3}
    headers = [m.header for m in client.media]
    assert [h["block_idx"] for h in headers] == [0, 1, 2] and [h["init"] for h in headers] == [True, False, False]
    assert [h["frame_idx"] for h in headers] == [0, 9, 17]  # chunk k > 0 does not resend the frame it starts from
    assert [s["block_idx"] for s in client.of_type("chunk.done")] == [0, 1, 2]
    streamed = b"".join(m.payload for m in client.media)
    reference = _chunks(server.engine, "ltx-demo", [PROMPT] * 3, seed=5, frames=9, continuation=True)
    assert streamed == _as_stream(reference)  # byte for byte: the same frames through the same encoder
    assert np.array_equal(decode_mp4(streamed), decode_mp4(_as_stream(reference)))
    assert len(decode_mp4(streamed)) == 25


def test_independent_chunks_as_jpeg_frames_equal_the_non_streamed_video(server):
    async def main():
        client = await Client.connect(server.url)
        await client.send(_t2v(model="wan-demo", max_chunks=2, chunk_frames=5, fps=25, output_format="jpeg",
                               output_quality=90))
        created = await client.until_type("session.created")
        await _until_done(client)
        await client.close()
        return created, client

    created, client = asyncio.run(main())
    assert created["session"]["continuation"] == "none"  # wan-demo does only text-to-video
    assert [m.header["frame_idx"] for m in client.media] == list(range(10))
    assert [m.header["block_idx"] for m in client.media] == [0] * 5 + [1] * 5
    reference = np.concatenate(_chunks(server.engine, "wan-demo", [PROMPT] * 2, seed=5, frames=5, continuation=False))
    expected = server.engine.encode_images([Image.fromarray(f) for f in reference], "jpeg", 90)
    assert [m.payload for m in client.media] == expected
    assert np.array_equal(decode_jpeg(client.media[3].payload), decode_jpeg(expected[3]))


def test_a_prompt_change_applies_at_the_next_chunk(server):
    async def main():
        client = await Client.connect(server.url)
        await client.send(_t2v(max_chunks=4, credits=2))  # fmp4: one credit a chunk, so the stream stops after 2
        await client.until(lambda e: e["type"] == "chunk.done" and e["block_idx"] == 1)
        await client.send({"type": "control", "kind": "prompt", "payload": {"prompt": OTHER}, "event_id": "ctl-1"})
        accepted = await client.until_type("control.accepted")
        await client.send({"type": "credit", "n": 2})
        await _until_done(client)
        await client.close()
        return accepted, client

    accepted, client = asyncio.run(main())
    assert accepted["event_id"] == "ctl-1" and accepted["block_idx"] == 2
    stats = client.of_type("chunk.done")
    assert [(s["block_idx"], s["event_id"]) for s in stats] == [(0, None), (1, None), (2, "ctl-1"), (3, None)]
    reference = _chunks(server.engine, "ltx-demo", [PROMPT, PROMPT, OTHER, OTHER], seed=5, frames=9, continuation=True)
    assert b"".join(m.payload for m in client.media) == _as_stream(reference)


def test_block_zero_starts_an_epoch_and_a_restart_loses_the_state(server):
    async def main():
        client = await Client.connect(server.url)
        await client.send(_t2v(credits=2))
        created = await client.until_type("session.created")
        await client.until(lambda e: e["type"] == "chunk.done" and e["block_idx"] == 1)
        first = client.media[0]
        await client.send({"type": "session.update", "session": {"block_idx": 5}, "event_id": "bad"})
        mismatch = await client.until_type("error")
        await client.send({"type": "session.update", "session": {"block_idx": 2}})  # continuing where it is: fine
        await client.until_type("session.updated")
        await client.send({"type": "session.update", "session": {"block_idx": 0}})  # a new epoch
        await client.until_type("session.updated")
        await client.send({"type": "credit", "n": 1})
        await client.until(lambda e: e["type"] == "chunk.done" and e["epoch"] == 2)
        restarted = client.media[-1]
        last_seq = client.events[-1]["server_event_seq"]

        server.restart()  # a new process for all the session knows: its state is gone
        again = await Client.connect(server.url)
        await again.send({"type": "session.resume", "session_id": created["session"]["id"],
                          "resume_token": created["resume_token"], "last_received_server_event_seq": last_seq})
        lost_resume = await again.until_type("error")
        await again.send(_t2v(block_idx=2))
        lost_block = await again.until_type("error")
        await again.send(_t2v(block_idx=0, max_chunks=1))
        fresh = await again.until_type("session.created")
        await _until_done(again)
        await again.close()
        return created, mismatch, first, restarted, lost_resume, lost_block, fresh, again

    created, mismatch, first, restarted, lost_resume, lost_block, fresh, again = asyncio.run(main())
    assert mismatch["error"]["code"] == "block_idx_mismatch" and mismatch["error"]["event_id"] == "bad"
    assert (restarted.header["epoch"], restarted.header["block_idx"], restarted.header["init"]) == (2, 0, True)
    assert restarted.payload == first.payload  # the new epoch starts the stream over, state reset
    assert lost_resume["error"]["code"] == "session_state_lost"
    assert (lost_block["error"]["code"], lost_block["error"]["param"]) == ("session_state_lost", "session.block_idx")
    assert fresh["session"]["id"] != created["session"]["id"]
    assert again.media and again.media[0].payload == first.payload
