"""The caches' series (encoders/cache.py's EncoderCache by name: prompt_embedding, encoder_output), on the
engine's registry (stages.metrics.Metrics.cache)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.hits = Counter("mmserve_cache_hits_total", "Cache hits", ["cache"], registry=r)
        self.misses = Counter("mmserve_cache_misses_total", "Cache misses", ["cache"], registry=r)
        self.bytes = Gauge("mmserve_cache_bytes", "Bytes held by a cache", ["cache"], registry=r)
        self.saved = Counter("mmserve_cache_compute_saved_seconds", "Compute time a cache saved (the "
                             "recorded cost of each entry, per hit)", ["cache"], registry=r)
