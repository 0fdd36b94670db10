"""Benchmark: the vision encoder path of vision-language models, side by side in one run.

    python examples/bench_vlm.py [--checkpoint DIR] [--images 32] [--vision-depth 6] [--device cpu]

1. Time to first token of a second question about the same image (different wording; the
   encoder-output cache is warm, the prefix cache holds the image's blocks) vs the first question.
2. Encoder throughput on N mixed-size images: mmserve's batched forwards (one per bucket) vs one
   image per forward, for LLaVA (every image resized to the tower's size: one stacked bucket) and
   Qwen2.5-VL (variable-length packing, nothing padded; attention stays per image).

Without --checkpoint it builds random-weight models whose vision tower dominates prefill (the tiny
language model of the demo; a deeper and wider tower; Qwen images up to 448 px). Ratios are the result.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_llava(out: Path, depth: int, hidden: int) -> Path:
    """The demo LLaVA with a deeper, wider CLIP tower at 112 px (random weights)."""
    import torch
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration, LlavaProcessor

    from pipelines.demo.vlm import build_llava as demo

    bundle = demo(seed=0)
    config = bundle.model.config
    vision = config.vision_config
    vision.num_hidden_layers, vision.hidden_size, vision.intermediate_size = depth, hidden, hidden * 4
    vision.image_size, vision.patch_size = 112, 14
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    images = CLIPImageProcessor(size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112})
    processor = LlavaProcessor(image_processor=images, tokenizer=bundle.processor.tokenizer, patch_size=14,
                               num_additional_image_tokens=1, vision_feature_select_strategy="default",
                               chat_template=bundle.processor.chat_template)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def build_checkpoint(out: Path, depth: int, hidden: int) -> Path:
    """The demo Qwen2.5-VL with a bigger tower and a 448 px pixel budget (random weights)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from pipelines.demo.vlm import build_qwen2_5_vl

    bundle = build_qwen2_5_vl(seed=0)
    config = bundle.model.config
    vision = config.vision_config
    vision.depth, vision.hidden_size, vision.intermediate_size = depth, hidden, hidden * 2
    vision.num_heads, vision.fullatt_block_indexes, vision.window_size = 4, [depth - 1], 112
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    for proc in (bundle.processor.image_processor, bundle.processor.video_processor):
        proc.size = {"shortest_edge": 56 * 56, "longest_edge": 448 * 448}
    model.save_pretrained(out)
    bundle.processor.save_pretrained(out)
    return out


def image_uri(seed: int, width: int, height: int) -> str:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ttft(engine, model: str, url: str, question: str) -> float:
    """Seconds from submit (fetch and decode included) to the first streamed token."""
    from pipelines.chat import ChatRequest
    from stages.events import EventKind
    from stages.llm.params import SamplingParams

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": question}]}]
    started = time.perf_counter()
    handle = engine.submit_chat(model, ChatRequest(messages=messages,
                                                   params=SamplingParams(temperature=0, max_tokens=4)))
    first = None
    for event in handle.events(timeout=600):
        if event.kind is EventKind.DELTA and first is None:
            first = time.perf_counter() - started
    return first


def bench_ttft(engine, model: str, repeats: int) -> tuple[float, float]:
    cold, warm = [], []
    for i in range(repeats):
        url = image_uri(100 + i, 448, 448)  # a new image each round: the first question misses
        cold.append(ttft(engine, model, url, "What is in this picture?"))
        warm.append(ttft(engine, model, url, "Which colours dominate it?"))
    return statistics.median(cold), statistics.median(warm)


def bench_encoder(adapter, count: int, rounds: int) -> tuple[float, float, int]:
    """Seconds for `count` mixed-size images: one forward per image vs mmserve's bucketed forwards."""
    import numpy as np
    from PIL import Image

    from encoders.vision import MediaItem

    sizes = [(112, 112), (168, 224), (224, 168), (140, 196)]
    prepared = []
    for i in range(count):
        w, h = sizes[i % len(sizes)]
        pixels = Image.fromarray((np.random.RandomState(i).rand(h, w, 3) * 255).astype("uint8"))
        prepared.append(adapter.prepare(adapter.task(MediaItem("image", pixels, f"bench{i}", h, w), "bench")))
    buckets: dict = {}
    for p in prepared:
        buckets.setdefault(adapter.bucket(p), []).append(p)

    def one_at_a_time():
        for p in prepared:
            adapter.encode([p])

    def bucketed():
        for group in buckets.values():
            adapter.encode(group)

    one_at_a_time(), bucketed()  # warm-up
    times = {}
    for name, fn in (("single", one_at_a_time), ("batched", bucketed)):
        samples = []
        for _ in range(rounds):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        times[name] = statistics.median(samples)
    return times["single"], times["batched"], len(buckets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a Qwen2-VL / Qwen2.5-VL / LLaVA checkpoint (default: build one)")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--vision-depth", type=int, default=6)
    parser.add_argument("--vision-hidden", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from pipelines.chat import LLMConfig
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine

    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or str(build_checkpoint(Path(tmp) / "bench-vlm", args.vision_depth, args.vision_hidden))
        spec = ModelSpec("bench", path, device=args.device, llm=LLMConfig(kv_cache_mb=64))
        engine = Engine(EngineConfig(models=(spec,)))
        engine.start()
        try:
            cold, warm = bench_ttft(engine, "bench", args.repeats)
            print(f"TTFT first question {cold * 1000:.1f} ms, second question (cache warm) {warm * 1000:.1f} ms: "
                  f"ratio {warm / cold:.2f}x (target <= 0.5x)")
            encoders = {"qwen2.5-vl": engine.chat_model("bench").adapters["image"]}
            if not args.checkpoint:
                llava = build_llava(Path(tmp) / "bench-llava", args.vision_depth, args.vision_hidden)
                engine.shutdown()
                engine = Engine(EngineConfig(models=(ModelSpec("llava", str(llava), device=args.device),)))
                engine.start()
                encoders["llava"] = engine.chat_model("llava").adapters["image"]
            for family, adapter in encoders.items():
                single, batched, buckets = bench_encoder(adapter, args.images, args.repeats)
                print(f"encoder ({family}), {args.images} mixed-size images: one per forward {single * 1000:.1f} ms, "
                      f"bucketed ({buckets} bucket(s)) {batched * 1000:.1f} ms: throughput {single / batched:.2f}x "
                      f"(target >= 1.5x)")
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
