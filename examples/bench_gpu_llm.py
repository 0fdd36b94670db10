"""Benchmark: LLM decode speed of mmserve (graphs off / on) vs transformers generate(), 7B-size Llama, random weights.

    python examples/bench_gpu_llm.py [--batch 1,16] [--prompt 128] [--output 128] [--peak-gbps auto]
    python examples/bench_gpu_llm.py --tiny       # the tiny demo Llama on the CPU, in seconds

Decode rate = B * (N - 1) tokens / (time of B requests of N new tokens - time of the same with 1 new token):
the prefill and the first token cancel out. At batch 1, the achieved memory bandwidth is the bytes one
decode step must read (every weight but the input embedding, plus the KV of the context) over the
step time, as a fraction of the GPU's peak (H200: 4.8 TB/s; H100 SXM: 3.35 TB/s).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


def _prompts(vocab: int, batch: int, length: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mmserve_rate(checkpoint: str, args, graphs: bool) -> dict[int, float]:
    from pipelines.chat import ChatRequest, LLMConfig
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine
    from stages.cuda_graphs import GraphConfig
    from stages.llm.params import SamplingParams

    batches = [int(b) for b in args.batch.split(",")]
    buckets = tuple(sorted({1, 2, 4, 8, *batches}))
    llm = LLMConfig(kv_cache_mb=args.kv_mb, block_size=16, max_num_seqs=max(batches), max_num_batched_tokens=4096)
    spec = ModelSpec("bench", checkpoint, device=args.device, dtype=args.dtype, llm=llm,
                     graphs=GraphConfig(batch_sizes=buckets) if graphs else GraphConfig())
    engine = Engine(EngineConfig(models=(spec,)))
    started = time.perf_counter()
    engine.start()
    print(f"  mmserve graphs {'on ' if graphs else 'off'}: ready in {time.perf_counter() - started:.1f} s")
    vocab = engine.chat_model("bench").runner.vocab_size
    rates = {}
    try:
        def run(prompts, n):
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
            _sync()
            t = time.perf_counter()
            handles = [engine.submit_chat("bench", ChatRequest(prompt=p, params=params)) for p in prompts]
            for h in handles:
                h.result(timeout=3600)
            _sync()
            return time.perf_counter() - t

        for b in batches:
            prompts = _prompts(vocab, b, args.prompt)
            run(prompts, 2)  # warm
            full, first = run(prompts, args.output), run(prompts, 1)
            rates[b] = b * (args.output - 1) / (full - first)
    finally:
        engine.shutdown()
    return rates


def generate_rate(checkpoint: str, args) -> tuple[dict[int, float], object]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    rates = {}
    for b in [int(x) for x in args.batch.split(",")]:
        ids = torch.tensor(_prompts(model.config.vocab_size, b, args.prompt), device=args.device)

        def run(n):
            _sync()
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
            _sync()
            return time.perf_counter() - t

        run(2)
        full, first = run(args.output), run(1)
        rates[b] = b * (args.output - 1) / (full - first)
    return rates, model


def step_bytes(model, context: int) -> int:
    """What one batch-1 decode step reads: the weights (not the input embedding: one row) and the KV."""
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * context * c.num_key_value_heads * head_dim * embed.element_size()
    return weights + kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a causal LM checkpoint (default: build the 7B-size random Llama)")
    parser.add_argument("--layers", type=int, default=32, help="layers of the built Llama (32 = 7B)")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--kv-mb", type=float, default=8192)
    parser.add_argument("--peak-gbps", type=float, default=None, help="default: from the device name")
    parser.add_argument("--tiny", action="store_true", help="the tiny demo Llama on the CPU")
    parser.add_argument("--out", default=str(Path.home() / ".cache/mmserve/bench"))
    args = parser.parse_args()
    import torch

    if args.tiny:
        from pipelines.demo import build_demo_model

        args.device, args.dtype, args.batch, args.prompt, args.output, args.kv_mb = "cpu", "float32", "1,4", 16, 8, 16
        checkpoint = args.checkpoint or str(build_demo_model("llama", Path(args.out) / "llama-tiny"))
    else:
        from gpu_models import build

        args.device, args.dtype = "cuda", "bfloat16"
        started = time.perf_counter()
        checkpoint = args.checkpoint or str(build("llama7b", Path(args.out) / f"llama7b-{args.layers}",
                                                  layers=args.layers))
        print(f"checkpoint {checkpoint} ({time.perf_counter() - started:.0f} s to build or find)")
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    print(f"{device}, {args.dtype}, prompt {args.prompt} tokens, {args.output} new tokens, greedy, EOS ignored")
    off = mmserve_rate(checkpoint, args, graphs=False)
    _free()
    on = mmserve_rate(checkpoint, args, graphs=True)
    _free()
    ref, model = generate_rate(checkpoint, args)
    for b in off:
        print(f"batch {b:3d}: mmserve graphs off {off[b]:8.1f} tok/s  graphs on {on[b]:8.1f} tok/s  "
              f"generate() {ref[b]:8.1f} tok/s  ratio {on[b] / ref[b]:.2f}x (graphs on vs generate)")
    if 1 in on:
        peak = args.peak_gbps or next((v for k, v in PEAK_GBPS.items() if k in device), None)
        moved = step_bytes(model, args.prompt + args.output // 2)
        achieved = moved * on[1] / 1e9
        fraction = f"{achieved / peak:.0%} of {peak:.0f} GB/s" if peak else "peak unknown (--peak-gbps)"
        print(f"batch 1 bandwidth: {moved / 1e9:.2f} GB per step x {on[1]:.1f} steps/s = {achieved:.0f} GB/s, "
              f"{fraction} (target >= 70%)")


if __name__ == "__main__":
    main()
