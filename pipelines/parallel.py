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
from pipelines.parallel_attention import after_parallel, before_parallel, image_tokens, sequence_parallel_plan
from stages.diffusion.block_stack import RowGroup
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
        from pipelines.served_diffusion import load_family
        from stages.thread_budget import one_thread

        with one_thread():
            family = load_family(dataclasses.replace(self.spec, device=self.device), self.family,
                                 EncoderCache("prompt_embedding", 0))
        family.accelerate(self.spec.speedups)  # the step cache's wrappers (rank 0 counts the decisions)
        return family


@dataclass(frozen=True)
class FamilyLoaders:
    spec: ModelSpec
    family: str

    def __call__(self, rank: int) -> FamilyLoader:
        plain = dataclasses.replace(self.spec, parallel=ParallelConfig(), pools={})
        return FamilyLoader(plain, self.family, self.spec.denoise_devices[rank])


@dataclass(frozen=True)
class SequenceParallel:
    """What every rank runs once its family is loaded (RankPlan.setup) when the replica shards the sequence: join
    torch.distributed's world (gloo on the CPU, NCCL on GPUs; a file store), build the (cfg, ring, ulysses) mesh and
    put diffusers' context-parallel hooks (parallel_attention.sequence_parallel_plan's plan) on each denoiser. On
    a restart the world is joined again and the hooks get the new mesh."""

    parallel: ParallelConfig
    device: str  # rank 0's; the others' type is the same
    timeout_s: float = 120.0

    def __call__(self, host: Any, rank: int, store_dir: str) -> None:
        import datetime
        import os

        import torch.distributed as dist
        from diffusers import ContextParallelConfig
        from diffusers import ParallelConfig as DiffusersParallel
        from torch.distributed.device_mesh import init_device_mesh

        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        if self.parallel.ring > 1:
            native_attention_with_lse()
        if dist.is_initialized():  # a restart: the old world's peers are gone
            dist.destroy_process_group()
        p, world = self.parallel, self.parallel.world
        kind = "cuda" if self.device.startswith("cuda") else "cpu"
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=rank, world_size=world,
                                store=dist.FileStore(os.path.join(store_dir, "world"), world),
                                timeout=datetime.timedelta(seconds=self.timeout_s))
        mesh = init_device_mesh(kind, (p.cfg, p.ring, p.ulysses), mesh_dim_names=("cfg", "ring", "ulysses"))
        device = torch.device(self.device) if kind == "cpu" else torch.device("cuda", torch.cuda.current_device())
        for key in host.denoiser_keys:
            module = getattr(host.pipe, key, None)
            if module is None:
                continue
            config = getattr(module, "_parallel_config", None)
            if config is not None:  # hooks in place: the new mesh
                config.context_parallel_config.setup(rank, world, device, mesh)
                continue

            def resolve(config, module=module):  # diffusers' own divides by the accelerator count: 0 on a CPU
                config.setup(rank, world, device, mesh=mesh)
                module._parallel_config = config
                return config

            module._resolve_parallel_config = resolve
            before_parallel(host.family, module)
            module.enable_parallelism(config=DiffusersParallel(context_parallel_config=ContextParallelConfig(
                ulysses_degree=p.ulysses, ring_degree=p.ring)), cp_plan=sequence_parallel_plan(host.family, module))
            after_parallel(host.family, module)


# Families whose denoiser runs sequence parallel and equals one device (tests/test_parallel.py): flux and wan on
# diffusers' plans, sd3 and ltx on pipelines/parallel_attention.py's.
SEQUENCE_PARALLEL_FAMILIES = ("flux", "wan", "sd3", "ltx")


