"""Benchmark: the cost of the Ray hop. The ray backend vs the local backend, one replica of each stage on each side,
side by side in one run; then, on the local backend, two placed denoise replicas vs one replica with their threads.

    python examples/bench_distributed.py [--checkpoint SD_DIR] [--llm LLM_DIR] [--steps 20] [--size 64]
                                         [--tokens 64] [--frames 4] [--frame-steps 4] [--repeats 3] [--threads N]
                                         [--skip-replicas] [--ray-address HOST:PORT]

1. An image of --steps denoise steps (text_encode -> denoise -> vae_decode): seconds per image.
2. A chat request of --tokens greedy tokens (EOS ignored): time to first token and median inter-token latency, from
   the arrival times of its DELTA events.
3. An img2img frame, the request a realtime video session sends per frame (realtime/video/img2img.py): a painted
   --size image, strength 0.5, --frame-steps steps, a fixed seed, one session; submit to result, --frames frames
   one after another per run, the median frame of each run.
4. Replicas (local backend only, --skip-replicas leaves it out): the wall time of 8 concurrent images (submitted
   together, different seeds) with the denoise pool as two placed replicas of one torch thread each vs as one
   replica of two threads, the same max batch size on both.

Both sides are warmed first; then --repeats rounds, each running both sides with the order alternating between
rounds. Every run is printed with the load average, then the medians and the ratios (ray / local; two replicas /
one replica). By default each backend picks its own torch threads (every pool a team of all the cores; on the ray
backend each team is alone in its actor's process, on the local one the pools' teams share one process), so the
image ratio includes that difference; --threads 1 gives both sides the same single-threaded stages: the hop alone.

Without --ray-address, Ray must stay on loopback (../shared/notes/distributed.md): the script runs itself again
inside a fresh network and PID namespace (`unshare`, root or user namespaces needed) and starts a one-node Ray
there (4 logical CPUs, a small object store), which ends with the namespace. Without --checkpoint / --llm it builds
the demo SD and Llama (random weights) in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: pipelines/, serve/
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PORT = 6391
INSIDE = "MMSERVE_BENCH_NETNS"
CONCURRENT = 8  # images at once in the replicas comparison
BATCH = 4  # the denoise pool's max_batch_size on both sides of it


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _start_local_ray(temp: str) -> str:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_prestart_worker_first_driver": "0"}
    subprocess.run([_ray_bin(), "start", "--head", f"--port={PORT}", "--num-cpus=4", "--include-dashboard=false",
                    "--object-store-memory=200000000", "--disable-usage-stats", f"--temp-dir={temp}/r"],
                   check=True, capture_output=True, timeout=120, env=env)
    return f"127.0.0.1:{PORT}"


def _engines(sd: str, llm: str, address: str, threads: int | None):
    from pipelines.chat import LLMConfig
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine
    from stages.pool import PoolConfig

    def pools(*kinds: str) -> dict[str, PoolConfig]:  # --threads: every stage's torch threads, on both sides
        return {} if threads is None else {kind: PoolConfig(threads=threads) for kind in kinds}

    models = (ModelSpec("sd", sd, pools=pools("text_encode", "denoise", "vae_decode")),
              ModelSpec("llm", llm, family="causal-lm", llm=LLMConfig(kv_cache_mb=32), pools=pools("llm")))
    local = Engine(EngineConfig(models=models))
    ray = Engine(EngineConfig(models=models, backend="ray", ray_address=address))
    for engine in (local, ray):
        engine.start()
    return {"local": local, "ray": ray}


def alternate(sides: list[str], repeats: int, measure, show) -> dict[str, list]:
    """--repeats rounds of measure(side, round) on every side, the order alternating between rounds; each run is
    printed (show(value)) with the load average. The values of each side, in round order."""
    runs: dict[str, list] = {side: [] for side in sides}
    width = max(map(len, sides))
    for round_ in range(1, repeats + 1):
        for side in sides if round_ % 2 else sides[::-1]:
            value = measure(side, round_)
            runs[side].append(value)
            print(f"round {round_} {side:{width}s}: {show(value)}   (load {loadavg()})", flush=True)
    return runs


def image_s(engine, args, seed: int) -> float:
    from pipelines.image_request import ImageRequest

    request = ImageRequest(prompt="a lighthouse", width=args.size, height=args.size,
                           num_inference_steps=args.steps, seed=seed)
    began = time.perf_counter()
    engine.submit_image("sd", request).result(timeout=600)
    return time.perf_counter() - began


def chat_latency(engine, args, seed: int) -> tuple[float, float]:
    """(time to first token, median inter-token latency) in seconds, from the DELTA events' arrival."""
    from pipelines.chat import ChatRequest
    from stages.events import EventKind
    from stages.llm.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    prompt = [5 + (seed * 7 + i) % 200 for i in range(32)]  # fresh per round: nothing comes from the prefix cache
    began = time.perf_counter()
    arrived = [time.perf_counter() for e in engine.submit_chat("llm", ChatRequest(prompt=prompt, params=params))
               .events(timeout=600) if e.kind is EventKind.DELTA]
    gaps = [b - a for a, b in zip(arrived, arrived[1:])]
    return arrived[0] - began, statistics.median(gaps)


