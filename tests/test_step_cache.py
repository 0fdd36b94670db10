"""Step caching through the real families: threshold 0 equals the uncached output bit for bit; a positive
threshold skips steps and stays within the declared PSNR; cached and uncached requests share forwards."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from pipelines.image_request import ImageRequest, RequestError
from pipelines.video import VideoRequest
from serve.errors import http_status
from stages.diffusion.step_cache import (
    BranchCache,
    StepCacheConfig,
    StepCacheParams,
    StepCacheState,
    decide_interval,
    decide_teacache,
    rescale,
)
from stages.events import StageError
from tests.helpers import running_engine

ALLOW = StepCacheConfig(enabled=True)
PSNR_FLOOR_DB = 30.0  # the declared quality budget of the positive thresholds below, vs the uncached output


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def skipped(engine, method: str) -> float:
    return engine.metrics.registry.get_sample_value(
        "mmserve_step_cache_steps_total", {"model": "m", "method": method, "outcome": "skipped"}) or 0.0


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from pipelines.demo import build_demo_model

    root = tmp_path_factory.mktemp("step-cache")
    return {f: str(build_demo_model(f, root / f)) for f in ("sd", "flux", "sd3", "wan", "ltx")}


@pytest.fixture(scope="module")
def engines(paths):
    """One engine per family, step caching allowed; denoise batches of up to 4 requests."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        yield {f: stack.enter_context(running_engine(p, step_cache=ALLOW, max_batch_size=4)) for f, p in paths.items()}


IMAGE = {"sd": dict(width=64, height=64, guidance_scale=5.0), "flux": dict(width=32, height=32),
         "sd3": dict(width=32, height=32, guidance_scale=4.0)}
VIDEO = {"wan": dict(width=32, height=32, num_frames=9), "ltx": dict(width=32, height=32, num_frames=9)}


def _run(engine, family: str, steps: int, step_cache=None, seed: int = 3, prompt: str = "a red bicycle"):
    if family in VIDEO:
        req = VideoRequest(prompt=prompt, num_inference_steps=steps, seed=seed, step_cache=step_cache, **VIDEO[family])
        return engine.submit_video("m", req).result(timeout=120)["pixels"]
    req = ImageRequest(prompt=prompt, num_inference_steps=steps, seed=seed, step_cache=step_cache, **IMAGE[family])
    return engine.submit_image("m", req).result(timeout=120)["pixels"]


# -- the policy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, param", [
    ("teacache", "step_cache"),
    ({"method": "deepcache"}, "step_cache.method"),
    ({"method": "teacache", "threshold": -0.1}, "step_cache.threshold"),
    ({"method": "teacache", "threshold": True}, "step_cache.threshold"),
    ({"method": "interval", "interval": 0}, "step_cache.interval"),
    ({"method": "interval", "threshold": 0.1}, "step_cache.threshold"),
    ({"method": "fbcache", "interval": 2}, "step_cache.interval"),
    ({"method": "teacache", "thresh": 0.1}, "step_cache.thresh"),
])
def test_bad_params_name_the_field(value, param):
    with pytest.raises(StageError) as e:
        StepCacheParams.parse(value)
    assert e.value.param == param and http_status(e.value) == 400


def test_teacache_accumulates_rescaled_change_and_restarts():
    state = StepCacheState.new(StepCacheParams("teacache", threshold=0.25), 1)
    branch = state.branches[0]
    identity = (1.0, 0.0)
    assert decide_teacache(state, branch, None, identity, forced=False)  # no previous input: compute
    assert not decide_teacache(state, branch, 0.1, identity, forced=False)  # 0.1 < 0.25: reuse
    assert not decide_teacache(state, branch, 0.1, identity, forced=False)  # 0.2 < 0.25: reuse
    assert decide_teacache(state, branch, 0.1, identity, forced=False)  # 0.3: compute, and restart
    assert branch.accumulated == 0.0
    assert decide_teacache(state, BranchCache(), 0.0, identity, forced=True)  # boundary steps always compute
    # A fitted polynomial that dips below zero must not make every later step a skip.
    assert rescale((1.0, -1.0), 0.5) == 0.0 and rescale((2.0, 1.0), 0.5) == 2.0


def test_interval_computes_every_kth_step():
    state = StepCacheState.new(StepCacheParams("interval", interval=3), 1)
    assert [decide_interval(state, i, forced=False) for i in range(7)] == [True, False, False, True, False, False,
                                                                           True]


# -- through the families ----------------------------------------------------------------------------


