"""Benchmark: the llm stage vs transformers generate(), side by side in one run.

    python examples/bench_llm.py [--checkpoint DIR] [--requests 16] [--prompt 256] [--output 128] [--repeats 3]

1. Output tokens/s of N concurrent requests through mmserve's engine (in process), vs generate() called one
   request at a time, and vs generate() on one batch of N (greedy, EOS ignored, equal lengths: no padding).
2. The same through a real server: N concurrent POST /v1/completions with token-id prompts (--server-prompt,
   --server-output new tokens, greedy, ignore_eos), HTTP and JSON included, vs the same two generate() sides.
3. Time to first token of a request whose long prefix (--prefix tokens) is in the prefix cache, vs the request
   that put it there (its prefix new), over --repeats prefixes.

Every side is warmed first, once at the run's shapes (the n prompts, 4 new tokens); then --repeats rounds, each
running every side once with the order rotated between rounds and fresh prompts per round (the same on every
side, so the prefix cache saves nothing), after a quiet second (--quiet-wait). Every run is printed with the load
average and the cores other processes used, then the medians. Without --checkpoint it builds the "small" demo
Llama (random weights). Ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: pipelines/, serve/
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_images import bench_server, loadavg, measured  # noqa: E402


def _prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()  # ids 0-2 are special tokens


def _engine(checkpoint: str, args):
    from pipelines.chat import LLMConfig
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine

    llm = LLMConfig(kv_cache_mb=256, block_size=16, max_num_seqs=max(args.requests, 1), max_num_batched_tokens=2048)
    engine = Engine(EngineConfig(models=(ModelSpec("bench", checkpoint, llm=llm),)))
    engine.start()
    return engine


def _submit(engine, ids, max_tokens):
    from pipelines.chat import ChatRequest
    from stages.llm.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return engine.submit_chat("bench", ChatRequest(prompt=list(ids), params=params, stream=False))  # result only


def _generate_child(checkpoint: str, conn) -> None:
    """The baseline's process: the model, then generate() for every (prompts, output, batched) it is sent."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    conn.send(model.config.vocab_size)
    while (job := conn.recv()) is not None:
        prompts, output, batched = job
        kwargs = dict(max_new_tokens=output, min_new_tokens=output, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            if batched:  # equal lengths: no padding needed, the fairest batch for generate()
                batch = torch.tensor(prompts)
                model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
            else:
                for p in prompts:
                    model.generate(torch.tensor([p]), **kwargs)
        conn.send(True)


class Generate:
    """The baseline: transformers' generate() on the same checkpoint, greedy, exactly `output` new tokens, in a
    process of its own. In the engine's process its OpenMP team would sit beside the stage worker's, and libgomp
    stops spinning once it manages more threads than cores: both sides would run slower than they can."""

    def __init__(self, checkpoint: str):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_generate_child, args=(checkpoint, child), daemon=True)
        self.process.start()
        self.vocab_size = self._conn.recv()

    def warm(self, prompts: list[list[int]]) -> None:
        """Both baselines once at the run's shapes: the batch of prompts, and one of them alone; 4 new tokens."""
        self.run(prompts, 4, batched=True)
        self.run(prompts[:1], 4, batched=False)

    def run(self, prompts: list[list[int]], output: int, batched: bool) -> None:
        self._conn.send((prompts, output, batched))
        self._conn.recv()

    def close(self) -> None:
        self._conn.send(None)
        self.process.join(30)


def rounds(sides: dict, tokens: int, args) -> dict[str, float]:
    """Each side once per round, the order rotated each round; prints every run; returns median tokens/s."""
    names, results = list(sides), {name: [] for name in sides}
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        line = []
        for name in order:
            seconds, cpu, others = measured(lambda: sides[name](r), [os.getpid(), *args.pids], args)
            results[name].append(tokens / seconds)
            line.append(f"{name} {tokens / seconds:8.1f} tok/s (others {others:.2f} cores)")
        print(f"  round {r + 1}/{args.repeats}: " + "   ".join(line) + f"   load {loadavg()}", flush=True)
    return {name: statistics.median(v) for name, v in results.items()}


def report(title: str, tps: dict[str, float], ours: str, args) -> None:
    for base, target in (("generate one at a time", 3.0), (f"generate batch of {args.requests}", 1.2 if
                                                            ours == "engine" else 1.0)):
        print(f"{title}: output tokens/s  mmserve {tps[ours]:8.1f}   {base} {tps[base]:8.1f}   ratio "
              f"{tps[ours] / tps[base]:.2f}x (median of {args.repeats}; target >= {target:g})")


