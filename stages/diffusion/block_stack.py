"""Step caching's execution: run a denoiser's block stack only for the rows that compute.

A `BlockStack` wraps the repeated blocks of one denoiser (a DiT's transformer blocks; for a
UNet, the UNet itself as a one-block stack whose "residual" is its output). Outside a cached
forward the wrappers call the blocks unchanged. Inside one (`BlockStack.active`), rows are
grouped per request and CFG branch; each group decides (stages/diffusion/step_cache.py) whether it
computes. Rows that compute flow through the blocks as a smaller batch; rows that reuse skip
them and take `stack input + cached residual` at the end, so one batched forward can mix
requests that compute and requests that reuse. When every row computes, the blocks see the
original tensors and the output is returned untouched (threshold 0 equals the uncached output).
"""

from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from stages.diffusion.step_cache import (
    IDENTITY,
    StepCacheState,
    decide_fbcache,
    decide_interval,
    decide_teacache,
    must_compute,
)
from stages.lora import rows_subset

# Block arguments that are shared by every row (positions, options): never sliced by rows.
SHARED_ARGS = frozenset({"image_rotary_emb", "rotary_emb", "joint_attention_kwargs", "attention_kwargs",
                         "cross_attention_kwargs", "return_dict"})


@dataclass(frozen=True)
class CacheSpec:
    """How a family's denoiser is cut for step caching."""

    key: str  # the denoiser's attribute on the pipeline ("unet", "transformer", "transformer_2")
    blocks: tuple[torch.nn.Module, ...]  # the repeated blocks in call order (the UNet itself: model level)
    hidden: str = "hidden_states"  # the argument that carries the image-token stream
    encoder: str | None = None  # a second stream the blocks pass on (Flux/SD3 text tokens)
    out_hidden: int | None = None  # index of the stream in a tuple output; None: the output is the tensor
    out_encoder: int | None = None
    residual: bool = True  # False: a skipped step reuses the output itself (a UNet's noise prediction)
    indicator: Callable[[dict[str, Any]], torch.Tensor] | None = None  # TeaCache input from block 0's arguments
    coefficients: tuple[float, ...] = IDENTITY  # TeaCache's rescale polynomial for this indicator
    first_steps: int = 1  # leading steps always computed (Wan's "ret steps" mode: 5)
    # block arguments shared by every row besides SHARED_ARGS (HunyuanVideo's rotary `freqs_cis`, [tokens, D]: a
    # name Z-Image uses for per-row frequencies, so it is the spec's to say)
    shared: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RowGroup:
    """Rows of one forward that share one decision: one CFG branch of a request, or an uncached request."""

    start: int
    stop: int
    state: StepCacheState | None  # None: the request does not cache; its rows always compute
    branch: int  # index into state.branches
    step: int  # the request's step index
    total: int  # the request's step count


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """mean|current - previous| / mean|previous|, as TeaCache and first-block caching measure change."""
    denominator = previous.abs().float().mean()
    if float(denominator) == 0.0:
        return float("inf")
    return float((current.float() - previous.float()).abs().mean() / denominator)


class BlockStack:
    """Wrappers around one denoiser's blocks; `active(groups)` makes the next forward a cached one."""

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self._local = threading.local()  # the cached forward in flight on this thread, if any
        self._signatures = []
        for k, block in enumerate(spec.blocks):
            original = block.forward
            self._signatures.append(inspect.signature(original))
            # An instance attribute shadows the class's forward; nn.Module.__call__ calls it.
            block.forward = functools.partial(self._call, k, original)

    @property
    def supports_fbcache(self) -> bool:
        return len(self.spec.blocks) >= 2

    @contextmanager
    def active(self, groups: list[RowGroup]) -> Iterator["StackRun"]:
        run = StackRun(self.spec, groups)
        self._local.run = run
        try:
            yield run
        finally:
            self._local.run = None

    def _call(self, k: int, original, *args, **kwargs):
        run: StackRun | None = getattr(self._local, "run", None)
        if run is None:
            return original(*args, **kwargs)
        return run.block(k, original, self._signatures[k].bind(*args, **kwargs))


