"""Wan 2.1/2.2 through the engine: equal to diffusers' WanPipeline / WanImageToVideoPipeline, batched, encodable."""

import dataclasses
import io
import time

import av
import diffusers.pipelines.wan.pipeline_wan as wan_t2v
import diffusers.pipelines.wan.pipeline_wan_i2v as wan_i2v
import numpy as np
import pytest
from diffusers import WanImageToVideoPipeline, WanPipeline

from pipelines.image_request import RequestError
from pipelines.video import VideoRequest
from serve.errors import http_status
from stages.events import EventKind
from stages.media.video import encode_video
from stages.pool import PoolConfig
from tests.helpers import noise_image, running_engine, seeded

SIZE, FRAMES = 32, 9  # 32 x 32 px, 9 frames -> 16 x 3 x 4 x 4 latents


@pytest.fixture(scope="module", autouse=True)
def _no_ftfy():
    # diffusers 0.42's WanImageToVideoPipeline calls ftfy without checking it is installed (WanPipeline checks):
    # give the reference pipeline WanPipeline's guarded text cleaner. The engine encodes through WanPipeline's.
    original = wan_i2v.basic_clean
    wan_i2v.basic_clean = wan_t2v.basic_clean
    yield
    wan_i2v.basic_clean = original


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from pipelines.demo import build_demo_model

    root = tmp_path_factory.mktemp("wan-demo")
    return {"t2v": str(build_demo_model("wan", root / "wan")),
            "i2v": str(build_demo_model("wan-i2v", root / "wan-i2v"))}


@pytest.fixture(scope="module")
def engine(paths):
    with running_engine(paths["t2v"]) as eng:
        yield eng


@pytest.fixture(scope="module")
def i2v_engine(paths):
    with running_engine(paths["i2v"]) as eng:
        yield eng


def _reference(cls, path):
    pipe = cls.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(engine, **kwargs):
    return engine.submit_video("m", VideoRequest(**kwargs)).result(timeout=60)


def test_defaults_follow_the_pipeline(engine, i2v_engine):
    info = engine.models["m"]
    assert (info.family, info.tasks, info.size_factor) == ("wan", ("text-to-video", "realtime-video"), 16)
    assert info.video_defaults == {"width": 832, "height": 480, "num_frames": 81, "fps": 16.0, "frame_factor": 4}
    assert i2v_engine.models["m"].tasks == ("image-to-video",)


@pytest.mark.parametrize("guidance,negative", [(4.0, "blurry"), (1.0, None)])
def test_text_to_video_equals_diffusers(engine, paths, guidance, negative):
    ours = _run(engine, prompt="a red bicycle", negative_prompt=negative, width=SIZE, height=SIZE, num_frames=FRAMES,
                num_inference_steps=4, guidance_scale=guidance, seed=11)
    ref = _reference(WanPipeline, paths["t2v"])(
        "a red bicycle", negative_prompt=negative, width=SIZE, height=SIZE, num_frames=FRAMES, num_inference_steps=4,
        guidance_scale=guidance, generator=seeded(11), output_type="np").frames[0]
    assert ours["frames"].shape == (FRAMES, SIZE, SIZE, 3) and ours["frames"].dtype == np.uint8
    assert (ours["fps"], ours["seed"]) == (16.0, 11)
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)
    np.testing.assert_array_equal(ours["frames"], (ref * 255).round().astype(np.uint8))


