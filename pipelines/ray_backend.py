"""The `ray` backend: a model's stage pools as Ray actors, on this machine or a cluster (DESIGN §3).

`RayCluster.connect` joins the cluster ([engine] ray_address, or a local Ray instance it starts) and checks every
pool's Ray resources against the cluster's nodes, before any model loads; an address that does not answer, a
resource no node has, or more GPUs than a node has is a ValueError naming the config key. `add_pools` then gives
each model stage a RayStagePool (stages/ray_pool.py) whose actors load the model from its config themselves
(`StageLoader`). Media stages stay in the API process: they already run in worker processes of their own.

`ray` is an optional extra (`pip install "mmserve[ray]"`); nothing imports it unless backend = "ray".
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import socket
from dataclasses import dataclass
from typing import Any

from encoders.cache import EncoderCache
from pipelines.config import EngineConfig, MediaConfig, ModelSpec, ParallelConfig
from pipelines.image_request import ImageLimits
from stages.executor import GraphExecutor
from stages.metrics import Metrics
from stages.pool import PoolConfig
from stages.ray_pool import ActorPlan, RayStagePool
from stages.stage import Stage
from stages.thread_budget import one_thread

log = logging.getLogger(__name__)

NAMESPACE = "mmserve"  # the Ray namespace of the server's actors


def _no_media():
    raise RuntimeError("media workers run in the API process, not in a replica's actor")


@dataclass(frozen=True)
class StageLoader:
    """What a replica's actor runs to load its stage: the served model from its config, on the replica's device.

    The whole model loads (a denoise replica's copy holds a text encoder it never runs), as a placed local replica
    does (pipelines/replicas.py); the stage's code is the local backend's."""

    spec: ModelSpec  # with the replica's device
    family: str
    kind: str  # which of the served model's stages
    random_weights: bool
    limits: ImageLimits
    media: MediaConfig
    prompt_cache_mb: int
    encoder_cache_mb: int
    rank_devices: tuple[str, ...] = ()  # a parallel denoise replica: its ranks' devices as the actor sees them

    def __call__(self, metrics: Metrics) -> Stage:
        """The stage, writing its series to `metrics` (the actor carries them to the API process)."""
        from pipelines.registry import served_class
        from pipelines.served import LoadContext

        spec = self.spec
        if self.rank_devices:  # (built here, where those devices exist)
            denoise = dataclasses.replace(spec.pools.get("denoise", PoolConfig()), devices=self.rank_devices,
                                          replicas=len(self.rank_devices), resources=(), num_gpus=0.0)
            spec = dataclasses.replace(spec, device=self.rank_devices[0], pools={**spec.pools, "denoise": denoise})

        context = LoadContext(metrics, EncoderCache("prompt_embedding", self.prompt_cache_mb << 20),
                              EncoderCache("encoder_output", self.encoder_cache_mb << 20), self.limits, _no_media,
                              self.media)
        with one_thread():  # as the engine loads (thread_budget.one_thread)
            served = served_class(self.family)(spec, self.family, context, self.random_weights)
        for kind, stage, _ in served.stages():
            if kind == self.kind:
                return stage
        raise ValueError(f"model {self.spec.name} has no {self.kind} stage")


@dataclass(frozen=True)
class ReplicaLoaders:
    """Replica index -> its StageLoader. Its device: with `num_gpus`, the GPU Ray gave its actor; else
    `devices[index]`, else the model's `device`."""

    base: StageLoader
    config: PoolConfig

    def __call__(self, replica: int) -> StageLoader:
        spec = self.base.spec
        device = self.config.devices[replica] if self.config.devices else spec.device
        if self.config.num_gpus:
            device = "cuda:0"  # the GPU Ray gave the actor is the only one it sees (CUDA_VISIBLE_DEVICES)
        if self.base.kind != "denoise" or spec.parallel.world == 1:  # only the denoise actor runs the ranks
            return dataclasses.replace(self.base, spec=dataclasses.replace(spec, device=device,
                                                                           parallel=ParallelConfig()))
        # A parallel replica: its actor holds every rank's GPU (cuda:0.. as it sees them) or runs CPU ranks; the
        # ranks are its child processes, so they share its node (what a STRICT_PACK placement group would give).
        ranks = tuple(f"cuda:{r}" for r in range(spec.parallel.world)) if self.config.num_gpus else \
            spec.denoise_devices
        return dataclasses.replace(self.base, rank_devices=ranks)


class RayCluster:
    """The engine's connection to Ray, and the pools it places there."""

    def __init__(self, config: EngineConfig, nodes: list[dict[str, Any]], started_here: bool):
        self.config = config
        self.nodes = nodes  # ray.nodes() at connect time: the live ones
        self._started_here = started_here

    @classmethod
    def connect(cls, config: EngineConfig) -> RayCluster:
        """Join the cluster at [engine] ray_address (None: start a local Ray instance) and check every pool's
        resources against its nodes. ValueErrors name the config key; nothing is loaded yet."""
        if config.ray_address is not None:
            _check_answers(config.ray_address)
        try:
            import ray
        except ImportError:
            raise ValueError("engine.backend = 'ray' needs the ray package: pip install 'mmserve[ray]'") from None
        started_here = not ray.is_initialized()
        if started_here:
            if config.ray_address is None:
                ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=True)
            else:
                ray.init(address=config.ray_address, namespace=NAMESPACE, log_to_driver=True)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        check_resources(config.models, nodes)
        log.info("ray backend: %d node(s) at %s", len(nodes), sorted({n["NodeManagerAddress"] for n in nodes}))
        return cls(config, nodes, started_here)

    def add_pools(self, executor: GraphExecutor, spec: ModelSpec, family: str, served: Any,
                  random_weights: bool) -> None:
        """A RayStagePool for each model stage of `served` (its actors load their own copy), started; media stages
        local. Needs a started executor (its pools start as they are added)."""
        c = self.config
        pools: list[RayStagePool] = []
        for kind, stage, default in served.stages():
            config = spec.pool(kind, default)
            name = f"{spec.name}/{kind}"
            if not stage.torch_threads:  # media stages: the API process's media workers run them
                executor.add_pool(name, stage, config)
                continue
            base = StageLoader(spec, family, kind, random_weights, c.limits, c.media, c.prompt_cache_mb,
                               c.encoder_cache_mb)
            plan = ActorPlan(ReplicaLoaders(base, config), ranks=spec.ranks(kind))
            pool = executor.add_pool(name, stage, config, pool_class=functools.partial(RayStagePool, plan=plan))
            assert isinstance(pool, RayStagePool)
            pools.append(pool)
        for pool in pools:  # the actors of all the model's pools load side by side
            pool.wait_started()

    def close(self) -> None:
        if self._started_here:
            import ray

            ray.shutdown()


