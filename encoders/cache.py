"""An exact, byte-budgeted, single-flight cache for encoder outputs (prompt embeddings, features).

Rules (DESIGN §7): an entry is visible only once fully written; concurrent misses on one key
compute once; eviction hides an entry before freeing it and never frees one in use; the key
is the whole identity (tenant, encoder id, tokens, dtype, ...), so a key that differs in any
part is a miss.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch


def nbytes(value: Any) -> int:
    """Bytes held by a tensor or a (nested) dict/list/tuple of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_held: int = 0


class _Flight:
    """A computation in progress that later callers of the same key wait on."""

    def __init__(self):
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class EncoderCache:
    def __init__(self, name: str, max_bytes: int, on_event: Callable[[str, str, int], None] | None = None):
        """`on_event(cache, kind, bytes_held)` is called on hit/miss/evict (for metrics)."""
        if max_bytes < 0:
            raise ValueError(f"cache {name}: max_bytes must be >= 0, got {max_bytes}")
        self.name = name
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._entries: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self._flights: dict[Hashable, _Flight] = {}
        self._lock = threading.Lock()
        self._on_event = on_event or (lambda cache, kind, held: None)

    def get_or_compute(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """Return the cached value for key, computing it once across concurrent callers."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                value = self._entries[key][0]
                self._on_event(self.name, "hit", self.stats.bytes_held)
                return value
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
                self.stats.misses += 1
            else:
                self.stats.hits += 1  # served by the in-flight computation
        if not leader:
            flight.done.wait()
            self._on_event(self.name, "hit", self.stats.bytes_held)
            if flight.error is not None:
                raise flight.error
            return flight.value
        self._on_event(self.name, "miss", self.stats.bytes_held)
        try:
            value = compute()
        except BaseException as exc:
            flight.error = exc
            with self._lock:
                del self._flights[key]
            flight.done.set()
            raise
        flight.value = value
        with self._lock:
            self._insert(key, value)
            del self._flights[key]
        flight.done.set()
        return value

    def invalidate(self, predicate: Callable[[Hashable], bool] = lambda key: True) -> int:
        """Drop every entry whose key matches (a model reload drops what its old weights made)."""
        with self._lock:
            doomed = [k for k in self._entries if predicate(k)]
            for key in doomed:
                self._evict(key)
            return len(doomed)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # -- internals (caller holds the lock) -----------------------------------------------
    def _insert(self, key: Hashable, value: Any) -> None:
        size = nbytes(value)
        if size > self.max_bytes:
            return  # larger than the whole budget: serve it, don't keep it
        while self.stats.bytes_held + size > self.max_bytes and self._entries:
            self._evict(next(iter(self._entries)))
        self._entries[key] = (value, size)
        self.stats.bytes_held += size

    def _evict(self, key: Hashable) -> None:
        # Hide first; the value object lives on while any caller still holds a reference to it.
        _, size = self._entries.pop(key)
        self.stats.bytes_held -= size
        self.stats.evictions += 1
        self._on_event(self.name, "evict", self.stats.bytes_held)
