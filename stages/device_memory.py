"""/metrics: the memory of each pool's devices, read at scrape time."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from prometheus_client.core import GaugeMetricFamily


class DeviceMemory:
    """A collector: per pool and device, torch's CUDA allocator (allocated and reserved bytes) on a CUDA device,
    the process's resident set on the CPU (the pools share it)."""

    def __init__(self, pools: Callable[[], dict[str, Any]]):
        self._pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily("mmserve_device_memory_bytes", "Memory of each stage pool's devices: on CUDA "
                                  "the bytes torch's allocator has allocated and reserved, on the CPU the process's "
                                  "resident set", labels=["stage", "model", "device", "kind"])
        for name, pool in list(self._pools().items()):
            model = getattr(getattr(pool, "stage", None), "model", "")
            for device in {str(d) for d in getattr(pool, "devices", ())}:
                for kind, value in _readings(torch.device(device)):
                    gauge.add_metric([name, model, device, kind], value)
        yield gauge


def _readings(device: torch.device) -> list[tuple[str, float]]:
    if device.type == "cuda":
        return [("allocated", torch.cuda.memory_allocated(device)), ("reserved", torch.cuda.memory_reserved(device))]
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return [("resident", resident_pages * os.sysconf("SC_PAGE_SIZE"))]