def _check_answers(address: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as exc:
        raise ValueError(f"engine.ray_address: nothing answers at {address} ({exc.strerror or exc}); start the "
                         f"head with `ray start --head --port {port}` or fix the address") from None


def check_resources(models: tuple[ModelSpec, ...], nodes: list[dict[str, Any]]) -> None:
    """Every configured pool's resources and GPUs fit on at least one node (one replica's actor on one node)."""
    have: dict[str, float] = {}  # resource -> the most one node has
    for node in nodes:
        for key, amount in node.get("Resources", {}).items():
            have[key] = max(have.get(key, 0.0), amount)
    custom = sorted(k for k in have if not k.startswith("node:") and k not in ("CPU", "GPU", "memory",
                                                                                 "object_store_memory"))
    for spec in models:
        for kind, pool in spec.pools.items():
            where = f"model {spec.name}: pools.{kind}"
            for key, amount in pool.resources:
                if key not in have:
                    raise ValueError(f"{where}.resources: no Ray node has a resource {key!r}; the cluster's custom "
                                     f"resources: {custom} (a node gets one with ray start --resources)")
                if amount > have[key]:
                    raise ValueError(f"{where}.resources: {key} = {amount:g} is more than any node has "
                                     f"({have[key]:g})")
            ranks = spec.ranks(kind)  # a parallel replica's ranks all sit on its actor's node
            if pool.num_gpus * ranks > have.get("GPU", 0.0):
                raise ValueError(f"{where}.num_gpus: {pool.num_gpus * ranks:g} GPUs for one replica ({ranks} ranks), "
                                 f"but the most one Ray node has is {have.get('GPU', 0.0):g}")
            threads = (pool.threads or 1) * ranks
            if threads > have.get("CPU", 0.0):
                raise ValueError(f"{where}.threads: each replica asks Ray for {threads} CPUs; the most one node has "
                                 f"is {have.get('CPU', 0.0):g} (ray start --num-cpus)")
