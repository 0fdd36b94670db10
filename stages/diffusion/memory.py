"""Memory-aware admission for the denoise loop (`memory_budget_mb`): limits before allocation.

A model's budget holds its weights (their bytes as loaded) and the activations of one denoiser forward. The
activations are measured on the forwards themselves, the first of each (size, rows): on CUDA the allocator's
peak above what was allocated before; elsewhere the peak of the bytes of live tensors the forward's ops make
(a dispatch mode that counts each new storage until its tensor dies). From those:

* `estimate(size, rows)`: for a measured size, the line through its measured row counts (or proportional to the
  one measured); for another size, bounds from the measured ones (a larger size needs at least what a smaller one
  does): the upper bound is the next larger measured size's bytes, or the largest smaller one's scaled by the
  square of the pixels (attention's scores grow with the square of the tokens); the lower bound is the next
  smaller measured size's bytes, or 0;
* a request whose forward alone would pass the budget even by the lower bound is refused before any model work
  (413, naming the budget);
* the loop cuts each step's batch to the items that fit (`fit`);
* an out-of-memory error that happens anyway fails no request at once: the pool halves that batch key's cap and
  the items run the step again, once (stages/pool.py).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Size = tuple[int, int, int]  # width, height, frames (1 for an image)


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors that ops create inside the mode (each new storage once)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: set[int] = set()
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if not key:
            return
        with self._lock:
            if key in self._storages:
                return
            self._storages.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        with self._lock:
            if key in self._storages:
                self._storages.discard(key)
                self.live -= nbytes


class ActivationMemory:
    def __init__(self):
        self._peaks: dict[Size, dict[int, int]] = {}
        self._lock = threading.Lock()

    def measured(self, size: Size, rows: int) -> bool:
        with self._lock:
            return rows in self._peaks.get(size, {})

    @contextmanager
    def measure(self, size: Size, rows: int, device: torch.device) -> Iterator[None]:
        """Record the forward inside the block as (size, rows)'s activation bytes."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            yield
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - before
        else:
            mode = _LiveBytes()
            with mode:
                yield
            peak = mode.peak
        with self._lock:
            self._peaks.setdefault(size, {})[rows] = peak

    def estimate(self, size: Size, rows: int, *, upper: bool = True) -> int | None:
        """Activation bytes of one forward of `rows` rows at `size`; None before any measurement. For a size not
        measured yet, an upper bound (`upper`: what batches are cut by) or a lower one (what refusals use: only a
        request that surely cannot fit is refused)."""
        with self._lock:
            peaks = {s: dict(p) for s, p in self._peaks.items() if p}
        if not peaks:
            return None
        if size in peaks:
            return _line(peaks[size], rows)
        pixels = _pixels(size)
        smaller = [s for s in peaks if _pixels(s) <= pixels]
        larger = [s for s in peaks if _pixels(s) >= pixels]
        if not upper:  # a larger size needs at least what a smaller one does
            return _line(peaks[max(smaller, key=_pixels)], rows) if smaller else 0
        if larger:
            return _line(peaks[min(larger, key=_pixels)], rows)
        ref = max(smaller, key=_pixels)
        return int(_line(peaks[ref], rows) * (pixels / _pixels(ref)) ** 2)


def _pixels(size: Size) -> int:
    return size[0] * size[1] * size[2]


def _line(points: dict[int, int], rows: int) -> int:
    """Bytes at `rows` on the line through two measured row counts (the two largest), or proportional to one."""
    if len(points) == 1:
        (r0, b0), = points.items()
        return int(b0 * rows / r0)
    (r0, b0), (r1, b1) = sorted(points.items())[-2:]
    slope = (b1 - b0) / (r1 - r0)
    return int(max(b1 + slope * (rows - r1), slope * rows, 0))


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed: CUDA's OutOfMemoryError, or the CPU allocator's refusal."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc))