def test_image_to_video_equals_diffusers(i2v_engine, paths):
    image = noise_image(48)  # resized to the request size, as the pipeline does
    ours = _run(i2v_engine, prompt="a cat", image=image, width=SIZE, height=SIZE, num_frames=FRAMES,
                num_inference_steps=3, guidance_scale=3.0, seed=5, fps=8)
    ref = _reference(WanImageToVideoPipeline, paths["i2v"])(
        image=image, prompt="a cat", width=SIZE, height=SIZE, num_frames=FRAMES, num_inference_steps=3,
        guidance_scale=3.0, generator=seeded(5), output_type="np").frames[0]
    assert ours["fps"] == 8.0
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_concurrent_requests_share_forwards_and_equal_solo(engine, paths):
    # Enough steps that the three loops overlap even on a loaded machine.
    specs = [dict(seed=1, num_inference_steps=12, guidance_scale=5.0),
             dict(seed=2, num_inference_steps=9, guidance_scale=1.0),
             dict(seed=3, num_inference_steps=10, guidance_scale=3.0, negative_prompt="dull")]
    common = dict(width=SIZE, height=SIZE, num_frames=FRAMES)
    solo = [_run(engine, prompt=f"prompt {i}", **common, **s)["pixels"] for i, s in enumerate(specs)]
    with running_engine(paths["t2v"], max_batch_size=4) as batching:
        handles = []
        for i, s in enumerate(specs):  # staggered arrivals: later requests join at a step boundary
            handles.append(batching.submit_video("m", VideoRequest(prompt=f"prompt {i}", **common, **s)))
            time.sleep(0.01)
        batched = [h.result(timeout=60)["pixels"] for h in handles]
        assert batching.metrics.stage.max_batch_size("m/denoise", "m") > 1
    for got, want in zip(batched, solo):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_cpu_video_model_decodes_two_batches_side_by_side(engine, paths):
    from pipelines.config import CPU_VIDEO_POOLS

    config = engine.executor.pools["m/vae_decode"].config  # pipelines.config.CPU_VIDEO_POOLS
    assert (config.replicas, config.max_batch_size, config.device) == (2, 2, "cpu")
    assert config == dataclasses.replace(CPU_VIDEO_POOLS["vae_decode"], device="cpu")
    with running_engine(paths["t2v"], pools={"vae_decode": PoolConfig(max_batch_size=3)}) as mine:
        configured = mine.executor.pools["m/vae_decode"].config  # a configured pool wins
        assert (configured.replicas, configured.max_batch_size) == (1, 3)


def test_progress_events_count_the_steps(engine):
    handle = engine.submit_video("m", VideoRequest(prompt="a tree", width=SIZE, height=SIZE, num_frames=5,
                                                   num_inference_steps=3, seed=1))
    steps = [(e.data["step"], e.data["total"]) for e in handle.events(timeout=60) if e.kind is EventKind.PROGRESS]
    assert steps == [(1, 3), (2, 3), (3, 3)]


def test_mp4_decodes_to_the_frames_size_and_fps(engine):
    out = _run(engine, prompt="a wave", width=SIZE, height=SIZE + 16, num_frames=FRAMES, num_inference_steps=2, seed=2)
    with av.open(io.BytesIO(encode_video(out["frames"], out["fps"], "mp4"))) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert stream.average_rate == out["fps"] == 16
    assert len(frames) == FRAMES and frames[0].shape == (SIZE + 16, SIZE, 3)


@pytest.mark.parametrize("kwargs,param", [
    (dict(num_frames=10), "num_frames"), (dict(num_frames=0), "num_frames"), (dict(num_frames=261), "num_frames"),
    (dict(width=40), "size"), (dict(width=2048, height=2048), "size"), (dict(fps=0), "fps"), (dict(fps=120), "fps"),
    (dict(num_inference_steps=0), "num_inference_steps"), (dict(guidance_scale=-1.0), "guidance_scale"),
    (dict(prompt=" "), "prompt"), (dict(image=noise_image(32)), "image"), (dict(seed=-1), "seed")])
def test_bad_requests_name_the_field(engine, kwargs, param):
    request = dict(prompt="x", width=SIZE, height=SIZE, num_frames=FRAMES) | kwargs
    with pytest.raises(RequestError) as err:
        engine.submit_video("m", VideoRequest(**request))
    assert err.value.param == param and http_status(err.value) == 400


