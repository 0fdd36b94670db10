"""Benchmark: realtime img2img sessions (WS /v1/realtime/video), stream batch on vs off, 1, 2 and 4 sessions.

    python examples/bench_realtime_video.py [--checkpoint DIR] [--vae tiny|full] [--size 64] [--steps 8]
                                            [--strength 0.5] [--lookahead N] [--frames 90] [--fps 30]
                                            [--sessions 1,2,4] [--device cpu] [--tiny]

A real mmserve server on loopback serves the SD checkpoint; each session is a camera client that sends
--frames JPEG frames at --fps (capture time stamped) and reads the stylised frames back. Per setting it
prints the output frames per second (per session and in total) and the per-frame latency (capture to
receipt, p50 / p99), for the stream batch on (lookahead = the denoise steps a frame runs: frames at
different steps share one denoiser forward) and off (lookahead 1: one frame in flight per session), at
equal steps, and the on/off ratio of frames per second. Newest input wins, so a server slower than the
camera drops (supersedes) frames rather than queueing them: fps counts frames delivered.

Without --checkpoint it builds the "small" demo SD model (random weights; --tiny: the tiny one, few frames)
under ~/.cache/mmserve/bench/, by default with a TAESD-shaped tiny VAE (AutoencoderTiny, random weights) in
place of its full one, as StreamDiffusion runs (its numbers use TAESD): the full VAE's encode and decode
cost more than the two UNet steps on a CPU and no batching shares them (--vae full keeps it).
With a GPU: --device cuda --checkpoint <an SD-turbo-size checkpoint> --size 512 --steps 2 --strength 0.5
(compare with StreamDiffusion's ~94 fps img2img on an RTX 4090, SD-turbo, 1 step).
Ratios, not absolute times, are the result: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: pipelines/, realtime/
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_images import bench_server  # noqa: E402


def _with_tiny_vae(checkpoint: Path, out: Path) -> Path:
    """A copy of an SD checkpoint whose VAE is a seeded random AutoencoderTiny (TAESD's architecture)."""
    import shutil

    import torch
    from diffusers import AutoencoderTiny

    if (out / "model_index.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint, tmp, ignore=shutil.ignore_patterns("vae"))
    torch.manual_seed(0)
    AutoencoderTiny().save_pretrained(tmp / "vae")
    index = json.loads((tmp / "model_index.json").read_text())
    index["vae"] = ["diffusers", "AutoencoderTiny"]
    (tmp / "model_index.json").write_text(json.dumps(index, indent=2))
    tmp.rename(out)
    return out


def _frame_jpeg(index: int, size: int) -> bytes:
    """A camera frame: a moving gradient with the index painted as bars (every frame differs)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    frame = np.stack([(x + 4 * index) % 256, (y + 2 * index) % 256, (x + y + index) % 256], -1).astype(np.uint8)
    for bit in range(8):
        frame[: size // 8, bit * size // 8:(bit + 1) * size // 8] = 255 if (index >> bit) & 1 else 0
    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="JPEG", quality=85)
    return out.getvalue()


async def _session(url: str, args, lookahead: int | None, frames: list[bytes]) -> dict:
    """One camera client: returns its output count, first-send and last-receipt times and latencies (ms)."""
    import websockets

    from realtime.sessions import pack_frame, unpack_frame

    async with websockets.connect(url, max_size=64 << 20, ping_interval=None) as ws:
        settings = {"mode": "img2img", "model": "bench", "prompt": "a watercolour painting", "size":
                    f"{args.size}x{args.size}", "steps": args.steps, "strength": args.strength, "seed": 1,
                    "frame_deadline_ms": 60_000, "credits": 10_000, "lookahead": lookahead}
        await ws.send(json.dumps({"type": "session.update", "session": settings}))
        created = json.loads(await ws.recv())
        if created["type"] != "session.created":
            raise RuntimeError(f"session refused: {created}")
        latencies, fates, last = [], 0, 0.0

        async def receive():
            nonlocal fates, last
            while fates < len(frames):
                message = await ws.recv()
                if isinstance(message, bytes):
                    header, _ = unpack_frame(message)
                    last = time.time() * 1000
                    latencies.append(last - header["capture_ts_ms"])
                elif json.loads(message)["type"] in ("chunk.done", "frame.dropped"):
                    fates += 1

        receiver = asyncio.create_task(receive())
        start = time.time() * 1000
        for seq, data in enumerate(frames):
            await ws.send(pack_frame({"seq": seq, "content_type": "image/jpeg", "capture_ts_ms": time.time() * 1000},
                                     data))
            await asyncio.sleep(1 / args.fps)
        await asyncio.wait_for(receiver, 600)
    return {"outputs": len(latencies), "start": start, "last": last, "latencies": latencies}


def _run(url: str, args, sessions: int, lookahead: int | None, frames: list[bytes]) -> dict:
    async def all_sessions():
        return await asyncio.gather(*(_session(url, args, lookahead, frames) for _ in range(sessions)))

    results = asyncio.run(all_sessions())
    latencies = sorted(x for r in results for x in r["latencies"])
    span_s = (max(r["last"] for r in results) - min(r["start"] for r in results)) / 1000
    total = sum(r["outputs"] for r in results)
    return {"fps_total": total / span_s, "fps_session": total / span_s / sessions, "outputs": total,
            "p50": statistics.median(latencies), "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


def _denoise_batches(base: str) -> tuple[float, float]:
    """(denoiser forwards, frames they carried) so far, from the batch-size histogram's count and sum."""
    import httpx

    values = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith(("mmserve_stage_batch_size_count", "mmserve_stage_batch_size_sum")) and \
                'stage="bench/denoise"' in line:
            values[line.split("{")[0].rsplit("_", 1)[1]] = float(line.rsplit(" ", 1)[1])
    return values.get("count", 0.0), values.get("sum", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="num_inference_steps; a frame runs steps x strength")
    parser.add_argument("--strength", type=float, default=0.5)
    parser.add_argument("--vae", default="tiny", choices=["tiny", "full"], help="the demo model's VAE")
    parser.add_argument("--lookahead", type=int, help="frames in flight with the stream batch on (default: the "
                                                         "denoise steps a frame runs)")
    parser.add_argument("--frames", type=int, default=90)
    parser.add_argument("--fps", type=float, default=30.0)
    parser.add_argument("--sessions", default="1,2,4")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tiny", action="store_true", help="the tiny demo model, 64 px, 12 frames, 1 and 2 sessions")
    args = parser.parse_args()
    if args.tiny:
        args.size, args.steps, args.frames, args.sessions = 64, 4, 12, "1,2"
    from pipelines.demo import build_demo_model

    scale = "tiny" if args.tiny else "small"
    checkpoint = args.checkpoint
    if checkpoint is None:
        root = Path.home() / ".cache/mmserve/bench"
        checkpoint = build_demo_model("sd", root / f"sd-{scale}", scale=scale)
        if args.vae == "tiny":
            checkpoint = _with_tiny_vae(checkpoint, root / f"sd-{scale}-taesd")
    counts = [int(n) for n in args.sessions.split(",")]
    denoise_steps = int(args.steps * args.strength)
    dtype = "float16" if args.device.startswith("cuda") else "float32"
    config = (f'[realtime]\nmax_video_sessions = {max(counts)}\n'
              f'[[models]]\nname = "bench"\npath = "{checkpoint}"\nfamily = "sd"\ndevice = "{args.device}"\n'
              f'dtype = "{dtype}"\n[models.pools.denoise]\nmax_batch_size = {max(8, max(counts) * denoise_steps)}\n')
    with bench_server(config) as (_, base):
        url = base.replace("http://", "ws://") + "/v1/realtime/video"
        import httpx

        tasks = {m["id"]: m["tasks"] for m in httpx.get(f"{base}/v1/models", timeout=30).json()["data"]}
        assert "realtime-video" in tasks["bench"], tasks
        frames = [_frame_jpeg(i, args.size) for i in range(args.frames)]
        vae = "its own" if args.checkpoint else args.vae
        print(f"checkpoint {checkpoint} ({vae} VAE), {args.size}x{args.size}, {args.steps} steps x strength "
              f"{args.strength} = {denoise_steps} denoise steps a frame, camera {args.fps:g} fps x "
              f"{args.frames} frames, {args.device}, {os.cpu_count()} CPUs")
        _run(url, args, 1, None, frames[: max(4, args.frames // 4)])  # warm-up
        for n in counts:
            result = {}
            for label, lookahead in (("on ", args.lookahead), ("off", 1)):
                forwards, items = _denoise_batches(base)
                r = result[label] = _run(url, args, n, lookahead, frames)
                after_forwards, after_items = _denoise_batches(base)
                batch = (after_items - items) / max(1.0, after_forwards - forwards)
                print(f"sessions {n}  stream batch {label}: {r['fps_session']:6.2f} fps/session {r['fps_total']:6.2f} "
                      f"fps total  latency p50 {r['p50']:7.1f} ms  p99 {r['p99']:7.1f} ms  "
                      f"{batch:.2f} frames a forward")
            ratio = result["on "]["fps_total"] / result["off"]["fps_total"]
            print(f"sessions {n}  stream batch on/off: ratio {ratio:.2f}x fps at equal steps (target >= 1.5)")


if __name__ == "__main__":
    main()
