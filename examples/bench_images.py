"""Benchmark: mmserve vs the diffusers pipeline, side by side in one run, on one SD-family checkpoint or on the
tiny demo checkpoint of each family named.

    python examples/bench_images.py [--checkpoint DIR] [--size 128 256] [--steps 8] [--concurrency 8] [--repeats 3]
    python examples/bench_images.py --families flux_kontext flux2 qwen_image sana z_image --size 64 --concurrency 4

For each --size:
1. Single-request latency: mmserve's Python API vs `StableDiffusionPipeline.__call__` (same checkpoint,
   seed and parameters, CFG on), the two sides alternating which goes first; median of --repeats.
2. Throughput: --concurrency requests sent at once to a real mmserve server on loopback vs the diffusers
   pipeline called that many times in sequence. --repeats runs, the sides alternating which goes first;
   every run is printed with the load average, then the medians. Prints the denoise batch sizes reached.

Without --checkpoint it builds a checkpoint of its own, one this project has no recipe for: a fresh,
seeded, random-weight SD 1.x-shaped model (narrower than SD 1.5: UNet 64-256 channels in SD's four
stages, a 6-layer CLIP text encoder, a four-stage VAE, SD 1.5's PNDM scheduler). Ratios, not absolute
times, are the result: the machine is shared, so read the load average printed beside each run.

With --families, each family's demo checkpoint (pipelines/demo, random weights, built once under
~/.cache/mmserve/bench/) gets the throughput comparison only (the server vs its own diffusers pipeline class, loaded
with DiffusionPipeline.from_pretrained), both sides at the pipeline's default guidance (the request names none).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: pipelines/, serve/
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GUIDANCE = 7.5  # CFG on, on both sides: every UNet forward has an unconditional and a conditional row
# --families: image families with a tiny demo checkpoint (pipelines/demo) of the same name
FAMILIES = ("sd", "sdxl", "sd3", "flux", "flux_kontext", "flux2", "flux2_klein", "qwen_image", "sana", "z_image")


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


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (the machine is shared: a high figure explains a noisy run)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _tree_s(roots: list[int]) -> float:
    """CPU seconds used by the processes `roots` and their descendants (reaped children included)."""
    parent, used = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry.name)] = int(fields[1])
            used[int(entry.name)] = sum(map(int, fields[11:15])) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    total = 0.0
    for pid in used:
        p = pid
        while p and p not in roots:
            p = parent.get(p, 0)
        total += used[pid] if p else 0.0
    return total


class OthersCpu:
    """The cores other processes kept busy while a block ran (this benchmark and its server excluded), and the
    CPU seconds this benchmark and its server used meanwhile."""

    def __init__(self, ours: list[int]):
        self.ours = ours
        self.cores = 0.0
        self.ours_s = 0.0

    def __enter__(self) -> "OthersCpu":
        self._start = (time.perf_counter(), _busy_s(), _tree_s(self.ours))
        return self

    def __exit__(self, *exc) -> None:
        t, busy, ours = self._start
        self.ours_s = _tree_s(self.ours) - ours
        self.cores = max(0.0, (_busy_s() - busy) - self.ours_s) / (time.perf_counter() - t)


def wait_quiet(ours: list[int], max_wait_s: float, below: float = 0.3) -> float:
    """Wait (up to max_wait_s) for a second in which other processes use fewer than `below` cores."""
    if max_wait_s <= 0:
        return 0.0
    deadline = time.monotonic() + max_wait_s
    while True:
        with OthersCpu(ours) as others:
            time.sleep(1.0)
        if others.cores < below or time.monotonic() > deadline:
            return others.cores


def alternating(repeats: int, first, second):
    """Run the two sides `repeats` times, swapping which goes first each time; yields (i, first_name, a, b)."""
    for i in range(repeats):
        if i % 2 == 0:
            a = first()
            b = second()
            yield i, "mmserve", a, b
        else:
            b = second()
            a = first()
            yield i, "diffusers", a, b


def compare_runs(repeats: int, ours_once, ref_once) -> tuple[list[float], float, float]:
    """Runs both sides alternately (each a `measured` call) and prints every run; returns (ratios, medians)."""
    ratios, ours_all, ref_all = [], [], []
    for i, first, (ours, ours_cpu, ours_others), (theirs, ref_cpu, ref_others) in alternating(
            repeats, ours_once, ref_once):
        ratios.append(theirs / ours)
        ours_all.append(ours)
        ref_all.append(theirs)
        print(f"  run {i + 1}/{repeats} ({first} first): mmserve {ours:7.2f} s ({ours_cpu:6.1f} CPU s)  "
              f"diffusers {theirs:7.2f} s ({ref_cpu:6.1f} CPU s)  ratio {theirs / ours:.2f}x  "
              f"other processes used {ours_others:.2f} / {ref_others:.2f} cores  load {loadavg()}", flush=True)
    return ratios, statistics.median(ours_all), statistics.median(ref_all)


# 1. A checkpoint this project does not know


def build_checkpoint(path: Path, seed: int = 0) -> Path:
    """A fresh random-weight SD 1.x-shaped pipeline, saved with `save_pretrained` (built once, then reused)."""
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    if (path / "model_index.json").exists():
        return path
    chars = [chr(c) for c in range(33, 127)]  # printable ASCII, alone and word-final; then the specials
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=77)
    hidden = 512
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=6,
        num_attention_heads=8, max_position_embeddings=77, projection_dim=hidden, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    unet = UNet2DConditionModel(
        sample_size=16, block_out_channels=(64, 128, 256, 256), layers_per_block=2, cross_attention_dim=hidden,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, attention_head_dim=8)
    vae = AutoencoderKL(
        block_out_channels=(64, 128, 256, 256), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, layers_per_block=2, sample_size=128)
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True,
                              steps_offset=1, set_alpha_to_one=False)  # SD 1.5's
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + ".tmp"))
    pipe.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another run built it first
        pass
    return path


def reference(checkpoint: str):
    from diffusers import StableDiffusionPipeline

    ref = StableDiffusionPipeline.from_pretrained(checkpoint, safety_checker=None, feature_extractor=None,
                                                  requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    return ref


# 2. Latency: one request at a time


def latency(checkpoint: str, ref, size: int, args) -> tuple[float, float]:
    import torch

    from pipelines import Pipeline

    params = dict(num_inference_steps=args.steps, height=size, width=size, guidance_scale=GUIDANCE)
    ours_t, ref_t = [], []

    def ours_once(i=0):
        t = time.perf_counter()
        pipe("a lighthouse", seed=i, **params)
        return time.perf_counter() - t

    def ref_once(i=0):
        t = time.perf_counter()
        ref("a lighthouse", generator=torch.Generator("cpu").manual_seed(i), **params)
        return time.perf_counter() - t

    with Pipeline.from_pretrained(checkpoint, max_batch_size=1) as pipe:
        ours_once(), ref_once()  # warm
        for _, _, a, b in alternating(args.repeats, ours_once, ref_once):
            ours_t.append(a)
            ref_t.append(b)
    return statistics.median(ours_t), statistics.median(ref_t)


# 3. Throughput: concurrent requests through the server vs a loop over the pipeline


async def _burst(base: str, model: str, size: int, n: int, args, prefix: str = "prompt",
                 knobs: dict | None = None) -> float:
    """n requests at once; `knobs`: the generation fields both sides set (guidance, family knobs)."""
    import httpx

    knobs = {"guidance_scale": GUIDANCE} if knobs is None else knobs
    body = lambda i: {"model": model, "prompt": f"{prefix} {i}", "size": f"{size}x{size}",  # noqa: E731
                      "num_inference_steps": args.steps, "seed": i, "response_format": "b64_json", **knobs}
    async def send(i: int):
        await asyncio.sleep(i * getattr(args, "stagger_ms", 0) / 1000)
        return await client.post(f"{base}/v1/images/generations", json=body(i))

    async with httpx.AsyncClient(timeout=3600) as client:
        t = time.perf_counter()
        replies = await asyncio.gather(*(send(i) for i in range(n)))
        elapsed = time.perf_counter() - t
    bad = [r.status_code for r in replies if r.status_code != 200]
    if bad:
        raise RuntimeError(f"server answered {bad}")
    return elapsed


def _batch_counts(metrics_text: str, stage: str) -> dict[float, float]:
    counts = {}
    for line in metrics_text.splitlines():
        if line.startswith("mmserve_stage_batch_size_bucket") and f'stage="{stage}"' in line:
            le = line.split('le="')[1].split('"')[0]
            if le != "+Inf":
                counts[float(le)] = float(line.rsplit(" ", 1)[1])
    return counts


def _batch_sizes(metrics_text: str, stage: str, since: str = "") -> str:
    """The batch sizes a stage ran, from /metrics (minus an earlier snapshot `since`): "<=1: 9, <=8: 24"."""
    counts, before = _batch_counts(metrics_text, stage), _batch_counts(since, stage)
    prev, seen = 0.0, []
    for le in sorted(counts):
        c = counts[le] - before.get(le, 0.0)
        if c > prev:
            seen.append(f"<={int(le)}: {int(c - prev)}")
        prev = c
    return ", ".join(seen)


@contextlib.contextmanager
def bench_server(config: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`mmserve serve` on a free loopback port with `config` (TOML: models, limits; not [server]), its config and job
    store in a temporary directory. Yields (the server process, its base URL) once it is ready; at the end the
    server is stopped and the directory removed."""
    with tempfile.TemporaryDirectory(prefix="mmserve-bench-") as tmp:
        path = Path(tmp) / "bench.toml"
        path.write_text(f'[server]\ndata_dir = "{Path(tmp) / "data"}"\n{config}')
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "--log-level", "warning", "serve", "--port",
                                 str(port), "--config", str(path)], cwd=Path(__file__).resolve().parent.parent,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_ready(base, proc)
            yield proc, base
        finally:
            proc.terminate()
            proc.wait(30)


