"""Benchmark: requests over several LoRA adapters, mixed in one batch against grouped by adapter.

    python examples/bench_lora.py [--rounds 3] [--scale small] [--steps 8]
    python examples/bench_lora.py --tiny        # tiny demo models, seconds on a CPU (the test runs this)

Images: 8 concurrent requests over 4 adapters (2 each), same prompt set and seeds on every side:

  mixed      mmserve, all 8 at once: different adapters share each denoiser forward (stages/lora.py)
  grouped    mmserve, one adapter's requests at a time (what a server that batches only requests with the
             same adapters, as vLLM-Omni does, can put in one forward)
  diffusers  one diffusers pipeline with the 4 adapters loaded, `set_adapters` before each request, one request
             after another (a script serving them)

Language model: 16 requests over 4 adapters (4 each), 32 tokens, greedy: mixed (all at once) against grouped
(one adapter's requests at a time).

On a CUDA device also: the per-row update of one 4096 x 4096 layer for 256 tokens over 4 adapters (rank 16), the
Triton kernel (stages/kernels/lora.py) against the torch gather (one index_select, two matmuls and an index_add
per adapter, what stages/lora.py runs on a CPU). Without one that part says so and is skipped.

Every side is warmed first; the rounds alternate which side goes first; each run is printed with the load
average, then the medians and the ratios. Round 1 checks that every side made the same images (1e-4) and the
same tokens. Demo checkpoints and random adapters are built in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: pipelines/, stages/
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ADAPTERS = ("ink", "neon", "clay", "pastel")
PROMPTS = ("a lighthouse on a cliff", "a red bicycle", "a bowl of ramen", "an astronaut on a horse",
           "a fox in snow", "a city street at night", "a dragonfly", "a cabin in a forest")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def timed(run) -> tuple[float, list]:
    started = time.perf_counter()
    out = run()
    return time.perf_counter() - started, out


def compare(name: str, sides: dict, rounds: int, check) -> dict[str, float]:
    """Warm each side, then `rounds` rounds in alternating order; print every run; check round 1's outputs."""
    for run in sides.values():
        run()
    times: dict[str, list[float]] = {side: [] for side in sides}
    order = list(sides)
    for r in range(rounds):
        outputs = {}
        for side in (order if r % 2 == 0 else order[::-1]):
            took, outputs[side] = timed(sides[side])
            times[side].append(took)
            print(f"{name} round {r + 1} {side:10s} {took * 1000:9.1f} ms   (load {load()})")
        if r == 0:
            print(f"{name} round 1: {check(outputs)}")
    return {side: statistics.median(t) for side, t in times.items()}


