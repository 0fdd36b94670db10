"""A diffusion model's denoiser over several ranks of one replica ([models.parallel]): starting the ranks with the
family loaded on each, and CFG-parallel (guidance's conditional half on rank 0, the unconditional on rank 1).

The rank processes and their collectives are stages/diffusion/ranks.py's; what a rank runs is the family's plain
`call_denoiser`, so the output equals the one-device forward's up to float rounding (each half runs as a batch
of its own rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipelines.config import ModelSpec, ParallelConfig
from stages.diffusion.ranks import RankGroup, RankPlan
from stages.metrics import Metrics
from stages.pool import PoolConfig
from stages.thread_budget import available_cores


@dataclass(frozen=True)
class FamilyLoader:
    """What a rank's process runs to load the family (its denoiser is what it runs): picklable."""

    spec: ModelSpec  # without `parallel`: a rank runs plain forwards
    family: str
    device: str

    def __call__(self) -> Any:
        from encoders.cache import EncoderCache
        from pipelines.families.video_base import VideoFamily
        from pipelines.registry import family_class
        from stages.thread_budget import one_thread

        cls = family_class(self.family)
        options = {"video": self.spec.video} if issubclass(cls, VideoFamily) else {}
        with one_thread():
            return cls(self.spec.name, self.spec.path, device=self.device, dtype=self.spec.dtype,
                       prompt_cache=EncoderCache("prompt_embedding", 0), **options)


@dataclass(frozen=True)
class FamilyLoaders:
    spec: ModelSpec
    family: str

    def __call__(self, rank: int) -> FamilyLoader:
        plain = dataclasses.replace(self.spec, parallel=ParallelConfig(), pools={})
        return FamilyLoader(plain, self.family, self.spec.denoise_devices[rank])


def start_ranks(spec: ModelSpec, family: str, metrics: Metrics) -> RankGroup:
    """The replica's other ranks, started and joined (each has loaded the family on its device)."""
    world = spec.parallel.world
    series = metrics.denoise

    def observe(rank: int, compute: float, collective: float) -> None:
        series.parallel_step.labels(model=spec.name, rank=str(rank)).observe(compute)
        series.parallel_collective.labels(model=spec.name, rank=str(rank)).observe(collective)

    threads = spec.pools.get("denoise", PoolConfig()).threads
    plan = RankPlan(FamilyLoaders(spec, family), world, spec.denoise_devices,
                    threads or max(1, available_cores() // world))
    group = RankGroup(f"{spec.name}/denoise", plan, observe)
    group.start()
    return group


def cfg_parallel(ranks: RankGroup, key: str, fn: Callable[..., torch.Tensor], batched: dict[str, Any],
                 shared: dict[str, Any], sizes: list[int]) -> torch.Tensor:
    """One CFG forward over a batch whose items each hold [uncond x n, cond x n] rows: the cond rows run here (rank
    0), the uncond rows on rank 1; the output in the batch's row order."""
    uncond: list[int] = []
    cond: list[int] = []
    start = 0
    for rows in sizes:
        half = rows // 2
        uncond += range(start, start + half)
        cond += range(start + half, start + rows)
        start += rows
    total = start
    rows_of = {name: v for name, v in batched.items() if isinstance(v, torch.Tensor) and v.dim() and
               v.shape[0] == total}
    whole = {name: v for name, v in {**batched, **shared}.items() if isinstance(v, torch.Tensor) and name not in
             rows_of}
    plain = {name: v for name, v in {**batched, **shared}.items() if not isinstance(v, torch.Tensor)}

    def part(index: list[int]) -> dict[str, torch.Tensor]:
        idx = torch.tensor(index, device=next(iter(rows_of.values())).device)
        return {**{name: v.index_select(0, idx) for name, v in rows_of.items()}, **whole}

    mine, theirs = ranks.forward(key, [part(cond), part(uncond)], plain, lambda inputs: fn(**inputs))
    out = mine.new_empty((total, *mine.shape[1:]))
    out[cond] = mine
    out[uncond] = theirs.to(mine.device)
    return out
