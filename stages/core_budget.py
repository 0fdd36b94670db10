"""CoreBudget: the CPU cores a process's stage workers share, handed out in arrival order.

Why: torch's intra-op pool is OpenMP, and each thread that runs torch ops gets a team of its own
(`torch.set_num_threads` sets the calling thread's team size, plus the default for threads that
have not run an op yet). Three stage workers at two threads each, all busy on a 2-core machine, are
six spinning threads on two cores; an OpenMP team whose thread is descheduled waits at every
barrier, so the denoise loop ran several times slower while a VAE decode or a text encode ran
beside it. So a CPU stage worker holds `threads` cores of the budget for each batch (or loop step)
it runs, and runs it with that many torch threads: busy workers never ask for more threads than
the cores the process may use (os.sched_getaffinity), and a worker that waits is next in line
(strict FIFO, so the denoise loop cannot starve the text encoder that feeds it new requests).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from typing import Callable, Iterator

import torch


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or taskset's limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads(replicas: int, cores: int | None = None) -> int:
    """Torch threads per worker of a pool that names none: the cores shared by the pool's replicas."""
    return max(1, (cores or available_cores()) // replicas)


class CoreBudget:
    def __init__(self, cores: int | None = None):
        self.cores = cores or available_cores()
        if self.cores < 1:
            raise ValueError(f"a core budget needs at least one core, got {self.cores}")
        self._free = self.cores
        self._line: collections.deque[object] = collections.deque()  # waiting workers, first come first served
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, threads: int, on_wait: Callable[[float], None] | None = None) -> Iterator[None]:
        """Wait for `threads` cores (all of them when more are asked), then run the block on that many torch threads.
        `on_wait(seconds)` is told how long the wait was."""
        need = min(threads, self.cores)
        ticket = object()
        asked = time.perf_counter()
        with self._cond:
            self._line.append(ticket)
            while self._line[0] is not ticket or self._free < need:
                self._cond.wait()
            self._line.popleft()
            self._free -= need
            self._cond.notify_all()  # the next in line may fit in what is left
        if on_wait is not None:
            on_wait(time.perf_counter() - asked)
        try:
            # Per thread for OpenMP; MKL's count is process-wide, and the holder is who computes now.
            torch.set_num_threads(threads)
            yield
        finally:
            with self._cond:
                self._free += need
                self._cond.notify_all()

    @property
    def free(self) -> int:
        """Cores no worker holds now."""
        with self._cond:
            return self._free

    @property
    def waiting(self) -> int:
        """Workers in line for cores."""
        with self._cond:
            return len(self._line)
