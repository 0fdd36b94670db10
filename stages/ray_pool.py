"""The ray backend's StagePool: each replica is a Ray actor that loads and runs the stage (stages/ray_replica.py).

The pool in the API process keeps what the local one keeps: the bounded queue, admission (`has_room`), routing (each
item goes to one replica when it is queued: least loaded, sticky for a session, prefix-affine for the LLM), and
the request's events. Per replica, a feeder thread sends queued items to the actor (as many as one batch window or
one step loop holds, so the rest stay here, where a lost replica's items can be routed again) and tells it which
of them stopped (cancelled or fenced: dropped at the actor's next step boundary; the actor knows the deadline
itself); a drain thread reads the actor's stream of messages (stage_started, progress, deltas, outputs, run
times) and hands them to the executor as a local worker would. Tensors travel inside the messages, through
Ray's object store; a replica's edge series (mmserve_edge_transfer_*) time the submit call that serializes them and
count their tensor bytes.

A replica whose process dies (kill -9) fails only its items that had started, with a retryable error
(ErrorKind.UNAVAILABLE: 503 with Retry-After); its items that had not started go to the other replicas. Ray
restarts the actor (`max_restarts`), which loads its stage again; it is warmed with the first item it ever ran
(the model's warm-up) before it takes work again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stages.events import ErrorKind, EventKind, StageError
from stages.metrics import Metrics
from stages.placement import tensor_bytes
from stages.pool import DoneFn, DropFn, PoolConfig, StagePool
from stages.ray_replica import Packet, ReplicaInfo, ReplicaMessage, ReplicaWorker
from stages.remote_series import SeriesSink
from stages.stage import LoopStage, Stage, WorkItem
from stages.thread_budget import ThreadBudget

log = logging.getLogger(__name__)

DOWN = 10**9  # a lost replica's load: nothing is routed to it while another is live
# A request that closes (cancelled, failed) wakes the feeders at once (RequestState.on_close); a fenced one (a voice
# session's epoch passed) is found by looking this often among a replica's items. Looking every 5 ms instead cost
# ~0.7 ms per streamed token on 2 cores (examples/bench_distributed.py).
STOP_POLL_S = 0.05


@dataclass(frozen=True)
class ActorPlan:
    """How a ray-backend pool makes its replicas' actors."""

    # replica index -> what its actor runs to load the stage (it writes its series to the Metrics given)
    load: Callable[[int], Callable[[Metrics], Stage]]
    max_restarts: int = 4  # Ray restarts a dead replica's actor this many times
    ranks: int = 1  # processes of one replica (a parallel denoise replica's): its actor asks for that many times
    start_timeout_s: float = 900.0  # every actor has loaded its stage within this (else start-up fails)


def _where() -> tuple[str, str]:
    """(Ray node id, node address) of the calling actor."""
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