def frame_s(engine, args, shift: int) -> float:
    """The median seconds, submit to result, of --frames img2img frames sent one after another as a realtime video
    session sends them (realtime/video/img2img.py): one session, one seed, strength 0.5, a moving gradient."""
    import numpy as np
    from PIL import Image

    from pipelines.image_request import ImageRequest, Task

    ramp = np.arange(args.size, dtype=np.int64) * 255 // max(args.size - 1, 1)
    seconds = []
    for i in range(args.frames):
        moved = (ramp + 8 * (shift * args.frames + i)) % 256
        pixels = np.stack([np.tile(moved, (args.size, 1)), np.tile(ramp[:, None], (1, args.size)),
                           np.full((args.size, args.size), 128)], axis=-1).astype(np.uint8)
        request = ImageRequest(prompt="a lighthouse", task=Task.IMAGE_TO_IMAGE, width=args.size, height=args.size,
                               num_inference_steps=args.frame_steps, seed=7, strength=0.5,
                               image=Image.fromarray(pixels, "RGB"), session="bench")
        began = time.perf_counter()
        engine.submit_image("sd", request).result(timeout=600)
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def concurrent_s(engine, args, seed: int) -> float:
    """The wall time of CONCURRENT images submitted together (different seeds) until the last one is done."""
    from pipelines.image_request import ImageRequest

    began = time.perf_counter()
    handles = [engine.submit_image("sd", ImageRequest(prompt="a lighthouse", width=args.size, height=args.size,
                                                      num_inference_steps=args.steps, seed=seed * 100 + i))
               for i in range(CONCURRENT)]
    for handle in handles:
        handle.result(timeout=600)
    return time.perf_counter() - began


def compare_backends(engines, args) -> None:
    for engine in engines.values():  # warm: the first step and token of each side outside the runs
        image_s(engine, args, seed=0)
        chat_latency(engine, args, seed=0)
        frame_s(engine, args, shift=0)

    def measure(side: str, round_: int) -> tuple[float, float, float, float]:
        return (image_s(engines[side], args, seed=round_), *chat_latency(engines[side], args, seed=round_),
                frame_s(engines[side], args, shift=round_))

    def show(v: tuple[float, float, float, float]) -> str:
        return (f"image {v[0] * 1000:8.1f} ms   chat ttft {v[1] * 1000:7.2f} ms   itl {v[2] * 1000:6.2f} ms   "
                f"img2img frame {v[3] * 1000:7.1f} ms")

    runs = alternate(["local", "ray"], args.repeats, measure, show)
    med = {name: {side: statistics.median(v[i] for v in runs[side]) for side in runs}
           for i, name in enumerate(("image", "ttft", "itl", "frame"))}
    print(f"\nmedians over {args.repeats} rounds (load {loadavg()}):")
    print(f"  image of {args.steps} steps at {args.size}px: local {med['image']['local'] * 1000:.1f} ms, ray "
          f"{med['image']['ray'] * 1000:.1f} ms, ratio {med['image']['ray'] / med['image']['local']:.3f}x")
    print(f"  chat ttft: local {med['ttft']['local'] * 1000:.2f} ms, ray {med['ttft']['ray'] * 1000:.2f} ms, "
          f"added {(med['ttft']['ray'] - med['ttft']['local']) * 1000:+.2f} ms")
    print(f"  chat inter-token: local {med['itl']['local'] * 1000:.2f} ms, ray {med['itl']['ray'] * 1000:.2f} ms, "
          f"added per token {(med['itl']['ray'] - med['itl']['local']) * 1000:+.2f} ms")
    print(f"  img2img frame: local {med['frame']['local'] * 1000:.1f} ms, ray {med['frame']['ray'] * 1000:.1f} ms, "
          f"ratio {med['frame']['ray'] / med['frame']['local']:.3f}x")