@pytest.mark.parametrize("family, method", [
    ("sd", "teacache"), ("sd", "interval"), ("flux", "teacache"), ("flux", "fbcache"), ("sd3", "fbcache"),
    ("sd3", "teacache"), ("wan", "teacache"), ("wan", "fbcache"), ("ltx", "teacache"), ("ltx", "fbcache"),
])
def test_threshold_zero_equals_uncached_bit_for_bit(engines, family, method):
    engine = engines[family]
    uncached = _run(engine, family, 4)
    params = {"method": method, "interval": 1} if method == "interval" else {"method": method, "threshold": 0.0}
    cached = _run(engine, family, 4, params)
    assert np.array_equal(cached, uncached)


@pytest.mark.parametrize("family, params", [
    ("sd", {"method": "teacache", "threshold": 1.0}),
    ("flux", {"method": "teacache", "threshold": 0.3}),
    ("sd3", {"method": "teacache", "threshold": 0.3}),
    ("flux", {"method": "fbcache", "threshold": 2.0}),
    ("sd3", {"method": "interval", "interval": 2}),
])
def test_positive_threshold_skips_steps_within_the_declared_psnr(engines, family, params):
    engine = engines[family]
    before = skipped(engine, params["method"])
    uncached = _run(engine, family, 8, seed=5)
    cached = _run(engine, family, 8, params, seed=5)
    assert skipped(engine, params["method"]) > before
    assert not np.array_equal(cached, uncached)  # something was reused
    assert psnr(cached, uncached) >= PSNR_FLOOR_DB


def test_interval_skips_exactly_the_inner_steps_per_branch(engines):
    engine = engines["sd"]  # CFG: two branches, each skips steps 1, 3 and 5 of 0..7 (the last always runs)
    before = skipped(engine, "interval")
    _run(engine, "sd", 8, {"method": "interval", "interval": 2})
    assert skipped(engine, "interval") - before == 6


def test_cached_and_uncached_requests_share_forwards_and_equal_their_solo_runs(engines):
    engine = engines["flux"]
    specs = [(None, 1), ({"method": "interval", "interval": 2}, 2), ({"method": "interval", "interval": 3}, 3),
             (None, 4)]
    solo = [_run(engine, "flux", 7, sc, seed=seed, prompt=f"p{seed}") for sc, seed in specs]
    handles = []
    for sc, seed in specs:
        req = ImageRequest(prompt=f"p{seed}", num_inference_steps=7, seed=seed, step_cache=sc, **IMAGE["flux"])
        handles.append(engine.submit_image("m", req))
        time.sleep(0.01)
    batched = [h.result(timeout=120)["pixels"] for h in handles]
    for got, want in zip(batched, solo):
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert engine.metrics.stage.max_batch_size("m/denoise", "m") >= 2


def test_requests_are_refused_where_the_model_cannot_cache(engines, paths):
    with pytest.raises(RequestError) as e:
        _run(engines["sd"], "sd", 2, {"method": "fbcache", "threshold": 0.1})  # a UNet has no block stack
    assert e.value.param == "step_cache.method"
    with running_engine(paths["sd"]) as plain:  # step caching not allowed for this model
        with pytest.raises(RequestError) as e:
            _run(plain, "sd", 2, {"method": "teacache", "threshold": 0.1})
        assert e.value.param == "step_cache"
        assert plain.family("m").denoiser.stacks == {}  # nothing wrapped: the forward is the plain one


