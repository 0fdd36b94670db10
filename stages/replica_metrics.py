"""Prometheus series of a placed pool's replicas and of the tensors moved to them at a node's edge."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stages.metric_buckets import BATCH_BUCKETS, TIME_BUCKETS

LABELS = ["stage", "model", "replica", "device", "node"]  # node: the Ray node id ("local" in this process)


class ReplicaMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.queue_age = Histogram("mmserve_replica_queue_age_seconds", "Time a work item waited for its replica",
                                   LABELS, buckets=TIME_BUCKETS, registry=r)
        self.run_time = Histogram("mmserve_replica_run_seconds", "Time of one batch (or loop step) of one replica",
                                  LABELS, buckets=TIME_BUCKETS, registry=r)
        self.batch_size = Histogram("mmserve_replica_batch_size", "Work items sharing one call of one replica",
                                    LABELS, buckets=BATCH_BUCKETS, registry=r)
        self.items = Counter("mmserve_replica_items_total", "Work items a replica took", LABELS, registry=r)
        self.live = Gauge("mmserve_replica_live", "1 while a replica can take work, 0 while it is down", LABELS,
                          registry=r)
        self.transfer_time = Histogram("mmserve_edge_transfer_seconds", "Time moving a work item's inputs to its "
                                       "replica's device", LABELS, buckets=TIME_BUCKETS, registry=r)
        self.transfer_bytes = Counter("mmserve_edge_transfer_bytes_total", "Bytes of tensors moved to a replica's "
                                      "device at a node's edge", LABELS, registry=r)
