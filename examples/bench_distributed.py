"""Benchmark: the cost of the Ray hop. The ray backend vs the local backend, one replica of each stage on each side,
side by side in one run.

    python examples/bench_distributed.py [--checkpoint SD_DIR] [--llm LLM_DIR] [--steps 20] [--size 64]
                                         [--tokens 64] [--repeats 3] [--ray-address HOST:PORT]

1. An image of --steps denoise steps (text_encode -> denoise -> vae_decode): seconds per image.
2. A chat request of --tokens greedy tokens (EOS ignored): time to first token and median inter-token latency, from
   the arrival times of its DELTA events.

Both sides are warmed first; then --repeats rounds, each running both sides with the order alternating between
rounds. Every run is printed with the load average, then the medians and the ratios (ray / local).

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


def _engines(sd: str, llm: str, address: str):
    from pipelines.chat import LLMConfig
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine

    models = (ModelSpec("sd", sd), ModelSpec("llm", llm, family="causal-lm", llm=LLMConfig(kv_cache_mb=32)))
    local = Engine(EngineConfig(models=models))
    ray = Engine(EngineConfig(models=models, backend="ray", ray_address=address))
    for engine in (local, ray):
        engine.start()
    return {"local": local, "ray": ray}


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


def run(args) -> None:
    tmp = tempfile.mkdtemp(prefix="mmserve-bench-dist-")
    address = args.ray_address or _start_local_ray(tmp)
    import ray

    ray.init(address=address, namespace="mmserve-bench", log_to_driver=False)
    print("ray nodes:", [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]])
    from pipelines.demo import build_demo_model

    sd = args.checkpoint or str(build_demo_model("sd", Path(tmp) / "sd"))
    llm = args.llm or str(build_demo_model("llama", Path(tmp) / "llama"))
    engines = _engines(sd, llm, address)
    try:
        for engine in engines.values():  # warm: the first step and token of each side outside the runs
            image_s(engine, args, seed=0)
            chat_latency(engine, args, seed=0)
        images: dict[str, list[float]] = {"local": [], "ray": []}
        ttft: dict[str, list[float]] = {"local": [], "ray": []}
        itl: dict[str, list[float]] = {"local": [], "ray": []}
        for round_ in range(args.repeats):
            order = ["local", "ray"] if round_ % 2 == 0 else ["ray", "local"]
            for side in order:
                seconds = image_s(engines[side], args, seed=round_ + 1)
                first, gap = chat_latency(engines[side], args, seed=round_ + 1)
                images[side].append(seconds)
                ttft[side].append(first)
                itl[side].append(gap)
                print(f"round {round_ + 1} {side:5s}: image {seconds * 1000:8.1f} ms   chat ttft {first * 1000:7.2f} ms"
                      f"   itl {gap * 1000:6.2f} ms   (load {loadavg()})", flush=True)
        med = {name: {side: statistics.median(v[side]) for side in v} for name, v in
               (("image", images), ("ttft", ttft), ("itl", itl))}
        print(f"\nmedians over {args.repeats} rounds (load {loadavg()}):")
        print(f"  image of {args.steps} steps at {args.size}px: local {med['image']['local'] * 1000:.1f} ms, ray "
              f"{med['image']['ray'] * 1000:.1f} ms, ratio {med['image']['ray'] / med['image']['local']:.3f}x")
        print(f"  chat ttft: local {med['ttft']['local'] * 1000:.2f} ms, ray {med['ttft']['ray'] * 1000:.2f} ms, "
              f"added {(med['ttft']['ray'] - med['ttft']['local']) * 1000:+.2f} ms")
        print(f"  chat inter-token: local {med['itl']['local'] * 1000:.2f} ms, ray {med['itl']['ray'] * 1000:.2f} ms, "
              f"added per token {(med['itl']['ray'] - med['itl']['local']) * 1000:+.2f} ms")
    finally:
        for engine in engines.values():
            engine.shutdown()
        ray.shutdown()
        if not args.ray_address:
            subprocess.run([_ray_bin(), "stop", "--force"], capture_output=True, timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a diffusers SD checkpoint (default: the demo SD, random weights)")
    p.add_argument("--llm", help="a causal LM checkpoint (default: the demo Llama, random weights)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ray-address", help="an existing cluster's head (default: a one-node Ray in a namespace)")
    args = p.parse_args()
    if args.ray_address or os.environ.get(INSIDE) == "1":
        run(args)
        return
    cmd = ["unshare", "--net", "--pid", "--fork", "--mount-proc", "bash", "-c", 'ip link set lo up && "$@"', "_",
           sys.executable, *sys.argv]
    sys.exit(subprocess.run(cmd, env={**os.environ, INSIDE: "1"}).returncode)


if __name__ == "__main__":
    main()
