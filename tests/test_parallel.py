"""A denoise replica over several ranks on the CPU with gloo ([models.parallel]: cfg = 2, ulysses = 2, and both
on four ranks): the output
equals the one-device engine's within float rounding (each guidance half runs as a batch of its own, and a
kernel's blocking can depend on the batch: measured <= 3e-6 on [0, 1] pixels, checked at 1e-4, a fortieth of one
8-bit level), alone and with requests batched at different steps; per-rank
series; cancel within a step; a killed rank fails only the forward in flight and the ranks come back; the ranks
listen on loopback only; configuration errors name the key."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from pipelines.config import EngineConfig, ModelSpec, ParallelConfig
from pipelines.engine import Engine
from pipelines.image_request import ImageRequest
from pipelines.video import VideoRequest
from stages.events import ErrorKind, EventKind, StageError
from stages.pool import PoolConfig
from tests.helpers import cancel_mid_loop, running_engine

THREADS = {"denoise": PoolConfig(threads=1, max_batch_size=4)}  # the same torch threads on both sides


@pytest.fixture(scope="module")
def sd_path(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return str(build_demo_model("sd", tmp_path_factory.mktemp("sd-demo") / "sd"))


@pytest.fixture(scope="module")
def one(sd_path):
    with running_engine(sd_path, pools=THREADS) as eng:
        yield eng


@pytest.fixture(scope="module")
def two(sd_path):
    with running_engine(sd_path, pools=THREADS, parallel=ParallelConfig(cfg=2)) as eng:
        yield eng


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    """Equal up to float rounding (see the module docstring); a wrong half, step or seed differs by ~0.1."""
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def _image(engine, seed: int, steps: int = 6):
    request = ImageRequest(prompt="a red cube", width=64, height=64, num_inference_steps=steps, seed=seed)
    return engine.submit_image("m", request)


def _ranks(engine):
    return engine._served["m"].model.ranks


def _ranks_host(engine):
    return engine._served["m"].model


def _sample(engine, name: str, rank: int) -> float:
    return engine.metrics.registry.get_sample_value(name, {"model": "m", "rank": str(rank)}) or 0.0


def test_cfg_parallel_equals_one_device(one, two):
    before = [_sample(two, "mmserve_parallel_step_seconds_count", r) for r in (0, 1)]
    for seed in (3, 4):
        want = _image(one, seed).result(timeout=120)["pixels"]
        got = _image(two, seed).result(timeout=120)["pixels"]
        assert_close(got, want)
    # Both ranks ran every step of both images (6 each); /metrics shows them and the exchange.
    assert [_sample(two, "mmserve_parallel_step_seconds_count", r) - before[r] for r in (0, 1)] == [12, 12]
    assert _sample(two, "mmserve_parallel_collective_seconds_count", 1) >= 12
    assert two.executor.idle()


def test_three_requests_batched_at_different_steps_equal_their_solo_runs(one, two):
    seeds = (11, 12, 13)
    want = {s: _image(one, s, steps=8).result(timeout=120)["pixels"] for s in seeds}
    first = _image(two, seeds[0], steps=8)
    for event in first.events(timeout=120):  # the others join its loop a few steps in
        if event.kind is EventKind.PROGRESS and event.data["step"] == 2:
            break
    rest = [_image(two, s, steps=8) for s in seeds[1:]]
    got = {seeds[0]: first.result(timeout=120)["pixels"],
           **{s: h.result(timeout=120)["pixels"] for s, h in zip(seeds[1:], rest)}}
    for s in seeds:
        assert_close(got[s], want[s])
    assert two.metrics.stage.max_batch_size("m/denoise", "m") >= 2  # they shared forwards across both ranks


def test_cancel_stops_within_a_step(two):
    handle = _image(two, seed=5, steps=200)
    took, step_s = cancel_mid_loop(handle, two.executor.pools["m/denoise"])
    assert took < 2 * step_s + 0.05, (took, step_s)
    with pytest.raises(StageError) as info:
        handle.result(timeout=5)
    assert info.value.kind is ErrorKind.CANCELLED
    assert _image(two, seed=5, steps=2).result(timeout=120)["pixels"].shape == (1, 64, 64, 3)


def test_the_ranks_listen_on_loopback_only(two):
    pids = _ranks(two).pids()
    assert len(pids) == 1
    listening = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True, timeout=30).stdout.splitlines()
    mine = [line for line in listening if any(f"pid={pid}," in line for pid in pids)]
    assert mine, listening  # gloo's pair listens for rank 0
    for line in mine:
        local = line.split()[3]
        assert local.rsplit(":", 1)[0] in ("127.0.0.1", "[::ffff:127.0.0.1]"), line


def test_a_killed_rank_fails_the_step_in_flight_then_the_ranks_come_back(one, two):
    ranks = _ranks(two)
    victim = ranks.pids()[0]
    handle = _image(two, seed=6, steps=200)
    for event in handle.events(timeout=120):
        if event.kind is EventKind.PROGRESS and event.data["step"] == 2:
            break
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(StageError) as info:
        handle.result(timeout=60)  # bounded: the collective sees the closed pair, no hang
    assert info.value.kind is ErrorKind.UNAVAILABLE and info.value.code == "rank_lost", info.value
    assert two.executor.idle() and two.executor.pools["m/denoise"].idle
    got = _image(two, seed=7).result(timeout=120)["pixels"]  # the ranks start again with this one
    assert ranks.pids() and victim not in ranks.pids()
    assert_close(got, _image(one, seed=7).result(timeout=120)["pixels"])


@pytest.fixture(scope="module")
def flux_path(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return str(build_demo_model("flux", tmp_path_factory.mktemp("flux-demo") / "flux"))


def _flux(engine, seed: int, *, cfg: bool = False, size: int = 64, steps: int = 4):
    extra, negative = ({"true_cfg_scale": 2.0}, "blurry") if cfg else ({}, None)
    request = ImageRequest(prompt="a red cube", width=size, height=size, num_inference_steps=steps, seed=seed,
                           negative_prompt=negative, extra=extra)
    return engine.submit_image("m", request)


@pytest.mark.parametrize("parallel", [ParallelConfig(ulysses=2), ParallelConfig(ring=2),
                                      ParallelConfig(cfg=2, ulysses=2)], ids=["ulysses2", "ring2", "cfg2-ulysses2"])
def test_flux_sequence_parallel_equals_one_device(flux_path, parallel):
    """Sequence parallel through diffusers' context-parallel hooks: each half's image and text tokens sharded over
    two ranks, all-to-all of heads in attention (Ulysses) or the keys and values passed round (ring, merged by
    their log-sum-exp); with cfg = 2 the two halves run on two such pairs (four ranks)."""
    with running_engine(flux_path, pools=THREADS) as plain:
        want = [_flux(plain, 3).result(timeout=120)["pixels"], _flux(plain, 4, cfg=True).result(timeout=120)["pixels"]]
    with running_engine(flux_path, pools=THREADS, parallel=parallel) as eng:
        got = [_flux(eng, 3).result(timeout=120)["pixels"], _flux(eng, 4, cfg=True).result(timeout=120)["pixels"]]
        steps = [_sample(eng, "mmserve_parallel_step_seconds_count", r) for r in range(parallel.world)]
        # A sequence two ranks cannot split (9 image tokens: FLUX.1 at 48 px; the demo's VAE makes every size even)
        # is refused naming the size before any rank starts the forward.
        from pipelines.parallel import _check_shards

        with pytest.raises(StageError) as info:
            _check_shards(_ranks_host(eng), "transformer", {"hidden_states": torch.zeros(1, 9, 64)}, 2)
        assert info.value.kind is ErrorKind.INVALID and info.value.param == "size", info.value
    for g, w in zip(got, want):
        assert_close(g, w)
    assert min(steps[:2]) >= 8  # the first pair ran both images' steps (and the warm-up's)
    if parallel.cfg == 2:
        assert min(steps[2:]) == 4  # the second pair ran the guided image's unconditional half only


def test_flux_ulysses_batches_requests_at_different_steps(flux_path):
    """Three requests on a Ulysses replica, two joining the first's loop two steps in: they share forwards (the
    sequence sharded across both ranks for every row) and each equals its solo one-device image."""
    seeds = (21, 22, 23)
    with running_engine(flux_path, pools=THREADS) as plain:
        want = {s: _flux(plain, s, steps=10).result(timeout=120)["pixels"] for s in seeds}
    with running_engine(flux_path, pools=THREADS, parallel=ParallelConfig(ulysses=2)) as eng:
        first = _flux(eng, seeds[0], steps=10)
        for event in first.events(timeout=120):
            if event.kind is EventKind.PROGRESS and event.data["step"] == 2:
                break
        rest = {s: _flux(eng, s, steps=10) for s in seeds[1:]}
        got = {seeds[0]: first.result(timeout=120)["pixels"],
               **{s: h.result(timeout=120)["pixels"] for s, h in rest.items()}}
        assert eng.metrics.stage.max_batch_size("m/denoise", "m") >= 2
    for s in seeds:
        assert_close(got[s], want[s])


def test_the_native_attention_op_returns_its_log_sum_exp():
    """What ring attention merges chunks by: the op's output equals SDPA's and its LSE the scores' logsumexp, and a
    call without return_lse is diffusers' own op."""
    from diffusers.models import attention_dispatch as dispatch

    from pipelines.parallel import native_attention_with_lse

    native_attention_with_lse()
    native_attention_with_lse()  # idempotent
    g = torch.Generator().manual_seed(0)
    q, k, v = (3 * torch.randn(2, 5, 4, 8, generator=g) for _ in range(3))  # [B, S, H, D], peaky scores
    op = dispatch._native_attention_forward_op
    out, lse = op(None, q, k, v, return_lse=True, _save_ctx=False)
    qh, kh, vh = (x.permute(0, 2, 1, 3) for x in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh).permute(0, 2, 1, 3)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, torch.logsumexp(qh @ kh.transpose(-1, -2) / 8 ** 0.5, -1).permute(0, 2, 1))
    torch.testing.assert_close(op(None, q, k, v, _save_ctx=False), want)