def native_attention_with_lse() -> None:
    """Let diffusers' native attention op return the log-sum-exp when asked. Ring attention runs the op on each
    key/value chunk and merges the chunks' outputs by their LSE; diffusers' native op (the one a CPU has) raises
    instead, so its call with return_lse runs the plain math here: [B, S, H, D] in and out, the LSE [B, S, H].
    Without return_lse diffusers' own op runs, unchanged. Idempotent."""
    from diffusers.models import attention_dispatch as dispatch

    original = dispatch._native_attention_forward_op
    if getattr(original, "mmserve_lse", False):
        return

    def op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
           return_lse=False, _save_ctx=True, _parallel_config=None):
        if not return_lse:
            return original(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                            _save_ctx=_save_ctx, _parallel_config=_parallel_config)
        if attn_mask is not None or is_causal or dropout_p:
            raise ValueError("ring attention on the native op supports no mask, causality or dropout")
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))  # [B, H, S, D]
        if enable_gqa and k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.exp(scores - lse.unsqueeze(-1)) @ v
        return out.permute(0, 2, 1, 3), lse.permute(0, 2, 1)

    op.mmserve_lse = True  # type: ignore[attr-defined]
    dispatch._native_attention_forward_op = op


def check_sequence_parallel(family: Any, parallel: ParallelConfig) -> None:
    """At load: the family's denoisers run sequence parallel with heads the Ulysses degree divides; else a
    ValueError naming parallel.ulysses (or ring)."""
    degree = "ulysses" if parallel.ulysses > 1 else "ring"
    for key in family.denoiser_keys:
        module = getattr(family.pipe, key, None)
        if module is None:
            continue
        if family.family not in SEQUENCE_PARALLEL_FAMILIES:
            raise ValueError(f"parallel.{degree}: the {type(module).__name__} of family {family.family} has no "
                             f"context-parallel plan (sequence parallelism covers {list(SEQUENCE_PARALLEL_FAMILIES)})")
        heads = getattr(module.config, "num_attention_heads", None)
        if heads is not None and heads % parallel.ulysses:
            raise ValueError(f"parallel.ulysses = {parallel.ulysses} must divide the {heads} attention heads of "
                             f"{type(module).__name__}")


