"""Weights that live on the CPU and stream to the model's device for each forward (`[models.offload]`, keyed by
the component names of model_index.json), through diffusers' group offloading:

    block   groups of one block each (the repeated blocks of a UNet or transformer, a text encoder's layers)
            move to the device before they run and back after; on CUDA a side stream prefetches the next group
            while the current one runs
    leaf    every leaf module on its own: the least device memory, the most copies
    model   the whole component moves to the device for its forward and back after it (diffusers' model CPU
            offload, per component: the fewest copies, the component's whole size on the device while it runs;
            concurrent forwards of one component share the trip)

Step-level batching keeps working (the hooks move weights, not activations); CUDA graphs do not (a captured
graph would replay copies of weights that are no longer there), so a model with offload runs without them, and
says so at start.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)
OFFLOAD_TYPES = {"block": "block_level", "leaf": "leaf_level", "model": "model"}


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
        if kind == "model":
            WholeModule(modules[name], device).install()
            log.info("model %s: %s kept on the CPU, moved to %s for each forward", model, name, device)
            continue
        apply_group_offloading(modules[name], onload_device=device, offload_device=torch.device("cpu"),
                               offload_type=OFFLOAD_TYPES[kind], use_stream=device.type == "cuda",
                               num_blocks_per_group=1 if kind == "block" else None)
        log.info("model %s: %s offloaded to the CPU (%s level), streamed to %s per forward", model, name, kind,
                 device)


class WholeModule:
    """A component on the CPU between forwards and on `device` during them: the first forward in moves it, the
    last one out (or failing) moves it back."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.module, self.device = module, device
        self.running = 0
        self._lock = threading.Lock()

    def install(self) -> None:
        self.module.to("cpu")
        self.module.register_forward_pre_hook(self._enter)
        self.module.register_forward_hook(self._leave, always_call=True)
        self.module._mmserve_offload = self  # type: ignore[assignment]

    def _enter(self, module, args) -> None:
        with self._lock:
            if not self.running:
                module.to(self.device)
            self.running += 1

    def _leave(self, module, args, output) -> None:
        with self._lock:
            self.running -= 1
            if not self.running:
                module.to("cpu")
