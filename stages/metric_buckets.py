"""Histogram buckets the engine's series share (stages/metrics.py and each subsystem's own metrics class)."""

from __future__ import annotations

TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