def test_http_extension_field_is_validated_and_runs(engines, tmp_path):
    from serve.app import create_app

    with TestClient(create_app(engines["flux"], data_dir=tmp_path)) as client:
        body = {"model": "m", "prompt": "a cat", "size": "32x32", "num_inference_steps": 3, "seed": 1}
        bad = client.post("/v1/images/generations", json={**body, "step_cache": {"method": "magic"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "step_cache.method"
        bad = client.post("/v1/images/generations", json={**body, "step_cache": {"method": "interval",
                                                                                  "threshold": 0.2}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "step_cache.threshold"
        ok = client.post("/v1/images/generations", json={**body, "step_cache": {"method": "teacache",
                                                                                 "threshold": 0.0}})
        assert ok.status_code == 200, ok.text


# -- the block stack's row bookkeeping, on a toy two-stream stack -------------------------------------


class _Block(torch.nn.Module):
    """Flux-like: (hidden, encoder, temb) -> (encoder, hidden); records the rows it ran."""

    def __init__(self, k: int):
        super().__init__()
        self.k, self.rows = k, []

    def forward(self, hidden_states, encoder_hidden_states, temb):
        self.rows.append(hidden_states.shape[0])
        return encoder_hidden_states + 1, hidden_states * (self.k + 2) + temb[:, None]


def _toy_stack():
    from stages.diffusion.block_stack import BlockStack, CacheSpec

    blocks = [_Block(k) for k in range(3)]
    stack = BlockStack(CacheSpec("toy", tuple(blocks), encoder="encoder_hidden_states", out_hidden=1, out_encoder=0,
                                 indicator=lambda args: args["temb"]))

    def model(h, e, temb):
        for block in blocks:
            e, h = block(hidden_states=h, encoder_hidden_states=e, temb=temb)
        return h
    return stack, blocks, model


def _groups(states, step, total=6):
    """Rows: two per request (no CFG, n=2); None: an uncached request."""
    from stages.diffusion.block_stack import RowGroup

    return [RowGroup(2 * i, 2 * i + 2, s, 0, step, total) for i, s in enumerate(states)]


def test_block_stack_runs_only_the_computing_rows_and_reuses_residuals():
    stack, blocks, model = _toy_stack()
    cached = StepCacheState.new(StepCacheParams("interval", interval=2), 1)
    h, e = torch.randn(4, 3, 5), torch.randn(4, 7, 5)
    for step, temb in enumerate([torch.ones(4, 5), 2 * torch.ones(4, 5)]):
        for b in blocks:
            b.rows.clear()
        with stack.active(_groups([cached, None], step)) as run:
            out = model(h, e, temb)
        want = model(h, e, temb)  # outside `active`: the plain blocks
        if step == 0:  # both compute: the untouched output, the residual remembered
            assert run.decisions == [True, True] and torch.equal(out, want)
            residual = (want - h)[:2]
        else:  # the cached request reuses step 0's residual; the other one computes alone
            assert run.decisions == [False, True] and [b.rows[0] for b in blocks] == [2, 2, 2]
            torch.testing.assert_close(out[:2], h[:2] + residual)
            torch.testing.assert_close(out[2:], want[2:])
    assert (cached.computed, cached.skipped) == (1, 1)


def test_first_block_cache_decides_after_the_first_block():
    stack, blocks, model = _toy_stack()
    state = StepCacheState.new(StepCacheParams("fbcache", threshold=0.5), 1)
    h, e, temb = torch.randn(4, 3, 5), torch.randn(4, 7, 5), torch.ones(4, 5)
    with stack.active(_groups([state, None], 0)):
        model(h, e, temb)  # step 0 always computes
    for b in blocks:
        b.rows.clear()
    with stack.active(_groups([state, None], 1)) as run:
        out = model(h, e, temb)  # same inputs: the first block's residual did not change
    assert run.decisions == [False, True]
    assert [b.rows for b in blocks] == [[4], [2], [2]]  # block 0 saw every row, the rest only the computing ones
    torch.testing.assert_close(out, model(h, e, temb))  # identical inputs: reuse reproduces the computed output


def test_video_jobs_carry_the_step_cache_to_the_engine(engines):
    """/v1/videos: the extension field is validated by the body (JSON or multipart text) and the family."""
    from pydantic import ValidationError

    from serve.routes.videos import VideoBody, precheck

    body = VideoBody.model_validate({"prompt": "waves", "step_cache": '{"method": "fbcache", "threshold": 0.1}'})
    fields = body.video_fields("m")
    assert fields["step_cache"] == {"method": "fbcache", "threshold": 0.1}
    precheck(engines["wan"], "m", {**fields, "width": 32, "height": 32, "num_frames": 9}, None, "default")
    with pytest.raises(ValidationError):
        VideoBody.model_validate({"prompt": "waves", "step_cache": {"method": "teacache", "threshold": -1}})
    with pytest.raises(StageError) as e:
        precheck(engines["wan"], "m", {**fields, "step_cache": {"method": "teacache", "interval": 2}}, None, "default")
    assert e.value.param == "step_cache.interval"


def test_a_model_may_bring_its_own_teacache_polynomial(paths):
    """A constant-zero polynomial says "nothing changed": every step but the first and the last is skipped."""
    with running_engine(paths["flux"], step_cache=StepCacheConfig(enabled=True, teacache_coefficients=(0.0,))) as e:
        assert e.family("m").denoiser.stacks["transformer"].spec.coefficients == (0.0,)
        _run(e, "flux", 6, {"method": "teacache", "threshold": 0.1})
        assert skipped(e, "teacache") == 4