def start_ranks(spec: ModelSpec, family_name: str, family: Any, metrics: Metrics) -> RankGroup:
    """The replica's other ranks, started and joined (each has loaded the family on its device)."""
    parallel = spec.parallel
    if parallel.ulysses * parallel.ring > 1:
        check_sequence_parallel(family, parallel)
    series = metrics.denoise

    def observe(rank: int, compute: float, collective: float) -> None:
        series.parallel_step.labels(model=spec.name, rank=str(rank)).observe(compute)
        series.parallel_collective.labels(model=spec.name, rank=str(rank)).observe(collective)

    threads = spec.pools.get("denoise", PoolConfig()).threads
    setup = SequenceParallel(parallel, spec.denoise_devices[0]) if parallel.ulysses * parallel.ring > 1 else None
    plan = RankPlan(FamilyLoaders(spec, family_name), parallel.world, spec.denoise_devices,
                    threads or max(1, available_cores() // parallel.world), setup=setup)
    group = RankGroup(f"{spec.name}/denoise", plan, observe, host=family)
    group.start()
    return group


def parallel_forward(family: Any, key: str, fn: Callable[..., torch.Tensor], batched: dict[str, Any],
                     shared: dict[str, Any], cfg: bool, sizes: list[int],
                     groups: list[RowGroup] | None = None) -> torch.Tensor | None:
    """One denoiser forward across the replica's ranks, or None when this batch does not split (no guidance on a
    cfg-only replica: rank 0 runs it alone).

    cfg = 2 with a guided batch (each item's rows [uncond x n, cond x n]): ranks 0..u-1 run the cond rows, ranks
    u..2u-1 the uncond rows (u = ulysses x ring ranks a half); each half's sequence is sharded across its u ranks
    by diffusers' hooks, which gather the output on each. Otherwise with sequence parallel every rank of the first
    half runs the whole batch. Step-cached requests (`groups`, cfg = 2 without sequence parallel): each half runs
    through its rank's block stack, which keeps that CFG branch's cache (the uncond branch's on rank 1, keyed by
    the request's StepCacheState.key); rank 1's decisions are counted on rank 0."""
    p, ranks = family.parallel, family.ranks
    shard = p.ulysses * p.ring
    if shard == 1 and not cfg:
        return None
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
    if shard > 1:
        _check_shards(family, key, {**rows_of, **whole}, shard)

    def part(index: list[int] | None) -> dict[str, torch.Tensor]:
        if index is None:
            return {**rows_of, **whole}
        idx = torch.tensor(index, device=next(iter(rows_of.values())).device)
        return {**{name: v.index_select(0, idx) for name, v in rows_of.items()}, **whole}

    if not cfg:  # the first cfg group runs everything; a second one sits this forward out
        parts = [part(None) if r < shard else None for r in range(p.world)]
        return ranks.forward(key, parts, plain, lambda inputs: fn(**inputs), replies=set())[0]
    halves = (part(cond), part(uncond))
    parts = [halves[r // shard] for r in range(p.world)]
    local, method = (lambda inputs: fn(**inputs)), "call_denoiser"
    cached = groups is not None and any(g.state is not None for g in groups)
    if cached:
        assert groups is not None and shard == 1  # ModelSpec refuses step_cache with sequence parallel
        mine_groups, their_groups = _half_groups(groups, cond), _half_groups(groups, uncond)
        plain = {**plain, "step_groups": [(g.start, g.stop, g.state.key if g.state else None,
                                           g.state.params if g.state else None, g.step, g.total)
                                          for g in their_groups]}

        def local(inputs):
            inputs.pop("step_groups")
            return family.denoiser(key, fn, inputs, {}, mine_groups)

        method = "rank_denoise"
    outputs = ranks.forward(key, parts, plain, local, replies={shard}, method=method)
    if cached:
        decisions = ranks.notes.get(shard) or []
        family.denoiser.count([g for g in their_groups if g.state is not None], decisions)
    mine, theirs = outputs[0], outputs[shard]
    assert mine is not None and theirs is not None  # rank 0 and the uncond half's first rank reply
    out = mine.new_empty((total, *mine.shape[1:]))
    out[cond] = mine
    out[uncond] = theirs.to(mine.device)
    return out


def _half_groups(groups: list[RowGroup], rows: list[int]) -> list[RowGroup]:
    """The row groups of one CFG half, re-indexed to its rows (`rows`: the half's rows of the batch, ascending; a
    group's rows in a half are consecutive)."""

    position = {r: p for p, r in enumerate(rows)}
    out = []
    for g in groups:
        mine = [position[r] for r in range(g.start, g.stop) if r in position]
        if mine:
            out.append(dataclasses.replace(g, start=mine[0], stop=mine[-1] + 1))
    return out


def _check_shards(family: Any, key: str, inputs: dict[str, torch.Tensor], shard: int) -> None:
    """The sequences the context-parallel plan splits divide among `shard` ranks: the image tokens (the latents'
    patches) and what the plan splits at the denoiser's entry. Else the request is refused naming its size (no
    rank has started the forward, so the group stays in step)."""
    from stages.events import ErrorKind, StageError

    module = getattr(family.pipe, key)
    counts = {}
    latents = inputs.get("hidden_states")
    if latents is not None and latents.dim() > 3:  # unpatchified: the plan splits the tokens inside
        counts["hidden_states"] = image_tokens(module, latents)
    for name, entry in sequence_parallel_plan(family.family, module).get("", {}).items():
        tensor = inputs.get(name) if isinstance(name, str) else None
        split, dims = getattr(entry, "split_dim", None), getattr(entry, "expected_dims", None)
        if tensor is None or split is None or dims is not None and tensor.dim() != dims:  # the hook skips it too
            continue
        counts[name] = tensor.shape[split]
    for name, count in counts.items():
        if count % shard:
            raise StageError("unsupported_size", f"the sequence of {name} ({count} tokens) does not split among "
                             f"the {shard} sequence-parallel ranks of {family.name}: pick a size whose token count "
                             f"it divides", param="size", kind=ErrorKind.INVALID)