class RayStagePool(StagePool):
    labels_replicas_now = False  # the replicas' nodes are known once their actors run

    def __init__(self, name: str, stage: Stage | Sequence[Stage], config: PoolConfig, metrics: Metrics,
                 on_done: DoneFn, on_drop: DropFn, budget: ThreadBudget | None = None, *, plan: ActorPlan):
        """`stage`: the API process's copy (it answers batch keys and affinity; the actors run their own)."""
        super().__init__(name, stage, config, metrics, on_done, on_drop, None)
        self.placed = True  # every item is routed to one replica's actor when it is queued
        self._plan = plan
        n = config.replicas
        self.nodes: list[ReplicaInfo | None] = [None] * n  # where each replica's actor runs now
        self._actors: list[Any] = []
        self._live = [False] * n
        self._sent: list[dict[int, WorkItem]] = [{} for _ in range(n)]  # token -> item, in the actor's hands
        self._running: set[int] = set()  # tokens whose stage_started came back: lost with their replica
        self._stop_sent: set[int] = set()
        self._warm: list[Packet | None] = [None] * n  # the first item each replica ran: it warms a restart
        self._warming: list[int | None] = [None] * n  # the token of a restarted replica's warm-up
        self._tokens = itertools.count()
        self._sink = SeriesSink(metrics.registry)  # the actors' stage series, carried here
        loop = isinstance(self.stage, LoopStage)
        # Items an actor holds: one step loop's worth, or a batch running and the next one gathering.
        self._capacity = self._loop_capacity() if loop else 2 * config.max_batch_size

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the replicas' actors (each loads its stage now); `wait_started` waits for them."""
        import ray

        actor_class = ray.remote(ReplicaWorker)
        self._actors = [self._new_actor(actor_class, r) for r in range(self.config.replicas)]

    def wait_started(self) -> None:
        """Block until every replica's actor has loaded its stage, then take work. A RuntimeError names the pool
        when one failed to load or could not be placed in time."""
        import ray

        try:
            infos = ray.get([a.info.remote() for a in self._actors], timeout=self._plan.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"pool {self.name}: its replicas' actors did not start within "
                               f"{self._plan.start_timeout_s:.0f} s (does the cluster have the resources it asks "
                               f"for free: {self._options()}?)") from None
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"pool {self.name}: a replica's actor failed to load its stage: {exc}") from None
        self.nodes = list(infos)
        self._m_replica = self._replica_series([i.node_id for i in infos])
        self._live = [True] * self.config.replicas
        for r in range(self.config.replicas):
            for target, what in ((self._feed, "feed"), (self._drain, "drain")):
                t = threading.Thread(target=target, args=(r,), name=f"{self.name}-{r}-{what}", daemon=True)
                t.start()
                self._threads.append(t)

    def _options(self) -> dict[str, Any]:
        ranks = self._plan.ranks
        return dict(num_cpus=(self.config.threads or 1) * ranks, num_gpus=self.config.num_gpus * ranks,
                    resources=dict(self.config.resources))

    def _new_actor(self, actor_class, replica: int):
        # max_concurrency: the events stream holds one thread; submit, stop and info take the others.
        actor = actor_class.options(**self._options(), max_restarts=self._plan.max_restarts, max_concurrency=4)
        return actor.remote(self._plan.load(replica), self.name, self.config, self.config.replicas, _where)

    def stop(self, timeout: float = 10.0) -> None:
        import ray

        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for actor in self._actors:
            try:
                ray.get(actor.close.remote(), timeout=timeout)
            except ray.exceptions.RayError:
                pass
            ray.kill(actor, no_restart=True)
        for t in self._threads:
            t.join(timeout)
        with self._cond:
            left = [item for sent in self._sent for item in sent.values()]
            self._sent = [{} for _ in self._sent]
        for item in left:
            self._drop(item, StageError("shutting_down", "the server is shutting down", kind=ErrorKind.UNAVAILABLE))

    def live_replicas(self) -> int:
        with self._cond:
            return sum(self._live)

    def usage(self, replica: int, timeout: float = 30.0) -> dict[str, int]:
        """What replica `replica`'s stage holds now (Stage.usage, and its items), asked of its actor."""
        import ray

        return ray.get(self._actors[replica].usage.remote(), timeout=timeout)

    def replica_pid(self, replica: int) -> int | None:
        info = self.nodes[replica]
        return None if info is None else info.pid

    # -- routing ------------------------------------------------------------------------
    def put(self, item: WorkItem) -> None:
        item.enqueued_at = time.monotonic()
        with self._cond:
            item.replica = self._route(item)
            self._queue.append(item)
            self._m_depth.set(len(self._queue))
            self._cond.notify_all()

    def _route(self, item: WorkItem) -> int | None:
        """A replica for `item` among the live ones (caller holds the lock); None while none is: the first back."""
        if not any(self._live):
            return None
        loads = [self._load(r) if self._live[r] else DOWN for r in range(self.config.replicas)]
        affinity = self.stage.affinity(item)
        if affinity is None:
            return self._router.pick(loads)
        return self._router.pick(loads, affinity.key, sticky=affinity.sticky)

    # -- feeding a replica --------------------------------------------------------------
    def _feed(self, r: int) -> None:
        while True:
            with self._cond:
                while True:
                    self._purge_stopped()
                    if self._stopping:
                        return
                    stops = [t for t, item in self._sent[r].items()
                             if t not in self._stop_sent and item.request.should_stop()]
                    if stops or self._live[r] and self._has_work(r) and len(self._sent[r]) < self._capacity:
                        break
                    self._cond.wait(STOP_POLL_S if self._sent[r] else None)
                self._stop_sent.update(stops)
                taken: list[tuple[int, WorkItem]] = []
                while self._live[r] and self._has_work(r) and len(self._sent[r]) < self._capacity:
                    token, item = next(self._tokens), self._popleft(r)
                    self._sent[r][token] = item
                    taken.append((token, item))
                self._active[r] = len(self._sent[r])
                self._m_depth.set(len(self._queue))
                actor = self._actors[r]
            if stops:
                actor.stop.remote(stops)
            if taken:
                packets = [self._packet(token, item) for token, item in taken]
                if self._warm[r] is None:
                    self._warm[r] = packets[0]
                started = time.perf_counter()
                actor.submit.remote(packets)  # serializes them (tensors into the object store) before it returns
                self._m_replica[r]["transfer_time"].observe(time.perf_counter() - started)
                self._m_replica[r]["transfer_bytes"].inc(sum(tensor_bytes(p.inputs) for p in packets))
                for _, item in taken:  # its request's end (a cancel) sends the stop now, not at the next look
                    item.request.on_close(self.wake)

    def _packet(self, token: int, item: WorkItem) -> Packet:
        deadline = item.request.deadline
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return Packet(token, item.request_id, item.request.model, item.node, item.inputs, item.piece, left,
                      traced=item.trace is not None)

    # -- what comes back ----------------------------------------------------------------
    def _drain(self, r: int) -> None:
        import ray

        while True:
            try:
                for ref in self._actors[r].events.remote():
                    for message in ray.get(ref):
                        self._handle(r, message)
                return  # the stream ended: the actor closed (the pool stops)
            except ray.exceptions.RayError as exc:
                if self._stopping:
                    return
                self._lost(r, exc)
                if not self._recover(r):
                    return

    def _handle(self, r: int, m: ReplicaMessage) -> None:
        if m.what == "series":
            self._sink.apply(r, m.data["changes"])
            return
        if m.what == "run":
            self._m_run.observe(m.data["seconds"])
            self._m_batch.observe(m.data["items"])
            self._m_replica[r]["run_time"].observe(m.data["seconds"])
            self._m_replica[r]["batch_size"].observe(m.data["items"])
            return
        with self._cond:
            item = self._sent[r].get(m.token)
            if m.what != "event" and item is not None:
                del self._sent[r][m.token]
                self._running.discard(m.token)
                self._stop_sent.discard(m.token)
                self._active[r] = len(self._sent[r])
                self._cond.notify_all()
            elif m.what == "event" and m.kind is EventKind.STAGE_STARTED:
                self._running.add(m.token)
        if item is None:
            if m.what != "event" and m.token == self._warming[r]:
                self._back(r)
            return
        if m.what == "event":
            assert m.kind is not None
            if m.kind is EventKind.STAGE_STARTED:
                waited = time.monotonic() - item.enqueued_at
                self._m_queue_age.observe(waited)
                self._m_replica[r]["items"].inc()
                self._m_replica[r]["queue_age"].observe(waited)
                if item.trace is not None:
                    item.trace.queue_wait_s = waited
            item.emit(m.kind, **m.data)
            return
        if m.trace is not None and item.trace is not None:  # the replica's facts; its batch ids are its own
            batch_id = m.trace["batch_id"] and f"{m.trace['batch_id']}@replica{r}"
            item.trace.took({**m.trace, "batch_id": batch_id})
        if m.what == "done":
            self._finish(item, m.data)
        else:
            error = None if m.error is None else StageError(m.error["code"], m.error["message"],
                                                            param=m.error["param"], kind=ErrorKind(m.error["kind"]))
            self._drop(item, error)

    # -- a lost replica -----------------------------------------------------------------
    def _lost(self, r: int, exc: Exception) -> None:
        """Fail the items that had started there (retryable); route the others, and its queued ones, again."""
        self._sink.drop(r)
        with self._cond:
            self._live[r] = False
            self._m_replica[r]["live"].set(0)
            sent, self._sent[r] = self._sent[r], {}
            self._active[r] = 0
            started = [item for token, item in sent.items() if token in self._running]
            again = [item for token, item in sent.items() if token not in self._running]
            self._running.difference_update(sent)
            self._stop_sent.difference_update(sent)
            self._queue.extendleft(reversed(again))  # they were queued first: they keep their place
            for item in self._queue:  # `again` included: they were routed to r
                if item.replica == r:
                    item.replica = self._route(item)
            self._m_depth.set(len(self._queue))
            self._cond.notify_all()
        log.warning("pool %s: replica %d was lost (%s): %d item(s) in flight failed, %d routed again", self.name, r,
                    type(exc).__name__, len(started), len(again))
        error = StageError("replica_lost", f"a replica of {self.name} was lost while it ran this request (its process "
                           f"ended); it is being restarted: retry", kind=ErrorKind.UNAVAILABLE)
        for item in started:
            self._drop(item, error)

    def _recover(self, r: int) -> bool:
        """Wait for Ray to restart the replica's actor, then warm it; False when it is gone for good."""
        import ray

        while not self._stopping:
            try:
                self.nodes[r] = ray.get(self._actors[r].info.remote(), timeout=10)
                break
            except ray.exceptions.ActorDiedError as exc:  # max_restarts spent (or killed with no_restart)
                if not self._stopping:
                    log.error("pool %s: replica %d is gone for good: %s", self.name, r, exc)
                return False
            except ray.exceptions.RayError:  # restarting: its stage is loading again
                time.sleep(0.2)
        if self._stopping:
            return False
        warm = self._warm[r]
        if warm is None:
            self._back(r)
        else:
            token = next(self._tokens)
            self._warming[r] = token
            self._actors[r].submit.remote([dataclasses.replace(warm, token=token, deadline_in_s=None)])
        return True

    def _back(self, r: int) -> None:
        with self._cond:
            self._warming[r] = None
            self._live[r] = True
            self._m_replica[r]["live"].set(1)
            for item in self._queue:  # items that waited while no replica was live
                if item.replica is None:
                    item.replica = self._route(item)
            self._cond.notify_all()
        log.info("pool %s: replica %d is back", self.name, r)
