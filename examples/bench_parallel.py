"""Benchmark: one request on a denoise replica of 2 ranks x 1 core vs 1 rank x 2 cores, on a small Flux.

    python examples/bench_parallel.py [--checkpoint FLUX_DIR] [--steps 8] [--size 256] [--repeats 3]
                                      [--modes cfg,ulysses]

Two modes, each comparing two engines that serve the same Flux checkpoint:

  cfg      ParallelConfig(cfg=2): true classifier-free guidance (true_cfg_scale 2, a negative prompt), the
           conditional half on rank 0 and the unconditional half on rank 1, one exchange a step.
  ulysses  ParallelConfig(ulysses=2): a plain request (no true CFG), each forward's image and text tokens sharded
           over the two ranks by diffusers' context-parallel hooks, all-to-all in attention.

The 2-rank side gives each rank one torch thread (pools={"denoise": PoolConfig(threads=1)}); the 1-rank side is the
same model without parallel, its denoise pool on two threads. On a CPU model the ranks are CPU processes (rank 0
is the engine's denoise worker thread, rank 1 a spawned process), so both sides use two cores.

A run is one image of --steps steps at --size px, submit to result. Each engine is warmed with one image first;
then --repeats rounds, the order alternating between rounds. Every run is printed with the load average, then per
mode the medians and the speed-up (1-rank time / 2-rank time; it may be < 1 on a CPU, where the ranks' exchanges and
the split's smaller matmuls can cost more than the second core gives), and for the 2-rank engine the per-rank mean
of mmserve_parallel_step_seconds (compute of a forward) and mmserve_parallel_collective_seconds (sending and
receiving its tensors) over the timed runs: rank 0's collective includes waiting for the other rank's output, and
Ulysses' all-to-alls inside attention count as compute. A run's time also holds the text encode and the VAE decode,
the same on both sides. Without --checkpoint the demo Flux (random weights) is built in a
temporary directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: pipelines/, stages/
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_distributed import alternate, loadavg  # noqa: E402  (examples/: the rounds and their printing)

MODEL = "flux"
SERIES = ("mmserve_parallel_step_seconds", "mmserve_parallel_collective_seconds")


def image_s(engine, args, seed: int, guided: bool) -> float:
    """Seconds, submit to result, of one image; guided: true CFG (two denoiser halves a step)."""
    from pipelines.image_request import ImageRequest

    extra, negative = ({"true_cfg_scale": 2.0}, "blurry") if guided else ({}, None)
    request = ImageRequest(prompt="a lighthouse", width=args.size, height=args.size, num_inference_steps=args.steps,
                           seed=seed, negative_prompt=negative, extra=extra)
    began = time.perf_counter()
    engine.submit_image(MODEL, request).result(timeout=600)
    return time.perf_counter() - began


def rank_series(engine, world: int) -> dict[tuple[str, int], tuple[float, float]]:
    """(sum, count) of each parallel series per rank."""
    def value(name: str, rank: int) -> float:
        return engine.metrics.registry.get_sample_value(name, {"model": MODEL, "rank": str(rank)}) or 0.0

    return {(s, r): (value(f"{s}_sum", r), value(f"{s}_count", r)) for s in SERIES for r in range(world)}


def compare(mode: str, parallel, guided: bool, path: str, args) -> None:
    """One mode: the 2-rank engine (parallel, 1 thread a rank) vs the 1-rank engine (2 threads), the same request."""
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine
    from stages.pool import PoolConfig

    specs = {"2 ranks x 1 core": ModelSpec(MODEL, path, pools={"denoise": PoolConfig(threads=1)}, parallel=parallel),
             "1 rank x 2 cores": ModelSpec(MODEL, path, pools={"denoise": PoolConfig(threads=2)})}
    two, one = specs
    engines = {}
    try:
        for side, spec in specs.items():
            engines[side] = Engine(EngineConfig(models=(spec,)))
            engines[side].start()
        request = "true CFG (true_cfg_scale 2, a negative prompt)" if guided else "no true CFG"
        print(f"\n{mode}: one image of {args.steps} steps at {args.size}px, {request}", flush=True)
        for engine in engines.values():  # warm: the first image of each side (ranks started, weights touched)
            image_s(engine, args, seed=0, guided=guided)
        before = rank_series(engines[two], parallel.world)
        runs = alternate(list(engines), args.repeats,
                         lambda side, round_: image_s(engines[side], args, seed=round_, guided=guided),
                         lambda v: f"image {v * 1000:9.1f} ms")
        after = rank_series(engines[two], parallel.world)
    finally:
        for engine in engines.values():
            engine.shutdown()
    med = {side: statistics.median(v) for side, v in runs.items()}
    print(f"\n{mode} medians over {args.repeats} rounds (load {loadavg()}):")
    print(f"  {mode}: {two} {med[two] * 1000:.1f} ms, {one} {med[one] * 1000:.1f} ms, "
          f"speed-up {med[one] / med[two]:.3f}x (1-rank / 2-rank; < 1: the 2 ranks are slower)")
    for rank in range(parallel.world):
        means = []
        for s in SERIES:
            total, count = (a - b for a, b in zip(after[s, rank], before[s, rank]))
            means.append(f"{total / count * 1000:8.2f} ms" if count else "       n/a")
        print(f"  {mode} rank {rank}: step {means[0]}, collective {means[1]} (mean per forward, "
              f"{int(after[SERIES[0], rank][1] - before[SERIES[0], rank][1])} forwards)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a diffusers Flux checkpoint (default: the demo Flux, random weights)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--size", type=int, default=256, help="width and height in px, a multiple of 16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="cfg,ulysses", help="comma-separated: cfg, ulysses")
    args = p.parse_args()
    if args.size % 16:
        p.error(f"--size must be a multiple of 16, got {args.size}")
    from pipelines.config import ParallelConfig

    modes = {"cfg": (ParallelConfig(cfg=2), True), "ulysses": (ParallelConfig(ulysses=2), False)}
    chosen = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not chosen or set(chosen) - set(modes):
        p.error(f"--modes: choose from {', '.join(modes)}, got {args.modes!r}")
    with tempfile.TemporaryDirectory(prefix="mmserve-bench-parallel-") as tmp:
        if args.checkpoint:
            path = args.checkpoint
        else:
            from pipelines.demo import build_demo_model

            path = str(build_demo_model("flux", Path(tmp) / "flux"))
        for mode in chosen:
            compare(mode, *modes[mode], path, args)


if __name__ == "__main__":
    main()