def test_a_killed_sequence_parallel_rank_restarts_the_world(flux_path):
    """Rank 1 dies inside a step's all-to-all: the step fails (rank_lost), not hangs; the next request joins a new
    world (rank 0's default group and mesh again, the hooks given the new mesh) and equals one device."""
    with running_engine(flux_path, pools=THREADS) as plain:
        want = _flux(plain, 8).result(timeout=120)["pixels"]
    with running_engine(flux_path, pools=THREADS, parallel=ParallelConfig(ulysses=2)) as eng:
        victim = _ranks(eng).pids()[0]
        request = ImageRequest(prompt="a red cube", width=64, height=64, num_inference_steps=200, seed=8)
        handle = eng.submit_image("m", request)
        for event in handle.events(timeout=120):
            if event.kind is EventKind.PROGRESS and event.data["step"] == 2:
                break
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(StageError) as info:
            handle.result(timeout=60)
        assert info.value.kind is ErrorKind.UNAVAILABLE and info.value.code == "rank_lost", info.value
        assert_close(_flux(eng, 8).result(timeout=120)["pixels"], want)
        assert victim not in _ranks(eng).pids()


@pytest.mark.parametrize("family, parallel", [("wan", ParallelConfig(cfg=2)), ("wan", ParallelConfig(ulysses=2)),
                                              ("ltx", ParallelConfig(ulysses=2))],
                         ids=["wan-cfg2", "wan-ulysses2", "ltx-ulysses2"])
