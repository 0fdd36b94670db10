"""Keep the test process at normal scheduling priority.

SVT-AV1 (PyAV's only AV1 encoder here) raises the thread that opens an encoder to SCHED_FIFO when the
process may (as root). Every process started from that thread afterwards inherits real-time priority,
and one whose threads spin (OpenMP's wait policy) then starves a 2-core machine: CI hung so.
"""

from __future__ import annotations

import os

_NORMAL = (os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_IDLE)


def realtime_threads() -> list[int]:
    """The ids of this process's threads that run under a real-time policy."""
    out = []
    for name in os.listdir("/proc/self/task"):
        try:
            if os.sched_getscheduler(int(name)) not in _NORMAL:
                out.append(int(name))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def normal_scheduling() -> list[int]:
    """Puts every real-time thread of this process back to SCHED_OTHER; returns their ids."""
    lowered = realtime_threads()
    for tid in lowered:
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            continue
    return lowered
