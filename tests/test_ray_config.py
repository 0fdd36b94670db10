"""Choosing the ray backend (no Ray needed here): config keys and their errors, the CLI flags, /ready's degraded
answer, the retryable error's Retry-After, and that the default backend never imports ray."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelines.config import EngineConfig, ModelSpec, ParallelConfig
from serve.config import load_config
from stages.pool import PoolConfig


def test_toml_selects_ray_and_places_pools(tmp_path):
    (tmp_path / "m.toml").write_text('''
[engine]
backend = "ray"
ray_address = "127.0.0.1:6379"

[[models]]
name = "m"
path = "/nowhere"
family = "sd"
[models.pools.denoise]
resources = {node_b = 1}
num_gpus = 0.5
''')
    engine = load_config(tmp_path / "m.toml").engine
    assert engine.backend == "ray" and engine.ray_address == "127.0.0.1:6379"
    pool = engine.models[0].pools["denoise"]
    assert pool.resources == (("node_b", 1.0),) and pool.num_gpus == 0.5


@pytest.mark.parametrize("kwargs, message", [
    (dict(backend="slurm"), "engine.backend must be 'local' or 'ray'"),
    (dict(ray_address="127.0.0.1:6379"), "engine.ray_address is for backend = 'ray'"),
    (dict(backend="ray", ray_address="localhost"), "engine.ray_address must be HOST:PORT"),
    (dict(models=(ModelSpec("m", "/x", pools={"denoise": PoolConfig(resources={"node_b": 1})}),)),
     "model m: pools.denoise.resources places a pool on Ray; it needs engine.backend = 'ray'"),
])
def test_bad_backend_config_names_the_key(kwargs, message):
    with pytest.raises(ValueError) as info:
        EngineConfig(**{"models": (), **kwargs})
    assert message in str(info.value)


@pytest.mark.parametrize("table, message", [
    ({"resources": {"node_b": 0}}, "resources must map resource names to amounts > 0"),
    ({"resources": ["node_b"]}, "resources must map resource names to amounts"),
    ({"num_gpus": -1}, "num_gpus must be a number >= 0"),
])
def test_bad_pool_resources_name_the_key(table, message):
    from serve.config import _model

    with pytest.raises(ValueError, match="pools.denoise") as info:
        _model({"name": "m", "path": "/nowhere", "family": "sd", "pools": {"denoise": table}}, 0, Path("."))
    assert message in str(info.value)


def test_cli_flags_choose_the_backend():
    from serve.cli import _parser, _with_backend

    config = EngineConfig(models=())
    args = _parser().parse_args(["serve", "--ray-address", "10.0.0.1:6379"])
    chosen = _with_backend(config, args.backend, args.ray_address)
    assert chosen.backend == "ray" and chosen.ray_address == "10.0.0.1:6379"
    local = _with_backend(config, "ray", None)
    assert local.backend == "ray" and local.ray_address is None  # a local Ray instance
    assert _with_backend(config, None, None) is config


def _ready(health):
    from serve.routes.system import ready

    engine = SimpleNamespace(ready=True, models={"m": None, "n": None}, health=lambda: health, load_error=None)
    state = SimpleNamespace(engine=engine, drain=SimpleNamespace(draining=False))  # not draining (serve/drain.py)
    response = asyncio.run(ready(SimpleNamespace(app=SimpleNamespace(state=state))))
    return response.status_code, json.loads(response.body)


def test_ready_says_degraded_while_a_replica_restarts():
    assert _ready({"m": "ok", "n": "ok"}) == (200, {"ready": True, "status": "ok", "models": ["m", "n"]})
    assert _ready({"m": "degraded", "n": "ok"})[1]["status"] == "degraded"
    status, body = _ready({"m": "down", "n": "degraded"})
    assert status == 503 and body["status"] == "down" and body["down"] == ["m"]


def test_a_lost_replica_is_503_with_retry_after():
    from serve.errors import error_response, stage_error_parts
    from stages.events import ErrorKind, StageError

    error = StageError("replica_lost", "a replica was lost", kind=ErrorKind.UNAVAILABLE)
    response = error_response(**stage_error_parts(error))
    assert response.status_code == 503 and response.headers["Retry-After"] == "5"


def test_the_local_backend_never_imports_ray():
    code = ("import sys, serve.cli, serve.app, pipelines.engine, pipelines.served; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent, timeout=120)


def test_a_parallel_replica_asks_for_every_rank_on_one_node():
    """Its ranks are its actor's child processes: one node must hold all their GPUs and CPUs."""
    from pipelines.ray_backend import check_resources

    spec = ModelSpec("m", "/x", parallel=ParallelConfig(cfg=2, ulysses=2),
                     pools={"denoise": PoolConfig(num_gpus=1, threads=1)})
    nodes = [{"Resources": {"CPU": 8.0, "GPU": 2.0}}, {"Resources": {"CPU": 8.0, "GPU": 2.0}}]
    with pytest.raises(ValueError, match=r"pools.denoise.num_gpus: 4 GPUs for one replica \(4 ranks\), but the most "
                                         r"one Ray node has is 2"):
        check_resources((spec,), nodes)
    check_resources((spec,), [{"Resources": {"CPU": 8.0, "GPU": 4.0}}])  # fits on one node
