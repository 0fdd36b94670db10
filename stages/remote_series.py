"""The series a stage writes inside a ray-backend replica's actor (the llm's TTFT, tokens and KV blocks, the denoise
stage's step cache, the encoder caches), carried to the API process's registry so that `/metrics` shows them as the
local backend does.

The actor's `SeriesDiff` reads its stage's registry and says what changed since it last asked: counters and
histograms as increments, gauges as their values. The API process's `SeriesSink` adds the increments to its own
series of the same names and labels (the same classes made them, stages.metrics.Metrics), and sets each gauge to the
sum over the pool's replicas (a lost replica's part is dropped). The pools' own series (mmserve_stage_*, the
replicas') are not carried: the API process's pool keeps them itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

SKIPPED = ("mmserve_stage_", "mmserve_replica_", "mmserve_edge_")  # kept by the API process's pool itself

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Change:
    """One series' change: a counter's or gauge's `value` (an increment, or the gauge's value now), or a histogram's
    increments of its cumulative buckets (`buckets`, in bound order) and of its sum (`value`)."""

    name: str  # the family's name (a counter's without _total)
    kind: str  # "counter", "gauge" or "histogram"
    labels: Labels
    value: float
    buckets: tuple[float, ...] = ()


class SeriesDiff:
    """What changed in `registry` since the last call (the actor's side)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._last: dict[tuple[str, Labels], Any] = {}

    def changes(self) -> list[Change]:
        out: list[Change] = []
        for family in self.registry.collect():
            if family.name.startswith(SKIPPED) or family.type not in ("counter", "gauge", "histogram"):
                continue
            for labels, now in _values(family).items():
                key = (family.name, labels)
                last = self._last.get(key)
                if now == last:
                    continue
                self._last[key] = now
                if family.type == "gauge":
                    out.append(Change(family.name, "gauge", labels, now))
                elif family.type == "counter":
                    out.append(Change(family.name, "counter", labels, now - (last or 0.0)))
                else:
                    total, buckets = now
                    was_total, was = last or (0.0, (0.0,) * len(buckets))
                    out.append(Change(family.name, "histogram", labels, total - was_total,
                                      tuple(b - a for a, b in zip(was, buckets, strict=True))))
        return out


def _values(family) -> dict[Labels, Any]:
    """label set -> value (a counter's total; a histogram's (sum, cumulative bucket counts in bound order))."""
    values: dict[Labels, Any] = {}
    buckets: dict[Labels, list[float]] = {}
    for s in family.samples:
        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        if family.type == "counter" and s.name.endswith("_total") or family.type == "gauge":
            values[labels] = s.value
        elif family.type == "histogram" and s.name.endswith("_bucket"):
            buckets.setdefault(labels, []).append(s.value)  # exposition order: ascending bounds, +Inf last
        elif family.type == "histogram" and s.name.endswith("_sum"):
            values[labels] = s.value
    return {labels: (values.get(labels, 0.0), tuple(b)) for labels, b in buckets.items()} if buckets else values


class SeriesSink:
    """Applies replicas' changes to the API process's series (one sink per pool)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._series: dict[str, MetricWrapperBase] = {}  # looked up at the first change (parts register late)
        self._gauges: dict[tuple[str, Labels], dict[int, float]] = {}  # -> replica -> its value
        self._lock = threading.Lock()

    def apply(self, replica: int, changes: list[Change]) -> None:
        with self._lock:
            if not self._series:
                self._series = _by_name(self.registry)
            for c in changes:
                metric = self._series.get(c.name)
                if metric is None:  # a series the API process's copy does not have (another version): skipped
                    continue
                child: Any = metric.labels(**dict(c.labels)) if c.labels else metric
                if c.kind == "counter":
                    if c.value > 0:
                        child.inc(c.value)
                elif c.kind == "gauge":
                    parts = self._gauges.setdefault((c.name, c.labels), {})
                    parts[replica] = c.value
                    child.set(sum(parts.values()))
                else:
                    _add_to_histogram(child, c)

    def drop(self, replica: int) -> None:
        """A lost replica's gauges no longer count (its restart reports them again)."""
        with self._lock:
            for (name, labels), parts in self._gauges.items():
                if parts.pop(replica, None) is not None:
                    metric: Any = self._series[name]
                    (metric.labels(**dict(labels)) if labels else metric).set(sum(parts.values()))


def _add_to_histogram(child, change: Change) -> None:
    # prometheus_client has no public way to add counts to a histogram; its child keeps one value per bucket
    # (not cumulative) and the sum (tests/test_ray_backend.py checks the carried counts exactly).
    previous = 0.0
    for bucket, cumulative in zip(child._buckets, change.buckets, strict=True):
        if cumulative - previous:
            bucket.inc(cumulative - previous)
        previous = cumulative
    if change.value:
        child._sum.inc(change.value)


def _by_name(registry: CollectorRegistry) -> dict[str, MetricWrapperBase]:
    """Family name -> the metric object that makes it, for the registry's series made by prometheus_client."""
    out: dict[str, MetricWrapperBase] = {}
    for collector in list(registry._collector_to_names):  # the registry's collectors (no public list)
        if isinstance(collector, MetricWrapperBase):
            for family in collector.describe():
                out[family.name] = collector
    return out
