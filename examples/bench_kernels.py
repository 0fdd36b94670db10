"""Benchmark: each Triton kernel against its torch reference at denoiser / 7B-LLM shapes (CUDA).

    python examples/bench_kernels.py [--dtype bfloat16] [--repeats 50]
    python examples/bench_kernels.py --tiny     # tiny shapes through the Triton interpreter on the CPU

Prints, per kernel, the median time of the unfused torch code it replaces (as diffusers / transformers
run it: the CFG combine then the scheduler's float32 step; Llama's RMSNorm; LayerNorm then the
modulation), the kernel's time, the ratio, and the kernel's achieved memory bandwidth (bytes it must
move / time). On the CPU (--tiny) the kernels run in the
Triton interpreter: the numbers only show that the benchmark runs, not a speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "--tiny" in os.sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

CASES = {  # name -> shapes at full size and --tiny
    # Flux 1024x1024: latents [1, 4096, 64]; SD 1.5 512x512 with CFG: [2, 4, 64, 64] (the step's x is [1, ...])
    "cfg_euler_step (flux 1024^2, true CFG)": ((1, 4096, 64), (1, 16, 8)),
    "cfg_euler_step (16 x flux 1024^2)": ((16, 4096, 64), (2, 16, 8)),
    "rms_norm (llama-7b decode, 16 rows)": ((16, 4096), (4, 64)),
    "rms_norm (llama-7b prefill, 2048 rows)": ((2048, 4096), (8, 64)),
    "adaln_modulate (flux block, 4096+512 tokens)": ((1, 4608, 3072), (1, 16, 48)),
    "adaln_modulate (4 x sd3 block, 4096 tokens)": ((4, 4096, 1536), (2, 8, 48)),
}


def unfused_cfg_step(x, cond, uncond, scale, dt):
    """base.guide, then FlowMatchEulerDiscreteScheduler.step's arithmetic."""
    guided = uncond + scale * (cond - uncond)
    return (x.to(torch.float32) + dt * guided).to(guided.dtype)


def unfused_adaln(x, scale, shift, eps=1e-6):
    """diffusers' AdaLayerNormZero: LayerNorm (no affine), then the modulation, in x's dtype."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale[:, None]) + shift[:, None]


def _time(fn, repeats: int, cuda: bool) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    from stages.kernels.adaln import adaln_modulate
    from stages.kernels.cfg_step import cfg_euler_step
    from stages.kernels.rmsnorm import rms_norm, rms_norm_reference

    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda" if cuda else "cpu"), getattr(torch, args.dtype)
    repeats = args.repeats if cuda else 2
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu (Triton interpreter)'}, {args.dtype}, "
          f"median of {repeats}")
    for name, (full, tiny) in CASES.items():
        shape = tiny if args.tiny else full
        x = torch.randn(shape, device=device, dtype=dtype)
        if name.startswith("cfg"):
            cond, uncond = torch.randn_like(x), torch.randn_like(x)
            ref = lambda: unfused_cfg_step(x, cond, uncond, 3.5, -0.03)  # noqa: E731
            ker = lambda: cfg_euler_step(x, cond, uncond, 3.5, -0.03, use_triton=True)  # noqa: E731
            moved = 4 * x.numel() * x.element_size()
        elif name.startswith("rms"):
            w = torch.randn(shape[-1], device=device, dtype=dtype)
            ref = lambda: rms_norm_reference(x, w, 1e-5)  # noqa: E731
            ker = lambda: rms_norm(x, w, 1e-5, use_triton=True)  # noqa: E731
            moved = 2 * x.numel() * x.element_size()
        else:
            scale = torch.randn(shape[0], shape[2], device=device, dtype=dtype)
            shift = torch.randn_like(scale)
            ref = lambda: unfused_adaln(x, scale, shift)  # noqa: E731
            ker = lambda: adaln_modulate(x, scale, shift, use_triton=True)  # noqa: E731
            moved = 2 * x.numel() * x.element_size()
        torch.testing.assert_close(ker().float(), ref().float(), atol=5e-2, rtol=5e-2)
        t_ref, t_ker = _time(ref, repeats, cuda), _time(ker, repeats, cuda)
        print(f"{name:<46} torch {t_ref * 1e6:9.1f} us   triton {t_ker * 1e6:9.1f} us   "
              f"ratio {t_ref / t_ker:.2f}x   {moved / t_ker / 1e9:8.1f} GB/s")


if __name__ == "__main__":
    main()
