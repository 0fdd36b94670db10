"""Harmless functions that let the tests exercise media-worker isolation for real (crash, hang, CPU, memory).

Not part of the server: a test registers them on its own pool with
`MediaPool(..., extra_functions=TEST_FUNCTIONS)`; the engine's pool never lists them. A worker is a
fresh interpreter on the parent's sys.path, so it imports this module under the name the test did.
Imports only the stdlib and numpy, as stages.media.image does, so a worker's baseline stays small.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np


def _test_echo(value: object) -> tuple[int, object]:
    """Returns (worker pid, value): shows the call crossed into a worker and which one."""
    return os.getpid(), value


def _test_sleep(seconds: float) -> tuple[int, float, float]:
    """Sleeps; returns (pid, start, end) wall times so tests can measure concurrency."""
    start = time.time()
    time.sleep(seconds)
    return os.getpid(), start, time.time()


def _test_crash(how: str = "exit") -> None:
    """Dies without reporting: os._exit ("exit"), a segmentation fault signal ("segv"), or SIGKILL ("kill", as an
    operator's kill -9 or the system's out-of-memory killer)."""
    if how in ("segv", "kill"):
        os.kill(os.getpid(), signal.SIGSEGV if how == "segv" else signal.SIGKILL)
    os._exit(3)


def _test_burn_cpu(seconds: float) -> float:
    """Busy-loops until `seconds` of CPU time are used; returns the CPU time used."""
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass
    return time.process_time() - start


def _test_allocate(mb: int) -> int:
    """Allocates and touches `mb` MiB; returns the size."""
    block = np.ones(mb * 1024 * 1024, dtype=np.uint8)
    return int(block.size)


# name -> module, the form of stages.media.image.WORKER_FUNCTIONS
TEST_FUNCTIONS = {name: __name__ for name in ("_test_echo", "_test_sleep", "_test_crash", "_test_burn_cpu",
                                              "_test_allocate")}