def test_video_parallel_equals_one_device(tmp_path, family, parallel):
    """Wan on diffusers' plan; LTX on ours (its text and the text's attention mask whole on every rank, the
    cross-attention local to each rank's image shard: diffusers' plan splits the mask and fails)."""
    from pipelines.demo import build_demo_model
    from pipelines.parallel import _check_shards

    path = str(build_demo_model(family, tmp_path / family))
    request = VideoRequest(prompt="a fox", width=32, height=32, num_frames=5, num_inference_steps=3, seed=2)
    with running_engine(path, pools=THREADS) as eng:
        want = eng.submit_video("m", request).result(timeout=120)["frames"]
    with running_engine(path, pools=THREADS, parallel=parallel) as eng:
        got = eng.submit_video("m", request).result(timeout=120)["frames"]
        assert _sample(eng, "mmserve_parallel_step_seconds_count", 1) >= 3  # rank 1 held a half or half the tokens
        if family == "wan" and parallel.ulysses == 2:  # one 48 px frame: 3 x 3 patches, which two ranks cannot split
            with pytest.raises(StageError) as info:
                _check_shards(_ranks_host(eng), "transformer", {"hidden_states": torch.zeros(1, 16, 1, 6, 6)}, 2)
            assert info.value.kind is ErrorKind.INVALID and "(9 tokens)" in str(info.value), info.value
    assert_close(np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32))


