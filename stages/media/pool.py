"""A pool of media worker processes with per-task CPU, memory and wall-clock limits.

Codecs are attack surface: a crafted file may crash, hang or balloon a decoder. Each task
runs in a child process that holds nothing else, so the worst a file can do is cost one task
and one worker restart. Children are fresh interpreters (`python -c`, not fork) that import
only `stages.media.image`: they inherit no torch, no CUDA context and no threads. (A multiprocessing
"spawn" child would also re-run the parent's `__main__` script, which for `mmserve` imports
torch before the address-space limit could be set.)

One parent thread per worker owns that worker: it takes a task from the shared queue, sends it,
waits for the reply with the wall-clock deadline, and replaces the worker if it died or hung.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from stages.media.image import WORKER_FUNCTIONS, MediaError

if TYPE_CHECKING:
    from stages.metrics import Metrics

log = logging.getLogger(__name__)

_MB = 1024 * 1024
_STARTUP_TIMEOUT_S = 60.0  # a fresh interpreter importing numpy + PIL takes ~0.3 s; allow a loaded host
_WORKER_CMD = ("import sys; from stages.media.pool import _worker_main; "
               "_worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])")


@dataclass
class _Task:  # parent-side record of one submitted call
    task_id: int  # matches the reply to the request
    fn_name: str  # a name in stages.media.image.WORKER_FUNCTIONS or the pool's extra_functions
    args: tuple  # positional arguments, pickled to the worker
    kwargs: dict  # keyword arguments, pickled to the worker
    future: Future  # resolved with the result or a MediaError
    enqueued_at: float = field(default_factory=time.monotonic)  # for the queue-age histogram


@dataclass
class _Request:  # parent -> worker
    task_id: int  # echoed in the reply
    fn_name: str  # looked up by the worker, again, in WORKER_FUNCTIONS and the extra functions it was started with
    args: tuple  # positional arguments
    kwargs: dict  # keyword arguments
    cpu_s: float  # CPU seconds this task may use on top of what the worker used so far


@dataclass
class _Reply:  # worker -> parent
    task_id: int  # the request's id
    value: Any = None  # the function's result when error is None
    error: BaseException | None = None  # MediaError or the function's own exception


@dataclass
class _Ready:  # worker -> parent, once limits are set
    pid: int  # the worker's process id
    baseline_mb: float  # address space already mapped before any task


@dataclass
class _Worker:  # parent-side handle of one child
    proc: subprocess.Popen  # the child process
    conn: Connection  # duplex pipe to the child (a Unix socket)


class MediaPool:
    """N media worker processes; `submit` queues a call and returns a Future."""

    def __init__(self, workers: int, task_cpu_s: float, task_memory_mb: int, task_timeout_s: float,
                 metrics: Metrics | None = None, extra_functions: Mapping[str, str] | None = None):
        if workers < 1:
            raise ValueError(f"media pool workers must be >= 1, got {workers}")
        if task_cpu_s <= 0 or task_timeout_s <= 0:
            raise ValueError(f"task_cpu_s and task_timeout_s must be > 0, got {task_cpu_s} and {task_timeout_s}")
        self.workers = workers  # worker processes, and so tasks running at once
        self.task_cpu_s = task_cpu_s  # CPU seconds per task (RLIMIT_CPU; SIGXCPU -> media_timeout)
        self.task_memory_mb = task_memory_mb  # address-space limit per worker (RLIMIT_AS); 0 = none
        self.task_timeout_s = task_timeout_s  # wall clock per task; the parent kills a worker past it
        self.metrics = metrics
        # name -> module, added to stages.media.image.WORKER_FUNCTIONS for this pool only (the tests' crash, hang and
        # memory functions); the engine's pool passes none, so the server runs only the media functions.
        self.extra_functions = dict(extra_functions or {})
        shadowed = sorted(set(self.extra_functions) & set(WORKER_FUNCTIONS))
        if shadowed:
            raise ValueError(f"extra_functions may not replace media worker functions: {shadowed}")
        self.tasks_done = 0  # tasks finished, successfully or not
        self.tasks_failed = 0  # tasks finished with an error
        self.workers_replaced = 0  # workers lost to a crash, a limit or a hang
        self._queue: queue.Queue[_Task | None] = queue.Queue()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._threads: list[threading.Thread] = []
        self._closed = False

    # -- public API --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker threads; each spawns its process at once. Idempotent; `submit` calls it."""
        with self._lock:
            if self._closed:
                raise RuntimeError("MediaPool is closed")
            if self._threads:
                return
            for i in range(self.workers):
                t = threading.Thread(target=self._slot_loop, name=f"media-worker-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def submit(self, fn_name: str, *args: Any, **kwargs: Any) -> Future:
        """Queue `stages.media.image.<fn_name>(*args, **kwargs)`; the Future gets its result or a MediaError."""
        if fn_name not in WORKER_FUNCTIONS and fn_name not in self.extra_functions:
            raise ValueError(f"{fn_name!r} is not a media worker function (see stages.media.image.WORKER_FUNCTIONS)")
        self.start()
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("MediaPool is closed")
            self._queue.put(_Task(next(self._ids), fn_name, args, kwargs, future))
        return future

    def run(self, fn_name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Blocking `submit`. `timeout` bounds the wait (queue + run); past it -> media_timeout."""
        future = self.submit(fn_name, *args, **kwargs)
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            future.cancel()  # only takes effect while still queued; a running task keeps its own limits
            raise MediaError("media_timeout", f"{fn_name} did not finish within timeout={timeout} s") from None

    def close(self) -> None:
        """Cancel queued tasks, let running ones finish (bounded by their limits), stop the workers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:
                try:
                    task = self._queue.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task.future.cancel()
            for _ in self._threads:
                self._queue.put(None)
        for t in self._threads:
            t.join()

    def __enter__(self) -> MediaPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one thread per worker ---------------------------------------------------------------

    def _slot_loop(self) -> None:
        worker = self._try_spawn()  # warm before the first task arrives
        while True:
            task = self._queue.get()
            if task is None:
                break
            if not task.future.set_running_or_notify_cancel():
                continue
            started = time.monotonic()
            if self.metrics is not None:
                self.metrics.stage.queue_age.labels(stage=f"media/{task.fn_name}", model="").observe(
                    started - task.enqueued_at)
            error: Exception | None
            value, error, lost = None, None, False
            for attempt in range(2):  # a second attempt only when the task never reached the worker
                try:
                    if worker is None:
                        worker = self._spawn()
                    value = self._execute(worker, task)
                except _WorkerLost as e:
                    assert worker is not None  # only _execute raises _WorkerLost
                    error, lost = e.error, True
                    if not e.delivered and attempt == 0:  # an idle worker died: the task is untouched, run it anew
                        self._stop(worker, kill=True)
                        worker, error, lost = None, None, False
                        with self._lock:
                            self.workers_replaced += 1
                        continue
                except Exception as e:  # the function's own error, a spawn failure, or unpicklable arguments
                    error = e
                break
            if lost:
                assert worker is not None  # lost: _execute raised _WorkerLost on it
                self._stop(worker, kill=True)
                worker = None
            self._finish(task, started, value, error, lost)
            if lost:
                worker = self._try_spawn()  # after resolving the future: the caller need not wait for it
        if worker is not None:
            self._stop(worker, kill=False)

    def _execute(self, worker: _Worker, task: _Task) -> Any:
        """Run one task on `worker`; raises _WorkerLost when the worker died, hung or broke the pipe."""
        name = task.fn_name
        request = _Request(task.task_id, name, task.args, task.kwargs, self.task_cpu_s)
        payload = ForkingPickler.dumps(request)  # pickling errors are the caller's, and leave the worker usable
        try:
            worker.conn.send_bytes(payload)
        except OSError as e:
            raise _WorkerLost(MediaError("media_worker", f"media worker pipe broke sending {name}: {e}"),
                              delivered=False) from None
        if not wait([worker.conn], timeout=self.task_timeout_s):
            raise _WorkerLost(MediaError("media_timeout", f"{name} ran longer than task_timeout_s="
                                                          f"{self.task_timeout_s} s; the worker was replaced"))
        try:
            reply = worker.conn.recv()
        except (EOFError, OSError):
            raise _WorkerLost(self._death_error(worker, name)) from None
        if not isinstance(reply, _Reply) or reply.task_id != task.task_id:  # out of step: never reuse it
            raise _WorkerLost(MediaError("media_worker", f"media worker answered {reply!r} to task {task.task_id}"))
        if reply.error is not None:
            raise reply.error
        return reply.value

    def _death_error(self, worker: _Worker, name: str) -> MediaError:
        try:
            code = worker.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return MediaError("media_worker", f"media worker closed its pipe while running {name}")
        if code == -signal.SIGXCPU:
            return MediaError("media_timeout", f"{name} used more than task_cpu_s={self.task_cpu_s} CPU seconds")
        if code == -signal.SIGKILL:  # nothing in the worker sends it: an operator, or the system out of memory
            return MediaError("media_worker_lost", f"the media worker running {name} was killed (SIGKILL, from "
                                                   f"outside the server); it was replaced: retry")
        return MediaError("media_worker",
                          f"media worker died ({_exit_reason(code)}) while running {name}; it was replaced")

    def _finish(self, task: _Task, started: float, value: Any, error: BaseException | None, lost: bool) -> None:
        if self.metrics is not None:
            m = self.metrics
            m.stage.run_time.labels(stage=f"media/{task.fn_name}", model="").observe(time.monotonic() - started)
            outcome = "ok" if error is None else getattr(error, "code", type(error).__name__)
            m.media.tasks.labels(function=task.fn_name, outcome=outcome).inc()
            if task.args and isinstance(task.args[0], (bytes, bytearray)):
                m.media.input_bytes.labels(function=task.fn_name).inc(len(task.args[0]))
        with self._lock:
            self.tasks_done += 1
            self.tasks_failed += error is not None
            self.workers_replaced += lost
        if error is None:
            task.future.set_result(value)
        else:
            task.future.set_exception(error)

    # -- worker processes --------------------------------------------------------------------

    def _try_spawn(self) -> _Worker | None:
        try:
            return self._spawn()
        except MediaError as e:
            log.warning("%s; will retry when the next task arrives", e)
            return None  # retried, and reported to that task, when the next task needs a worker

    def _spawn(self) -> _Worker:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # what spawn would pass: the parent's path
        env["CUDA_VISIBLE_DEVICES"] = ""  # a codec never needs a GPU
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = "1"  # parallelism comes from the worker count; thread pools only eat address space
        cmd = [sys.executable, "-c", _WORKER_CMD, str(child_sock.fileno()), str(self.task_memory_mb),
               json.dumps(self.extra_functions)]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(child_sock.fileno(),), env=env, stdin=subprocess.DEVNULL)
        except OSError as e:
            parent_sock.close()
            raise MediaError("media_worker", f"could not start a media worker: {e}") from None
        finally:
            child_sock.close()  # the child holds its copy; ours would hide its death (no EOF)
        worker = _Worker(proc, Connection(parent_sock.detach()))
        ready = None
        try:
            if wait([worker.conn], timeout=_STARTUP_TIMEOUT_S):
                ready = worker.conn.recv()
        except (EOFError, OSError):
            pass
        if not isinstance(ready, _Ready):
            self._stop(worker, kill=True)
            raise MediaError("media_worker", f"media worker did not start within {_STARTUP_TIMEOUT_S} s "
                                             f"(exit code {proc.poll()}); see its stderr")
        if self.task_memory_mb and ready.baseline_mb + 64 > self.task_memory_mb:
            self._stop(worker, kill=True)
            raise MediaError("media_worker", f"task_memory_mb={self.task_memory_mb} leaves no room: a worker "
                                             f"maps {ready.baseline_mb:.0f} MB before any task; raise it")
        return worker

    @staticmethod
    def _stop(worker: _Worker, kill: bool) -> None:
        if not kill:
            try:
                worker.conn.send(None)  # asks the loop to return
                worker.proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait()
        worker.conn.close()


def _exit_reason(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:  # a real-time signal has no name
        return f"signal {-code}"


class _WorkerLost(Exception):
    """The worker cannot be trusted with another task; `error` is what the task reports. `delivered` False: the
    worker was gone before the task was sent (a pipe that broke while it sat idle), so the task never ran."""

    def __init__(self, error: MediaError, *, delivered: bool = True):
        super().__init__(error)
        self.error = error
        self.delivered = delivered


# -- inside the child ---------------------------------------------------------------------------

def _worker_main(fd: int, memory_mb: int, extra_functions_json: str = "{}") -> None:
    """Serve requests on `fd` until the parent says stop or goes away; run only WORKER_FUNCTIONS and the
    extra functions (a JSON object, name -> module) the parent started this worker with."""
    import stages.media.image as media

    extra_functions = json.loads(extra_functions_json)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server; it stops us via the pipe
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU/SIGSEGV must not leave core files
    if memory_mb:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = memory_mb * _MB if hard == resource.RLIM_INFINITY else min(memory_mb * _MB, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    conn = Connection(fd)
    conn.send(_Ready(os.getpid(), _mapped_mb()))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return  # the parent is gone
        if request is None:
            return
        _set_cpu_budget(request.cpu_s)
        try:
            function = media.worker_function(request.fn_name, extra_functions)
            if function is None:
                raise MediaError("media_worker", f"{request.fn_name!r} is not a media worker function")
            value = function(*request.args, **request.kwargs)
            reply = _Reply(request.task_id, value)
        except MemoryError:
            reply = _Reply(request.task_id, error=MediaError(
                "media_worker", f"{request.fn_name} ran out of memory: the worker limit is task_memory_mb={memory_mb}"))
        except Exception as e:  # the function's error goes to the caller, whatever it is
            reply = _Reply(request.task_id, error=e)
        try:
            conn.send(reply)
        except Exception as e:  # an unpicklable or too-large (MemoryError) result
            conn.send(_Reply(request.task_id, error=MediaError(
                "media_worker", f"{request.fn_name}'s result could not be sent back: {type(e).__name__}: {e}")))


def _set_cpu_budget(cpu_s: float) -> None:
    # RLIMIT_CPU counts the whole process lifetime, so the budget is "used so far + this task".
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_s)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _mapped_mb() -> float:
    try:
        with open("/proc/self/statm") as f:  # Linux; first field: total program size in pages
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") / _MB
    except OSError:
        return 0.0
