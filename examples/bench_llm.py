"""Benchmark: the llm stage vs transformers generate(), side by side in one run.

    python examples/bench_llm.py [--checkpoint DIR] [--requests 16] [--prompt 256] [--output 128]

1. Output tokens/s of N concurrent requests through mmserve's engine, vs generate() called one
   request at a time, and vs generate() on one left-padded batch of N (greedy, EOS ignored).
2. Time to first token of a request whose long prefix (--prefix tokens) is in the prefix cache,
   vs the same request on an empty cache.

Without --checkpoint it builds the "small" demo Llama (random weights). Ratios are the result.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
    return engine.submit_chat("bench", ChatRequest(prompt=list(ids), params=params))


def throughput(checkpoint: str, args) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    prompts = _prompts(model.config.vocab_size, args.requests, args.prompt)
    total = args.requests * args.output
    engine = _engine(checkpoint, args)
    try:
        _submit(engine, prompts[0][:16], 4).result()  # warm
        t = time.perf_counter()
        handles = [_submit(engine, p, args.output) for p in prompts]
        outs = [h.result(timeout=3600) for h in handles]
        ours = time.perf_counter() - t
        assert sum(o["usage"]["completion_tokens"] for o in outs) == total
    finally:
        engine.shutdown()
    kwargs = dict(max_new_tokens=args.output, min_new_tokens=args.output, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm
        t = time.perf_counter()
        for p in prompts:
            model.generate(torch.tensor([p]), **kwargs)
        sequential = time.perf_counter() - t
        batch = torch.tensor(prompts)  # equal lengths: no padding needed, the fairest batch for generate()
        t = time.perf_counter()
        model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
        batched = time.perf_counter() - t
    return {"ours": total / ours, "sequential": total / sequential, "batched": total / batched}


def ttft(checkpoint: str, args) -> tuple[float, float]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    prefix = _prompts(vocab, 1, args.prefix, seed=1)[0]
    tails = _prompts(vocab, 3, 16, seed=2)
    engine = _engine(checkpoint, args)

    def first_token(ids) -> float:
        t = time.perf_counter()
        handle = _submit(engine, ids, 1)
        handle.result(timeout=600)
        return time.perf_counter() - t

    try:
        _submit(engine, tails[2], 2).result()  # warm
        uncached = first_token(prefix + tails[0])  # empty cache: the whole prompt is prefilled
        cached = first_token(prefix + tails[1])  # the prefix's full blocks come from the cache
    finally:
        engine.shutdown()
    return cached, uncached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint")
    parser.add_argument("--scale", default="small", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--prefix", type=int, default=1024)
    args = parser.parse_args()

    from pipelines.demo import build_demo_model

    checkpoint = args.checkpoint or str(build_demo_model("llama",
                                                         Path.home() / f".cache/mmserve/bench/llama-{args.scale}",
                                                         scale=args.scale))
    print(f"checkpoint {checkpoint}; {args.requests} requests, prompt {args.prompt}, output {args.output}; "
          f"{os.cpu_count()} CPUs")
    tps = throughput(checkpoint, args)
    print(f"output tokens/s  mmserve {tps['ours']:8.1f}   generate() one at a time {tps['sequential']:8.1f}   "
          f"ratio {tps['ours'] / tps['sequential']:.2f}x (target >= 3)")
    print(f"output tokens/s  mmserve {tps['ours']:8.1f}   generate() one batch of {args.requests} "
          f"{tps['batched']:8.1f}   ratio {tps['ours'] / tps['batched']:.2f}x (target >= 1.2)")
    cached, uncached = ttft(checkpoint, args)
    print(f"TTFT with a {args.prefix}-token prefix cached {cached * 1000:8.1f} ms   "
          f"uncached {uncached * 1000:8.1f} ms   ratio {cached / uncached:.2f}x (target <= 0.3)")


if __name__ == "__main__":
    main()
