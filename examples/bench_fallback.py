"""Benchmark: the diffusers fallback's overhead, one request through mmserve against the pipeline's bare `__call__`.

    python examples/bench_fallback.py [--rounds 5] [--size 256] [--steps 20]
    python examples/bench_fallback.py --tiny      # 64 px, 4 steps, 1 round (the test runs this)

A tiny PixArt-Sigma checkpoint (no native family: served by pipelines/fallback.py through its own `__call__`) is
built in a temporary directory. Each round runs one request on each side, the sides alternating which goes first:

  mmserve    Engine.submit_image -> the `pipeline` stage (a fresh scheduler, the step hook for progress and
             cancellation, the seeded generator) -> result
  __call__   the same pipeline class from the same checkpoint, called directly with the same seed

Every run is printed with the load average, then the medians and their ratio (the issue's target: <= 1.05x).
Round 1 checks that both sides made the same image.
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


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="64 px, 4 steps, 1 round (seconds)")
    args = p.parse_args()
    if args.tiny:
        args.size, args.steps, args.rounds = 64, 4, 1

    import numpy as np
    import torch
    from diffusers import PixArtSigmaPipeline

    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.demo.fallback import build_pixart_sigma
    from pipelines.engine import Engine
    from pipelines.image_request import ImageRequest

    call = dict(prompt="a lighthouse on a cliff", negative_prompt="blurry", width=args.size, height=args.size,
                num_inference_steps=args.steps, guidance_scale=4.5)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_pixart_sigma(Path(tmp) / "pixart")
        engine = Engine(EngineConfig(models=(ModelSpec("pixart", path),)))
        engine.start()
        pipe = PixArtSigmaPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        try:
            def ours():
                return engine.submit_image("pixart", ImageRequest(seed=1, **call)).result(timeout=3600)["pixels"][0]

            def theirs():
                return pipe(**call, generator=torch.Generator("cpu").manual_seed(1), output_type="np").images[0]

            sides = {"mmserve": ours, "__call__": theirs}
            for run in sides.values():  # warm both
                run()
            times: dict[str, list[float]] = {side: [] for side in sides}
            for r in range(args.rounds):
                outputs = {}
                for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    started = time.perf_counter()
                    outputs[side] = sides[side]()
                    took = time.perf_counter() - started
                    times[side].append(took)
                    print(f"round {r + 1} {side:9s} {took * 1000:9.1f} ms   (load {load_average()})")
                if r == 0:
                    same = np.allclose(outputs["mmserve"], outputs["__call__"], atol=1e-5)
                    print("round 1: " + ("both sides made the same image" if same else "the images DIFFER"))
        finally:
            engine.shutdown()
    ours_s, theirs_s = statistics.median(times["mmserve"]), statistics.median(times["__call__"])
    print(f"\nmedians over {args.rounds} rounds (PixArt-Sigma tiny, {args.size} px, {args.steps} steps; load "
          f"{load_average()}): mmserve {ours_s * 1000:.1f} ms, __call__ {theirs_s * 1000:.1f} ms   overhead "
          f"{ours_s / theirs_s:.3f}x")


if __name__ == "__main__":
    main()