def image_server(checkpoint: str, args) -> contextlib.AbstractContextManager[tuple[subprocess.Popen, str]]:
    return bench_server(f'[[models]]\nname = "bench"\npath = "{checkpoint}"\n'
                        f'[models.pools.denoise]\nmax_batch_size = {args.concurrency}\n'
                        f'[limits]\nmax_pixels = {max(max(args.size) ** 2, 1 << 20)}\n')


def measured(fn, ours: list[int], args):
    """fn() after a quiet second (or --quiet-wait s), timed: (seconds, CPU seconds it used, cores other processes
    used meanwhile)."""
    wait_quiet(ours, args.quiet_wait)
    with OthersCpu(ours) as others:
        t = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t
    return seconds, others.ours_s, others.cores


def throughput(base: str, server_pid: int, ref, size: int, args, knobs: dict | None = None,
               label: str = "") -> list[float]:
    """Every run's ratio (diffusers' sequential time / mmserve's concurrent time), each printed as it ends.
    knobs: what both sides set besides prompt, size, steps and seed (None: CFG at GUIDANCE)."""
    import httpx
    import torch

    n, ours_pids = args.concurrency, [os.getpid(), server_pid]
    knobs = {"guidance_scale": GUIDANCE} if knobs is None else knobs
    # New prompts every run (the same on both sides): the server's prompt cache saves nothing across runs.
    ours_runs, ref_runs = itertools.count(), itertools.count()

    def ours_once():
        prefix = f"prompt {size} {next(ours_runs)}"
        return measured(lambda: asyncio.run(_burst(base, "bench", size, n, args, prefix, knobs)), ours_pids, args)

    def ref_once():
        prefix = f"prompt {size} {next(ref_runs)}"

        def loop():
            for i in range(n):
                ref(prompt=f"{prefix} {i}", num_inference_steps=args.steps, height=size, width=size,
                    generator=torch.Generator("cpu").manual_seed(i), **knobs)
        return measured(loop, ours_pids, args)

    asyncio.run(_burst(base, "bench", size, 1, args, "warm", knobs))  # warm both sides at this size
    ref(prompt="warm", num_inference_steps=2, height=size, width=size, **knobs)
    before = httpx.get(f"{base}/metrics").text
    ratios, ours, theirs = compare_runs(args.repeats, ours_once, ref_once)
    sizes = _batch_sizes(httpx.get(f"{base}/metrics").text, "bench/denoise", since=before)
    print(f"throughput {label}{size}x{size}: mmserve {n / ours:6.2f} img/s (server, {n} concurrent)   diffusers "
          f"{n / theirs:6.2f} img/s ({n} sequential)   ratio {statistics.median(ratios):.2f}x median of "
          f"{' '.join(f'{r:.2f}' for r in ratios)} (target >= 1.0 in every run)")
    print(f"denoise batch sizes reached: {sizes}")
    return ratios


