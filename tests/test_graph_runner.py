"""The graph runner's dispatch through the real code (eager on the CPU): signatures, bucket choice, padding,
fallback diagnostics, warm-up-only capture; then in the denoise and LLM decode stages. GPU replay tests at the end."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from pipelines.chat import ChatRequest
from pipelines.config import EngineConfig, ModelSpec
from pipelines.engine import Engine
from pipelines.image_request import ImageRequest
from stages.cuda_graphs import GraphConfig, GraphRunner, signature
from stages.llm.params import SamplingParams
from tests.helpers import running_engine


class RowwiseModel:
    """fn(x, t, scale): each output row depends on its own input row only; records the rows it ran."""

    def __init__(self):
        self.weight = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))
        self.calls: list[int] = []
        self.seen: list[dict] = []

    def __call__(self, x, t, ids, scale):
        self.calls.append(x.shape[0])
        self.seen.append({"x": x.clone(), "t": t.clone()})
        return (x @ self.weight) * scale + t[:, None] + ids.sum()


def _inputs(rows: int, dim: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, dim, generator=g), "t": torch.randn(rows, generator=g)}


def _runner(padding="always", sizes=(1, 2, 4), pad_values=None):
    fn = RowwiseModel()
    return GraphRunner("toy", fn, GraphConfig(batch_sizes=sizes, padding=padding), pad_values=pad_values), fn


SHARED = {"ids": torch.arange(6.0).reshape(3, 2), "scale": 2.0}


def test_signature_names_every_field_and_needs_one_row_count():
    rows, shape = signature({**_inputs(3), "cond": None}, SHARED)
    assert rows == 3
    assert dict(shape) == {"x": ((6,), "float32"), "t": ((), "float32"), "cond": None, "ids": ((3, 2), "float32"),
                           "scale": 2.0}
    with pytest.raises(ValueError, match="row count"):
        signature({"x": torch.zeros(2, 6), "t": torch.zeros(3)}, {})
    # A pair of tensors (rotary cos and sin) is described by their shapes: two calls with new tensors share a graph.
    pair = lambda: (torch.randn(4, 8), torch.randn(4, 8))  # noqa: E731
    first, again = (signature(_inputs(3), {"rotary": pair()})[1] for _ in range(2))
    assert first == again and dict(first)["rotary"] == (((4, 8), "float32"), ((4, 8), "float32"))


def test_config_is_checked():
    with pytest.raises(ValueError, match="padding"):
        GraphConfig(batch_sizes=(1,), padding="sometimes")
    with pytest.raises(ValueError, match="duplicates"):
        GraphConfig(batch_sizes=(2, 2))
    with pytest.raises(ValueError, match="need graphs.batch_sizes"):
        GraphConfig(sizes=((64, 64),))
    assert GraphConfig(batch_sizes=[1, 2], sizes=[[64, 32]]).sizes == ((64, 32),)  # TOML lists become tuples


def test_warm_up_captures_every_bucket_then_padding_replays_and_slices():
    runner, fn = _runner()
    live = _inputs(3)
    out = runner(live, SHARED)  # warm-up: this shape is captured for 1, 2 and 4 rows, then replayed at 4
    assert runner.observer.captures == 3 and runner.captured == 3
    assert out.shape[0] == 3 and fn.calls[-1] == 4  # the replay ran the 4-row bucket
    torch.testing.assert_close(out, RowwiseModel()(**live, **SHARED))
    runner.seal()
    replays = runner.observer.replays
    runner(_inputs(2, seed=2), SHARED)  # an exact bucket: no padding
    assert runner.observer.replays == replays + 1 and runner.observer.padded_rows == 1
    assert runner.observer.captures == 3  # sealed: serving never captures


def test_padding_rows_never_leak_into_real_rows():
    runner, fn = _runner()
    big = {"x": torch.full((4, 6), 1e6), "t": torch.full((4,), -1e6)}
    runner(big, SHARED)  # leaves huge values in the 4-row bucket's static buffers
    small = _inputs(3, seed=7)
    got = runner(small, SHARED)
    assert torch.isclose(fn.seen[-1]["x"][3], big["x"][3]).all()  # the stale padding row was really there
    torch.testing.assert_close(got, RowwiseModel()(**small, **SHARED))


def test_pad_values_fill_padding_rows_on_every_call():
    runner, fn = _runner(pad_values={"t": 0.0})
    full = _inputs(4)
    runner(full, SHARED)  # real values in every row of the 4-row bucket
    runner(_inputs(3, seed=3), SHARED)
    assert fn.seen[-1]["t"][3] == 0.0  # the pad value, not the previous call's row
    assert torch.equal(fn.seen[-1]["x"][3], full["x"][3])  # inputs without a pad value keep their stale row


def test_never_padding_and_rows_over_the_largest_bucket_run_eagerly(caplog):
    runner, fn = _runner(padding="never")
    runner(_inputs(4), SHARED)
    runner.seal()
    runner(_inputs(3), SHARED)
    assert fn.calls[-1] == 3 and runner.observer.eager_calls == {"padding": 1}
    with caplog.at_level(logging.INFO, logger="stages.cuda_graphs"):
        runner(_inputs(5), SHARED)
        runner(_inputs(6), SHARED)
    assert runner.observer.eager_calls["rows"] == 2
    assert sum("exceed the largest graph bucket" in r.message for r in caplog.records) == 1  # logged once


def test_auto_padding_decides_per_row_count_at_warm_up():
    runner, _ = _runner(padding="auto", sizes=(2, 8))
    runner(_inputs(2), SHARED)
    rows, shape = signature(_inputs(2), SHARED)
    choices = {r: runner.choose(shape, r) for r in range(1, 9)}
    assert choices[2] == 2 and choices[8] == 8  # exact buckets always replay
    assert all(choices[r] in (None, 2 if r < 2 else 8) for r in (1, 3, 5, 7))  # pad up, or eager where it costs


def test_a_shape_missed_after_warm_up_runs_eagerly_and_names_the_field_once(caplog):
    runner, fn = _runner()
    runner(_inputs(2), SHARED)
    runner.seal()
    with caplog.at_level(logging.WARNING, logger="stages.cuda_graphs"):
        for _ in range(3):
            out = runner(_inputs(2, dim=6), {**SHARED, "scale": 3.0})
    torch.testing.assert_close(out, fn(**_inputs(2), **{**SHARED, "scale": 3.0}))
    misses = [r.message for r in caplog.records if "no graph for" in r.message]
    assert len(misses) == 1 and "scale=3.0" in misses[0] and "captured: 2.0" in misses[0]
    assert runner.observer.eager_calls == {"shape": 3} and runner.observer.captures == 3


# -- in the denoise stage ------------------------------------------------------------------------

GRAPHS = GraphConfig(batch_sizes=(1, 2, 4), sizes=((64, 64),), padding="always")


def _metric(engine, name: str, **labels) -> float:
    return engine.metrics.registry.get_sample_value(name, {"stage": "denoise", "model": "m", **labels}) or 0.0


@pytest.fixture(scope="module")
def sd_demo(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return str(build_demo_model("sd", tmp_path_factory.mktemp("sd") / "sd"))


def test_denoise_replays_padded_buckets_and_equals_eager(sd_demo, caplog):
    sd_path = sd_demo
    kwargs = dict(prompt="a lighthouse", num_inference_steps=3, seed=4, width=64, height=64)
    with running_engine(sd_path) as plain:
        want_cfg = plain.submit_image("m", ImageRequest(**kwargs)).result()["pixels"]
        want_pad = plain.submit_image("m", ImageRequest(**kwargs, n=3, guidance_scale=1.0)).result()["pixels"]
    with running_engine(sd_path, graphs=GRAPHS) as engine:
        assert _metric(engine, "mmserve_graph_captures_total") == 3  # one shape x three buckets, before ready
        got_cfg = engine.submit_image("m", ImageRequest(**kwargs)).result()["pixels"]  # 2 rows: exact
        got_pad = engine.submit_image("m", ImageRequest(**kwargs, n=3, guidance_scale=1.0)).result()["pixels"]
        np.testing.assert_allclose(got_cfg, want_cfg, atol=1e-5)
        np.testing.assert_allclose(got_pad, want_pad, atol=1e-5)  # 3 rows padded to 4
        assert _metric(engine, "mmserve_graph_padded_rows_total") >= 3  # one padding row per step
        with caplog.at_level(logging.WARNING, logger="stages.cuda_graphs"):
            engine.submit_image("m", ImageRequest(**{**kwargs, "width": 32, "height": 32})).result()
        assert _metric(engine, "mmserve_graph_eager_total", reason="shape") == 3
        assert any("no graph for sample=((4, 4, 4), 'float32')" in r.message for r in caplog.records)
        engine.submit_image("m", ImageRequest(**kwargs, n=3)).result()  # 6 rows: over the largest bucket
        assert _metric(engine, "mmserve_graph_eager_total", reason="rows") == 3
        assert _metric(engine, "mmserve_graph_captures_total") == 3  # no capture while serving
        assert _metric(engine, "mmserve_graph_replays_total") >= 6


def test_flux_shared_ids_are_copied_into_the_graph(tmp_path):
    """32x64 and 64x32 have one token count (one graph) but different image ids: both must equal eager."""
    from pipelines.demo import build_demo_model

    path = str(build_demo_model("flux", tmp_path / "flux"))
    sizes = [(32, 64), (64, 32)]
    kwargs = dict(prompt="a cat", num_inference_steps=2, seed=2)
    with running_engine(path) as plain:
        want = [plain.submit_image("m", ImageRequest(**kwargs, width=w, height=h)).result()["pixels"] for w, h in sizes]
    graphs = GraphConfig(batch_sizes=(1, 2), sizes=((32, 64),), padding="always")
    with running_engine(path, graphs=graphs) as engine:
        got = [engine.submit_image("m", ImageRequest(**kwargs, width=w, height=h)).result()["pixels"] for w, h in sizes]
        assert _metric(engine, "mmserve_graph_eager_total", reason="shape") == 0
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5)


# -- in the LLM decode step ----------------------------------------------------------------------


def test_llm_decode_buckets_with_padding_rows_equal_generate(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.chat import LLMConfig
    from pipelines.demo import build_demo_model

    path = str(build_demo_model("llama", tmp_path / "llama"))
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    graphs = GraphConfig(batch_sizes=(1, 2, 4), padding="always")
    engine = Engine(EngineConfig(models=(ModelSpec("m", path, llm=LLMConfig(kv_cache_mb=4, block_size=4),
                                                   graphs=graphs),)))
    engine.start()
    try:
        runner = engine.chat_model("m").runner
        assert runner.decode_graphs.sealed and runner.decode_graphs.observer.captures == 3
        prompts = [tok(f"request {i} " * (2 + i)).input_ids for i in range(3)]  # 3 decode rows -> bucket 4
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
        handles = [engine.submit_chat("m", ChatRequest(prompt=p, params=params)) for p in prompts]
        outs = [h.result(timeout=120)["choices"][0]["token_ids"] for h in handles]
        for p, out in zip(prompts, outs):
            ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            assert out == ref[0, len(p):].tolist()
        observer = runner.decode_graphs.observer
        assert observer.replays > 0 and observer.padded_rows > 0 and observer.captures == 3
        assert engine.metrics.registry.get_sample_value("mmserve_graph_replays_total",
                                                        {"stage": "llm", "model": "m"}) == observer.replays
    finally:
        engine.shutdown()


# -- on the GPU (run on the device when one is lent) ---------------------------------------------


@pytest.mark.gpu
def test_gpu_replay_equals_eager_for_every_bucket_and_padding_does_not_leak():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda().eval()
    fn = lambda x, t: net(x) + t[:, None]  # noqa: E731
    runner = GraphRunner("gpu-toy", fn, GraphConfig(batch_sizes=(1, 2, 4, 8), padding="always"),
                         pool=torch.cuda.graph_pool_handle())
    with torch.inference_mode():
        runner({"x": torch.randn(8, 64, device="cuda"), "t": torch.randn(8, device="cuda")})
        runner.seal()
        assert all(b.graph is not None for b in next(iter(runner._shapes.values())).values())
        for rows in range(1, 9):
            x, t = torch.randn(rows, 64, device="cuda"), torch.randn(rows, device="cuda")
            bucket = runner.choose(signature({"x": x, "t": t}, {})[1], rows)
            padded = {"x": torch.cat([x, torch.full((bucket - rows, 64), 1e4, device="cuda")]),
                      "t": torch.cat([t, torch.zeros(bucket - rows, device="cuda")])}
            got = runner({"x": x, "t": t})
            torch.testing.assert_close(got, fn(**padded)[:rows], atol=1e-5, rtol=1e-5)  # the replay = eager
            torch.testing.assert_close(got, fn(x, t), atol=1e-4, rtol=1e-4)  # padding rows do not leak
    assert runner.observer.captures == 4


@pytest.mark.gpu
def test_gpu_no_capture_while_serving_and_pool_flat_over_1000_mixed_requests(sd_demo):
    graphs = GraphConfig(batch_sizes=(1, 2, 4, 8), sizes=((64, 64), (128, 128)), padding="auto")
    with running_engine(sd_demo, device="cuda", graphs=graphs, max_batch_size=4) as engine:
        captures = _metric(engine, "mmserve_graph_captures_total")
        assert captures == 8
        shapes = [(64, 64), (128, 128), (96, 96)]  # the last is outside the set: eager
        reserved = []
        for wave in range(50):
            handles = [engine.submit_image("m", ImageRequest(prompt=f"p{i}", num_inference_steps=1, seed=i,
                                                             width=shapes[i % 3][0], height=shapes[i % 3][1],
                                                             n=1 + i % 2))
                       for i in range(wave * 20, wave * 20 + 20)]
            for h in handles:
                h.result(timeout=120)
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
        assert _metric(engine, "mmserve_graph_captures_total") == captures  # no capture while serving
        assert _metric(engine, "mmserve_graph_replays_total") > 0
        assert max(reserved[10:]) <= reserved[9] * 1.05  # flat after the first waves


@pytest.mark.parametrize("family", ["flux_kontext", "flux2", "flux2_klein", "qwen_image", "sana", "z_image"])
def test_the_newer_image_families_replay_graphs_equal_to_eager(family, tmp_path):
    """Every newer family's denoiser goes through the graph runner: captured at warm-up for the declared size and
    rows, replayed at every step, equal to eager. The warm-up's own prompt: qwen_image and z_image feed the text
    unpadded, so its token count is part of the captured shape (another length runs eagerly)."""
    from pipelines.demo import build_demo_model

    path = str(build_demo_model(family, tmp_path / family))
    kwargs = dict(prompt="warm-up", num_inference_steps=2, seed=2, width=64, height=64)
    with running_engine(path) as plain:
        want = plain.submit_image("m", ImageRequest(**kwargs)).result()["pixels"]
    with running_engine(path, graphs=GraphConfig(batch_sizes=(1, 2, 4), sizes=((64, 64),), padding="always")) as engine:
        assert _metric(engine, "mmserve_graph_captures_total") > 0  # at warm-up, before the first request
        got = engine.submit_image("m", ImageRequest(**kwargs)).result()["pixels"]
        assert _metric(engine, "mmserve_graph_replays_total") >= 3  # the warm-up's step, then both of these
        assert _metric(engine, "mmserve_graph_eager_total", reason="shape") == 0
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("family", ["cogvideox", "hunyuan_video", "hunyuan_video15", "ltx2"])
def test_the_newer_video_families_replay_graphs_equal_to_eager(family, tmp_path):
    """The video families' denoisers through the graph runner at the warm-up's size and frames (cogvideox's rotary
    (cos, sin) pair is a shared input: copied into the graph's buffers, described by its shapes), equal to eager."""
    from pipelines.demo import build_demo_model
    from pipelines.video import VideoRequest

    path = str(build_demo_model(family, tmp_path / family))

    def request():
        return VideoRequest(prompt="warm-up", width=64, height=64, num_frames=9, num_inference_steps=2, seed=3)
    with running_engine(path) as plain:
        want = plain.submit("m", request()).result(timeout=300)["frames"]
    graphs = GraphConfig(batch_sizes=(1, 2, 4), sizes=((64, 64),), frames=(9,), padding="always")
    with running_engine(path, graphs=graphs) as engine:
        got = engine.submit("m", request()).result(timeout=300)["frames"]
        assert _metric(engine, "mmserve_graph_replays_total") >= 4  # the warm-up's two steps, then these two
        assert _metric(engine, "mmserve_graph_eager_total", reason="shape") == 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
