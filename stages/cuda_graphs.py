"""The graph runner: one forward replayed from graphs captured at warm-up for declared buckets (DESIGN §8).

A call's *signature* is its row count (the batch) plus named fields: the shape and dtype of each
per-row input (without the row axis), the shape of each shared tensor, and each plain value.
A bucket is (row count, the other fields). At warm-up every shape the runner sees is captured
for every declared row count, largest first, into one memory pool; then `seal()` and no capture
happens while serving. A call then:
* with a captured shape and rows <= the largest bucket: copies its inputs into the bucket's
  static buffers (padding rows up to the bucket), replays, and clones the real rows out; or runs
  eagerly when padding was measured to cost more than the launch overhead it saves;
* otherwise runs eagerly, and the first time a field differs the runner logs which one.

On CUDA a bucket is a torch.cuda.CUDAGraph; elsewhere the same dispatch runs the callable eagerly
on the static buffers, so bucket choice, padding and slicing are exercised on the CPU too.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping

import torch

from stages.cuda_graph_metrics import GraphObserver

log = logging.getLogger(__name__)
PADDING_POLICIES = ("auto", "always", "never")

Signature = tuple[tuple[str, Hashable], ...]  # named fields, sorted by name


@dataclass(frozen=True)
class GraphConfig:
    """Per model (ModelSpec.graphs): the declared buckets. Empty batch_sizes: no graphs."""

    batch_sizes: tuple[int, ...] = ()  # rows of one forward (a CFG request of n images is 2n rows)
    sizes: tuple[tuple[int, int], ...] = ()  # diffusion: (width, height) warmed up, so captured
    frames: tuple[int, ...] = ()  # video diffusion: frame counts warmed up with each size
    padding: str = "auto"  # auto: pad when warm-up timing says it pays; always; never

    def __post_init__(self):
        # TOML arrays arrive as lists: keep the frozen config hashable.
        object.__setattr__(self, "batch_sizes", tuple(self.batch_sizes))
        object.__setattr__(self, "sizes", tuple(tuple(s) for s in self.sizes))
        object.__setattr__(self, "frames", tuple(self.frames))
        if any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ValueError(f"graphs.batch_sizes must be positive integers, got {list(self.batch_sizes)}")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError(f"graphs.batch_sizes has duplicates: {list(self.batch_sizes)}")
        if self.padding not in PADDING_POLICIES:
            raise ValueError(f"graphs.padding must be one of {list(PADDING_POLICIES)}, got {self.padding!r}")
        for size in self.sizes:
            if len(size) != 2 or min(size) < 1:
                raise ValueError(f"graphs.sizes holds (width, height) pairs, got {size!r}")
        if any(f < 1 for f in self.frames):
            raise ValueError(f"graphs.frames must be positive, got {list(self.frames)}")
        if (self.sizes or self.frames) and not self.batch_sizes:
            raise ValueError("graphs.sizes and graphs.frames need graphs.batch_sizes (the row buckets)")

    @property
    def enabled(self) -> bool:
        return bool(self.batch_sizes)


def signature(batched: Mapping[str, torch.Tensor | None], shared: Mapping[str, Any]) -> tuple[int, Signature]:
    """(rows, named fields) of a call. Per-row inputs share their first axis; None is a field value too. A shared
    value is described by its tensors' shapes and dtypes (nested in tuples and lists, as rotary (cos, sin) pairs
    come), anything else by itself."""
    rows = {v.shape[0] for v in batched.values() if v is not None}
    if len(rows) != 1:
        raise ValueError(f"per-row inputs must agree on their row count, got {sorted(rows)}")
    fields: list[tuple[str, Hashable]] = []
    for name, v in batched.items():
        fields.append((name, None if v is None else (tuple(v.shape[1:]), str(v.dtype).removeprefix("torch."))))
    for name, v in shared.items():
        fields.append((name, _described(v)))
    return rows.pop(), tuple(sorted(fields))


def _described(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), str(value.dtype).removeprefix("torch.")
    if isinstance(value, (tuple, list)):
        return tuple(_described(v) for v in value)
    return value


def _cloned(value: Any) -> Any:
    """A shared value with its tensors copied (a bucket's static inputs), the same structure."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_cloned(v) for v in value)
    return value


def _copy_into(static: Any, value: Any) -> None:
    """A call's shared tensors into the bucket's static ones (the same structure: the same signature)."""
    if isinstance(value, torch.Tensor):
        static.copy_(value)
    elif isinstance(value, (tuple, list)):
        for s, v in zip(static, value, strict=True):
            _copy_into(s, v)


class _Bucket:
    """Static buffers of one (rows, shape) bucket and the captured graph that reads them."""

    def __init__(self, rows: int, batched: dict[str, torch.Tensor | None], shared: dict[str, Any]):
        self.rows = rows
        self.batched = batched
        self.shared = shared
        self.output: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def replay(self, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
        else:  # the CPU (or any non-CUDA device): the same buffers, run eagerly
            self.output = fn(**self.batched, **self.shared)
        assert self.output is not None  # the capture set it (a graph's output buffer)
        return self.output


class GraphRunner:
    """One callable `fn(**batched, **shared) -> Tensor[rows, ...]` behind declared row buckets."""

    def __init__(self, name: str, fn: Callable[..., torch.Tensor], config: GraphConfig, *,
                 pad_values: Mapping[str, float] | None = None, observer: GraphObserver | None = None,
                 pool: Any = None, timing_repeats: int = 2):
        self.name = name  # for logs: "<model>/<denoiser>" or "<model>/decode"
        self.fn = fn
        self.config = config
        self.buckets = tuple(sorted(config.batch_sizes))
        self.pad_values = pad_values or {}  # inputs whose padding rows must hold a value (else: stale rows)
        self.observer = observer or GraphObserver()
        self.pool = pool  # CUDA memory pool shared by every capture of the owner
        self.timing_repeats = timing_repeats
        self.sealed = False
        self._shapes: dict[Signature, dict[int, _Bucket]] = {}
        self._choice: dict[Signature, dict[int, int | None]] = {}  # rows -> bucket to replay (None: eager)
        self._logged: set[str] = set()
        self._lock = threading.Lock()  # static buffers serve one call at a time

    # -- lifecycle ----------------------------------------------------------------------------
    def seal(self) -> None:
        """Warm-up is over: from now on an unknown shape runs eagerly, never captures."""
        self.sealed = True

    @property
    def captured(self) -> int:
        return sum(len(b) for b in self._shapes.values())

    # -- a call -------------------------------------------------------------------------------
    def __call__(self, batched: Mapping[str, torch.Tensor | None],
                 shared: Mapping[str, Any] | None = None) -> torch.Tensor:
        shared = shared or {}
        rows, shape = signature(batched, shared)
        with self._lock:
            if shape not in self._shapes:
                if self.sealed:
                    self._miss(shape)
                    self.observer.eager("shape")
                    return self.fn(**batched, **shared)
                self._capture(shape, rows, batched, shared)
            bucket = self.choose(shape, rows)
            if bucket is None:
                self.observer.eager("rows" if rows > self.buckets[-1] else "padding")
                if rows > self.buckets[-1] and "rows" not in self._logged:
                    self._logged.add("rows")
                    log.info("%s: %d rows exceed the largest graph bucket %d; running eagerly", self.name, rows,
                             self.buckets[-1])
                return self.fn(**batched, **shared)
            return self._replay(self._shapes[shape][bucket], rows, batched, shared)

    def choose(self, shape: Signature, rows: int) -> int | None:
        """The bucket a call of `rows` rows replays, or None to run it eagerly."""
        return self._choice.get(shape, {}).get(rows)

    def _replay(self, bucket: _Bucket, rows: int, batched, shared) -> torch.Tensor:
        for name, value in batched.items():
            if value is None:
                continue
            static = bucket.batched[name]
            assert static is not None  # the same signature: None in the same fields
            static[:rows].copy_(value)
            if rows < bucket.rows and name in self.pad_values:
                static[rows:].fill_(self.pad_values[name])  # e.g. no KV write, no context
        for name, value in shared.items():
            _copy_into(bucket.shared[name], value)
        out = bucket.replay(self.fn)
        self.observer.replayed(rows, bucket.rows)
        return out[:rows].clone()  # the static output is overwritten by the next replay

    # -- warm-up ------------------------------------------------------------------------------
    def _capture(self, shape: Signature, rows: int, batched, shared) -> None:
        """Every declared row count of this shape, largest first, from the live inputs (rows repeated)."""
        device = next(v for v in batched.values() if v is not None).device
        cuda = device.type == "cuda"
        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved(device) if cuda else 0
        buckets: dict[int, _Bucket] = {}
        for size in sorted(self.buckets, reverse=True):
            bucket = _Bucket(size, {n: None if v is None else _tile(v, size, self.pad_values.get(n))
                                    for n, v in batched.items()},
                             {n: _cloned(v) for n, v in shared.items()})
            if cuda:
                bucket.graph, bucket.output = _capture_cuda(self.fn, bucket, self.pool)
            buckets[size] = bucket
            self.observer.captured()
        self._shapes[shape] = buckets
        pool_bytes = torch.cuda.memory_reserved(device) - reserved if cuda else 0
        self._choice[shape] = self._decide(buckets, batched, shared)
        self.observer.capture_done(time.perf_counter() - started, pool_bytes)
        log.info("%s: captured %d buckets %s for %s in %.2f s (%d pool bytes); %s", self.name, len(buckets),
                 list(self.buckets), _describe(shape), time.perf_counter() - started, pool_bytes,
                 _describe_choice(self._choice[shape]))

    def _decide(self, buckets: dict[int, _Bucket], batched, shared) -> dict[int, int | None]:
        """Per row count up to the largest bucket: the bucket to pad up to, or None (eager).

        An exact bucket always replays. Otherwise padding is the policy's call; `auto` times the
        padded replay against the eager forward at the real row count and keeps the faster.
        """
        choice: dict[int, int | None] = {}
        for rows in range(1, self.buckets[-1] + 1):
            bucket = next(b for b in self.buckets if b >= rows)
            if bucket == rows or self.config.padding == "always":
                choice[rows] = bucket
            elif self.config.padding == "never":
                choice[rows] = None
            else:
                live = {n: None if v is None else _tile(v, rows, self.pad_values.get(n)) for n, v in batched.items()}
                eager = self._time(lambda: self.fn(**live, **shared))
                padded = self._time(lambda: buckets[bucket].replay(self.fn))
                choice[rows] = bucket if padded <= eager else None
        return choice

    def _time(self, call: Callable[[], Any]) -> float:
        times = []
        for _ in range(self.timing_repeats):
            _sync()
            t = time.perf_counter()
            call()
            _sync()
            times.append(time.perf_counter() - t)
        return min(times)

    # -- diagnostics --------------------------------------------------------------------------
    def _miss(self, shape: Signature) -> None:
        """Log once per field which field kept a call off the graphs (compared with the nearest capture)."""
        fields = dict(shape)
        nearest = min(self._shapes, key=lambda s: _differences(fields, dict(s)), default=None)
        if nearest is None:
            if "<none>" not in self._logged:
                self._logged.add("<none>")
                log.warning("%s: no graph was captured at warm-up; running eagerly", self.name)
            return
        captured = dict(nearest)
        for name in sorted(set(fields) | set(captured)):
            if fields.get(name) != captured.get(name) and name not in self._logged:
                self._logged.add(name)
                log.warning("%s: no graph for %s=%s (captured: %s); running eagerly", self.name, name,
                            fields.get(name), captured.get(name))


def _tile(value: torch.Tensor, rows: int, pad: float | None) -> torch.Tensor:
    """`value`'s rows repeated (or the pad value) up to `rows` rows: a contiguous static buffer."""
    index = torch.arange(rows, device=value.device) % value.shape[0]
    out = value.index_select(0, index).contiguous()
    if pad is not None and rows > value.shape[0]:
        out[value.shape[0]:].fill_(pad)
    return out


def _capture_cuda(fn: Callable[..., torch.Tensor], bucket: _Bucket, pool: Any):
    """Warm the callable on a side stream (lazy init, autotuning), then capture one replayable call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(**bucket.batched, **bucket.shared)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: other stage threads may touch CUDA meanwhile (their work is not part of this graph)
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = fn(**bucket.batched, **bucket.shared)
    return graph, output


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _differences(a: dict, b: dict) -> int:
    return sum(a.get(k) != b.get(k) for k in set(a) | set(b))


def _describe(shape: Signature) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape)


def _describe_choice(choice: dict[int, int | None]) -> str:
    return "rows->bucket " + " ".join(f"{r}->{b if b is not None else 'eager'}" for r, b in sorted(choice.items()))

