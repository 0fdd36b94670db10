"""Memory-aware admission (memory_budget_mb, stages/diffusion/memory.py): activations measured on the denoiser's
own forwards, a request that cannot fit refused before any model work, steps cut to what fits, and an
out-of-memory error that fails one step, halves the cap and runs its items again."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from pipelines.image_request import ImageRequest, RequestError
from stages.diffusion.memory import ActivationMemory
from tests.helpers import demo_path, running_engine

CALL = dict(width=64, height=64, num_inference_steps=3, guidance_scale=5.0)


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    return demo_path(tmp_path_factory, "sd")


def test_measured_activations_grow_with_rows_and_size():
    """The CPU measure counts the tensors a forward makes while they live: more rows and more pixels take more."""
    layer = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    memory = ActivationMemory()
    with torch.no_grad():
        for size, rows in (((8, 8, 1), 1), ((8, 8, 1), 4), ((16, 16, 1), 1)):
            with memory.measure(size, rows, torch.device("cpu")):
                layer(torch.randn(rows * size[0] * size[1], 64))
    one, four, big = (memory.estimate(s, r) for s, r in (((8, 8, 1), 1), ((8, 8, 1), 4), ((16, 16, 1), 1)))
    assert 0 < one < four <= 4 * one + 1 and big > one
    assert one >= 64 * 256 * 4  # at least the hidden activation of the 64 tokens
    # an unmeasured size between: the upper bound (for batches) above the lower one (for refusals)
    assert memory.estimate((12, 12, 1), 2, upper=False) < memory.estimate((12, 12, 1), 2)


def test_a_small_budget_refuses_what_cannot_fit_and_runs_one_request_a_step(sd):
    """Budget = weights + one CFG request's activations (measured by a first engine) + a margin: one 64x64 image
    runs and equals its run without a budget; four at once are refused (413 naming the budget); two concurrent
    requests never share a step, though the pool would take four."""
    with running_engine(sd, max_batch_size=4, memory_budget_mb=1e6) as probe:
        plain = probe.submit_image("m", ImageRequest(prompt="a red bicycle", seed=1, **CALL)).result(timeout=120)
        family = probe.family("m")
        two_rows = family.activations.estimate((64, 64, 1), 2)
        weights = family.weights_bytes
    assert two_rows and weights
    budget_mb = (weights + two_rows * 1.5) / 2**20
    with running_engine(sd, max_batch_size=4, memory_budget_mb=budget_mb) as eng:
        got = eng.submit_image("m", ImageRequest(prompt="a red bicycle", seed=1, **CALL)).result(timeout=120)
        np.testing.assert_array_equal(got["pixels"], plain["pixels"])
        with pytest.raises(RequestError) as info:
            eng.submit_image("m", ImageRequest(prompt="x", seed=2, n=4, **CALL))
        assert info.value.code == "memory_limit" and info.value.param == "n" and "memory_budget_mb" in str(info.value)
        handles = [eng.submit_image("m", ImageRequest(prompt=f"p{i}", seed=i, **CALL)) for i in range(3)]
        assert all(h.result(timeout=120)["pixels"].shape == (1, 64, 64, 3) for h in handles)
        assert eng.metrics.stage.max_batch_size("m/denoise", "m") == 1


def test_an_out_of_memory_step_halves_the_cap_and_runs_again(sd):
    """An OOM injected in the first denoiser forward of two or more requests: that step fails, the cap halves, its
    items run the step again and finish equal to their runs alone; it is counted; nothing is left in the pools."""
    requests = [ImageRequest(prompt=f"prompt {i}", seed=i, **CALL) for i in range(3)]
    with running_engine(sd, max_batch_size=4) as eng:
        alone = [eng.submit_image("m", r).result(timeout=120)["pixels"] for r in requests]
        family = eng.family("m")
        real, raised = family.call_denoiser, threading.Event()

        def flaky(key, *args, **inputs):
            if not raised.is_set() and inputs["sample"].shape[0] >= 4:
                raised.set()
                raise torch.OutOfMemoryError("injected: CUDA out of memory")
            return real(key, *args, **inputs)
        family.call_denoiser = flaky
        handles = [eng.submit_image("m", r) for r in requests]
        together = [h.result(timeout=120)["pixels"] for h in handles]
        assert raised.is_set()
        assert eng.metrics.registry.get_sample_value("mmserve_stage_oom_total",
                                                     {"stage": "m/denoise", "model": "m"}) == 1
        assert eng.executor.in_flight() == 0
    for got, want in zip(together, alone):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_with_a_budget_large_images_decode_in_tiles(sd):
    """Above the tiling threshold (lowered here to 32x32) a budgeted model decodes with diffusers' tiled VAE decode;
    below it, and without a budget, whole."""
    calls = []
    with running_engine(sd, memory_budget_mb=1e6) as eng:
        family = eng.family("m")
        family.vae_tiling_above_px = 32 * 32
        vae = family.pipe.vae
        vae.tile_sample_min_size, vae.tile_latent_min_size = 32, 4  # tiles smaller than the 64x64 image
        real = vae.tiled_decode
        vae.tiled_decode = lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
        eng.submit_image("m", ImageRequest(prompt="a red bicycle", seed=1, **CALL)).result(timeout=120)
        assert calls and not vae.use_tiling  # tiled for that decode only
        calls.clear()
        eng.submit_image("m", ImageRequest(prompt="a red bicycle", seed=1, **{**CALL, "width": 32, "height": 32})) \
            .result(timeout=120)
        assert not calls


def test_metrics_report_each_pools_device_memory(sd):
    with running_engine(sd) as eng:
        value = eng.metrics.registry.get_sample_value(
            "mmserve_device_memory_bytes", {"stage": "m/denoise", "model": "m", "device": "cpu", "kind": "resident"})
    assert value is not None and value > 10 * 2**20
