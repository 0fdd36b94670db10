"""What every kernel wrapper checks before a launch."""

from __future__ import annotations

import os

import torch


def wants_triton(tensor: torch.Tensor, use_triton: bool | None) -> bool:
    """None: the kernel on CUDA, the torch reference elsewhere. True on CPU needs the interpreter."""
    if use_triton is None:
        return tensor.is_cuda
    if use_triton and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before "
                         "importing triton, or pass use_triton=False for the torch reference")
    return use_triton
