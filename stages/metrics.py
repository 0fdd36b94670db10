"""Prometheus metrics for the runtime. One registry per engine; labels never carry a tenant or request id.

`Metrics` holds the engine's registry and each subsystem's series, created by that subsystem's own class:
`stage` (StageMetrics, below: stage pools and the executor), `media` (stages/media/metrics.py), `llm`
(stages/llm/metrics.py), `graphs` (stages/cuda_graph_metrics.py), `denoise` (stages/diffusion/metrics.py)
and `cache` (stages/cache_metrics.py). The layers above stages/ define theirs (realtime/video/metrics.py,
realtime/voice/metrics.py, serve/metrics.py) and put them on the same registry with `Metrics.part`.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stages.cache_metrics import CacheMetrics
from stages.cuda_graph_metrics import GraphMetrics
from stages.diffusion.metrics import DenoiseMetrics
from stages.llm.metrics import LLMMetrics
from stages.media.metrics import MediaMetrics
from stages.metric_buckets import BATCH_BUCKETS, TIME_BUCKETS

P = TypeVar("P")


class StageMetrics:
    """Stage pools (every pool, and media tasks as stage "media/<function>") and the graph executor."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.queue_age = Histogram("mmserve_stage_queue_age_seconds", "Time a work item waited in a stage queue",
                                   ["stage", "model"], buckets=TIME_BUCKETS, registry=r)
        self.run_time = Histogram("mmserve_stage_run_seconds", "Time of one batch (or one loop step) of a stage",
                                  ["stage", "model"], buckets=TIME_BUCKETS, registry=r)
        self.batch_size = Histogram("mmserve_stage_batch_size", "Work items sharing one stage call",
                                    ["stage", "model"], buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("mmserve_stage_queue_depth", "Items waiting in a stage queue", ["stage", "model"],
                                 registry=r)
        self.active = Gauge("mmserve_stage_active_items", "Items a stage is working on", ["stage", "model"], registry=r)
        self.thread_wait = Histogram("mmserve_stage_thread_wait_seconds", "Time a CPU stage worker waited for its "
                                     "torch threads (the shared thread budget) before a batch or loop step",
                                     ["stage", "model"], buckets=TIME_BUCKETS, registry=r)
        self.oom = Counter("mmserve_stage_oom_total", "Out-of-memory errors in a loop step: each halved that batch "
                           "key's cap and ran the step's items again, once", ["stage", "model"], registry=r)
        self.graph_requests = Counter("mmserve_graph_requests_total", "Graph requests by model and outcome",
                                      ["model", "outcome"], registry=r)
        self.graph_nodes = Counter("mmserve_graph_nodes_total", "Nodes of graph requests started, by the request's "
                                   "model, the node and the stage pool that ran it: the path requests take",
                                   ["model", "node", "stage"], registry=r)

    def batch_size_samples(self, stage: str, model: str = "") -> dict[int, float]:
        """Cumulative bucket counts of the batch-size histogram: {upper bound: count <= bound}."""
        out: dict[int, float] = {}
        for metric in self.batch_size.collect():
            for s in metric.samples:
                if s.name.endswith("_bucket") and s.labels["stage"] == stage and s.labels["model"] == model:
                    le = s.labels["le"]
                    if le != "+Inf":
                        out[int(float(le))] = s.value
        return out

    def max_batch_size(self, stage: str, model: str = "") -> int:
        """The largest batch size bucket that has seen a batch (for tests and benchmarks)."""
        seen, prev = 0, 0.0
        for bound, count in sorted(self.batch_size_samples(stage, model).items()):
            if count > prev:
                seen = bound
            prev = count
        return seen


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.stage = StageMetrics(self.registry)
        self.media = MediaMetrics(self.registry)
        self.llm = LLMMetrics(self.registry)
        self.graphs = GraphMetrics(self.registry)
        self.denoise = DenoiseMetrics(self.registry)
        self.cache = CacheMetrics(self.registry)
        self._parts: dict[Any, Any] = {}
        self._parts_lock = threading.Lock()

    def part(self, cls: Callable[[CollectorRegistry], P]) -> P:
        """The series of a subsystem this module cannot import (realtime/, serve/): `cls(registry)`, created
        on this engine's registry at the first call and the same object at every later one."""
        with self._parts_lock:
            if cls not in self._parts:
                self._parts[cls] = cls(self.registry)
            return self._parts[cls]
