"""Weights that live on the CPU and stream to the model's device for each forward (`[models.offload]`, keyed by
the component names of model_index.json), through diffusers' group offloading:

    block   groups of one block each (the repeated blocks of a UNet or transformer, a text encoder's layers)
            move to the device before they run and back after; on CUDA a side stream prefetches the next group
            while the current one runs
    leaf    every leaf module on its own: the least device memory, the most copies

Step-level batching keeps working (the hooks move weights, not activations); CUDA graphs do not (a captured
graph would replay copies of weights that are no longer there), so a model with offload runs without them, and
says so at start.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
OFFLOAD_TYPES = {"block": "block_level", "leaf": "leaf_level"}


def check_offload(model: str, offload: dict[str, str]) -> None:
    for component, kind in offload.items():
        if kind not in OFFLOAD_TYPES:
            raise ValueError(f"model {model}: offload.{component} = {kind!r}: expected one of {list(OFFLOAD_TYPES)}")


def apply_offload(model: str, components: dict[str, object], offload: dict[str, str], device: torch.device) -> None:
    """Offload each named component (a torch module of the pipeline) to the CPU, onloading to `device`."""
    from diffusers.hooks import apply_group_offloading

    modules = {name: m for name, m in components.items() if isinstance(m, torch.nn.Module)}
    unknown = sorted(set(offload) - set(modules))
    if unknown:
        raise ValueError(f"model {model}: offload names {unknown}, which are not modules of the pipeline; its "
                         f"modules: {sorted(modules)}")
    for name, kind in offload.items():
        apply_group_offloading(modules[name], onload_device=device, offload_device=torch.device("cpu"),
                               offload_type=OFFLOAD_TYPES[kind], use_stream=device.type == "cuda",
                               num_blocks_per_group=1 if kind == "block" else None)
        log.info("model %s: %s offloaded to the CPU (%s level), streamed to %s per forward", model, name, kind,
                 device)
