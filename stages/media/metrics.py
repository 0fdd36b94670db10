"""The media subsystem's series (worker tasks, fetched sources), on the engine's registry
(stages.metrics.Metrics.media). A media task's queue age and run time are stage series (stage "media/<fn>")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class MediaMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.tasks = Counter("mmserve_media_tasks_total", "Media worker tasks by function and outcome",
                             ["function", "outcome"], registry=r)
        self.input_bytes = Counter("mmserve_media_input_bytes_total", "Bytes handed to media decode tasks",
                                   ["function"], registry=r)
        self.fetches = Counter("mmserve_media_fetch_total", "Media sources fetched, by kind and outcome",
                               ["kind", "outcome"], registry=r)
        self.fetch_bytes = Counter("mmserve_media_fetch_bytes_total", "Bytes fetched for media sources",
                                   ["kind"], registry=r)