@pytest.mark.parametrize("parallel", [ParallelConfig(ulysses=2), ParallelConfig(cfg=2, ring=2)],
                         ids=["ulysses2", "cfg2-ring2"])
def test_sd3_sequence_parallel_equals_one_device(tmp_path, parallel):
    """SD3 has no diffusers plan: ours splits the image tokens after the patch embedding and keeps the text (77
    CLIP + 256 T5 tokens, odd) whole on every rank; the joint attention all-to-alls (Ulysses) or gathers (ring) the
    image's queries, keys and values and slices the text's heads. The demo is SD3.5-medium-shaped (per-head RMS
    norm, a second image-only attention in the first block), so both attentions run sharded."""
    from pipelines.demo import build_demo_model

    path = str(build_demo_model("sd3", tmp_path / "sd3"))

    def images(eng):
        return [eng.submit_image("m", ImageRequest(
            prompt="a red cube", width=64, height=64, num_inference_steps=3, seed=5, guidance_scale=scale,
            negative_prompt="blurry" if scale > 1 else None)).result(timeout=120)["pixels"] for scale in (1.0, 5.0)]

    with running_engine(path, pools=THREADS) as eng:
        want = images(eng)
    with running_engine(path, pools=THREADS, parallel=parallel) as eng:
        got = images(eng)
        steps = [_sample(eng, "mmserve_parallel_step_seconds_count", r) for r in range(parallel.world)]
    for g, w in zip(got, want):
        assert_close(g, w)
    assert min(steps) >= 3  # every rank ran (the cfg pair the guided image's unconditional half)


def test_step_caching_on_cfg_parallel_equals_one_device(tmp_path):
    """Three step-cached SD3 requests in one batch (first-block cache, TeaCache, every 2nd step) on cfg = 2: rank 1
    keeps the unconditional branch's cache, rank 0 the conditional's; each image and the computed/skipped counts
    (rank 1's decisions counted on rank 0) equal one device's."""
    from pipelines.demo import build_demo_model
    from stages.diffusion.step_cache import StepCacheConfig

    path = str(build_demo_model("sd3", tmp_path / "sd3"))
    caches = [{"method": "fbcache", "threshold": 0.3}, {"method": "teacache", "threshold": 0.1},
              {"method": "interval", "interval": 2}]

    def run(eng):
        handles = [eng.submit_image("m", ImageRequest(
            prompt="a red cube", width=64, height=64, num_inference_steps=8, seed=5 + i, guidance_scale=5.0,
            negative_prompt="blurry", step_cache=c)) for i, c in enumerate(caches)]
        images = [h.result(timeout=120)["pixels"] for h in handles]
        counts = {(c["method"], o): eng.metrics.registry.get_sample_value(
            "mmserve_step_cache_steps_total", {"model": "m", "method": c["method"], "outcome": o})
            for c in caches for o in ("computed", "skipped")}
        return images, counts

    allow = StepCacheConfig(enabled=True)
    with running_engine(path, pools=THREADS, step_cache=allow) as eng:
        want, want_counts = run(eng)
    with running_engine(path, pools=THREADS, step_cache=allow, parallel=ParallelConfig(cfg=2)) as eng:
        got, counts = run(eng)
    assert counts == want_counts
    assert all(counts[(c["method"], "skipped")] >= 2 for c in caches), counts  # every method skipped on both
    for g, w in zip(got, want):
        assert_close(g, w)


def test_parallel_vae_decode_equals_the_one_rank_tiled_decode(tmp_path):
    """[models.parallel] vae = true: a video's VAE tiles (16 px tiles, 8 px stride: 16 tiles at 32 px) decoded
    across the two ranks and blended on rank 0 give vae.tiled_decode's video; the whole video equals a one-device
    engine's with the same tiling."""
    from pipelines.demo import build_demo_model
    from pipelines.parallel_vae import parallel_tiled_decode
    from pipelines.video import VideoConfig

    path = str(build_demo_model("wan", tmp_path / "wan"))
    video = VideoConfig(vae_tiling=True, vae_tile=(16, 8))
    request = VideoRequest(prompt="a fox", width=32, height=32, num_frames=5, num_inference_steps=2, seed=2)
    with running_engine(path, pools=THREADS, video=video) as eng:
        want = eng.submit_video("m", request).result(timeout=120)["frames"]
    with running_engine(path, pools=THREADS, video=video, parallel=ParallelConfig(cfg=2, vae=True)) as eng:
        family = _ranks_host(eng)
        before = _sample(eng, "mmserve_parallel_step_seconds_count", 1)
        got = eng.submit_video("m", request).result(timeout=120)["frames"]
        assert _sample(eng, "mmserve_parallel_step_seconds_count", 1) - before >= 2 + 8  # 2 steps, 8 of 16 tiles
        z = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            reference = family.pipe.vae.tiled_decode(z, return_dict=False)[0]
        assert_close(parallel_tiled_decode(family, z).numpy(), reference.numpy())
    assert_close(np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32))


