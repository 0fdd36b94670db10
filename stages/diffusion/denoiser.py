"""The denoiser forward of one model behind its speed-ups (the hooks of DESIGN §5).

A family builds one batched call (`fn(**batched, **shared)`, per-row inputs in `batched`) and
hands it here with its row groups. Then, in this order:
* step caching, when a request in the batch asked for it: the call runs eagerly inside the
  block stack's cached forward (which rows compute is decided per step, so no graph fits);
* the graph runner, when the model declares buckets (captured at warm-up, then sealed);
* else the plain eager call.
Regional compile is applied to the blocks once, at load (`prepare`), under either path.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from stages.cuda_graph_metrics import GraphObserver, MetricsObserver
from stages.cuda_graphs import GraphConfig, GraphRunner, signature
from stages.diffusion.block_stack import BlockStack, CacheSpec, RowGroup
from stages.diffusion.compile import CompileConfig, compile_blocks
from stages.diffusion.step_cache import StepCacheConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Speedups:
    """A model's speed-up settings, as its ModelSpec declares them (all off by default)."""

    graphs: GraphConfig = GraphConfig()  # declared buckets; captured at warm-up
    compile: CompileConfig = CompileConfig()  # regional torch.compile of the repeated blocks
    step_cache: StepCacheConfig = StepCacheConfig()  # whether requests may ask for step caching
    fused_kernels: bool = False  # Triton kernels for the norms and the flow-matching commit (CUDA)


class DenoiserCall:
    def __init__(self, model: str, *, graphs: GraphConfig = GraphConfig(), compile: CompileConfig = CompileConfig(),
                 step_cache: StepCacheConfig = StepCacheConfig(), metrics=None):
        self.model = model  # metric label
        self.graphs = graphs
        self.compile = compile
        self.step_cache = step_cache
        self.metrics = metrics
        self.stacks: dict[str, BlockStack] = {}  # denoiser key -> its wrapped blocks (models that allow caching)
        self.runners: dict[str, GraphRunner] = {}  # denoiser key -> its graph runner (created at first call)
        self.observer = MetricsObserver(metrics, "denoise", model) if metrics is not None else GraphObserver()
        self._pool: Any = None  # one CUDA memory pool for every capture of this model (an opaque handle)
        self._first_calls: set = set()  # (key, signature) seen: a compiled block's first call compiles
        self.sealed = False

    def prepare(self, key: str, regions: Sequence[torch.nn.Module], cache_spec: CacheSpec | None) -> None:
        """At load: compile the repeated blocks, then wrap them for step caching (the wrappers stay eager)."""
        if self.compile.enabled and regions:
            n = compile_blocks(regions, self.compile)
            log.info("%s/%s: %d blocks compiled (backend %s, mode %s); they compile at their first call", self.model,
                     key, n, self.compile.backend, self.compile.mode or "default")
        if self.step_cache.enabled and cache_spec is not None:
            if self.step_cache.teacache_coefficients is not None:  # a model's own fit beats the family's
                cache_spec = dataclasses.replace(cache_spec, coefficients=self.step_cache.teacache_coefficients)
            self.stacks[key] = BlockStack(cache_spec)

    def seal(self) -> None:
        """Warm-up is over: no graph is captured from now on."""
        self.sealed = True
        for runner in self.runners.values():
            runner.seal()

    def __call__(self, key: str, fn: Callable[..., torch.Tensor], batched: dict[str, torch.Tensor | None],
                 shared: dict[str, Any], groups: list[RowGroup]) -> torch.Tensor:
        if any(g.state is not None for g in groups):
            if self.graphs.enabled:
                self.observer.eager("step_cache")
            with self.stacks[key].active(groups) as run:
                out = self._first_call_timed(key, batched, shared, lambda: fn(**batched, **shared))
            self.count(run.groups, run.decisions)
            return out
        if self.graphs.enabled:
            runner = self._runner(key, fn)
            return self._first_call_timed(key, batched, shared, lambda: runner(batched, shared))
        return self._first_call_timed(key, batched, shared, lambda: fn(**batched, **shared))

    def _runner(self, key: str, fn: Callable[..., torch.Tensor]) -> GraphRunner:
        runner = self.runners.get(key)
        if runner is None:
            if self._pool is None and torch.cuda.is_available():
                self._pool = torch.cuda.graph_pool_handle()
            runner = GraphRunner(f"{self.model}/{key}", fn, self.graphs, observer=self.observer, pool=self._pool)
            if self.sealed:
                runner.seal()
            self.runners[key] = runner
        return runner

    def _first_call_timed(self, key: str, batched, shared, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """With compile on, the first call of each shape compiles: its time is the compile warm-up cost."""
        if not self.compile.enabled:
            return call()
        shape = (key, signature(batched, shared))
        if shape in self._first_calls:
            return call()
        started = time.perf_counter()
        out = call()
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        seconds = time.perf_counter() - started
        self._first_calls.add(shape)
        if self.metrics is not None:
            self.metrics.denoise.compile_seconds.labels(stage="denoise", model=self.model).inc(seconds)
        log.info("%s/%s: first call of %d rows took %.2f s (compile warm-up)", self.model, key, shape[1][0], seconds)
        return out

    def count(self, groups: list[RowGroup], decisions: list[bool | None]) -> None:
        """The step cache's decisions, one per row group (a CFG-parallel rank's are counted on rank 0)."""
        if self.metrics is None:
            return
        for g, computed in zip(groups, decisions):
            if g.state is not None:
                self.metrics.denoise.step_cache_steps.labels(model=self.model, method=g.state.params.method,
                                                             outcome="computed" if computed else "skipped").inc()
