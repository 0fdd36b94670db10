"""Benchmark: constrained decoding's cost in the llm stage, side by side in one run.

    python examples/bench_structured.py [--checkpoint DIR] [--requests 16] [--output 128] [--repeats 3]

Two sides on the same engine (the "small" demo Llama without --checkpoint):

  free         --requests concurrent greedy requests, --output new tokens each (EOS ignored);
  constrained  the same, half of them under a JSON schema (an array of --output // 2 digits, so the grammar
               needs about as many tokens as the free rows make), sharing the steps with the free half.

Output tokens/s of each side (completion tokens counted from the replies), each side warmed, the order alternating
over --repeats rounds, every run printed with the load average, then the medians and the ratio (target >= 0.9).
Then the grammar compile time of --schemas distinct schemas, cold (first compile) and cached (the same again).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: pipelines/, stages/
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--schemas", type=int, default=20)
    args = p.parse_args()

    from pipelines.chat import ChatRequest, LLMConfig
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.demo import build_demo_model
    from pipelines.engine import Engine
    from stages.llm.grammar import Grammar
    from stages.llm.params import SamplingParams

    checkpoint = args.checkpoint or str(build_demo_model("llama", Path.home() / ".cache/mmserve/bench/llama-small",
                                                         scale="small"))
    llm = LLMConfig(kv_cache_mb=256, block_size=16, max_num_seqs=max(args.requests, 1), max_num_batched_tokens=2048)
    engine = Engine(EngineConfig(models=(ModelSpec("bench", checkpoint, llm=llm),)))
    engine.start()
    digits = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": args.output // 2, "maxItems": args.output // 2}
    grammar = Grammar("json_schema", json.dumps(digits))

    def run(constrained: bool, r: int) -> tuple[float, int]:
        handles = []
        for i in range(args.requests):
            shaped = constrained and i % 2 == 0
            params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=not shaped,
                                    response_format=grammar if shaped else None)
            messages = [{"role": "user", "content": f"round {r} request {i}: list some digits"}]
            handles.append(engine.submit_chat("bench", ChatRequest(messages=messages, params=params)))
        started = time.perf_counter()
        outputs = [h.result(timeout=600) for h in handles]
        took = time.perf_counter() - started
        return took, sum(o["usage"]["completion_tokens"] for o in outputs)

    try:
        run(False, -1)
        run(True, -2)  # warm both (and compile the schema once)
        rates: dict[str, list[float]] = {"free": [], "constrained": []}
        for r in range(args.repeats):
            order = ("free", "constrained") if r % 2 == 0 else ("constrained", "free")
            for side in order:
                took, tokens = run(side == "constrained", r)
                rates[side].append(tokens / took)
                print(f"round {r + 1} {side:11s} {tokens:5d} tokens in {took * 1000:8.1f} ms = {tokens / took:8.1f} "
                      f"tok/s   (load {load()})", flush=True)
        free, shaped = statistics.median(rates["free"]), statistics.median(rates["constrained"])
        print(f"\nmedians over {args.repeats} rounds (load {load()}): free {free:.1f} tok/s, half constrained "
              f"{shaped:.1f} tok/s   ratio {shaped / free:.2f}x (target >= 0.9)")
        grammars = engine.chat_model("bench").stage.grammars
        schemas = [Grammar("json_schema", json.dumps({"type": "object", "properties": {
            f"field_{i}_{k}": {"type": "string", "maxLength": 8 + k} for k in range(i % 6 + 2)},
            "required": [f"field_{i}_0"]}))
            for i in range(args.schemas)]
        cold = []
        for schema in schemas:
            started = time.perf_counter()
            grammars.compile(schema)
            cold.append(time.perf_counter() - started)
        warm = []
        for schema in schemas:
            started = time.perf_counter()
            grammars.compile(schema)
            warm.append(time.perf_counter() - started)
        print(f"grammar compile, {args.schemas} schemas: cold median {statistics.median(cold) * 1000:.2f} ms "
              f"(max {max(cold) * 1000:.2f}), cached median {statistics.median(warm) * 1e6:.1f} us")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
