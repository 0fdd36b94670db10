"""LoRA adapters per row of a forward: requests with different adapters (and none) share one batch.

Adapters are loaded the way their users load them (diffusers' `load_lora_weights`, which converts kohya / A1111
files and reads PEFT and diffusers ones; PEFT for language models): PEFT then wraps each targeted linear layer in a
`peft.tuners.lora.Linear` holding every adapter's `lora_A`, `lora_B` and scale. `mix_lora_layers` turns PEFT's own
application off in those layers (their base layer's output is left as it is: the base weights are never changed,
nothing is fused) and adds, after each forward, the low-rank update of the adapters that `rows_use` names for each
row of that forward:

    y[rows of adapter i] += w_row * (alpha_i / r_i) * B_i(A_i(x[rows of adapter i]))

the same update PEFT computes for an adapter activated with `set_adapters([...], [w])`, computed only for the rows
that use it (a gathered low-rank matmul: one pair of small matmuls per adapter in the batch, not per request).
A row may use several adapters at once, each with its weight. On CUDA tensors (or inside `kernel_use(True)`) the
layer's adapters are stacked into slots, ranks zero-padded to a multiple of RANK_BUCKET, and one Triton kernel call
applies every row's updates (stages/kernels/lora.py); elsewhere each adapter is a torch gather as above.

Rows are the forward's leading dimension: the requests' latents in a denoiser batch (classifier-free guidance's
two halves are rows too), the prompts in a text encoder batch; in a packed token batch ([1, tokens, features], the
llm stage's), its tokens. A plan of one row applies to every row of a forward (one request whatever its batch
shape).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

import torch

Use = tuple[tuple[str, float], ...]  # one row's adapters and their weights, in the order they are applied


@dataclass(frozen=True)
class SlotPlan:
    """A captured step's adapters as tensors: each row's slots (0: none) and weights, [rows, per_row] each."""

    slots: torch.Tensor
    weights: torch.Tensor


@dataclass(frozen=True)
class RowAdapters:
    rows: tuple[Use, ...]  # per row of the forward

    @cached_property
    def groups(self) -> dict[str, tuple[list[int], list[float]]]:
        """adapter -> (its rows, their weights), adapters in the order rows first name them."""
        out: dict[str, tuple[list[int], list[float]]] = {}
        for row, use in enumerate(self.rows):
            for name, weight in use:
                rows, weights = out.setdefault(name, ([], []))
                rows.append(row)
                weights.append(weight)
        return out


_ROWS: ContextVar[RowAdapters | None] = ContextVar("mmserve_lora_rows", default=None)
_KERNEL: ContextVar[bool | None] = ContextVar("mmserve_lora_kernel", default=None)  # None: on CUDA tensors
_SLOTS: ContextVar[SlotPlan | None] = ContextVar("mmserve_lora_slots", default=None)
RANK_BUCKET = 16  # stacked adapters' ranks are padded up to a multiple of it (stages/kernels/lora.py)
_MIXED: weakref.WeakSet = weakref.WeakSet()  # the layers whose forward hook adds the rows' updates


@contextmanager
def rows_use(rows: Sequence[Use]) -> Iterator[None]:
    """Within the block, mixed LoRA layers add for row i of each forward the adapters `rows[i]` names (a single
    row: for every row). No adapter on any row: the base model, untouched."""
    token = _ROWS.set(RowAdapters(tuple(tuple(use) for use in rows)) if any(rows) else None)
    try:
        yield
    finally:
        _ROWS.reset(token)


@contextmanager
def rows_subset(rows: Sequence[int]) -> Iterator[None]:
    """Within the block, forwards run only `rows` (indices into the current plan's rows: the rows a step cache's
    blocks compute); a one-row plan, or none, stays as it is."""
    plan = _ROWS.get()
    token = None
    if plan is not None and len(plan.rows) > 1:
        token = _ROWS.set(RowAdapters(tuple(plan.rows[i] for i in rows)))
    try:
        yield
    finally:
        if token is not None:
            _ROWS.reset(token)


def mix_lora_layers(model: torch.nn.Module) -> int:
    """Make every PEFT LoRA linear layer of `model` apply adapters per row (`rows_use`) instead of its active ones;
    call again after each adapter load (loading activates the new adapter). Returns the number of such layers."""
    from peft.tuners.lora import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if isinstance(module, LoraLinear):
            for name in module.lora_A:
                if name in module.lora_variant:
                    raise ValueError(f"adapter {name!r}: only plain LoRA mixes per row (not DoRA or other variants)")
            module.enable_adapters(False)  # PEFT adds nothing itself: the base layer's output, then ours
            if module not in _MIXED:
                module.register_forward_hook(_add_row_updates)
                _MIXED.add(module)
            count += 1
    return count


def scale_of(module, name: str, weight: float) -> float:
    """The scale PEFT's `set_scale(name, weight)` gives adapter `name` in `module`: weight * alpha / r (rsLoRA:
    / sqrt(r)), computed in the same order, so the update is the same float."""
    rank = module.r[name]
    return weight * module.lora_alpha[name] / (math.sqrt(rank) if module.use_rslora.get(name, False) else rank)


def _add_row_updates(module, args, output: torch.Tensor) -> torch.Tensor:
    slotted = _SLOTS.get()
    if slotted is not None:
        return _slot_row_updates(module, slotted, args[0], output) if hasattr(module, "_mmserve_slot_a") else output
    plan = _ROWS.get()
    if plan is None:
        return output
    x = args[0]
    every_row = len(plan.rows) == 1
    packed = not every_row and x.shape[0] != len(plan.rows) and x.shape[:-1].numel() == len(plan.rows)
    if packed:  # a packed token batch [1, tokens, features]: a row per token
        return _add_row_updates(module, (x.reshape(-1, x.shape[-1]),), output.reshape(-1, output.shape[-1])) \
            .reshape(output.shape)
    if not every_row and x.shape[0] != len(plan.rows):
        raise RuntimeError(f"a LoRA plan of {len(plan.rows)} rows for a forward of {x.shape[0]}")
    if use_kernel(x):
        return _kernel_row_updates(module, plan, x, output)
    for name, (rows, weights) in plan.groups.items():
        if name not in module.lora_A:  # this adapter does not touch this layer
            continue
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        if every_row:
            update = lora_b(lora_a(x.to(lora_a.weight.dtype))) * scale_of(module, name, weights[0])
            output = output + update.to(output.dtype)
            continue
        index = torch.tensor(rows, device=x.device)
        update = lora_b(lora_a(x.index_select(0, index).to(lora_a.weight.dtype)))
        scales = torch.tensor([scale_of(module, name, w) for w in weights], dtype=update.dtype, device=update.device)
        update = update * scales.view(-1, *([1] * (update.dim() - 1)))
        output = output.index_add(0, index, update.to(output.dtype))
    return output


def adapter_bytes(model: torch.nn.Module, name: str) -> int:
    """The bytes adapter `name`'s low-rank weights take in `model`."""
    from peft.tuners.lora import LoraLayer

    total = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and name in module.lora_A:
            for part in (module.lora_A[name], module.lora_B[name]):
                total += sum(p.numel() * p.element_size() for p in part.parameters())
    return total


