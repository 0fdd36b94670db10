"""What a graph runner reports: counts kept for tests and logs, and the engine's Prometheus metrics."""

from __future__ import annotations


class GraphObserver:
    """Where a runner reports what it did (metrics); the base class keeps counts for tests and logs."""

    def __init__(self):
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
    """A GraphObserver that also feeds the engine's Prometheus metrics (stages.metrics.Metrics)."""

    def __init__(self, metrics, stage: str, model: str):
        super().__init__()
        self.metrics, self.labels = metrics, dict(stage=stage, model=model)

    def replayed(self, rows: int, bucket: int) -> None:
        super().replayed(rows, bucket)
        m = self.metrics
        m.graph_replays.labels(**self.labels).inc()
        m.graph_rows.labels(**self.labels).inc(rows)
        m.graph_padded_rows.labels(**self.labels).inc(bucket - rows)

    def eager(self, reason: str) -> None:
        super().eager(reason)
        self.metrics.graph_eager.labels(reason=reason, **self.labels).inc()

    def captured(self) -> None:
        super().captured()
        self.metrics.graph_captures.labels(**self.labels).inc()

    def capture_done(self, seconds: float, pool_bytes: int) -> None:
        super().capture_done(seconds, pool_bytes)
        self.metrics.graph_capture_seconds.labels(**self.labels).inc(seconds)
        self.metrics.graph_pool_bytes.labels(**self.labels).inc(pool_bytes)
