"""An exact, byte-budgeted, single-flight cache for encoder outputs (prompt embeddings, features).

Rules (DESIGN §7): an entry is visible only once fully written; concurrent misses on one key
compute once; eviction hides an entry before freeing it and never frees one in use; the key
is the whole identity (tenant, encoder id, tokens, dtype, ...), so a key that differs in any
part is a miss.
"""

from __future__ import annotations

import collections
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

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


@dataclass
class Lookups:
    """The claims one caller made, across caches: what a traced stage span reports as its cache hits."""

    hits: int = 0  # a cached value, or one another caller was computing
    misses: int = 0  # this caller computed it


_lookups: ContextVar[Lookups | None] = ContextVar("cache_lookups", default=None)


@contextmanager
def counting_lookups() -> Iterator[Lookups]:
    """Count the claims made in this context (every cache's)."""
    tally = Lookups()
    token = _lookups.set(tally)
    try:
        yield tally
    finally:
        _lookups.reset(token)


class _Flight:
    """A computation in progress that later callers of the same key wait on."""

    def __init__(self):
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


@dataclass
class Claim:
    """What `EncoderCache.claim` found for a key."""

    key: Hashable
    kind: str  # "hit": value is cached; "wait": another caller computes it; "lead": this caller must compute it
    value: Any = None  # for "hit"
    flight: _Flight | None = None  # for "wait" and "lead"

    def wait(self, timeout: float | None = None) -> Any:
        """The leader's value (or its error), for a "wait" claim."""
        if not self.flight.done.wait(timeout):
            raise TimeoutError(f"encoder cache: no result for {self.key!r} within {timeout}s")
        if self.flight.error is not None:
            raise self.flight.error
        return self.flight.value


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
        claim = self.claim(key)
        if claim.kind == "hit":
            return claim.value
        if claim.kind == "wait":
            return claim.wait()
        try:
            value = compute()
        except BaseException as exc:
            self.abandon(claim, exc)
            raise
        self.fulfil(claim, value)
        return value

    # -- the same protocol in steps, for a batch that computes many keys in one call ---------------
    def claim(self, key: Hashable) -> Claim:
        """A hit (value), a wait on another caller's computation, or the lead: then fulfil or abandon it."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                value = self._entries[key][0]
                held = self.stats.bytes_held
                kind = "hit"
            else:
                flight = self._flights.get(key)
                if flight is None:
                    flight = self._flights[key] = _Flight()
                    self.stats.misses += 1
                    kind = "lead"
                else:
                    self.stats.hits += 1  # served by the in-flight computation
                    kind = "wait"
                held = self.stats.bytes_held
        tally = _lookups.get()
        if tally is not None:
            if kind == "lead":
                tally.misses += 1
            else:
                tally.hits += 1
        if kind == "hit":
            self._on_event(self.name, "hit", held)
            return Claim(key, "hit", value=value)
        self._on_event(self.name, "miss" if kind == "lead" else "hit", held)
        return Claim(key, kind, flight=flight)

    def fulfil(self, claim: Claim, value: Any) -> None:
        """The leader's value: stored (within the budget) and handed to every waiter."""
        assert claim.kind == "lead", claim.kind
        claim.flight.value = value
        with self._lock:
            self._insert(claim.key, value)
            del self._flights[claim.key]
        claim.flight.done.set()

    def abandon(self, claim: Claim, error: BaseException) -> None:
        """The leader failed: waiters get the error, the key stays uncached."""
        assert claim.kind == "lead", claim.kind
        claim.flight.error = error
        with self._lock:
            del self._flights[claim.key]
        claim.flight.done.set()

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
