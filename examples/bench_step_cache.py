"""Benchmark: step caching's speed-up and its quality cost, against the uncached output of the same requests.

    python examples/bench_step_cache.py [--family sd] [--checkpoint DIR] [--size 256] [--steps 20] [--prompts 4]
    python examples/bench_step_cache.py --tiny        # tiny demo models, seconds on a CPU (the test runs this)

For each method and threshold, the fixed prompt set (seeds 0..N-1) runs one request at a time through
the engine, each cached request right after the same request uncached; the table shows the median
time ratio (cached / uncached, whole request), the fraction of branch-steps skipped, and the mean
PSNR / SSIM of the images against the uncached ones. Threshold 0 is checked to
be bit-identical. Without --checkpoint it builds demo checkpoints (random weights: the images are
noise, but noise a denoiser made, so the drift is a real measurement of the mechanism).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import psnr, ssim  # noqa: E402

PROMPTS = ["a lighthouse on a cliff at dusk", "a red bicycle leaning on a brick wall", "a bowl of ramen, top view",
           "an astronaut riding a horse", "a watercolor of a fox in snow", "a city street in the rain at night",
           "a macro photo of a dragonfly", "a cozy cabin in a pine forest"]
SETTINGS = {  # family -> step cache settings compared (threshold 0 first: it must equal uncached)
    "unet": [{"method": "teacache", "threshold": 0.0}, {"method": "teacache", "threshold": 0.2},
             {"method": "teacache", "threshold": 0.4}, {"method": "interval", "interval": 2},
             {"method": "interval", "interval": 3}],
    "dit": [{"method": "teacache", "threshold": 0.0}, {"method": "teacache", "threshold": 0.3},
            {"method": "teacache", "threshold": 0.6}, {"method": "fbcache", "threshold": 0.3},
            {"method": "fbcache", "threshold": 1.0}, {"method": "interval", "interval": 2}],
}


def run_one(engine, args, i: int, step_cache=None) -> tuple[np.ndarray, float]:
    from pipelines.image_request import ImageRequest

    req = ImageRequest(prompt=PROMPTS[i], width=args.size, height=args.size, num_inference_steps=args.steps, seed=i,
                       step_cache=step_cache, guidance_scale=args.guidance)
    started = time.perf_counter()
    pixels = engine.submit_image("bench", req).result(timeout=3600)["pixels"]
    return pixels, time.perf_counter() - started


def skipped_fraction(engine, method: str, before: dict) -> float:
    reg = engine.metrics.registry
    get = lambda outcome: reg.get_sample_value("mmserve_step_cache_steps_total",  # noqa: E731
                                               {"model": "bench", "method": method, "outcome": outcome}) or 0.0
    skipped, computed = get("skipped") - before.get("skipped", 0.0), get("computed") - before.get("computed", 0.0)
    return skipped / max(skipped + computed, 1.0)


def bench(family: str, checkpoint: str, args) -> None:
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine
    from pipelines.image_request import ImageLimits
    from stages.diffusion.step_cache import StepCacheConfig
    from stages.pool import PoolConfig

    spec = ModelSpec("bench", checkpoint, device=args.device, dtype=args.dtype,
                     step_cache=StepCacheConfig(enabled=True), pools={"denoise": PoolConfig(max_batch_size=1)})
    engine = Engine(EngineConfig(models=(spec,), limits=ImageLimits(max_pixels=max(args.size ** 2, 1 << 20))))
    engine.start()
    try:
        kind = "unet" if engine.models["bench"].family in ("sd", "sdxl") else "dit"
        run_one(engine, args, 0)  # warm
        reference = [run_one(engine, args, i)[0] for i in range(args.prompts)]
        print(f"{family}: {args.prompts} prompts x {args.steps} steps at {args.size}x{args.size}; per setting the "
              f"median over prompts of cached / uncached time, each pair run back to back")
        print(f"  {'setting':<32} {'time ratio':>10} {'speed-up':>9} {'skipped':>8} {'PSNR dB':>8} {'SSIM':>6}")
        for setting in SETTINGS[kind]:
            reg = engine.metrics.registry
            before = {o: reg.get_sample_value("mmserve_step_cache_steps_total", {"model": "bench", "method":
                                              setting["method"], "outcome": o}) or 0.0 for o in ("skipped", "computed")}
            ratios, images = [], []
            for i in range(args.prompts):
                uncached = run_one(engine, args, i)[1]
                image, cached = run_one(engine, args, i, setting)
                ratios.append(cached / uncached)
                images.append(image)
            ratio = float(np.median(ratios))
            name = ", ".join(f"{k}={v}" for k, v in setting.items())
            if setting.get("threshold", 1) == 0.0 and not all(np.array_equal(a, b) for a, b in zip(images, reference)):
                raise SystemExit(f"{name}: threshold 0 differs from the uncached output")
            p = np.mean([min(psnr(a, b), 99.0) for a, b in zip(images, reference)])
            s = np.mean([ssim(a, b) for a, b in zip(images, reference)])
            print(f"  {name:<32} ratio {ratio:4.2f}x {1 / ratio:8.2f}x "
                  f"{skipped_fraction(engine, setting['method'], before):7.0%} {p:8.1f} {s:6.3f}")
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="sd,flux", help="comma-separated demo families (without --checkpoint)")
    parser.add_argument("--checkpoint", help="a checkpoint directory instead of the demo models")
    parser.add_argument("--size", type=int, default=None, help="pixels (default: 256 for sd, 256 for flux)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--guidance", type=float, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tiny", action="store_true", help="tiny demo models, 64 px, 6 steps, 2 prompts")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.prompts, args.size = 6, 2, args.size or 64
    from pipelines.demo import build_demo_model

    targets = [("checkpoint", args.checkpoint)] if args.checkpoint else []
    for family in ([] if args.checkpoint else args.family.split(",")):
        scale = "small" if family == "sd" and not args.tiny else "tiny"
        targets.append((family, str(build_demo_model(family, Path.home() / f".cache/mmserve/bench/{family}-{scale}",
                                                     scale=scale))))
    print(f"{os.cpu_count()} CPUs, device {args.device}, {args.dtype}")
    for family, checkpoint in targets:
        size = args.size
        args.size = size or 256
        bench(family, checkpoint, args)
        args.size = size


if __name__ == "__main__":
    main()
