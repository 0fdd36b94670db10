"""A multi-rank denoiser replica: the denoise stage's worker is rank 0, and ranks 1..N-1 are processes of their own,
each with the denoiser loaded on its device, that run the parts of a forward rank 0 hands them (DESIGN §3).

Rank 0 keeps everything a one-device replica does: the pool's queue, step-level batching, the commit (guidance and
scheduler step), events, cancellation and deadlines at step boundaries. Per forward it broadcasts one header (which
denoiser, the tensors' names, shapes and dtypes, as a pickled byte tensor) and the tensors of the part each other
rank runs, runs its own part meanwhile, and receives each rank's output and its compute time. The collectives go
through a torch.distributed process group of the replica's own (gloo on the CPU, NCCL on GPUs), not the default
group, so one server may hold several parallel models; rendezvous is a file store and gloo binds loopback only
(GLOO_SOCKET_IFNAME=lo), so nothing listens on the machine's interfaces. Every collective has a bounded timeout: a
rank that dies fails the forward in flight (ErrorKind.UNAVAILABLE, `rank_lost`) and the group starts again, ranks
reloaded, at the next forward.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from stages.events import ErrorKind, StageError
from stages.zygote import Forked, Zygote

log = logging.getLogger(__name__)

HEADER_TAG, OUTPUT_TAG, TIMES_TAG, STATUS_TAG = 1, 2, 3, 4
START_TIMEOUT_S = 600.0  # every rank has loaded its denoiser within this
# Forks every rank of this process's parallel replicas; what any rank imports, imported once.
ZYGOTE = Zygote(preload=("torch", "diffusers", "transformers", "stages.diffusion.ranks"))


@dataclass(frozen=True)
class RankPlan:
    """How a replica's other ranks start: what each runs to load its denoiser, and where."""

    # rank -> a picklable callable that loads, in the rank's process, the object whose `call_denoiser(key, **inputs)`
    # runs one denoiser forward (the model family)
    load: Callable[[int], Callable[[], Any]]
    world: int
    devices: tuple[str, ...]  # one per rank, rank 0's first
    threads: int  # torch threads of each CPU rank
    timeout_s: float = 120.0  # one collective; past it the forward fails and the group restarts
    # What every rank (0 included) runs once loaded, before the group joins: setup(host, rank, store_dir) joins
    # what the host's own parallelism needs (sequence parallel: torch.distributed's world and a device mesh, its
    # rendezvous a file under store_dir). Picklable; None: nothing.
    setup: Callable[[Any, int, str], None] | None = None


def _process_group(store_path: str, rank: int, world: int, device: str, timeout_s: float):
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pairs on loopback, never the machine's interfaces
    store = dist.FileStore(store_path, world)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.startswith("cuda"):
        return dist.ProcessGroupNCCL(store, rank, world, timeout)  # type: ignore[arg-type]  # stubs: Options only
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def _send_object(pg, value: Any, ranks: range, tag: int, device: torch.device) -> None:
    """A small picklable value (a header) to each of `ranks`, as byte tensors on the group's device (NCCL sends
    CUDA tensors only)."""
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    for r in ranks:
        pg.send([size], r, tag).wait()
        pg.send([data], r, tag).wait()


def _recv_object(pg, src: int, tag: int, device: torch.device) -> Any:
    size = torch.empty(1, dtype=torch.int64, device=device)
    pg.recv([size], src, tag).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    pg.recv([data], src, tag).wait()
    return pickle.loads(data.cpu().numpy().tobytes())


