"""Benchmark: mmserve's denoise speed-ups vs the diffusers pipeline, real-size architectures, random weights.

    python examples/bench_gpu_diffusion.py [--models sd15,flux] [--variants eager,graphs,compile,cache]
                                           [--concurrency 16] [--repeats 3] [--sequential 16]
    python examples/bench_gpu_diffusion.py --tiny     # the tiny demo models on the CPU, in seconds

Per model (SD 1.5-size UNet at 512x512, 30 steps, CFG 7.5; FLUX.1-size transformer at 1024x1024, 28 steps,
embedded guidance 3.5):
1. Single-request latency (median of --repeats): diffusers eager, diffusers with torch.compile, and
   mmserve per variant: eager, graphs (bucketed CUDA graphs), compile (regional compile + graphs),
   cache (TeaCache at --cache-threshold; step-cached forwards run eagerly, without graphs).
2. Throughput: --concurrency requests at once through mmserve (graphs), with each request's latency
   (p50, p99), vs two diffusers baselines: the pipeline called --sequential times in a row, and the
   pipeline called once with a list of --concurrency prompts (one generator per prompt), a user's best
   alternative when the prompts are known together.
Targets: graphs >= 1.3x faster than diffusers eager at batch 1; >= 3x the sequential throughput at 16
concurrent, and not below the batched call's (>= 1.0x).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

SETUPS = {  # model -> size, steps, guidance, diffusers pipeline class name
    "sd15": dict(size=512, steps=30, guidance=7.5, cfg=True, pipeline="StableDiffusionPipeline"),
    "flux": dict(size=1024, steps=28, guidance=3.5, cfg=False, pipeline="FluxPipeline"),
}
TINY = {"sd15": dict(size=64, steps=4), "flux": dict(size=32, steps=4)}
PROMPT = "a lighthouse on a cliff at dusk, oil painting"


def prompt(seed: int) -> str:
    """A different prompt per call: mmserve's prompt-embedding cache must not make its calls cheaper."""
    return f"{PROMPT}, variation {seed}"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- diffusers ------------------------------------------------------------------------------------


def diffusers_latency(checkpoint: str, setup: dict, args, compiled: bool) -> tuple[float, float, float, float]:
    """(median latency, seconds of the first call, images/s over --sequential calls, images/s of one call with
    --concurrency prompts); the throughputs are 0 for the compiled pipeline (latency only)."""
    import diffusers
    import torch

    cls = getattr(diffusers, setup["pipeline"])
    extra = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False} \
        if setup["pipeline"].startswith("StableDiffusion") else {}
    pipe = cls.from_pretrained(checkpoint, dtype=getattr(torch, args.dtype), **extra).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    denoiser = "unet" if hasattr(pipe, "unet") else "transformer"
    if compiled:
        setattr(pipe, denoiser, torch.compile(getattr(pipe, denoiser), mode=args.diffusers_compile_mode,
                                              backend=args.compile_backend))

    def call(*seeds: int) -> float:
        """One pipeline call: one prompt per seed, each with its own generator (as mmserve seeds each request)."""
        _sync()
        t = time.perf_counter()
        pipe([prompt(s) for s in seeds], height=setup["size"], width=setup["size"],
             num_inference_steps=setup["steps"], guidance_scale=setup["guidance"],
             generator=[torch.Generator("cpu").manual_seed(s) for s in seeds])
        _sync()
        return time.perf_counter() - t

    first = call(0)
    latency = statistics.median(call(i + 1) for i in range(args.repeats))
    if compiled:
        return latency, first, 0.0, 0.0
    sequential = sum(call(100 + i) for i in range(args.sequential))
    seeds = [200 + i for i in range(args.concurrency)]  # the prompts mmserve_throughput sends
    call(*seeds)  # warm: the first call at this batch size pays for its allocations (and autotuning)
    batched = call(*seeds)
    return latency, first, args.sequential / sequential, args.concurrency / batched


# -- mmserve --------------------------------------------------------------------------------------


