"""Benchmark: mmserve vs the diffusers pipeline, side by side in one run, on one SD-family checkpoint.

    python examples/bench_images.py [--checkpoint DIR] [--size 256] [--steps 10] [--concurrency 8]

1. Single-request latency: mmserve's Python API vs `StableDiffusionPipeline.__call__`
   (same checkpoint, seed and parameters; runs interleaved, median of --repeats).
2. Throughput: --concurrency requests sent at once to a real mmserve server on loopback vs the
   diffusers pipeline called that many times in sequence. Prints the denoise batch sizes reached.

Without --checkpoint it builds the "small" demo SD model (random weights, big enough that compute
is measurable on the CPU). Ratios, not absolute times, are the result: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not become ready")


def latency(checkpoint: str, args) -> tuple[float, float]:
    import torch
    from diffusers import StableDiffusionPipeline

    from pipelines import Pipeline

    ref = StableDiffusionPipeline.from_pretrained(checkpoint, safety_checker=None, feature_extractor=None,
                                                  requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    params = dict(num_inference_steps=args.steps, height=args.size, width=args.size)
    ours_t, ref_t = [], []
    with Pipeline.from_pretrained(checkpoint, max_batch_size=1) as pipe:
        pipe("warm", seed=0, **params)
        ref("warm", generator=torch.Generator("cpu").manual_seed(0), **params)
        for i in range(args.repeats):
            t = time.perf_counter()
            pipe("a lighthouse", seed=i, **params)
            ours_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            ref("a lighthouse", generator=torch.Generator("cpu").manual_seed(i), **params)
            ref_t.append(time.perf_counter() - t)
    return statistics.median(ours_t), statistics.median(ref_t)


async def _burst(base: str, model: str, args) -> float:
    import httpx

    body = lambda i: {"model": model, "prompt": f"prompt {i}", "size": f"{args.size}x{args.size}",  # noqa: E731
                      "num_inference_steps": args.steps, "seed": i, "response_format": "b64_json"}
    async with httpx.AsyncClient(timeout=3600) as client:
        t = time.perf_counter()
        replies = await asyncio.gather(*(client.post(f"{base}/v1/images/generations", json=body(i))
                                         for i in range(args.concurrency)))
        elapsed = time.perf_counter() - t
    bad = [r.status_code for r in replies if r.status_code != 200]
    if bad:
        raise RuntimeError(f"server answered {bad}")
    return elapsed


def _batch_sizes(metrics_text: str, stage: str) -> str:
    counts = {}
    for line in metrics_text.splitlines():
        if line.startswith("mmserve_stage_batch_size_bucket") and f'stage="{stage}"' in line:
            le = line.split('le="')[1].split('"')[0]
            counts[le] = float(line.rsplit(" ", 1)[1])
    prev, seen = 0.0, []
    for le, c in sorted(((k, v) for k, v in counts.items() if k != "+Inf"), key=lambda kv: float(kv[0])):
        if c > prev:
            seen.append(f"<={int(float(le))}: {int(c - prev)}")
        prev = c
    return ", ".join(seen)


def throughput(checkpoint: str, args) -> tuple[float, float, str]:
    import httpx
    import torch
    from diffusers import StableDiffusionPipeline

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    config = Path(tempfile.mkdtemp()) / "bench.toml"
    config.write_text(f'[[models]]\nname = "bench"\npath = "{checkpoint}"\n'
                      f'[models.pools.denoise]\nmax_batch_size = {args.concurrency}\n'
                      f'[limits]\nmax_pixels = {max(args.size * args.size, 1 << 20)}\n')
    proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "serve", "--port", str(port), "--config", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(base, proc)
        asyncio.run(_burst(base, "bench", argparse.Namespace(**{**vars(args), "concurrency": 1})))  # warm
        ours = asyncio.run(_burst(base, "bench", args))
        sizes = _batch_sizes(httpx.get(f"{base}/metrics").text, "bench/denoise")
    finally:
        proc.terminate()
        proc.wait(30)
    ref = StableDiffusionPipeline.from_pretrained(checkpoint, safety_checker=None, feature_extractor=None,
                                                  requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    t = time.perf_counter()
    for i in range(args.concurrency):
        ref(f"prompt {i}", num_inference_steps=args.steps, height=args.size, width=args.size,
            generator=torch.Generator("cpu").manual_seed(i))
    return ours, time.perf_counter() - t, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint")
    parser.add_argument("--scale", default="small", choices=["tiny", "small"], help="demo model to build if no checkpoint")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from pipelines.demo import build_demo_model

    checkpoint = args.checkpoint or str(build_demo_model("sd", Path.home() / f".cache/mmserve/bench/sd-{args.scale}",
                                                         scale=args.scale))
    print(f"checkpoint {checkpoint}, {args.size}x{args.size}, {args.steps} steps, {os.cpu_count()} CPUs")
    ours, ref = latency(checkpoint, args)
    print(f"latency   mmserve {ours * 1000:8.1f} ms   diffusers {ref * 1000:8.1f} ms   ratio {ours / ref:.3f}x (target <= 1.05)")
    ours, ref, sizes = throughput(checkpoint, args)
    n = args.concurrency
    print(f"throughput mmserve {n / ours:6.2f} img/s (server, {n} concurrent)   diffusers {n / ref:6.2f} img/s "
          f"({n} sequential)   ratio {ref / ours:.2f}x (target >= 2)")
    print(f"denoise batch sizes reached: {sizes}")


if __name__ == "__main__":
    main()
