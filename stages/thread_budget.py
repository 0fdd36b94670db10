"""ThreadBudget: the torch threads that a process's CPU stage workers may run at once, handed out in arrival order.

torch's intra-op pool here is OpenMP, and every thread that runs torch ops gets a team of its own:
`torch.set_num_threads` sets the calling thread's team size (and the size that threads which have not run
an op yet will take); only MKL's count is process-wide. So N busy stage workers run N teams, and nothing
bounded their sum: ten loaded models' text encoders, loops and decoders could all run a team of every
core at once. Each CPU stage worker now runs its pool's `threads` (its team) and holds that many of the
budget for each batch or loop step it runs; a worker that does not fit waits, first come first served
(strict FIFO: the denoise loop, which asks again after every step, cannot starve the stages that feed it).

Why the default budget is twice the cores, not the cores: measured on 2 cores (examples/bench_images.py's
checkpoint, 8 requests of 128x128 px), a budget of the cores — one busy stage at a time — was as fast for
requests arriving together and 20 % slower for requests arriving 300 ms apart (`--stagger-ms 300`: the
VAE decode of a finished request could no longer run beside the denoise loop, and a small batch does not
keep two threads busy: each team fills the other's OpenMP barrier waits; libgomp stops spinning once it has
more threads than cores). Two teams of every core matched the unbounded server; a third waits its turn.
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


def default_threads(replicas: int) -> int:
    """Torch threads per worker of a pool that names none: the cores this process may use, shared by the replicas."""
    return max(1, available_cores() // replicas)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one torch thread in the calling thread (then its count as it was): for work outside the
    stage workers, such as loading weights. libgomp spins only while it manages no more threads than there are
    cores; past that, every parallel region of every team pays a futex wake-up. A thread that once ran a
    multi-threaded op keeps its team alive for as long as it lives, so a loading thread's team made every stage
    worker's ops about 2x slower (measured: a 16x256 linear 70 -> 155 us on 2 cores, the LLM's decode steps 1.6x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_budget() -> int:
    """Two busy stages, each on every core (see the module docstring)."""
    return 2 * available_cores()


class ThreadBudget:
    def __init__(self, threads: int | None = None):
        self.threads = threads or default_budget()  # torch threads all CPU stage workers may run at once
        if self.threads < 1:
            raise ValueError(f"a thread budget needs at least one thread, got {self.threads}")
        self._free = self.threads
        self._line: collections.deque[object] = collections.deque()  # waiting workers, first come first served
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, threads: int, on_wait: Callable[[float], None] | None = None) -> Iterator[None]:
        """Wait for `threads` of the budget (all of it when more are asked), then run the block on that many torch
        threads. `on_wait(seconds)` is told how long the wait was."""
        need = min(threads, self.threads)
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
            torch.set_num_threads(threads)  # this thread's OpenMP team (and MKL's process-wide count)
            yield
        finally:
            with self._cond:
                self._free += need
                self._cond.notify_all()

    @property
    def free(self) -> int:
        """Threads of the budget no worker holds now."""
        with self._cond:
            return self._free

    @property
    def waiting(self) -> int:
        """Workers in line."""
        with self._cond:
            return len(self._line)