def mmserve_engine(checkpoint: str, setup: dict, args, variant: str):
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine
    from stages.cuda_graphs import GraphConfig
    from stages.diffusion.compile import CompileConfig
    from stages.diffusion.step_cache import StepCacheConfig
    from stages.pool import PoolConfig

    rows = args.concurrency * (2 if setup["cfg"] else 1)
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b < rows) + (rows,)
    graphs = GraphConfig(batch_sizes=buckets, sizes=((setup["size"], setup["size"]),))
    options = {"eager": {}, "graphs": {"graphs": graphs},
               "compile": {"graphs": graphs, "compile": CompileConfig(enabled=True, backend=args.compile_backend)},
               "cache": {"step_cache": StepCacheConfig(enabled=True)}}[variant]
    pools = {"denoise": PoolConfig(max_batch_size=args.concurrency, max_queue=4 * args.concurrency),
             "text_encode": PoolConfig(max_batch_size=args.concurrency, max_delay_ms=2.0),
             "vae_decode": PoolConfig(max_batch_size=4, max_delay_ms=2.0)}
    spec = ModelSpec("bench", checkpoint, device=args.device, dtype=args.dtype, pools=pools, **options)
    engine = Engine(EngineConfig(models=(spec,)))
    started = time.perf_counter()
    engine.start()  # warm-up: captures every bucket (graphs), compiles (compile)
    return engine, time.perf_counter() - started


def mmserve_request(setup: dict, seed: int, step_cache=None):
    from pipelines.image_request import ImageRequest

    return ImageRequest(prompt=prompt(seed), width=setup["size"], height=setup["size"],
                        num_inference_steps=setup["steps"], guidance_scale=setup["guidance"], seed=seed,
                        step_cache=step_cache)


def mmserve_latency(engine, setup: dict, args, step_cache=None) -> float:
    def call(seed: int) -> float:
        _sync()
        t = time.perf_counter()
        engine.submit_image("bench", mmserve_request(setup, seed, step_cache)).result(timeout=3600)
        _sync()
        return time.perf_counter() - t

    call(0)
    return statistics.median(call(i + 1) for i in range(args.repeats))


def mmserve_throughput(engine, setup: dict, args) -> tuple[float, float, float]:
    """(images/s, p50 latency, p99 latency) of --concurrency requests sent at once."""
    import threading

    latencies: list[float] = []
    lock = threading.Lock()

    def one(seed: int) -> None:
        t = time.perf_counter()
        engine.submit_image("bench", mmserve_request(setup, seed)).result(timeout=3600)
        with lock:
            latencies.append(time.perf_counter() - t)

    threads = [threading.Thread(target=one, args=(200 + i,)) for i in range(args.concurrency)]
    started = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - started
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(round(0.99 * (len(latencies) - 1))))]
    return args.concurrency / wall, statistics.median(latencies), p99