class AdapterGate:
    """Forwards through a model's LoRA layers hold the gate shared; loading and unloading adapters hold it alone
    (PEFT replaces modules and activates a new adapter while it loads, which a forward running then would see).
    Writers go first: a forward waits while a load waits. A thread already inside a forward may enter again.

    `using(names)` is a forward's entry: `ensure(names)` (a registry loads the adapters it had evicted), then the
    shared hold."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._local = threading.local()

    @contextmanager
    def forward(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        if not depth:
            with self._cond:
                while self._writing or self._writers_waiting:
                    self._cond.wait()
                self._readers += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if not depth:
                with self._cond:
                    self._readers -= 1
                    if not self._readers:
                        self._cond.notify_all()

    @contextmanager
    def change(self) -> Iterator[None]:
        if getattr(self._local, "depth", 0):
            raise RuntimeError("an adapter load or unload from inside a forward would wait for itself")
        with self._cond:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    def ensure(self, names: Sequence[str]) -> None:
        """Make the adapters `names` resident (a registry with a byte budget reloads the ones it evicted)."""

    @contextmanager
    def using(self, names: Sequence[str] = ()) -> Iterator[None]:
        if names and not getattr(self._local, "depth", 0):
            self.ensure(names)
        with self.forward():
            yield


@contextmanager
def kernel_use(enabled: bool | None) -> Iterator[None]:
    """Within the block, the per-row updates run on the Triton kernel (True; on CPU tensors it needs
    TRITON_INTERPRET=1), on the torch gather (False), or on the kernel for CUDA tensors only (None, the default)."""
    token = _KERNEL.set(enabled)
    try:
        yield
    finally:
        _KERNEL.reset(token)


def use_kernel(x: torch.Tensor) -> bool:
    enabled = _KERNEL.get()
    return x.is_cuda if enabled is None else enabled


def _stacked(module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's adapters `names` as the kernel's slots: A [S, R, IN], B [S, OUT, R], ranks zero-padded to a
    multiple of RANK_BUCKET. Cached on the layer until its adapters' weights change (a load, an unload)."""
    weights = tuple((module.lora_A[n].weight, module.lora_B[n].weight) for n in names)
    key = (names, tuple((id(a), id(b), a._version, b._version) for a, b in weights))
    cached = getattr(module, "_mmserve_stacked", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    rank = max(a.shape[0] for a, _ in weights)
    rank = -(-rank // RANK_BUCKET) * RANK_BUCKET
    a0, b0 = weights[0]
    stack_a = a0.new_zeros((len(names), rank, a0.shape[1]))
    stack_b = b0.new_zeros((len(names), b0.shape[0], rank))
    for slot, (a, b) in enumerate(weights):
        stack_a[slot, :a.shape[0]] = a
        stack_b[slot, :, :b.shape[1]] = b
    module._mmserve_stacked = (key, (stack_a, stack_b))
    return stack_a, stack_b


def _kernel_row_updates(module, plan: RowAdapters, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The plan's updates for this layer in one kernel call (stages/kernels/lora.py): each row of the forward is
    x's leading index; its tokens (the middle dimensions) each become an entry per adapter of the row."""
    from stages.kernels.lora import lora_rows

    names = tuple(n for n in plan.groups if n in module.lora_A)
    if not names:
        return output
    stack_a, stack_b = _stacked(module, names)
    lead = x.shape[0]
    per_row = x[0].numel() // x.shape[-1] if x.dim() > 1 and lead else 0  # tokens of one row
    rows, slots, scales = [], [], []
    for slot, name in enumerate(names):
        row_ids, weights = plan.groups[name]
        if len(plan.rows) == 1:  # one plan row: every row of the forward
            row_ids, weights = list(range(lead)), weights * lead
        rows += row_ids
        slots += [slot] * len(row_ids)
        scales += [scale_of(module, name, w) for w in weights]
    device = x.device
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    tokens = (row_index[:, None] * per_row + torch.arange(per_row, device=device)).reshape(-1)
    repeat = per_row
    flat_x = x.reshape(-1, x.shape[-1])
    flat_out = output.reshape(-1, output.shape[-1])
    result = lora_rows(flat_x, flat_out, stack_a, stack_b, tokens,
                       torch.tensor(slots, dtype=torch.long, device=device).repeat_interleave(repeat),
                       torch.tensor(scales, dtype=torch.float32, device=device).repeat_interleave(repeat),
                       use_triton=True)
    return result.reshape(output.shape)


# -- adapters in slots: LoRA inside captured graphs ----------------------------------------------------------------


@contextmanager
def slots_use(slots: torch.Tensor, weights: torch.Tensor) -> Iterator[None]:
    """Within the block, mixed layers with slot buffers add for each row (token) the adapters in its `slots` at its
    `weights` ([rows, per_row] each), with tensor ops only: a CUDA graph captured here stays valid for any mix."""
    token = _SLOTS.set(SlotPlan(slots, weights))
    try:
        yield
    finally:
        _SLOTS.reset(token)


class LoraSlots:
    """A model's resident adapters in numbered slots of static per-layer buffers: A [count + 1, rank, IN],
    B [count + 1, OUT, rank] and each slot's alpha / r per layer (slot 0 stays zero: no adapter). Ranks are
    zero-padded to `rank`, the declared bucket; a load copies an adapter in and an unload zeroes its slot, so the
    buffers never move and graphs that read them stay valid."""

    def __init__(self, count: int, rank: int, per_row: int):
        if count < 1 or rank < 1 or per_row < 1:
            raise ValueError(f"LoRA slots need count, rank and per_row >= 1, got {count}, {rank}, {per_row}")
        self.count, self.rank, self.per_row = count, rank, per_row
        self._of: dict[str, int] = {}

    def plan(self, uses: Sequence[Use], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, per_row] slots and weights of each row's adapters (padding: slot 0, weight 0)."""
        slots = torch.zeros(len(uses), self.per_row, dtype=torch.long)
        weights = torch.zeros(len(uses), self.per_row, dtype=torch.float32)
        for row, use in enumerate(uses):
            for k, (name, weight) in enumerate(use):
                slots[row, k], weights[row, k] = self._of[name], weight
        return slots.to(device), weights.to(device)

    def put(self, model: torch.nn.Module, name: str) -> None:
        """Copy adapter `name` (loaded by PEFT, ranks <= the bucket) into a free slot of every mixed layer."""
        from peft.tuners.lora import Linear as LoraLinear

        free = sorted(set(range(1, self.count + 1)) - set(self._of.values()))
        if not free:
            raise RuntimeError(f"all {self.count} LoRA slots are taken")
        slot = free[0]
        for module in model.modules():
            if not isinstance(module, LoraLinear):
                continue
            module = cast(Any, module)  # PEFT's ModuleDicts are untyped
            self._buffers(module)
            self._clear(module, slot)
            if name in module.lora_A:
                a, b = module.lora_A[name].weight, module.lora_B[name].weight
                module._mmserve_slot_a[slot, :a.shape[0]] = a
                module._mmserve_slot_b[slot, :, :b.shape[1]] = b
                module._mmserve_slot_scale[slot] = scale_of(module, name, 1.0)
        self._of[name] = slot

    def drop(self, model: torch.nn.Module, name: str) -> None:
        slot = self._of.pop(name, None)
        if slot is None:
            return
        for module in model.modules():
            if hasattr(module, "_mmserve_slot_a"):
                self._clear(module, slot)

    def check(self, model: torch.nn.Module, name: str) -> None:
        """An adapter whose rank passes the bucket cannot go in a slot: refused, naming both."""
        from peft.tuners.lora import Linear as LoraLinear

        ranks = {module.r[name] for module in model.modules() if isinstance(module, LoraLinear) and name in module.r}
        if ranks and max(ranks) > self.rank:
            raise ValueError(f"its rank {max(ranks)} is above the declared rank bucket {self.rank} (max_lora_rank)")

    def _buffers(self, module) -> None:
        if hasattr(module, "_mmserve_slot_a"):
            return
        base = module.get_base_layer().weight
        shape_in, shape_out = base.shape[1], base.shape[0]
        dtype = next(iter(module.lora_A.values())).weight.dtype
        module._mmserve_slot_a = base.new_zeros((self.count + 1, self.rank, shape_in), dtype=dtype)
        module._mmserve_slot_b = base.new_zeros((self.count + 1, shape_out, self.rank), dtype=dtype)
        module._mmserve_slot_scale = base.new_zeros(self.count + 1, dtype=torch.float32)

    @staticmethod
    def _clear(module, slot: int) -> None:
        module._mmserve_slot_a[slot].zero_()
        module._mmserve_slot_b[slot].zero_()
        module._mmserve_slot_scale[slot] = 0.0


def _slot_row_updates(module, plan: SlotPlan, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Every row's slotted adapters in one call, from tensors only (no host value decides anything)."""
    from stages.kernels.lora import lora_rows

    flat_x, flat_out = x.reshape(-1, x.shape[-1]), output.reshape(-1, output.shape[-1])
    per_row = plan.slots.shape[1]
    rows = torch.arange(flat_x.shape[0], device=x.device).repeat_interleave(per_row)
    slots = plan.slots.reshape(-1)
    scales = plan.weights.reshape(-1) * module._mmserve_slot_scale[slots]
    return lora_rows(flat_x, flat_out, module._mmserve_slot_a, module._mmserve_slot_b, rows, slots, scales,
                     use_triton=use_kernel(x)).reshape(output.shape)