def throughput(checkpoint: str, ref: Generate, args) -> dict[str, float]:
    vocab, n = ref.vocab_size, args.requests
    fresh = lambda r: _prompts(vocab, n, args.prompt, seed=100 + r)  # noqa: E731
    engine = _engine(checkpoint, args)
    try:
        warm = fresh(-1)  # every side once at the run's shapes (a batch of n prompts), 4 new tokens
        for handle in [_submit(engine, p, 4) for p in warm]:
            handle.result()
        ref.warm(warm)

        def ours(r):
            outs = [h.result(timeout=3600) for h in [_submit(engine, p, args.output) for p in fresh(r)]]
            assert sum(o["usage"]["completion_tokens"] for o in outs) == n * args.output

        args.pids = [ref.process.pid]
        return rounds({"engine": ours, "generate one at a time": lambda r: ref.run(fresh(r), args.output, False),
                       f"generate batch of {n}": lambda r: ref.run(fresh(r), args.output, True)},
                      n * args.output, args)
    finally:
        engine.shutdown()


async def _completions(base: str, prompts: list[list[int]], output: int) -> int:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        replies = await asyncio.gather(*(client.post(f"{base}/v1/completions", json={
            "model": "bench", "prompt": p, "max_tokens": output, "temperature": 0, "ignore_eos": True})
            for p in prompts))
    bad = [(r.status_code, r.text[:200]) for r in replies if r.status_code != 200]
    if bad:
        raise RuntimeError(f"server answered {bad[:2]}")
    return sum(r.json()["usage"]["completion_tokens"] for r in replies)


def server(checkpoint: str, ref: Generate, args) -> dict[str, float]:
    vocab, n = ref.vocab_size, args.requests
    fresh = lambda r: _prompts(vocab, n, args.server_prompt, seed=200 + r)  # noqa: E731
    config = (f'[[models]]\nname = "bench"\npath = "{checkpoint}"\n'
              f'[models.llm]\nkv_cache_mb = 256\nmax_num_seqs = {max(n, 1)}\n')
    with bench_server(config) as (proc, base):
        warm = fresh(-1)  # every side once at the run's shapes
        asyncio.run(_completions(base, warm, 4))
        ref.warm(warm)

        def ours(r):
            assert asyncio.run(_completions(base, fresh(r), args.server_output)) == n * args.server_output

        args.pids = [proc.pid, ref.process.pid]
        return rounds({"server": ours,
                       "generate one at a time": lambda r: ref.run(fresh(r), args.server_output, False),
                       f"generate batch of {n}": lambda r: ref.run(fresh(r), args.server_output, True)},
                      n * args.server_output, args)


def ttft(checkpoint: str, args) -> tuple[float, float]:
    """Median time to first token, over --repeats prefixes, of a request whose prefix the request before it
    prefilled (cached), and of that request before it (uncached: the prefix is new)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    engine = _engine(checkpoint, args)

    def first_token(ids) -> float:
        t = time.perf_counter()
        handle = _submit(engine, ids, 1)
        handle.result(timeout=600)
        return time.perf_counter() - t

    cached, uncached = [], []
    try:
        _submit(engine, _prompts(vocab, 1, 16, seed=2)[0], 2).result()  # warm
        for r in range(args.repeats):
            prefix = _prompts(vocab, 1, args.prefix, seed=10 + r)[0]
            tails = _prompts(vocab, 2, 16, seed=20 + r)
            uncached.append(first_token(prefix + tails[0]))  # the whole prompt is prefilled
            cached.append(first_token(prefix + tails[1]))  # the prefix's full blocks come from the cache
            print(f"  TTFT {r + 1}/{args.repeats}: cached {cached[-1] * 1000:6.1f} ms   uncached "
                  f"{uncached[-1] * 1000:6.1f} ms   load {loadavg()}", flush=True)
    finally:
        engine.shutdown()
    return statistics.median(cached), statistics.median(uncached)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint")
    parser.add_argument("--scale", default="small", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--server-prompt", type=int, default=200)
    parser.add_argument("--server-output", type=int, default=96)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-wait", type=float, default=30.0,
                        help="before each timed side, wait up to this long for a second in which other processes "
                             "use under 0.3 cores (the machine is shared); 0: do not wait")
    parser.add_argument("--skip-server", action="store_true", help="leave out the server comparison")
    args = parser.parse_args()

    from pipelines.demo import build_demo_model

    checkpoint = args.checkpoint or str(build_demo_model("llama",
                                                         Path.home() / f".cache/mmserve/bench/llama-{args.scale}",
                                                         scale=args.scale))
    print(f"checkpoint {checkpoint}; {args.requests} requests, prompt {args.prompt}, output {args.output}; "
          f"{os.cpu_count()} CPUs, load {loadavg()}", flush=True)
    ref = Generate(checkpoint)
    try:
        report("engine", throughput(checkpoint, ref, args), "engine", args)
        if not args.skip_server:
            print(f"server: {args.requests} concurrent /v1/completions, token-id prompts of {args.server_prompt}, "
                  f"{args.server_output} new tokens", flush=True)
            report("server", server(checkpoint, ref, args), "server", args)
    finally:
        ref.close()
    cached, uncached = ttft(checkpoint, args)
    print(f"TTFT with a {args.prefix}-token prefix cached {cached * 1000:8.1f} ms   "
          f"uncached {uncached * 1000:8.1f} ms   ratio {cached / uncached:.2f}x (median of {args.repeats}; "
          f"target <= 0.3)")


if __name__ == "__main__":
    main()