class StackRun:
    """One cached forward: the decisions of its row groups and the rows flowing through the blocks."""

    def __init__(self, spec: CacheSpec, groups: list[RowGroup]):
        self.spec = spec
        self.groups = groups
        self.rows = groups[-1].stop if groups else 0
        self.decisions: list[bool | None] = [None] * len(groups)  # True: computed; False: reused
        self.active: list[int] = []  # rows running through the blocks, ascending
        self.stack_input: torch.Tensor | None = None  # [rows, ...] the hidden stream entering block 0
        self.bases: dict[int, torch.Tensor] = {}  # group -> what its residual is added to (first-block cache)

    # -- the block call ---------------------------------------------------------------------
    def block(self, k: int, original, bound: inspect.BoundArguments):
        last = len(self.spec.blocks) - 1
        if k == 0:
            self._before_first(bound.arguments)
        rows_in = len(self.active)
        out = self._run(original, bound)
        if k == 0 and any(d is None for d in self.decisions):
            out = self._after_first(out, rows_in)
        if k == last:
            out = self._finish(out)
        return out

    def _run(self, original, bound: inspect.BoundArguments):
        if len(self.active) == self.rows:
            return original(*bound.args, **bound.kwargs)
        if not self.active:  # every row reuses: the blocks are skipped, the streams pass through
            args = bound.arguments
            return self._pack(args[self.spec.hidden], args.get(self.spec.encoder) if self.spec.encoder else None)
        index = torch.tensor(self.active, dtype=torch.long)
        for name, value in list(bound.arguments.items()):
            if name not in SHARED_ARGS and name not in self.spec.shared:
                bound.arguments[name] = _take_rows(value, index, self.rows)
        with rows_subset(self.active):  # the LoRA plan's rows follow (stages/lora.py)
            return original(*bound.args, **bound.kwargs)

    # -- decisions --------------------------------------------------------------------------
    def _before_first(self, args: dict[str, Any]) -> None:
        spec = self.spec
        self.stack_input = args[spec.hidden]
        indicator = None
        for gi, g in enumerate(self.groups):
            if g.state is None:
                self.decisions[gi] = True
                continue
            state, branch = g.state, g.state.branches[g.branch]
            forced = must_compute(state, branch, g.step, g.total, spec.key, spec.first_steps)
            method = state.params.method
            if method == "interval":
                self.decisions[gi] = decide_interval(state, g.step, forced)
            elif method == "teacache":
                if indicator is None:
                    assert spec.indicator is not None  # every family's CacheSpec gives TeaCache its indicator
                    indicator = spec.indicator(args)
                current = indicator[g.start:g.stop]
                previous = branch.reference
                distance = relative_l1(current, previous) if previous is not None and previous.shape == current.shape \
                    else None
                self.decisions[gi] = decide_teacache(state, branch, distance, spec.coefficients, forced)
                branch.reference = current.clone()  # TeaCache compares consecutive steps, computed or not
            # fbcache: decided after the first block, which every one of its rows runs
        self.active = [r for gi, g in enumerate(self.groups) if self.decisions[gi] is not False
                       for r in range(g.start, g.stop)]

    def _after_first(self, out, rows_in: int):
        """First-block cache: compare each pending group's first-block residual, drop the rows that reuse."""
        hidden, encoder = self._unpack(out)
        position = {r: p for p, r in enumerate(self.active)}
        for gi, g in enumerate(self.groups):
            if self.decisions[gi] is not None:
                continue
            assert g.state is not None and self.stack_input is not None  # uncached groups were decided already
            state, branch = g.state, g.state.branches[g.branch]
            p = position[g.start]
            first_out = hidden[p:p + g.stop - g.start]
            residual = first_out - self.stack_input[g.start:g.stop]
            previous = branch.reference
            distance = relative_l1(residual, previous) if previous is not None and previous.shape == residual.shape \
                else None
            forced = must_compute(state, branch, g.step, g.total, self.spec.key, self.spec.first_steps)
            compute = decide_fbcache(state, distance, forced)
            if compute:
                branch.reference = residual  # compared against until the next computed step
            self.bases[gi] = first_out
            self.decisions[gi] = compute
        keep = [r for gi, g in enumerate(self.groups) if self.decisions[gi] for r in range(g.start, g.stop)]
        if len(keep) == len(self.active):
            return out
        index = torch.tensor([position[r] for r in keep], dtype=torch.long, device=hidden.device)
        self.active = keep
        if encoder is not None and encoder.shape[0] == rows_in:
            encoder = encoder.index_select(0, index)
        return self._pack(hidden.index_select(0, index), encoder)

    # -- the stack's output -----------------------------------------------------------------
    def _finish(self, out):
        hidden, encoder = self._unpack(out)
        reused = [gi for gi, d in enumerate(self.decisions) if d is False]
        if not reused:  # every row computed: the output is the uncached one
            self._store(hidden)
            return out
        first = self.groups[reused[0]]
        sample = hidden if self.active else first.state.branches[first.branch].residual
        full = sample.new_empty((self.rows, *sample.shape[1:]))
        if self.active:
            full.index_copy_(0, torch.tensor(self.active, dtype=torch.long, device=full.device), hidden)
        for gi in reused:
            g = self.groups[gi]
            cached = g.state.branches[g.branch].residual
            full[g.start:g.stop] = self._base(gi) + cached if self.spec.residual else cached
        self._store(full)
        return self._pack(full, encoder)

    def _store(self, full: torch.Tensor) -> None:
        """Remember what the computed groups' next skipped step will reuse; count every decision."""
        for gi, g in enumerate(self.groups):
            if g.state is None:
                continue
            branch = g.state.branches[g.branch]
            if self.decisions[gi]:
                rows = full[g.start:g.stop]
                branch.residual = rows - self._base(gi) if self.spec.residual else rows.clone()
                branch.stack = self.spec.key
                g.state.computed += 1
            else:
                g.state.skipped += 1

    def _base(self, gi: int) -> torch.Tensor:
        g = self.groups[gi]
        assert self.stack_input is not None  # set when block 0 ran
        return self.bases.get(gi, self.stack_input[g.start:g.stop])

    # -- block output formats ---------------------------------------------------------------
    def _unpack(self, out) -> tuple[torch.Tensor, torch.Tensor | None]:
        spec = self.spec
        if spec.out_hidden is None:
            return out, None
        return out[spec.out_hidden], out[spec.out_encoder] if spec.out_encoder is not None else None

    def _pack(self, hidden: torch.Tensor, encoder: torch.Tensor | None):
        spec = self.spec
        if spec.out_hidden is None:
            return hidden
        parts: list[Any] = [None] * (max(spec.out_hidden, spec.out_encoder or 0) + 1)
        parts[spec.out_hidden] = hidden
        if spec.out_encoder is not None:
            parts[spec.out_encoder] = encoder
        return tuple(parts)


def _take_rows(value: Any, index: torch.Tensor, rows: int) -> Any:
    """The active rows of a per-row argument (a tensor with `rows` rows, or a container of them)."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 1 and value.shape[0] == rows:
            return value.index_select(0, index.to(value.device))
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_take_rows(v, index, rows) for v in value)
    if isinstance(value, dict):
        return {k: _take_rows(v, index, rows) for k, v in value.items()}
    return value
