"""Regional torch.compile: compile the repeated blocks of a denoiser, not the whole model.

Blocks repeat (a DiT's transformer blocks, a UNet's down/mid/up blocks), so compiling each
block's forward costs a few compilations shared by many calls, and the glue around them stays
eager (step caching and the graph runner wrap that glue). The compile itself happens lazily at
the first call of each shape, during warm-up; the denoiser reports that time separately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

# Modes whose CUDA graphs would fight the graph runner's own are refused.
MODES = (None, "default", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileConfig:
    """Per model (ModelSpec.compile)."""

    enabled: bool = False
    mode: str | None = None  # torch.compile mode; None: torch's default
    backend: str = "inductor"  # "eager" / "aot_eager" check the plumbing without code generation
    dynamic: bool | None = None  # None: torch marks dims dynamic once a second shape is seen
    fullgraph: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"compile.mode must be one of {list(MODES)}, got {self.mode!r} "
                             "(reduce-overhead and max-autotune capture CUDA graphs; the graph runner does that)")


def compile_blocks(blocks: Iterable[torch.nn.Module], config: CompileConfig) -> int:
    """Replace each block's forward by its compiled version; returns how many were compiled."""
    count = 0
    for block in blocks:
        # An instance attribute: wrappers installed later (step caching) see the compiled forward.
        block.forward = torch.compile(block.forward, mode=config.mode, backend=config.backend,
                                      dynamic=config.dynamic, fullgraph=config.fullgraph)
        count += 1
    return count