def kernel_bench(rounds: int) -> dict[str, float] | None:
    """The kernel against the torch gather on one layer (CUDA only): median milliseconds of 50 calls each."""
    import torch

    if not torch.cuda.is_available():
        print("kernel: no CUDA device here; the Triton kernel vs torch gather comparison is skipped")
        return None
    from stages.kernels.lora import lora_rows

    dev, dim, tokens, rank, adapters = "cuda", 4096, 256, 16, 4
    gen = torch.Generator(dev).manual_seed(0)
    x = torch.randn(tokens, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    out = torch.randn(tokens, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    a = torch.randn(adapters, rank, dim, device=dev, dtype=torch.bfloat16, generator=gen) / dim ** 0.5
    b = torch.randn(adapters, dim, rank, device=dev, dtype=torch.bfloat16, generator=gen) / rank ** 0.5
    rows = torch.arange(tokens, device=dev)
    slots = rows % adapters
    scales = torch.ones(tokens, device=dev)

    def gather():
        y = out
        for s in range(adapters):
            index = rows[slots == s]
            y = y.index_add(0, index, (x.index_select(0, index) @ a[s].T) @ b[s].T)
        return y

    def kernel():
        return lora_rows(x, out, a, b, rows, slots, scales, use_triton=True)

    torch.testing.assert_close(kernel().float(), gather().float(), rtol=2e-2, atol=2e-2)
    sides = {"triton": kernel, "gather": gather}

    def run(fn):
        def timed_calls():
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
        return timed_calls
    med = compare("kernel", {k: run(f) for k, f in sides.items()}, rounds, lambda _: "both sides agree (2e-2)")
    return {k: v * 1000 / 50 for k, v in med.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", default="small", help="demo SD scale: tiny (64 px) or small (256 px)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="tiny models, 2 steps, 1 round (seconds)")
    args = p.parse_args()
    if args.tiny:
        args.scale, args.steps, args.rounds = "tiny", 2, 1

    import numpy as np
    import torch

    from pipelines.chat import ChatRequest
    from pipelines.config import EngineConfig, LoraSpec, ModelSpec
    from pipelines.demo import build_demo_model
    from pipelines.demo.lora import build_diffusion_lora, build_llm_lora
    from pipelines.engine import Engine
    from pipelines.image_request import ImageRequest
    from stages.llm.params import SamplingParams
    from stages.pool import PoolConfig

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sd = str(build_demo_model("sd", root / "sd", scale=args.scale))
        llama = str(build_demo_model("llama", root / "llama"))
        unet = dict(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "ff.net.2"])
        sd_loras = {a: build_diffusion_lora(sd, root / f"sd-{a}", i, {"unet": unet}) for i, a in enumerate(ADAPTERS)}
        lm_loras = {a: build_llm_lora(llama, root / f"lm-{a}", i, r=8, lora_alpha=16,
                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
                    for i, a in enumerate(ADAPTERS)}
        engine = Engine(EngineConfig(models=(
            ModelSpec("sd", sd, pools={"denoise": PoolConfig(max_batch_size=8, max_queue=64)},
                      loras=tuple(LoraSpec(a, path) for a, path in sd_loras.items())),
            ModelSpec("lm", llama, family="causal-lm",
                      loras=tuple(LoraSpec(a, path) for a, path in lm_loras.items())))))
        engine.start()
        try:
            images = [(PROMPTS[i], i, ADAPTERS[i % len(ADAPTERS)]) for i in range(8)]

            def image(prompt, seed, adapter):
                return ImageRequest(prompt=prompt, num_inference_steps=args.steps, guidance_scale=5.0, seed=seed,
                                    lora=((adapter, 1.0),))

            def mixed():
                handles = [engine.submit_image("sd", image(*spec)) for spec in images]
                return [h.result(timeout=1200)["pixels"] for h in handles]

            def grouped():
                out = {}
                for adapter in ADAPTERS:
                    group = [spec for spec in images if spec[2] == adapter]
                    handles = [engine.submit_image("sd", image(*spec)) for spec in group]
                    out.update({spec[1]: h.result(timeout=1200)["pixels"] for spec, h in zip(group, handles)})
                return [out[i] for i in range(len(images))]

            from diffusers import StableDiffusionPipeline

            pipe = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None, requires_safety_checker=False)
            pipe.set_progress_bar_config(disable=True)
            for adapter, path in sd_loras.items():
                pipe.load_lora_weights(path, adapter_name=adapter)

            def diffusers():
                out = []
                for prompt, seed, adapter in images:
                    pipe.set_adapters([adapter], [1.0])
                    out.append(pipe(prompt, num_inference_steps=args.steps, guidance_scale=5.0, output_type="np",
                                    generator=torch.Generator("cpu").manual_seed(seed)).images)
                return out

            def same_images(outputs):
                ok = all(np.allclose(a, b, atol=1e-4) for side in ("grouped", "diffusers")
                         for a, b in zip(outputs["mixed"], outputs[side]))
                return "mixed, grouped and diffusers made the same images" if ok else "the images DIFFER"

            img = compare("images", {"mixed": mixed, "grouped": grouped, "diffusers": diffusers}, args.rounds,
                          same_images)
            batch = engine.metrics.stage.max_batch_size("sd/denoise", "sd")

            texts = [([1, 7 + i, 30 + i, 55], ADAPTERS[i % len(ADAPTERS)]) for i in range(16)]
            greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

            def lm_request(prompt, adapter):
                return ChatRequest(prompt=prompt, params=greedy, lora=((adapter, None),))

            def lm_mixed():
                handles = [engine.submit("lm", lm_request(*spec)) for spec in texts]
                return [h.result(timeout=600)["choices"][0]["token_ids"] for h in handles]

            def lm_grouped():
                out = {}
                for adapter in ADAPTERS:
                    group = [(i, spec) for i, spec in enumerate(texts) if spec[1] == adapter]
                    handles = [(i, engine.submit("lm", lm_request(*spec))) for i, spec in group]
                    out.update({i: h.result(timeout=600)["choices"][0]["token_ids"] for i, h in handles})
                return [out[i] for i in range(len(texts))]

            def same_tokens(outputs):
                return "mixed and grouped made the same tokens" if outputs["mixed"] == outputs["grouped"] \
                    else "the tokens DIFFER"

            lm = compare("llm", {"mixed": lm_mixed, "grouped": lm_grouped}, args.rounds, same_tokens)
        finally:
            engine.shutdown()
    print(f"\nmedians over {args.rounds} rounds (load {load()}):")
    print(f"  images, 8 requests over 4 adapters ({args.scale} SD, {args.steps} steps; largest denoise batch "
          f"{batch}): mixed {img['mixed'] * 1000:.1f} ms, grouped {img['grouped'] * 1000:.1f} ms, diffusers "
          f"{img['diffusers'] * 1000:.1f} ms   mixed vs grouped {img['grouped'] / img['mixed']:.2f}x, "
          f"vs diffusers {img['diffusers'] / img['mixed']:.2f}x")
    print(f"  llm, 16 requests over 4 adapters (32 tokens): mixed {lm['mixed'] * 1000:.1f} ms, grouped "
          f"{lm['grouped'] * 1000:.1f} ms   mixed vs grouped {lm['grouped'] / lm['mixed']:.2f}x")
    kernel = kernel_bench(args.rounds)
    if kernel is not None:
        print(f"  one layer's update (4096 x 4096, 256 tokens, 4 adapters of rank 16, bf16): triton "
              f"{kernel['triton']:.3f} ms, torch gather {kernel['gather']:.3f} ms   "
              f"{kernel['gather'] / kernel['triton']:.2f}x")


if __name__ == "__main__":
    main()
