"""Benchmark: mmserve's video path vs the diffusers pipeline, side by side in one run, on a Wan checkpoint or on the
tiny demo checkpoint of each video family named.

    python examples/bench_video.py [--checkpoint DIR] [--size 64] [--frames 17] [--steps 8] [--requests 4]
    python examples/bench_video.py --families cogvideox hunyuan_video ltx2 [--repeats 1]

1. Throughput: --requests text-to-video jobs created at once on a real mmserve server on loopback
   (POST /v1/videos, then GET /v1/videos polled every 0.05 s until all completed) vs the checkpoint's own
   diffusers pipeline (`WanPipeline`, `LTX2Pipeline`, ...) `__call__` called that many times in sequence (same
   checkpoint, seeds and parameters; guidance and frame rate the pipeline's defaults on both sides). --repeats runs,
   the sides alternating which goes first; every run is printed with the load average and the cores other processes
   used meanwhile, then the medians. Prints the denoise batch sizes reached (from /metrics).
2. Peak memory of the temporal VAE decode: the checkpoint's `vae.decode` on random latents of
   --vae-size x --vae-size px and --vae-frames frames, with `vae.enable_tiling()` vs without; each
   variant runs in its own subprocess and reports its peak RSS growth (VmHWM minus VmRSS before).

Without --checkpoint it builds the demo model of each --families entry (default wan; random weights) under
~/.cache/mmserve/bench/; step 2 runs for Wan only (its VAE). A family's --size and --frames must fit its factors
(LTX-2: sizes of 32k px, 8k + 1 frames; the defaults 64 px and 17 frames fit every family).
Ratios, not absolute times, are the result: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: pipelines/, serve/
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_images import _batch_sizes, bench_server, compare_runs, loadavg, measured  # noqa: E402

FAMILIES = ("wan", "ltx", "cogvideox", "hunyuan_video", "hunyuan_video15", "ltx2")  # text-to-video demo checkpoints
# How often the client asks after its jobs: one GET /v1/videos for all of them (each request costs the server CPU
# the jobs would use, and a job's completion is seen up to this late).
POLL_S = 0.05


async def _jobs(base: str, model: str, args, n: int, prefix: str = "prompt") -> float:
    import httpx

    body = lambda i: {"model": model, "prompt": f"{prefix} {i}", "size": f"{args.size}x{args.size}",  # noqa: E731
                      "num_frames": args.frames, "num_inference_steps": args.steps, "seed": i}
    async with httpx.AsyncClient(timeout=600) as client:
        t = time.perf_counter()
        created = await asyncio.gather(*(client.post(f"{base}/v1/videos", json=body(i)) for i in range(n)))
        bad = [(r.status_code, r.text) for r in created if r.status_code != 200]
        if bad:
            raise RuntimeError(f"server answered {bad}")
        pending = {r.json()["id"] for r in created}
        while pending:
            listed = (await client.get(f"{base}/v1/videos", params={"limit": 100})).json()["data"]
            for job in listed:
                if job["id"] in pending and job["status"] == "completed":
                    pending.discard(job["id"])
                elif job["id"] in pending and job["status"] in ("failed", "cancelled", "expired"):
                    raise RuntimeError(f"video {job['id']} {job['status']}: {job.get('error')}")
            if pending:
                await asyncio.sleep(POLL_S)
        return time.perf_counter() - t


def throughput(checkpoint: str, args, label: str = "") -> list[float]:
    """Every run's ratio (diffusers' sequential time / mmserve's concurrent time), each printed as it ends."""
    import httpx
    import torch
    from diffusers import DiffusionPipeline

    config = (f'[jobs]\nvideo_concurrency = {max(4, args.requests)}\n'
              f'max_jobs_per_tenant = {max(8, 2 * args.requests)}\n'
              f'[[models]]\nname = "bench"\npath = "{checkpoint}"\n'
              f'[models.pools.denoise]\nmax_batch_size = {max(4, args.requests)}\n')
    ref = DiffusionPipeline.from_pretrained(checkpoint)  # the checkpoint's own class (model_index.json)
    ref.set_progress_bar_config(disable=True)
    params = dict(height=args.size, width=args.size, num_frames=args.frames, num_inference_steps=args.steps,
                  output_type="np")
    n, ours_runs, ref_runs = args.requests, itertools.count(), itertools.count()
    # New prompts every run (the same on both sides): the server's prompt cache saves nothing across runs.
    with bench_server(config) as (proc, base):
        ours_pids = [os.getpid(), proc.pid]

        def ours_once():
            prefix = f"prompt {next(ours_runs)}"
            return measured(lambda: asyncio.run(_jobs(base, "bench", args, n, prefix)), ours_pids, args)

        def ref_once():
            prefix = f"prompt {next(ref_runs)}"

            def loop():
                for i in range(n):
                    ref(f"{prefix} {i}", generator=torch.Generator("cpu").manual_seed(i), **params)
            return measured(loop, ours_pids, args)

        asyncio.run(_jobs(base, "bench", args, 1, "warm"))  # warm (another prompt: nothing cached is reused)
        ref("warm 0", generator=torch.Generator("cpu").manual_seed(0), **params)
        before = httpx.get(f"{base}/metrics").text
        ratios, ours, theirs = compare_runs(args.repeats, ours_once, ref_once)
        sizes = _batch_sizes(httpx.get(f"{base}/metrics").text, "bench/denoise", since=before)
    print(f"throughput {label}mmserve {ours:7.2f} s for {n} videos (server, {n} concurrent jobs)   "
          f"diffusers {theirs:7.2f} s ({n} sequential)   ratio {statistics.median(ratios):.2f}x median of "
          f"{' '.join(f'{r:.2f}' for r in ratios)} (target >= 1.0 in every run)")
    print(f"denoise batch sizes reached: {sizes}")
    return ratios


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _vae_child(checkpoint: str, tiled: bool, frames: int, size: int) -> None:
    """One decode in this process; prints {"peak_kb": growth of the peak RSS, "seconds": ...}."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.set_grad_enabled(False)
    vae = AutoencoderKLWan.from_pretrained(checkpoint, subfolder="vae")
    if tiled:
        vae.enable_tiling()
    factor_t = 2 ** sum(vae.config.temperal_downsample)
    factor_s = 2 ** len(vae.config.temperal_downsample)
    latents = torch.randn(1, vae.config.z_dim, (frames - 1) // factor_t + 1, size // factor_s, size // factor_s,
                          generator=torch.Generator().manual_seed(0))
    before = _status_kb("VmRSS")
    t = time.perf_counter()
    out = vae.decode(latents).sample
    seconds = time.perf_counter() - t
    print(json.dumps({"peak_kb": _status_kb("VmHWM") - before, "seconds": seconds, "shape": list(out.shape)}))


def vae_memory(checkpoint: str, args) -> dict[bool, dict]:
    result = {}
    for tiled in (False, True):
        run = subprocess.run([sys.executable, __file__, "--_vae-child", "1" if tiled else "0", "--checkpoint",
                              checkpoint, "--vae-frames", str(args.vae_frames), "--vae-size", str(args.vae_size)],
                             capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise RuntimeError(run.stderr)
        result[tiled] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a Wan checkpoint directory; default: the demo model of each family")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=["wan"], metavar="FAMILY",
                        help=f"video families whose tiny demo checkpoints to benchmark (any of {', '.join(FAMILIES)})")
    parser.add_argument("--size", type=int, default=64, help="frame width and height, px")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="before each timed side, wait up to this long for a second in which other processes "
                             "use under 0.3 cores (the machine is shared); 0: do not wait")
    parser.add_argument("--vae-size", type=int, default=512, help="decoded frame width and height, px")
    parser.add_argument("--vae-frames", type=int, default=5)
    parser.add_argument("--_vae-child", dest="vae_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vae_child is not None:
        return _vae_child(args.checkpoint, args.vae_child == "1", args.vae_frames, args.vae_size)

    from pipelines.demo import build_demo_model

    if args.checkpoint and args.families != ["wan"]:
        parser.error("--checkpoint is a Wan checkpoint; leave out --families, or --checkpoint for the demo models")
    for family in args.families:
        checkpoint = args.checkpoint or str(build_demo_model(family, Path.home() / f".cache/mmserve/bench/"
                                                                              f"{family}-tiny"))
        print(f"{family}: checkpoint {checkpoint}, {args.size}x{args.size} px, {args.frames} frames, {args.steps} "
              f"steps, {os.cpu_count()} CPUs, load {loadavg()}", flush=True)
        throughput(checkpoint, args, label=f"{family} ")
    if "wan" not in args.families:
        print(f"load at the end {loadavg()}")
        return
    checkpoint = args.checkpoint or str(build_demo_model("wan", Path.home() / ".cache/mmserve/bench/wan-tiny"))
    mem = vae_memory(checkpoint, args)
    untiled, tiled = mem[False], mem[True]
    print(f"vae decode {args.vae_size}x{args.vae_size} px x {args.vae_frames} frames: peak RSS growth untiled "
          f"{untiled['peak_kb'] / 1024:8.1f} MiB ({untiled['seconds']:.2f} s)   "
          f"tiled {tiled['peak_kb'] / 1024:8.1f} MiB "
          f"({tiled['seconds']:.2f} s)   ratio {untiled['peak_kb'] / max(tiled['peak_kb'], 1):.2f}x")


if __name__ == "__main__":
    main()