def bench(name: str, checkpoint: str, setup: dict, args) -> None:
    print(f"\n{name}: {setup['size']}x{setup['size']}, {setup['steps']} steps, guidance {setup['guidance']} "
          f"({'CFG' if setup['cfg'] else 'embedded'}), {args.dtype}")
    ref, ref_first, ref_ips, batched_ips = diffusers_latency(checkpoint, setup, args, compiled=False)
    _free()  # the pipeline is gone with the call: give its memory back before the next one loads
    print(f"  diffusers eager        {ref:8.3f} s   (first call {ref_first:.1f} s)")
    print(f"  diffusers throughput   {ref_ips:.3f} img/s ({args.sequential} sequential calls), {batched_ips:.3f} img/s "
          f"(one call with {args.concurrency} prompts)")
    if "diffusers-compile" in args.variants:
        comp, comp_first, _, _ = diffusers_latency(checkpoint, setup, args, compiled=True)
        _free()
        print(f"  diffusers compile      {comp:8.3f} s   ratio {ref / comp:.2f}x vs eager (compile warm-up "
              f"{comp_first:.0f} s)")
    for variant in [v for v in args.variants if v in ("eager", "graphs", "compile", "cache")]:
        engine, ready = mmserve_engine(checkpoint, setup, args, variant)
        try:
            step_cache = {"method": "teacache", "threshold": args.cache_threshold} if variant == "cache" else None
            latency = mmserve_latency(engine, setup, args, step_cache)
            metrics = engine.metrics.registry
            extra = ""
            if variant in ("graphs", "compile"):
                capture = metrics.get_sample_value("mmserve_graph_capture_seconds",
                                                   {"stage": "denoise", "model": "bench"}) or 0.0
                pool = metrics.get_sample_value("mmserve_graph_pool_bytes", {"stage": "denoise", "model": "bench"}) or 0
                extra += f", capture {capture:.1f} s, pool {pool / 2**20:.0f} MiB"
            if variant == "compile":
                compiled = metrics.get_sample_value("mmserve_compile_warmup_seconds",
                                                    {"stage": "denoise", "model": "bench"}) or 0.0
                extra += f", compile warm-up {compiled:.1f} s"
            if variant == "cache":
                got = {o: metrics.get_sample_value("mmserve_step_cache_steps_total", {"model": "bench", "method":
                                                   "teacache", "outcome": o}) or 0.0 for o in ("skipped", "computed")}
                extra += f", {got['skipped'] / max(sum(got.values()), 1):.0%} of steps skipped"
            print(f"  mmserve {variant:<14} {latency:8.3f} s   ratio {ref / latency:.2f}x vs diffusers eager "
                  f"(ready in {ready:.0f} s{extra})")
            if variant == "graphs":
                ips, p50, p99 = mmserve_throughput(engine, setup, args)
                print(f"  throughput {args.concurrency} concurrent: mmserve {ips:.3f} img/s (p50 {p50:.2f} s, p99 "
                      f"{p99:.2f} s) vs diffusers {ref_ips:.3f} img/s ({args.sequential} sequential)   "
                      f"ratio {ips / ref_ips:.2f}x (target >= 3)")
                print(f"  throughput {args.concurrency} concurrent: mmserve {ips:.3f} img/s vs diffusers "
                      f"{batched_ips:.3f} img/s (one call with {args.concurrency} prompts)   "
                      f"ratio {ips / batched_ips:.2f}x (target >= 1.0)")
        finally:
            engine.shutdown()
        del engine
        _free()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sd15,flux")
    parser.add_argument("--variants", default="eager,graphs,compile,cache,diffusers-compile")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sequential", type=int, default=None, help="diffusers calls in a row (default: concurrency)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-threshold", type=float, default=0.25)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--diffusers-compile-mode", default=None)
    parser.add_argument("--flux-double", type=int, default=19)
    parser.add_argument("--flux-single", type=int, default=38)
    parser.add_argument("--tiny", action="store_true", help="tiny demo models on the CPU (compile backend eager)")
    parser.add_argument("--out", default=str(Path.home() / ".cache/mmserve/bench"))
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    args.sequential = args.sequential or args.concurrency
    import torch

    if args.tiny:
        from pipelines.demo import build_demo_model

        args.device, args.dtype, args.compile_backend = "cpu", "float32", "eager"
        checkpoints = {m: str(build_demo_model("sd" if m == "sd15" else m, Path(args.out) / f"{m}-tiny"))
                       for m in args.models.split(",")}
        setups = {m: {**SETUPS[m], **TINY[m]} for m in checkpoints}
    else:
        from gpu_models import build

        args.device, args.dtype = "cuda", "bfloat16"
        checkpoints, setups = {}, {}
        for m in args.models.split(","):
            started = time.perf_counter()
            options = {"double": args.flux_double, "single": args.flux_single} if m == "flux" else {}
            checkpoints[m] = str(build(m, Path(args.out) / m, **options))
            setups[m] = SETUPS[m]
            print(f"checkpoint {checkpoints[m]} ({time.perf_counter() - started:.0f} s to build or find)")
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    print(f"{device}, torch {torch.__version__}")
    for m, checkpoint in checkpoints.items():
        bench(m, checkpoint, setups[m], args)


if __name__ == "__main__":
    main()
