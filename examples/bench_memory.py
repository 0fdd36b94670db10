"""Benchmark: the memory settings of a diffusion model side by side, mmserve and diffusers with the same setting.

    python examples/bench_memory.py [--rounds 3] [--size 256] [--steps 8]
    python examples/bench_memory.py --tiny      # 64 px, 2 steps, 1 round (the test runs this)

One table row per setting of the demo FLUX (its transformer and T5 encoder; random weights):

  float      everything float32, as loaded
  int8wo     [models.quantize] transformer and text_encoder_2 = "int8wo" (torchao int8 weight-only)
  gguf-q8    transformer from a GGUF file quantized Q8_0 (written here with the gguf package)
  gguf-q4    the same, Q4_0
  offload    [models.offload] transformer = "block", text_encoder_2 = "leaf" (group offloading)
  fp8, nf4   need a CUDA device: listed as "not run" on a CPU

Columns: resident bytes of the weights as loaded, what one request adds at its peak (the process's resident
high-water mark, reset before the request, over its resident set then, CPU; the CUDA allocator's peak over its
bytes then, GPU), time per denoise step for
mmserve and for diffusers with the same setting (medians of the rounds; every run printed with the load
average), and PSNR of the image against float's. Each setting is warmed first and the rounds alternate which
side goes first.
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

PROMPT = "a lighthouse on a cliff at dusk"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM, the resident high-water mark
            f.write("5")


def memory_now(device, key: str = "VmRSS") -> int:
    """CUDA: the allocator's bytes now (VmRSS) or its peak (VmHWM); CPU: the process's resident set or its peak."""
    import torch

    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) if key == "VmRSS" else torch.cuda.max_memory_allocated(device)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return 0


def psnr(a, b) -> float:
    import numpy as np

    mse = float(((a.astype(np.float64) - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="64 px, 2 steps, 1 round (seconds)")
    args = p.parse_args()
    if args.tiny:
        args.size, args.steps, args.rounds = 64, 2, 1

    import torch
    from diffusers import FluxPipeline

    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.demo import build_demo_model
    from pipelines.demo.gguf import write_gguf
    from pipelines.engine import Engine
    from pipelines.image_request import ImageRequest
    from pipelines.offload import apply_offload
    from pipelines.quantize import Quantization

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        flux = str(build_demo_model("flux", Path(tmp) / "flux"))
        q8 = write_gguf(flux, "transformer", Path(tmp) / "q8.gguf", "Q8_0")
        q4 = write_gguf(flux, "transformer", Path(tmp) / "q4.gguf", "Q4_0")
        settings = {"float": ({}, {}), "int8wo": ({"transformer": "int8wo", "text_encoder_2": "int8wo"}, {}),
                    "gguf-q8": ({"transformer": f"gguf:{q8}"}, {}), "gguf-q4": ({"transformer": f"gguf:{q4}"}, {}),
                    "offload": ({}, {"transformer": "block", "text_encoder_2": "leaf"}),
                    "fp8": ({"transformer": "fp8"}, {}), "nf4": ({"transformer": "nf4"}, {})}
        call = dict(width=args.size, height=args.size, num_inference_steps=args.steps, guidance_scale=3.5)
        rows, reference = [], None
        for name, (quantize, offload) in settings.items():
            if not cuda and name in ("fp8", "nf4"):
                rows.append((name, None))
                continue
            spec = ModelSpec("m", flux, device=str(device), quantize=quantize, offload=offload)
            engine = Engine(EngineConfig(models=(spec,)))
            engine.start()
            pipe = FluxPipeline.from_pretrained(flux, **(Quantization(quantize).load_kwargs(flux, torch.float32)
                                                        if quantize else {}))
            pipe.set_progress_bar_config(disable=True)
            pipe.to(device)
            if offload:
                apply_offload("diffusers", pipe.components, offload, device)
            try:
                def ours():
                    return engine.submit_image("m", ImageRequest(prompt=PROMPT, seed=1, **call)) \
                        .result(timeout=3600)["pixels"][0]

                def theirs():
                    return pipe(PROMPT, generator=torch.Generator("cpu").manual_seed(1), output_type="np",
                                **call).images[0]

                ours(), theirs()  # warm both
                times: dict[str, list[float]] = {"mmserve": [], "diffusers": []}
                peak = image = None
                for r in range(args.rounds):
                    for side in (("mmserve", "diffusers") if r % 2 == 0 else ("diffusers", "mmserve")):
                        reset_peak(device)
                        before = memory_now(device)
                        started = time.perf_counter()
                        out = ours() if side == "mmserve" else theirs()
                        took = time.perf_counter() - started
                        times[side].append(took / args.steps)
                        if side == "mmserve":
                            peak, image = memory_now(device, "VmHWM") - before, out
                        print(f"{name:8s} round {r + 1} {side:9s} {took * 1000:9.1f} ms "
                              f"({took / args.steps * 1000:.1f} ms a step)   (load {load_average()})")
                reference = image if reference is None else reference
                rows.append((name, (engine.models["m"].resident_bytes, peak,
                                    statistics.median(times["mmserve"]), statistics.median(times["diffusers"]),
                                    psnr(reference, image))))
            finally:
                engine.shutdown()
    print(f"\nFLUX demo, {args.size} px, {args.steps} steps, {device} (load {load_average()}); medians over "
          f"{args.rounds} rounds")
    print(f"{'setting':10s} {'weights MiB':>12s} {'peak +MiB':>10s} {'mmserve ms/step':>16s} "
          f"{'diffusers ms/step':>18s} {'PSNR dB':>8s}")
    for name, row in rows:
        if row is None:
            print(f"{name:10s} not run (needs a CUDA device)")
            continue
        weights, peak, ours_s, theirs_s, quality = row
        print(f"{name:10s} {weights / 2**20:12.1f} {peak / 2**20:10.1f} {ours_s * 1000:16.1f} "
              f"{theirs_s * 1000:18.1f} {quality:8.1f}")


if __name__ == "__main__":
    main()
