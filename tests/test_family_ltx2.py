"""LTX-2 through the engine: video and audio equal to diffusers' LTX2Pipeline (CFG, spatio-temporal and modality
guidance), batched across requests at different steps, defaults its own."""

import time

import numpy as np
import pytest
from diffusers import LTX2Pipeline

from pipelines.video import VideoRequest
from tests.helpers import running_engine, seeded

SIZE, FRAMES, FPS = 64, 17, 24.0  # 64 x 64 px, 17 frames -> [4, 3, 4, 4] video latents (48 tokens), 18 audio tokens
STG_BLOCKS = (1,)  # the demo transformer has 2 blocks; LTX-2's default block 28 would perturb none


@pytest.fixture(scope="module")
def ltx2_path(tmp_path_factory):
    from pipelines.demo import build_demo_model

    return str(build_demo_model("ltx2", tmp_path_factory.mktemp("ltx2-demo") / "ltx2"))


@pytest.fixture(scope="module")
def engine(ltx2_path):
    with running_engine(ltx2_path) as eng:
        eng.family("m").stg_blocks = STG_BLOCKS
        yield eng


@pytest.fixture(scope="module")
def reference(ltx2_path):
    pipe = LTX2Pipeline.from_pretrained(ltx2_path)  # offline: the saved checkpoint reloads by itself
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(pipe, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    seed, fps = kwargs.pop("seed"), kwargs.pop("fps")
    out = pipe(**kwargs, frame_rate=fps, generator=seeded(seed), spatio_temporal_guidance_blocks=list(STG_BLOCKS),
               output_type="np")
    return out.frames[0], out.audio[0].float().numpy().T  # [F, H, W, 3], [samples, channels]


@pytest.mark.parametrize("guidance,negative", [(3.0, None), (1.0, "blurry")])
def test_text_to_video_equals_diffusers(engine, reference, guidance, negative):
    """The default guidance (CFG, STG, modality isolation, rescale), and video CFG off (the audio's stays on)."""
    args = dict(prompt="a red bicycle", negative_prompt=negative, width=SIZE + 32, height=SIZE, num_frames=FRAMES,
                fps=FPS, num_inference_steps=3, guidance_scale=guidance, seed=11)
    ours = engine.submit_video("m", VideoRequest(**args)).result(timeout=120)
    frames, audio = _reference(reference, **args)
    assert ours["frames"].shape == (FRAMES, SIZE, SIZE + 32, 3) and ours["frames"].dtype == np.uint8
    assert (ours["fps"], ours["seed"], ours["sample_rate"]) == (FPS, 11, 16000)
    np.testing.assert_allclose(ours["pixels"], frames, atol=1e-5)
    assert ours["audio"].shape == audio.shape and ours["audio"].dtype == np.float32
    np.testing.assert_allclose(ours["audio"], audio, atol=1e-5)


def test_concurrent_requests_share_forwards_and_equal_diffusers(ltx2_path, reference):
    """Two requests of one shape at different step counts, guidance and seeds share every forward."""
    common = dict(width=SIZE, height=SIZE, num_frames=FRAMES, fps=FPS)
    specs = [dict(prompt="a cat", seed=1, num_inference_steps=6, guidance_scale=3.0, **common),
             dict(prompt="a dog on a long walk by the sea", seed=2, num_inference_steps=4, guidance_scale=4.5,
                  negative_prompt="dull", **common)]
    with running_engine(ltx2_path, max_batch_size=4) as batching:
        batching.family("m").stg_blocks = STG_BLOCKS
        handles = []
        for spec in specs:
            handles.append(batching.submit_video("m", VideoRequest(**spec)))
            time.sleep(0.01)
        batched = [h.result(timeout=120) for h in handles]
        assert batching.metrics.stage.max_batch_size("m/denoise", "m") >= 2
    assert np.abs(batched[0]["audio"] - batched[1]["audio"]).max() > 1e-2  # the soundtracks differ: a real check
    for got, spec in zip(batched, specs):
        frames, audio = _reference(reference, **spec)
        np.testing.assert_allclose(got["pixels"], frames, atol=1e-4)
        np.testing.assert_allclose(got["audio"], audio, atol=1e-4)


def test_omitted_fields_take_the_pipeline_defaults(engine):
    info = engine.models["m"]
    assert (info.family, "text-to-video" in info.tasks, info.size_factor) == ("ltx2", True, 32)
    assert info.video_defaults == {"width": 768, "height": 512, "num_frames": 121, "fps": 24.0, "frame_factor": 8}
    family = engine.family("m")
    req = family.validate(VideoRequest(prompt="x"))
    # LTX2Pipeline.__call__: 30 steps, guidance 3 (the audio's 7), 512 x 768, 121 frames at 24 fps
    assert (req.num_inference_steps, req.guidance_scale, family.audio_scale(req)) == (30, 3.0, 7.0)
    assert (req.width, req.height, req.num_frames, req.fps, isinstance(req.seed, int)) == (768, 512, 121, 24.0, True)
    assert family.uses_negative(family.validate(VideoRequest(prompt="x", guidance_scale=1.0)))  # the audio's CFG
    assert family.request_rows(req) == 4  # CFG pair, STG, modality isolation


def test_unserved_knobs_are_refused_by_name(engine):
    from pipelines.image_request import RequestError

    with pytest.raises(RequestError) as refused:
        engine.family("m").validate(VideoRequest(prompt="x", true_cfg_scale=4.0))
    assert refused.value.param == "true_cfg_scale"
    with pytest.raises(RequestError) as refused:
        engine.family("m").validate(VideoRequest(prompt="x", width=48, height=64))
    assert refused.value.param == "size"  # not a multiple of 32 (LTX2Pipeline.check_inputs)
    with pytest.raises(RequestError) as refused:
        engine.family("m").validate(VideoRequest(prompt="x", step_cache={"method": "teacache"}))
    assert refused.value.param == "step_cache"


def test_encoded_video_carries_the_soundtrack():
    """encode_video muxes float samples beside the frames: AAC in mp4, Opus in webm, the length of the audio."""
    import io

    import av

    from stages.media.video_encode import encode_video

    frames = (np.random.RandomState(0).rand(FRAMES, SIZE, SIZE, 3) * 255).astype(np.uint8)
    t = np.arange(16000 * FRAMES // 24) / 16000
    audio = np.stack([0.5 * np.sin(2 * np.pi * 440 * t), 0.5 * np.sin(2 * np.pi * 660 * t)], 1).astype(np.float32)
    for fmt, codec in (("mp4", "aac"), ("webm", "opus")):
        with av.open(io.BytesIO(encode_video(frames, FPS, fmt, audio=audio, sample_rate=16000))) as container:
            assert [s.codec_context.name for s in container.streams] == ["h264" if fmt == "mp4" else "vp9", codec]
            decoded = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)  # [2, samples]
        rate = 16000 if fmt == "mp4" else 48000
        assert decoded.shape[0] == 2 and abs(decoded.shape[1] / rate - len(t) / 16000) < 0.1
    with pytest.raises(ValueError, match="gif carries no audio"):
        encode_video(frames, FPS, "gif", audio=audio, sample_rate=16000)


def test_videos_endpoint_serves_the_mp4_with_its_soundtrack(ltx2_path, tmp_path, reference):
    """POST /v1/videos: the MP4 holds the video's frames and, as a second (AAC) track, LTX2Pipeline's audio for the
    same seed: AAC is lossy, so the track is compared by its error, several times smaller than another seed's."""
    import io

    import av
    import httpx

    from tests.test_serve_support import Server

    server = Server(tmp_path, f'[[models]]\nname = "ltx2"\npath = "{ltx2_path}"\n')
    try:
        body = {"model": "ltx2", "prompt": "a red bicycle", "size": f"{SIZE}x{SIZE}", "num_frames": FRAMES,
                "num_inference_steps": 3, "seed": 11}
        job = httpx.post(f"{server.url}/v1/videos", json=body, timeout=60).json()
        deadline = time.monotonic() + 120
        while job["status"] not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.2)
            job = httpx.get(f"{server.url}/v1/videos/{job['id']}", timeout=10).json()
        assert job["status"] == "completed", job
        data = httpx.get(f"{server.url}/v1/videos/{job['id']}/content", timeout=30).content
    finally:
        server.stop()
    with av.open(io.BytesIO(data)) as container:
        video = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.int16)
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.audio[0].rate == 16000
        audio = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1).T  # [samples, 2]
    # the server's STG blocks are the model's default (28), as the pipeline's
    common = dict(prompt="a red bicycle", width=SIZE, height=SIZE, num_frames=FRAMES, num_inference_steps=3,
                  output_type="np")
    out = reference(**common, generator=seeded(11))
    want, other = out.audio[0].float().numpy().T, reference(**common, generator=seeded(12)).audio[0].float().numpy().T
    assert video.shape == out.frames[0].shape  # (the frames equal the pipeline's: tested above, before the codec)
    n = min(len(audio), len(want))
    codec_error = np.sqrt(np.mean((audio[:n] - want[:n]) ** 2))
    seed_effect = np.sqrt(np.mean((audio[:n] - other[:n]) ** 2))
    assert codec_error < seed_effect / 3, (codec_error, seed_effect)
