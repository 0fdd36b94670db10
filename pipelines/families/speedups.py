"""The denoiser forward of every family behind its speed-ups (DESIGN §5, §8): what a family declares
(its denoisers, their repeated blocks, how step caching cuts them) and the calls its steps make."""

from __future__ import annotations

import collections
import functools
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from pipelines.config import ParallelConfig
from pipelines.image_request import RequestError
from stages.diffusion.block_stack import CacheSpec, RowGroup
from stages.diffusion.denoiser import DenoiserCall, Speedups
from stages.diffusion.ranks import RankGroup
from stages.diffusion.step_cache import StepCacheState
from stages.lora import AdapterGate, rows_use
from stages.stage import WorkItem


class SpeedupHost(Protocol):
    """What the speed-ups need of the class they are mixed into (DiffusionFamily, the base of the image and the
    video families, pipelines/families/diffusion_base.py)."""

    name: str  # the served model's name (metric labels)
    family: str
    loras: AdapterGate  # every denoiser forward holds it (adapters load and unload between forwards)

    def measured(self, items: list[WorkItem], rows: int) -> AbstractContextManager:
        """Around a denoiser forward: its activation bytes recorded when a memory budget needs them."""
        ...

    @property
    def pipe(self) -> Any:
        """The loaded diffusers pipeline (its denoisers are attributes named in `denoiser_keys`)."""
        ...

    @staticmethod
    def guide(model_output: torch.Tensor, cfg: bool, scale: float) -> torch.Tensor:
        """Classifier-free guidance over a [uncond, cond] batch (the output unchanged without CFG)."""
        ...

    @staticmethod
    def split(batched: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """A batched output cut back into its items' rows."""
        ...


class DenoiserSpeedups(SpeedupHost):
    """The speed-ups of a family's denoiser forward, over what `SpeedupHost` provides."""

    denoiser_keys: tuple[str, ...] = ("unet",)  # the pipeline attributes holding denoisers
    speedups: Speedups
    denoiser: DenoiserCall
    ranks: RankGroup | None = None  # a replica over several ranks ([models.parallel], pipelines/parallel.py)
    parallel: ParallelConfig = ParallelConfig()

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.close()

    def accelerate(self, speedups: Speedups, metrics=None) -> None:
        """At load: fused norms, regional compile and step-cache wrappers on each denoiser; graphs per config."""
        self.speedups = speedups
        self.denoiser = DenoiserCall(self.name, graphs=speedups.graphs, compile=speedups.compile,
                                     step_cache=speedups.step_cache, metrics=metrics)
        for key in self.denoiser_keys:
            module = getattr(self.pipe, key, None)
            if module is None:
                continue
            if speedups.fused_kernels:
                from stages.kernels.patch import use_fused_norms

                use_fused_norms(module)
            self.denoiser.prepare(key, self.compile_regions(module), self.cache_spec(key, module))

    def repeated_blocks(self, module) -> tuple:
        """The denoiser's repeated blocks in call order (a DiT's transformer blocks)."""
        return ()

    def compile_regions(self, module) -> tuple:
        """What regional compile compiles: the repeated blocks (a UNet's down, mid and up blocks)."""
        return self.repeated_blocks(module)

    def cache_spec(self, key: str, module) -> CacheSpec | None:
        """How step caching cuts this denoiser; None: the family does not cache."""
        return None

    def check_step_cache(self, params) -> None:
        """A request's step cache needs a model that allows it (and first-block caching a block stack)."""
        if params is None:
            return
        if not self.speedups.step_cache.enabled:
            raise RequestError("step_cache", f"model {self.name} does not allow step caching (approximate); enable "
                                             "it per model with step_cache = {enabled = true}")
        stacks = [self.denoiser.stacks.get(k) for k in self.denoiser_keys if getattr(self.pipe, k, None) is not None]
        if not stacks or any(s is None for s in stacks):
            raise RequestError("step_cache", f"model {self.name} ({self.family}) has no step cache")
        if params.method == "fbcache" and not all(s is not None and s.supports_fbcache for s in stacks):
            raise RequestError("step_cache.method", f"fbcache needs a transformer of at least two blocks; model "
                                                    f"{self.name} ({self.family}) supports teacache and interval")

    def denoise(self, key: str, items: list[WorkItem], sizes: list[int], batched: dict[str, Any],
                shared: dict[str, Any] | None = None) -> list[torch.Tensor]:
        """One batched denoiser forward through the speed-ups, or across the replica's ranks (CFG-parallel, when
        every item uses guidance); split back per item."""
        fn = functools.partial(self.call_denoiser, key)
        groups = self.row_groups(items, sizes)
        out = None
        if self.ranks is not None:
            from pipelines.parallel import parallel_forward

            cfg = all(item.inputs["cond"]["cfg"] for item in items)
            out = parallel_forward(self, key, fn, batched, shared or {}, cfg and self.parallel.cfg == 2, sizes, groups)
        uses = [getattr(item.inputs["request"], "lora", ()) for item in items]
        with self.measured(items, sum(sizes)), self.loras.using([name for use in uses for name, _ in use]):
            if out is None and any(uses):  # adapters per row (stages/lora.py): eager, outside any captured graph
                with rows_use([use for use, size in zip(uses, sizes) for _ in range(size)]):
                    if any(g.state is not None for g in groups):  # step caching: each request's own state
                        out = self.denoiser(key, fn, batched, shared or {}, groups)
                    else:
                        out = fn(**batched, **(shared or {}))
            if out is None:
                out = self.denoiser(key, fn, batched, shared or {}, groups)
        return self.split(out, sizes)

    def rank_denoise(self, key: str, step_groups: list[tuple], **inputs: Any) -> torch.Tensor:
        """A CFG-parallel rank's half of a step-cached forward: `step_groups` are its row groups as (start, stop,
        the request's cache key or None, its params, step, total); the branch each caches lives here, on the rank
        that computes it, until its last step (or, for a request that ended early, until 256 newer ones)."""
        caches = self.__dict__.setdefault("_rank_caches", collections.OrderedDict())
        groups = []
        for start, stop, cache_key, params, step, total in step_groups:
            state = None
            if cache_key is not None:
                state = caches.pop(cache_key, None) or StepCacheState.new(params, 1)
                if step < total - 1:
                    caches[cache_key] = state
            groups.append(RowGroup(start, stop, state, 0, step, total))
        while len(caches) > 256:
            caches.popitem(last=False)
        before = [g.state.computed for g in groups if g.state is not None]
        out = self.denoiser(key, functools.partial(self.call_denoiser, key), inputs, {}, groups)
        after = [g.state.computed for g in groups if g.state is not None]
        self._rank_decisions = [a > b for a, b in zip(after, before, strict=True)]
        return out

    def rank_notes(self) -> list[bool] | None:
        """What rank 0 counts of this rank's last forward: its step-cache decisions (True: computed)."""
        return self.__dict__.pop("_rank_decisions", None)

    def call_denoiser(self, key: str, *args: Any, **inputs: Any) -> torch.Tensor:
        """The denoiser `key` on one batch of inputs -> its output tensor (what graphs capture). A family may
        override it with the denoiser's own parameters."""
        return getattr(self.pipe, key)(*args, **inputs, return_dict=False)[0]

    @staticmethod
    def row_groups(items: list[WorkItem], sizes: list[int]) -> list[RowGroup]:
        """Rows per item and, for step-cached requests, per CFG branch ([uncond x n, cond x n])."""
        groups, start = [], 0
        for item, rows in zip(items, sizes, strict=True):
            s = item.state
            params = getattr(item.inputs["request"], "step_cache", None)
            if params is None:
                groups.append(RowGroup(start, start + rows, None, 0, s["i"], s["total"]))
            else:
                state = s.get("step_cache")
                if state is None:
                    state = s["step_cache"] = StepCacheState.new(params, 2 if item.inputs["cond"]["cfg"] else 1)
                per = rows // len(state.branches)
                groups += [RowGroup(start + b * per, start + (b + 1) * per, state, b, s["i"], s["total"])
                           for b in range(len(state.branches))]
            start += rows
        return groups

    def scheduler_step(self, item: WorkItem, model_output: torch.Tensor, scale: float, latents: torch.Tensor):
        """Guidance and the scheduler step; a plain flow-matching Euler step runs as one fused kernel when
        `fused_kernels` is on (the same math in float32)."""
        s, cfg = item.state, item.inputs["cond"]["cfg"]
        scheduler, t = s["scheduler"], s["timesteps"][s["i"]]
        if self.speedups.fused_kernels and _plain_flow_match(scheduler):
            from stages.kernels.cfg_step import cfg_euler_step

            if scheduler.step_index is None:
                scheduler._init_step_index(t)
            i = scheduler.step_index
            uncond, cond = model_output.chunk(2) if cfg else (None, model_output)
            latents = cfg_euler_step(latents, cond, uncond, scale, float(scheduler.sigmas[i + 1] - scheduler.sigmas[i]))
            scheduler._step_index += 1  # as FlowMatchEulerDiscreteScheduler.step advances it
            return latents
        noise_pred = self.guide(model_output, cfg, scale)
        return scheduler.step(noise_pred, t, latents, return_dict=False)[0]


def norm1_indicator(block, args: dict) -> torch.Tensor:
    """TeaCache's input for MMDiT blocks (Flux, SD3): the first block's adaLN-modulated, normalised image tokens."""
    return block.norm1(args["hidden_states"], emb=args["temb"])[0]


def _plain_flow_match(scheduler) -> bool:
    from diffusers import FlowMatchEulerDiscreteScheduler

    if type(scheduler) is not FlowMatchEulerDiscreteScheduler:
        return False
    return not scheduler.config.stochastic_sampling  # type: ignore[attr-defined]  # diffusers: an untyped FrozenDict