def compare_replicas(sd: str, args) -> None:
    """Local backend: the denoise pool as two placed 1-thread replicas vs one 2-thread replica."""
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine
    from stages.pool import PoolConfig

    pools = {"two-1t": PoolConfig(devices=("cpu", "cpu"), threads=1, max_batch_size=BATCH),
             "one-2t": PoolConfig(threads=2, max_batch_size=BATCH)}
    engines = {side: Engine(EngineConfig(models=(ModelSpec("sd", sd, pools={"denoise": pool}),)))
               for side, pool in pools.items()}
    try:
        for engine in engines.values():
            engine.start()
        print(f"\nreplicas, local backend: {CONCURRENT} concurrent images of {args.steps} steps at {args.size}px, "
              f"max batch {BATCH}", flush=True)
        for engine in engines.values():  # warm: every replica's first batch outside the runs
            concurrent_s(engine, args, seed=0)
        runs = alternate(list(engines), args.repeats, lambda side, round_: concurrent_s(engines[side], args, round_),
                         lambda v: f"{CONCURRENT} images {v:8.3f} s")
        med = {side: statistics.median(v) for side, v in runs.items()}
        print(f"\nmedians over {args.repeats} rounds (load {loadavg()}):")
        print(f"  {CONCURRENT} concurrent images: two 1-thread replicas {med['two-1t']:.3f} s, one 2-thread replica "
              f"{med['one-2t']:.3f} s, ratio {med['two-1t'] / med['one-2t']:.3f}x")
    finally:
        for engine in engines.values():
            engine.shutdown()


def run(args, tmp: str) -> None:
    """The benchmark, with the demo checkpoints and a Ray started here under `tmp`."""
    from pipelines.demo import build_demo_model

    sd = args.checkpoint or str(build_demo_model("sd", Path(tmp) / "sd"))
    llm = args.llm or str(build_demo_model("llama", Path(tmp) / "llama"))
    if not args.skip_replicas:  # before Ray starts: nothing else on the cores
        compare_replicas(sd, args)
    address = args.ray_address or _start_local_ray(tmp)
    import ray

    ray.init(address=address, namespace="mmserve-bench", log_to_driver=False)
    print("ray nodes:", [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]])
    engines = _engines(sd, llm, address, args.threads)
    try:
        compare_backends(engines, args)
    finally:
        for engine in engines.values():
            engine.shutdown()
        ray.shutdown()
    # A Ray started here needs no `ray stop` (~20 s): when this process exits, so does the namespace's first process
    # (the bash that ran it), and the kernel kills everything left in the namespace.


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a diffusers SD checkpoint (default: the demo SD, random weights)")
    p.add_argument("--llm", help="a causal LM checkpoint (default: the demo Llama, random weights)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--frames", type=int, default=4, help="img2img frames per run (the run's median is reported)")
    p.add_argument("--frame-steps", type=int, default=4, help="num_inference_steps of an img2img frame")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch threads of every stage on both sides of the hop (default: each "
                   "backend's own: the cores, per pool; in one process the pools' OpenMP teams then share the cores)")
    p.add_argument("--skip-replicas", action="store_true", help="leave out the two-replicas vs two-threads part")
    p.add_argument("--ray-address", help="an existing cluster's head (default: a one-node Ray in a namespace)")
    args = p.parse_args()
    if os.environ.get(INSIDE):  # in the namespace, with the directory the process outside made
        run(args, os.environ[INSIDE])
        return
    with tempfile.TemporaryDirectory(prefix="mmserve-bench-dist-") as tmp:  # removed once Ray's processes are gone
        if args.ray_address:
            run(args, tmp)
            return
        cmd = ["unshare", "--net", "--pid", "--fork", "--mount-proc", "bash", "-c", 'ip link set lo up && "$@"', "_",
               sys.executable, *sys.argv]
        code = subprocess.run(cmd, env={**os.environ, INSIDE: tmp}).returncode
    sys.exit(code)


if __name__ == "__main__":
    main()
