"""Regional compile of the repeated blocks: outputs unchanged, first-call (compile) time reported apart,
and it composes with step caching and the graph runner."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.image_request import ImageRequest
from stages.cuda_graphs import GraphConfig
from stages.diffusion.compile import CompileConfig
from stages.diffusion.step_cache import StepCacheConfig
from tests.helpers import running_engine

# The "eager" backend runs dynamo's capture and guards without code generation: the plumbing, in seconds.
DYNAMO_ONLY = CompileConfig(enabled=True, backend="eager")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from pipelines.demo import build_demo_model

    root = tmp_path_factory.mktemp("compile")
    return {f: str(build_demo_model(f, root / f)) for f in ("sd", "flux")}


def _compiled(block) -> bool:
    """The block's forward is torch.compile's, directly or inside the step-cache wrapper (a partial)."""
    forward = block.forward
    inner = forward.args[1] if hasattr(forward, "args") else forward
    return hasattr(inner, "_torchdynamo_orig_callable")


def _pixels(engine, **kwargs):
    return engine.submit_image("m", ImageRequest(prompt="a cat", num_inference_steps=3, seed=1, **kwargs)).result(
        timeout=300)["pixels"]


@pytest.mark.parametrize("family, size", [("sd", 64), ("flux", 32)])
def test_compiled_blocks_equal_eager_and_report_their_warm_up(paths, family, size):
    with running_engine(paths[family]) as plain:
        want = _pixels(plain, width=size, height=size)
    with running_engine(paths[family], compile=DYNAMO_ONLY, step_cache=StepCacheConfig(enabled=True),
                        graphs=GraphConfig(batch_sizes=(1, 2), sizes=((size, size),))) as engine:
        fam = engine.family("m")
        blocks = fam.compile_regions(getattr(fam.pipe, fam.denoiser_keys[0]))
        assert blocks and all(_compiled(b) for b in blocks)
        assert engine.metrics.registry.get_sample_value("mmserve_compile_warmup_seconds",
                                                        {"stage": "denoise", "model": "m"}) > 0
        np.testing.assert_allclose(_pixels(engine, width=size, height=size), want, atol=1e-5)
        cached = _pixels(engine, width=size, height=size, step_cache={"method": "teacache", "threshold": 0.0})
        np.testing.assert_allclose(cached, want, atol=1e-5)


def test_modes_that_capture_their_own_graphs_are_refused():
    with pytest.raises(ValueError, match="reduce-overhead"):
        CompileConfig(enabled=True, mode="reduce-overhead")


@pytest.mark.gpu
def test_gpu_inductor_compile_equals_eager(paths):
    with running_engine(paths["flux"], device="cuda") as plain:
        want = _pixels(plain, width=64, height=64)
    with running_engine(paths["flux"], device="cuda", compile=CompileConfig(enabled=True),
                        graphs=GraphConfig(batch_sizes=(1, 2), sizes=((64, 64),))) as engine:
        np.testing.assert_allclose(_pixels(engine, width=64, height=64), want, atol=1e-3)
