"""LTX-Video through the engine: equal to diffusers' LTXPipeline / LTXImageToVideoPipeline, batched, encodable."""

import io
import time

import av
import numpy as np
import pytest
from diffusers import LTXImageToVideoPipeline, LTXPipeline

from pipelines.image_request import RequestError
from pipelines.video import VideoConfig, VideoRequest
from stages.media.video import encode_video
from tests.helpers import noise_image, running_engine, seeded, variant

SIZE, FRAMES = 32, 9  # 32 x 32 px, 9 frames -> 8 x 3 x 8 x 8 latents, 192 tokens


@pytest.fixture(scope="module")
def ltx_path(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return str(build_demo_model("ltx", tmp_path_factory.mktemp("ltx-demo") / "ltx"))


@pytest.fixture(scope="module")
def engine(ltx_path):
    with running_engine(ltx_path) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(ltx_path):
    pipe = LTXPipeline.from_pretrained(ltx_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(engine, **kwargs):
    return engine.submit_video("m", VideoRequest(**kwargs)).result(timeout=60)


def test_defaults_follow_the_pipeline(engine):
    info = engine.models["m"]
    assert (info.family, set(info.tasks), info.size_factor) == ("ltx", {"text-to-video", "image-to-video",
                                                                        "realtime-video"}, 32)
    assert info.video_defaults == {"width": 704, "height": 512, "num_frames": 161, "fps": 25.0, "frame_factor": 4}
    fam = engine.family("m")
    assert (fam.default_steps, fam.default_guidance) == (50, 3.0)


@pytest.mark.parametrize("guidance,negative,fps", [(4.0, "blurry", 25), (1.0, None, 24), (3.0, None, 8)])
def test_text_to_video_equals_diffusers(engine, reference, guidance, negative, fps):
    ours = _run(engine, prompt="a red bicycle", negative_prompt=negative, width=SIZE, height=SIZE + 32,
                num_frames=FRAMES, fps=fps, num_inference_steps=4, guidance_scale=guidance, seed=11)
    ref = reference("a red bicycle", negative_prompt=negative, width=SIZE, height=SIZE + 32, num_frames=FRAMES,
                    frame_rate=fps, num_inference_steps=4, guidance_scale=guidance, generator=seeded(11),
                    output_type="np").frames[0]
    assert ours["frames"].shape == (FRAMES, SIZE + 32, SIZE, 3) and ours["frames"].dtype == np.uint8
    assert (ours["fps"], ours["seed"]) == (float(fps), 11)
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


@pytest.mark.parametrize("guidance", [1.0, 3.5])
def test_image_to_video_equals_diffusers(engine, reference, guidance):
    image = noise_image(48)
    ours = _run(engine, prompt="a cat", image=image, width=SIZE, height=SIZE, num_frames=FRAMES,
                num_inference_steps=3, guidance_scale=guidance, seed=5)
    ref = variant(reference, LTXImageToVideoPipeline)(
        image=image, prompt="a cat", width=SIZE, height=SIZE, num_frames=FRAMES, num_inference_steps=3,
        guidance_scale=guidance, generator=seeded(5), output_type="np").frames[0]
    np.testing.assert_allclose(ours["pixels"], ref, atol=1e-5)


def test_concurrent_requests_share_forwards_and_equal_solo(engine, ltx_path):
    """Different seeds, step counts and guidance, and an image-to-video request beside them."""
    # Enough steps that the loops overlap even on a loaded machine.
    specs = [dict(seed=1, num_inference_steps=12, guidance_scale=3.0),
             dict(seed=2, num_inference_steps=9, guidance_scale=1.0),
             dict(seed=3, num_inference_steps=10, guidance_scale=4.0, negative_prompt="dull"),
             dict(seed=4, num_inference_steps=10, guidance_scale=2.0, image=noise_image(SIZE))]
    common = dict(width=SIZE, height=SIZE, num_frames=FRAMES)
    solo = [_run(engine, prompt=f"prompt {i}", **common, **s)["pixels"] for i, s in enumerate(specs)]
    with running_engine(ltx_path, max_batch_size=4) as batching:
        handles = []
        for i, s in enumerate(specs):
            handles.append(batching.submit_video("m", VideoRequest(prompt=f"prompt {i}", **common, **s)))
            time.sleep(0.01)
        batched = [h.result(timeout=60)["pixels"] for h in handles]
        assert batching.metrics.stage.max_batch_size("m/denoise", "m") > 1
    for got, want in zip(batched, solo):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_tiled_and_sliced_decode_matches_the_plain_decode(engine, ltx_path):
    """The VAE options only bound memory: at a size below the tile size the result is the same."""
    plain = _run(engine, prompt="a boat", width=SIZE, height=SIZE, num_frames=FRAMES, num_inference_steps=2, seed=9)
    with running_engine(ltx_path, video=VideoConfig(vae_tiling=True, vae_slicing=True)) as tiled:
        vae = tiled.family("m").pipe.vae
        assert vae.use_tiling and vae.use_slicing
        out = tiled.submit_video("m", VideoRequest(prompt="a boat", width=SIZE, height=SIZE, num_frames=FRAMES,
                                                   num_inference_steps=2, seed=9)).result(timeout=60)
    np.testing.assert_allclose(out["pixels"], plain["pixels"], atol=1e-5)


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_encoded_video_decodes_to_the_frames_size_and_fps(engine, fmt):
    out = _run(engine, prompt="a wave", width=SIZE + 32, height=SIZE, num_frames=FRAMES, num_inference_steps=2, seed=2)
    with av.open(io.BytesIO(encode_video(out["frames"], out["fps"], fmt))) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert stream.average_rate == out["fps"] == 25
    assert len(frames) == FRAMES and frames[0].shape == (SIZE, SIZE + 32, 3)


@pytest.mark.parametrize("kwargs,param", [
    (dict(num_frames=8), "num_frames"), (dict(width=48), "size"), (dict(fps=-1.0), "fps"),
    (dict(num_inference_steps=500), "num_inference_steps"),
    (dict(num_inference_steps=1), "num_inference_steps")])  # the schedule ends at shift_terminal: two steps at least
def test_bad_requests_name_the_field(engine, kwargs, param):
    with pytest.raises(RequestError) as err:
        engine.submit_video("m", VideoRequest(**(dict(prompt="x", width=SIZE, height=SIZE, num_frames=FRAMES)
                                                 | kwargs)))
    assert err.value.param == param
