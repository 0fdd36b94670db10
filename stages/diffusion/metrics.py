"""The denoise stage's speed-up series (compiled blocks, step caching), on the engine's registry
(stages.metrics.Metrics.denoise). Its CUDA-graph series are stages/cuda_graph_metrics.py's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stages.metric_buckets import TIME_BUCKETS


class DenoiseMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.compile_seconds = Gauge("mmserve_compile_warmup_seconds", "Time of the first call per shape of a "
                                     "model with compiled blocks: compilation, and with graphs that shape's capture",
                                     ["stage", "model"], registry=r)
        self.step_cache_steps = Counter("mmserve_step_cache_steps_total", "Branch-steps of step-cached requests, "
                                        "computed or skipped", ["model", "method", "outcome"], registry=r)
        self.parallel_step = Histogram("mmserve_parallel_step_seconds", "Compute of one rank's part of a parallel "
                                       "denoiser forward", ["model", "rank"], buckets=TIME_BUCKETS, registry=r)
        self.parallel_collective = Histogram("mmserve_parallel_collective_seconds", "Time one rank spent sending "
                                             "and receiving a parallel denoiser forward's tensors", ["model", "rank"],
                                             buckets=TIME_BUCKETS, registry=r)