def test_image_requests_and_video_requests_do_not_cross(engine):
    from pipelines.image_request import ImageRequest

    with pytest.raises(RequestError) as err:
        engine.submit_image("m", ImageRequest(prompt="x", width=SIZE, height=SIZE))
    assert err.value.param == "model"


@pytest.fixture(scope="module")
def wan22_paths(tmp_path_factory):
    """Wan 2.2 layouts on the demo's components: A14B (a second, low-noise transformer below a boundary
    timestep) and TI2V (per-token timesteps; one checkpoint for text- and image-to-video)."""
    import copy

    import torch

    from pipelines.demo.video import build_wan

    parts = dict(build_wan(0, "tiny").components)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        low_noise = copy.deepcopy(parts["transformer"])
        for p in low_noise.parameters():
            p.data.add_(0.1 * torch.randn_like(p))
    root = tmp_path_factory.mktemp("wan22")
    WanPipeline(**{**parts, "transformer_2": low_noise}, boundary_ratio=0.875).save_pretrained(root / "a14b")
    WanPipeline(**parts, expand_timesteps=True).save_pretrained(root / "ti2v")
    return {"a14b": str(root / "a14b"), "ti2v": str(root / "ti2v")}


@pytest.mark.parametrize("layout", ["a14b", "ti2v"])
def test_wan22_text_to_video_equals_diffusers(wan22_paths, layout):
    common = dict(negative_prompt="x", num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=6,
                  guidance_scale=4.0)
    ref = _reference(WanPipeline, wan22_paths[layout])("a cat", generator=seeded(3), output_type="np", **common)
    with running_engine(wan22_paths[layout]) as eng:
        tasks = ("text-to-video",) if layout == "a14b" else ("text-to-video", "image-to-video")
        assert eng.models["m"].tasks == (*tasks, "realtime-video")
        ours = _run(eng, prompt="a cat", seed=3, **common)
    np.testing.assert_allclose(ours["pixels"], ref.frames[0], atol=1e-5)


def test_wan22_ti2v_image_to_video_equals_diffusers(wan22_paths):
    image = noise_image(SIZE)
    common = dict(num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=4.0)
    base = _reference(WanPipeline, wan22_paths["ti2v"])
    ref = WanImageToVideoPipeline(**base.components, expand_timesteps=True)
    ref.set_progress_bar_config(disable=True)
    want = ref(image=image, prompt="a cat", generator=seeded(3), output_type="np", **common).frames[0]
    with running_engine(wan22_paths["ti2v"]) as eng:
        ours = _run(eng, image=image, prompt="a cat", seed=3, **common)
    np.testing.assert_allclose(ours["pixels"], want, atol=1e-5)


def test_wan21_image_to_video_with_clip_image_embeddings_equals_diffusers(tmp_path):
    from pipelines.demo.video import build_wan

    build_wan(0, "tiny", image_to_video=True, clip_image_encoder=True).save_pretrained(tmp_path / "wan21-i2v")
    path, image = str(tmp_path / "wan21-i2v"), noise_image(40)
    common = dict(negative_prompt="x", num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=3,
                  guidance_scale=4.0)
    want = _reference(WanImageToVideoPipeline, path)(image=image, prompt="a cat", generator=seeded(3),
                                                      output_type="np", **common).frames[0]
    with running_engine(path) as eng:
        ours = _run(eng, image=image, prompt="a cat", seed=3, **common)
    np.testing.assert_allclose(ours["pixels"], want, atol=1e-5)


@pytest.mark.parametrize("seconds", [9.059044868668332e307, 1e300, 1e6])
def test_seconds_past_any_limit_name_seconds(engine, seconds):
    """A huge but finite duration overflowed the frame count (a 500 found by the schema fuzzer): it is a 400."""
    with pytest.raises(RequestError) as err:
        engine.submit_video("m", VideoRequest(prompt="x", width=SIZE, height=SIZE, seconds=seconds))
    assert err.value.param == "seconds" and http_status(err.value) == 400 and "the limit is" in err.value.message
