"""What a graph runner reports: counts kept for tests and logs, and the engine's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class GraphMetrics:
    """The graph runners' series (DESIGN §8; stage is "denoise" or "llm"), on the engine's registry
    (stages.metrics.Metrics.graphs)."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.replays = Counter("mmserve_graph_replays_total", "Forwards replayed from a captured graph",
                               ["stage", "model"], registry=r)
        self.rows = Counter("mmserve_graph_rows_total", "Real rows of replayed forwards", ["stage", "model"],
                            registry=r)
        self.padded_rows = Counter("mmserve_graph_padded_rows_total", "Padding rows added to reach a bucket "
                                   "(pad ratio = padded / (rows + padded))", ["stage", "model"], registry=r)
        self.eager = Counter("mmserve_graph_eager_total", "Forwards of a graph-enabled stage run eagerly, by "
                             "reason (shape, rows, padding, step_cache)", ["stage", "model", "reason"],
                             registry=r)
        self.captures = Counter("mmserve_graph_captures_total", "Buckets captured (warm-up only)",
                                ["stage", "model"], registry=r)
        self.capture_seconds = Gauge("mmserve_graph_capture_seconds", "Time spent capturing graphs",
                                     ["stage", "model"], registry=r)
        self.pool_bytes = Gauge("mmserve_graph_pool_bytes", "Device memory reserved by graph capture",
                                ["stage", "model"], registry=r)


class GraphObserver:
    """Where a runner reports what it did (metrics); the base class keeps counts for tests and logs."""

    def __init__(self) -> None:
        self.replays = self.rows = self.padded_rows = self.captures = 0
        self.eager_calls: dict[str, int] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    def replayed(self, rows: int, bucket: int) -> None:
        self.replays += 1
        self.rows += rows
        self.padded_rows += bucket - rows

    def eager(self, reason: str) -> None:
        self.eager_calls[reason] = self.eager_calls.get(reason, 0) + 1

    def captured(self) -> None:
        self.captures += 1

    def capture_done(self, seconds: float, pool_bytes: int) -> None:
        self.capture_seconds += seconds
        self.pool_bytes += pool_bytes


class MetricsObserver(GraphObserver):
    """A GraphObserver that also feeds the engine's Prometheus metrics (stages.metrics.Metrics.graphs)."""

    def __init__(self, metrics, stage: str, model: str):
        super().__init__()
        self.metrics, self.labels = metrics.graphs, dict(stage=stage, model=model)

    def replayed(self, rows: int, bucket: int) -> None:
        super().replayed(rows, bucket)
        m = self.metrics
        m.replays.labels(**self.labels).inc()
        m.rows.labels(**self.labels).inc(rows)
        m.padded_rows.labels(**self.labels).inc(bucket - rows)

    def eager(self, reason: str) -> None:
        super().eager(reason)
        self.metrics.eager.labels(reason=reason, **self.labels).inc()

    def captured(self) -> None:
        super().captured()
        self.metrics.captures.labels(**self.labels).inc()

    def capture_done(self, seconds: float, pool_bytes: int) -> None:
        super().capture_done(seconds, pool_bytes)
        self.metrics.capture_seconds.labels(**self.labels).inc(seconds)
        self.metrics.pool_bytes.labels(**self.labels).inc(pool_bytes)