def ready(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor whose data is there: a context-parallel output may be a functional collective's result still
    in flight (AsyncCollectiveTensor), whose memory must not be read before it is waited on."""
    wait = getattr(tensor, "wait", None)
    return wait() if callable(wait) else tensor


def rank_main(load: Callable[[], Any], setup: Callable[[Any, int, str], None] | None, rank: int, world: int,
              device: str, threads: int, store_dir: str, timeout_s: float) -> None:
    """The body of rank `rank` > 0: load the denoiser, join the group, then run what rank 0 sends until it says
    stop (or the group breaks: rank 0 is gone). A forward that raises is reported to rank 0, not fatal."""
    torch.set_num_threads(threads)
    host = load()
    if setup is not None:
        setup(host, rank, store_dir)
    pg = _process_group(os.path.join(store_dir, "store"), rank, world, device, timeout_s)
    pg.barrier().wait()  # loaded and joined: rank 0 waits for every rank here
    dev = torch.device(device)
    while True:
        try:
            header = _recv_object(pg, 0, HEADER_TAG, dev)
        except RuntimeError:  # rank 0 closed the group
            return
        if header is None:
            return
        inputs: dict[str, Any] = dict(header["plain"])
        for name, shape, dtype in header["tensors"]:
            tensor = torch.empty(shape, dtype=dtype, device=dev)
            pg.recv([tensor], 0, HEADER_TAG).wait()
            inputs[name] = tensor
        began = time.perf_counter()
        try:
            with torch.inference_mode():
                out = ready(getattr(host, header["method"])(header["key"], **inputs)).contiguous()
            error = None
        except Exception as exc:  # the same inputs fail on every rank alike (a shape a shard cannot split)
            out, error = None, f"{type(exc).__name__}: {exc}"
        notes = getattr(host, "rank_notes", None)  # what the forward tells rank 0 besides its output
        status = {"error": error, "compute": time.perf_counter() - began, "notes": notes() if notes else None,
                  "shape": None if out is None else tuple(out.shape), "dtype": None if out is None else out.dtype}
        sent = time.perf_counter()
        _send_object(pg, status, range(0, 1), STATUS_TAG, dev)
        if out is not None and header["reply"]:
            pg.send([out], 0, OUTPUT_TAG).wait()
        times = torch.tensor([status["compute"], time.perf_counter() - sent], dtype=torch.float64, device=dev)
        pg.send([times], 0, TIMES_TAG).wait()


class RankGroup:
    """Rank 0's side of a multi-rank replica: starts the other ranks (child processes) and runs forwards across
    them. One forward at a time (the replica's one loop worker calls it)."""

    def __init__(self, name: str, plan: RankPlan, observe: Callable[[int, float, float], None] | None = None,
                 host: Any = None):
        """`observe(rank, compute_s, collective_s)` is told each rank's times of every forward; `host` is rank 0's
        (what plan.setup prepares here)."""
        self.name = name
        self.plan = plan
        self.host = host
        self.observe = observe or (lambda rank, compute, collective: None)
        self.notes: dict[int, Any] = {}  # each busy rank's `rank_notes()` after the last forward
        self._procs: list[Forked | subprocess.Popen] = []
        self._pg: Any = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._lock = threading.Lock()

    @property
    def world(self) -> int:
        return self.plan.world

    def start(self) -> None:
        """Start ranks 1..N-1 and join the group with them (blocks until every rank has loaded)."""
        self._dir = tempfile.TemporaryDirectory(prefix="mmserve-ranks-")
        for rank in range(1, self.plan.world):
            # On a CPU a fork of the zygote (stages/zygote.py: the heavy imports done once, so a restart after a
            # lost rank takes no new interpreter); never multiprocessing's spawn, which imports the caller's
            # __main__ again: a user's unguarded script would start a second engine in the rank.
            args = os.path.join(self._dir.name, f"rank{rank}.pickle")
            with open(args, "wb") as f:
                pickle.dump((self.plan.load(rank), self.plan.setup, rank, self.plan.world, self.plan.devices[rank],
                             self.plan.threads, self._dir.name, self.plan.timeout_s), f)
            if any(d.startswith("cuda") for d in self.plan.devices):
                # CUDA and fork do not mix (a driver initialized before the fork fails in the child): a fresh
                # interpreter, whose imports cost little beside a GPU model's load
                self._procs.append(subprocess.Popen([sys.executable, "-m", "stages.diffusion.ranks", args],
                                                    stdin=subprocess.DEVNULL))
            else:
                self._procs.append(ZYGOTE.launch("stages.diffusion.ranks:rank_from_file", args,
                                                 preload=(type(self.plan.load).__module__,)))
        if self.plan.setup is not None:
            self.plan.setup(self.host, 0, self._dir.name)
        self._pg = _process_group(os.path.join(self._dir.name, "store"), 0, self.plan.world, self.plan.devices[0],
                                  START_TIMEOUT_S)
        self._pg.barrier().wait()  # every rank has loaded and joined
        self._pg.set_timeout(datetime.timedelta(seconds=self.plan.timeout_s))
        log.info("%s: %d ranks joined (pids %s)", self.name, self.plan.world, [p.pid for p in self._procs])

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        if self._pg is not None:
            try:
                _send_object(self._pg, None, range(1, self.plan.world), HEADER_TAG, torch.device(self.plan.devices[0]))
            except RuntimeError:
                pass
        self._reap(grace_s=5.0)

    def _reap(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the ranks to exit, kill what still runs, and forget the group."""
        for proc in self._procs:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._procs, self._pg = [], None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def forward(self, key: str, parts: list[dict[str, Any] | None], plain: dict[str, Any],
                local: Callable[[dict[str, Any]], torch.Tensor], replies: set[int] | None = None,
                method: str = "call_denoiser") -> list[torch.Tensor | None]:
        """Run `parts[r]` (tensor inputs of one denoiser call) on rank r, each with the `plain` inputs too; rank
        0's part through `local`; a rank whose part is None sits this one out. Each rank's output in rank order:
        rank 0's, and those of `replies` (None: every rank; the others None). The other ranks call their host's
        `method(key, **inputs)` (the denoiser forward; or a VAE tile's decode). A rank that died or timed out:
        StageError (unavailable, rank_lost), and the group starts again at the next call; a forward that raised on
        the ranks: StageError naming it."""
        with self._lock:
            if self._pg is None:
                self._collective(self.start)
            replies = set(range(1, self.plan.world)) if replies is None else replies
            dev = torch.device(self.plan.devices[0])
            sent = time.perf_counter()
            self._collective(lambda: self._send_parts(method, key, parts, plain, replies, dev))
            collective = time.perf_counter() - sent
            began = time.perf_counter()
            try:
                mine, failed = ready(local({**(parts[0] or {}), **plain})), None
            except Exception as exc:  # the others met the same: their statuses are read before it is raised
                mine, failed = None, exc
            compute = time.perf_counter() - began
            received = time.perf_counter()
            busy = [r for r in range(1, self.plan.world) if parts[r] is not None]
            theirs, times, errors, self.notes = self._collective(lambda: self._receive(busy, replies, dev))
            if failed is not None or errors:
                raise StageError("parallel_forward_failed", f"the parallel denoiser of {self.name} failed: "
                                 f"{failed or errors[0]}", kind=ErrorKind.INTERNAL) from failed
            self.observe(0, compute, collective + time.perf_counter() - received)
            for r, (compute_r, collective_r) in zip(busy, times, strict=True):
                self.observe(r, compute_r, collective_r)
            return [mine, *(theirs.get(r) for r in range(1, self.plan.world))]

    def _collective(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except RuntimeError as exc:  # a collective failed: a rank is gone or stuck (past the timeout)
            log.error("%s: a rank was lost (%s); the ranks start again at the next step", self.name, exc)
            self._kill()
            raise StageError("rank_lost", f"a rank of {self.name}'s parallel denoiser was lost while it ran this "
                             "request; the ranks are restarting: retry", kind=ErrorKind.UNAVAILABLE) from exc

    def _send_parts(self, method: str, key: str, parts: list[dict[str, Any] | None], plain: dict[str, Any],
                    replies: set[int], dev: torch.device) -> None:
        for r in range(1, self.plan.world):
            part = parts[r]
            if part is None:
                continue
            tensors = {name: t.to(dev).contiguous() for name, t in part.items()}
            header = {"method": method, "key": key, "plain": plain, "reply": r in replies,
                      "tensors": [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]}
            _send_object(self._pg, header, range(r, r + 1), HEADER_TAG, dev)
            for t in tensors.values():
                self._pg.send([t], r, HEADER_TAG).wait()

    def _receive(self, busy: list[int], replies: set[int], dev: torch.device
                 ) -> tuple[dict[int, torch.Tensor], list[list[float]], list[str], dict[int, Any]]:
        outputs: dict[int, torch.Tensor] = {}
        times, errors, notes = [], [], {}
        for r in busy:
            status = _recv_object(self._pg, r, STATUS_TAG, dev)
            notes[r] = status["notes"]
            if status["error"] is None and r in replies:
                out = torch.empty(status["shape"], dtype=status["dtype"], device=dev)
                self._pg.recv([out], r, OUTPUT_TAG).wait()
                outputs[r] = out
            elif status["error"] is not None:
                errors.append(f"rank {r}: {status['error']}")
            t = torch.empty(2, dtype=torch.float64, device=dev)
            self._pg.recv([t], r, TIMES_TAG).wait()
            times.append(t.tolist())
        return outputs, times, errors, notes

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        self._reap(grace_s=5.0)


def rank_from_file(path: str) -> None:
    """A rank's process (RankGroup.start): `rank_main` with the arguments pickled in the file at `path`."""
    with open(path, "rb") as f:
        rank_main(*pickle.load(f))


if __name__ == "__main__":
    rank_from_file(sys.argv[1])