def family_knobs(family: str, size: int) -> dict:
    """What both sides set for a family's demo: no guidance (each takes its pipeline's default); FLUX.1 Kontext's
    max_area at the size asked (its default resizes every generation to 1024 x 1024)."""
    return {"max_area": size * size} if family == "flux_kontext" else {}


def bench_families(families: list[str], args) -> None:
    """The throughput comparison on each family's tiny demo checkpoint, one server per family."""
    from diffusers import DiffusionPipeline

    from pipelines.demo import build_demo_model

    for family in families:
        checkpoint = str(build_demo_model(family, Path.home() / f".cache/mmserve/bench/{family}-tiny"))
        ref = DiffusionPipeline.from_pretrained(checkpoint)
        ref.set_progress_bar_config(disable=True)
        print(f"{family}: {type(ref).__name__}, checkpoint {checkpoint}, load {loadavg()}", flush=True)
        with image_server(checkpoint, args) as (proc, base):
            for size in args.size:
                throughput(base, proc.pid, ref, size, args, knobs=family_knobs(family, size), label=f"{family} ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="an SD checkpoint directory; default: build the benchmark's own")
    parser.add_argument("--size", type=int, nargs="+", default=[128, 256], help="square sizes, px")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stagger-ms", type=float, default=0.0,
                        help="send request i at i * this many ms (0: all at once); the diffusers loop still runs "
                             "back to back, so keep it under one image's time")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, metavar="FAMILY",
                        help=f"instead of the SD checkpoint: each family's tiny demo checkpoint, throughput only "
                             f"(any of {', '.join(FAMILIES)})")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="before each timed side, wait up to this long for a second in which other processes "
                             "use under 0.3 cores (the machine is shared); 0: do not wait")
    args = parser.parse_args()
    if args.families:
        if args.checkpoint:
            parser.error("--families benchmarks the demo checkpoints; leave out --checkpoint")
        print(f"families {args.families}, sizes {args.size}, {args.steps} steps, {args.concurrency} concurrent, "
              f"{os.cpu_count()} CPUs, load {loadavg()}", flush=True)
        bench_families(args.families, args)
        print(f"load at the end {loadavg()}")
        return

    checkpoint = args.checkpoint or str(build_checkpoint(Path.home() / ".cache/mmserve/bench/sd-unknown"))
    print(f"checkpoint {checkpoint}, sizes {args.size}, {args.steps} steps, CFG {GUIDANCE}, {os.cpu_count()} CPUs, "
          f"load {loadavg()}", flush=True)
    ref = reference(checkpoint)
    if not args.skip_latency:
        for size in args.size:
            ours, theirs = latency(checkpoint, ref, size, args)
            print(f"latency {size}x{size}  mmserve {ours * 1000:8.1f} ms   diffusers {theirs * 1000:8.1f} ms   "
                  f"ratio {ours / theirs:.3f}x (target <= 1.05)  load {loadavg()}", flush=True)
    with image_server(checkpoint, args) as (proc, base):
        for size in args.size:
            throughput(base, proc.pid, ref, size, args)
    print(f"load at the end {loadavg()}")


if __name__ == "__main__":
    main()