def test_parallel_vae_needs_a_wan_vae(sd_path):
    with pytest.raises(ValueError, match="parallel.vae: the parallel decode covers Wan 2.1's VAE"):
        Engine(EngineConfig(models=(ModelSpec("m", sd_path, parallel=ParallelConfig(cfg=2, vae=True)),))).start()


def test_a_unet_has_no_sequence_to_shard(sd_path):
    engine = Engine(EngineConfig(models=(ModelSpec("m", sd_path, parallel=ParallelConfig(ulysses=2)),)))
    with pytest.raises(ValueError, match="parallel.ulysses: the UNet2DConditionModel of family sd has no "
                                         "context-parallel plan \\(sequence parallelism covers \\['flux', 'wan', "
                                         "'sd3', 'ltx'\\]\\)"):
        engine.start()
    engine.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    (dict(parallel=dict(cfg=3)), "parallel.cfg must be 1 or 2"),
    (dict(parallel=dict(ring=0)), "parallel.ring must be an integer >= 1"),
    (dict(parallel=dict(vae=True)), "parallel.vae: the VAE's tiles are spread over the denoise replica's ranks"),
    (dict(parallel=dict(cfg=2), pools={"denoise": PoolConfig(replicas=2)}), "pools.denoise.replicas must be 1"),
    (dict(parallel=dict(cfg=2), pools={"denoise": PoolConfig(devices=("cpu", "cpu", "cpu"))}),
     "pools.denoise.devices must list one device per rank (2"),
    (dict(parallel=dict(cfg=2), device="cuda:0"), "pools.denoise.devices must list the 2 ranks' devices"),
    (dict(parallel=dict(ulysses=2), step_cache=dict(enabled=True)),
     "step_cache does not combine with parallel.ulysses or ring yet"),
])
def test_bad_parallel_config_names_the_key(kwargs, message):
    from stages.diffusion.step_cache import StepCacheConfig

    if isinstance(kwargs.get("parallel"), dict):
        try:
            kwargs["parallel"] = ParallelConfig(**kwargs["parallel"])
        except ValueError as e:
            assert message in str(e)
            return
    if "step_cache" in kwargs:
        kwargs["step_cache"] = StepCacheConfig(**kwargs["step_cache"])
    with pytest.raises(ValueError) as info:
        ModelSpec("m", "/nowhere", **kwargs)
    assert message in str(info.value)


def test_toml_parallel_table(tmp_path):
    from serve.config import load_config

    path = tmp_path / "mmserve.toml"
    path.write_text('[[models]]\nname = "m"\npath = "/x"\nfamily = "sd"\n[models.parallel]\ncfg = 2\n'
                    '[models.pools.denoise]\ndevices = ["cpu", "cpu"]\n')
    spec = load_config(path).engine.models[0]
    assert spec.parallel == ParallelConfig(cfg=2) and spec.denoise_devices == ("cpu", "cpu")
    pool = spec.pool("denoise")  # the executor's view: one replica, on rank 0's device
    assert (pool.replicas, pool.devices, pool.device) == (1, (), "cpu")
    path.write_text('[[models]]\nname = "m"\npath = "/x"\n[models.parallel]\ncfgg = 2\n')
    with pytest.raises(ValueError, match="cfgg"):
        load_config(path)


def test_shutdown_stops_the_ranks(sd_path):
    engine = Engine(EngineConfig(models=(ModelSpec("m", sd_path, pools=THREADS, parallel=ParallelConfig(cfg=2)),)))
    engine.start()
    pids = _ranks(engine).pids()
    done = threading.Event()
    threading.Thread(target=lambda: (engine.shutdown(), done.set()), daemon=True).start()
    assert done.wait(30)
    for pid in pids:
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z":
            assert time.monotonic() < deadline, f"rank process {pid} still runs"
            time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
