"""Placement on the local backend: a pool's replicas each on their own device with their own copy of the weights
(`cpu` twice stands in for two GPUs), items routed across them, and start-up errors naming the key."""

from pathlib import Path

import numpy as np
import pytest

from pipelines.config import ModelSpec
from pipelines.image_request import ImageRequest
from serve.config import _model
from stages.pool import PoolConfig
from stages.replica_metrics import ReplicaMetrics
from tests.helpers import running_engine


@pytest.fixture(scope="module")
def sd_path(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return str(build_demo_model("sd", tmp_path_factory.mktemp("sd-demo") / "sd"))


def _image(engine, seed):
    request = ImageRequest(prompt="a red cube", width=64, height=64, num_inference_steps=3, seed=seed)
    return engine.submit_image("m", request)


def _items(engine, replica):
    metrics = engine.metrics.part(ReplicaMetrics)
    series = metrics.items.labels(stage="m/denoise", model="m", replica=str(replica), device="cpu", node="local")
    return series._value.get()


def test_two_placed_denoise_replicas_equal_one_and_share_the_load(sd_path):
    with running_engine(sd_path) as plain:
        expected = [_image(plain, seed).result(timeout=300)["pixels"] for seed in range(4)]
    pools = {"denoise": PoolConfig(devices=("cpu", "cpu"), max_batch_size=2),
             "vae_decode": PoolConfig(devices=("cpu",))}
    with running_engine(sd_path, pools=pools) as placed:
        pool = placed.executor.pools["m/denoise"]
        assert pool.config.replicas == 2 and pool.stages[0] is not pool.stages[1]
        # each replica holds its own copy of the weights
        assert pool.stages[0].adapter.pipe.unet is not pool.stages[1].adapter.pipe.unet
        before = [_items(placed, r) for r in (0, 1)]
        handles = [_image(placed, seed) for seed in range(4)]
        got = [h.result(timeout=300)["pixels"] for h in handles]
        for a, b in zip(got, expected):  # float error only: the replicas batch and thread differently
            np.testing.assert_allclose(a, b, atol=1e-4)
        spread = [_items(placed, r) - before[r] for r in (0, 1)]
        assert spread[0] >= 1 and spread[1] >= 1 and sum(spread) == 4
        assert placed.executor.idle()


def test_a_session_sticks_to_one_replica():
    from stages.placement import Router

    router = Router(2)
    first = router.pick([0, 0], "s1", sticky=True)
    busy = [9, 0] if first == 0 else [0, 9]  # its replica is far busier: a session stays anyway
    assert all(router.pick(busy, "s1", sticky=True) == first for _ in range(3))
    # a prefix moves to the least loaded replica once its home holds `slack` more items
    home = router.pick([0, 0], "p")
    assert router.pick([1, 0] if home == 0 else [0, 1], "p") == home
    assert router.pick([9, 0] if home == 0 else [0, 9], "p") != home


@pytest.mark.parametrize("table, message", [
    ({"devices": ["cuda:7"]}, "devices[0]: 'cuda:7' does not exist here"),
    ({"devices": ["nonsense"]}, "devices[0]: 'nonsense' is not a device name"),
    ({"devices": ["cpu"], "replicas": 3}, "replicas = 3 is more replicas than devices"),
])
def test_bad_placement_names_the_key(table, message):
    table = {"name": "m", "path": "/nowhere", "family": "sd", "pools": {"denoise": table}}
    with pytest.raises(ValueError, match="pools.denoise") as info:
        _model(table, 0, Path("."))
    assert message in str(info.value)


def test_spec_keeps_the_devices():
    spec = ModelSpec("m", "/nowhere", pools={"denoise": PoolConfig(devices=("cpu", "cpu"))})
    pool = spec.pool("denoise")
    assert pool.devices == ("cpu", "cpu") and pool.replicas == 2 and pool.device == "cpu"


def test_llm_replicas_route_a_repeated_prefix_to_its_cache(tmp_path):
    from pipelines.chat import ChatRequest, LLMConfig
    from pipelines.demo import build_demo_model
    from stages.llm.params import SamplingParams

    path = str(build_demo_model("llama", tmp_path / "llama"))
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = [list(range(5, 5 + 40)), list(range(60, 60 + 40))]  # two prefixes of several blocks
    config = LLMConfig(kv_cache_mb=8, block_size=4)
    with running_engine(path, family="causal-lm", llm=config) as plain:
        expected = [plain.submit_chat("m", ChatRequest(prompt=p, params=params)).result(timeout=120)["choices"][0]
                    ["token_ids"] for p in prompts]
    pools = {"llm": PoolConfig(devices=("cpu", "cpu"), max_batch_size=4096, max_queue=256)}
    with running_engine(path, family="causal-lm", llm=config, pools=pools) as placed:
        pool = placed.executor.pools["m/llm"]
        homes = None
        for _ in range(3):  # greedy output equals the unplaced model's, and each prefix keeps its replica
            for p, want in zip(prompts, expected):
                got = placed.submit_chat("m", ChatRequest(prompt=p, params=params)).result(timeout=120)
                assert got["choices"][0]["token_ids"] == want
            homes = homes or dict(pool._router._homes)
            assert dict(pool._router._homes) == homes and len(homes) >= 2  # (the warm-up has one too)
        assert placed.executor.idle()


def test_a_realtime_video_session_stays_on_one_replica(sd_path):
    """WS /v1/realtime/video img2img on two placed denoise replicas: two frames of the session are in the engine at
    once (lookahead 2), which least-loaded routing would spread over both; every frame of it runs on one."""
    from pipelines.config import EngineConfig
    from pipelines.engine import Engine
    from tests.test_realtime_video_support import img2img_session_spreads

    pools = {"denoise": PoolConfig(devices=("cpu", "cpu"), max_batch_size=2)}
    engine = Engine(EngineConfig(models=(ModelSpec("m", sd_path, family="sd", pools=pools),)))
    engine.start()
    try:
        for spread, frames in img2img_session_spreads(engine, lambda r: _items(engine, r)):
            assert frames >= 2 and sorted(spread)[0] == 0 and sum(spread) >= frames, spread
    finally:
        engine.shutdown()
