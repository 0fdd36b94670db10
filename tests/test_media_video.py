"""Video probing, seek sampling and encoding (stages.media.video*). CPU only, offline.

Test videos are made here with PyAV: each frame has its index painted into it as 16x16
black/white blocks (one bit each), which survive any codec, so a returned frame says which
frame it is.
"""

from __future__ import annotations

import functools
import io
import math
import os
import pickle
import re
import struct
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from stages.media import video_seek as media_video_seek
from stages.media.image import WORKER_FUNCTIONS, MediaError, worker_function
from stages.media.pool import MediaPool
from stages.media.video import (
    DecodedVideo,
    VideoDecodeLimits,
    VideoSampling,
    decode_all_frames,
    decode_video,
    probe_video,
)
from stages.media.video_encode import FragmentedMP4Writer, encode_video

try:
    from tests.media_worker_tasks import TEST_FUNCTIONS
    from tests.scheduling import normal_scheduling
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from media_worker_tasks import TEST_FUNCTIONS
    from scheduling import normal_scheduling

H, W, FPS, N = 64, 96, 30, 90  # test clips: 96x64, 30 fps, 3 s
_BITS = 12  # painted bits: indices up to 4095

# Our codec name -> (PyAV encoder, options).
_CODECS = {
    "h264": ("libx264", {"preset": "ultrafast"}),
    "h264-bframes": ("libx264", {"preset": "fast", "bf": "2"}),  # B-frames: pts != dts, negative index times
    "h264-veryfast": ("libx264", {"preset": "veryfast"}),  # 3 B-frames, b-pyramid: most B-frames non-reference
    "h264-medium": ("libx264", {"preset": "medium"}),  # libx264's default: b-pyramid, 3 reference frames
    # Alt-ref settings; this libvpx makes no hidden frames in one pass, but what it makes must stay exact.
    "vp9-altref": ("libvpx-vp9", {"deadline": "good", "cpu-used": "4", "auto-alt-ref": "1", "lag-in-frames": "16"}),
    # Three temporal sub-layers: non-reference pictures of lower sub-layers are read by higher ones.
    "hevc-layers": ("libx265", {"preset": "medium", "x265-params": "temporal-layers=3"}),
    "vp9": ("libvpx-vp9", {"deadline": "realtime", "cpu-used": "8"}),
    "hevc": ("libx265", {"preset": "ultrafast"}),
    "av1": ("libsvtav1", {"preset": "12"}),
    "mpeg4": ("mpeg4", {}),
}
_MUXERS = {"mp4": "mp4", "mov": "mov", "mkv": "matroska", "webm": "webm", "avi": "avi", "ts": "mpegts"}


def _paint(index: int) -> np.ndarray:
    img = np.full((H, W, 3), 128, np.uint8)
    for bit in range(_BITS):
        y, x = 16 * (bit // 6), 16 * (bit % 6)
        img[y:y + 16, x:x + 16] = 255 if index >> bit & 1 else 0
    yy, xx = np.mgrid[32:H, 0:W]
    img[32:] = ((xx + 3 * index + yy) % 256)[..., None]  # moving content: predicted frames do real work
    return img


def _read_index(img: np.ndarray) -> int:
    value = 0
    for bit in range(_BITS):
        y, x = 16 * (bit // 6), 16 * (bit % 6)
        value |= int(img[y + 4:y + 12, x + 4:x + 12].mean() > 128) << bit
    return value


@functools.lru_cache(maxsize=None)
def _video(container: str, codec: str, gop: int, n: int = N) -> bytes:
    encoder, options = _CODECS[codec]
    if encoder not in av.codecs_available:
        pytest.skip(f"this PyAV build has no {encoder} encoder")
    out = io.BytesIO()
    with av.open(out, "w", format=_MUXERS[container]) as c:
        stream = c.add_stream(encoder, rate=FPS)
        stream.width, stream.height, stream.pix_fmt, stream.gop_size = W, H, "yuv420p", gop
        if encoder == "libx265":  # x265 takes its keyframe settings (and log level) in its own parameter string
            params = f"keyint={gop}:min-keyint={gop}:scenecut=0:log-level=error"
            options = {**options, "x265-params": ":".join(filter(None, [params, options.get("x265-params")]))}
        stream.options = {**options, "keyint_min": str(gop), "sc_threshold": "0"}
        for i in range(n):
            c.mux(stream.encode(av.VideoFrame.from_ndarray(_paint(i), format="rgb24")))
        c.mux(stream.encode(None))
    if encoder == "libsvtav1":
        normal_scheduling()  # SVT-AV1 raised this thread to SCHED_FIFO (tests/scheduling.py)
    return out.getvalue()


def _painted(decoded: DecodedVideo) -> list[int]:
    return [_read_index(f) for f in decoded.frames]


def _code(excinfo: pytest.ExceptionInfo) -> str:
    return excinfo.value.code


def _gif_declaring(width: int, height: int) -> bytes:
    """A 35-byte GIF: a 1x1 image on a logical screen of width x height."""
    header = b"GIF89a" + struct.pack("<HH", width, height) + bytes([0x80, 0, 0]) + b"\0\0\0\xff\xff\xff"
    image = b"\x2c" + struct.pack("<HHHH", 0, 0, 1, 1) + b"\0" + b"\x02\x02\x44\x01\x00"
    return header + image + b"\x3b"


def _hours_long(container: str = "mp4") -> bytes:
    """A ~1.5 KB video of 3 tiny frames, one every 2 hours: it declares 6 hours."""
    out = io.BytesIO()
    with av.open(out, "w", format=_MUXERS[container]) as c:
        stream = c.add_stream("libx264", rate=Fraction(1, 7200))
        stream.width, stream.height, stream.pix_fmt, stream.options = 64, 48, "yuv420p", {"preset": "ultrafast"}
        for _ in range(3):
            c.mux(stream.encode(av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24")))
        c.mux(stream.encode(None))
    return out.getvalue()


# -- seek sampling returns exactly the requested frames -------------------------------------

_CASES = [("mp4", "h264", 1), ("mp4", "h264", 12), ("mp4", "h264", 60), ("mov", "h264", 12), ("mkv", "h264", 12),
          ("mkv", "h264", 60), ("webm", "vp9", 12), ("webm", "vp9", 60), ("mp4", "h264-bframes", 12),
          ("mp4", "hevc", 12), ("mkv", "av1", 12), ("mp4", "h264-veryfast", 12), ("mkv", "h264-medium", 60),
          ("webm", "vp9-altref", 12), ("mp4", "hevc-layers", 12)]


@pytest.mark.parametrize("container,codec,gop", _CASES, ids=[f"{c}-{k}-gop{g}" for c, k, g in _CASES])
def test_sampling_returns_exact_frames(container, codec, gop):
    data = _video(container, codec, gop)
    info = probe_video(data)
    assert (info.format, info.width, info.height, info.fps, info.frame_count) == (container, W, H, FPS, N)
    assert info.codec == codec.split("-")[0] and info.duration_s == pytest.approx(3.0, abs=0.05)
    cases = [  # (kwargs, expected frame indices: the first frame at or after each target instant)
        (dict(fps=2, start_s=0.1), [3, 18, 33, 48, 63, 78]),
        (dict(num_frames=5, start_s=0.5, end_s=2.5), [15, 27, 39, 51, 63]),  # every 0.4 s
        (dict(num_frames=4, end_s=1.0), [0, 8, 15, 23]),  # 7.5 and 22.5 round up to the next frame
        (dict(fps=60, start_s=2.9), [87, 88, 88, 89, 89, 90 - 1]),  # faster than the video: repeats
    ]
    for kwargs, expected in cases:
        out = decode_video(data, **kwargs)
        assert out.indices == expected, kwargs
        assert _painted(out) == expected, kwargs
        assert out.timestamps_s == pytest.approx([i / FPS for i in expected], abs=1e-3)  # matroska: ms
        assert out.frames.shape == (len(expected), H, W, 3) and not out.frames.flags.writeable
    every = decode_video(data)  # neither fps nor num_frames: every frame
    assert every.indices == _painted(every) == list(range(N))


# (container, codec, keyframe interval, whether non-reference frames get skipped)
_SKIP_CASES = [("mp4", "h264-bframes", 12, True), ("mp4", "h264-veryfast", 12, True), ("mp4", "h264-medium", 60, True),
               ("mkv", "h264-medium", 12, True), ("mp4", "hevc", 12, True), ("mkv", "hevc-layers", 60, True),
               ("mp4", "h264", 12, False),  # ultrafast: no B-frames, every frame a reference
               ("webm", "vp9-altref", 60, False), ("webm", "vp9", 12, False), ("mkv", "av1", 12, False)]


@pytest.mark.parametrize("container,codec,gop,skips", _SKIP_CASES,
                         ids=[f"{c}-{k}-gop{g}" for c, k, g, _ in _SKIP_CASES])
def test_skipping_nonref_frames_returns_the_same_pixels(container, codec, gop, skips, monkeypatch):
    data = _video(container, codec, gop)
    everything = decode_all_frames(data)
    assert everything.indices == _painted(everything) == list(range(N))
    samplings = [dict(fps=1), dict(fps=2, start_s=0.1), dict(fps=7, start_s=0.05), dict(num_frames=3, start_s=1.0),
                 dict(num_frames=5, start_s=0.5, end_s=2.5), dict(fps=10, start_s=2.0)]
    with_skips = plain = 0
    for kwargs in samplings:
        out = decode_video(data, **kwargs)
        assert _painted(out) == out.indices, kwargs
        np.testing.assert_array_equal(out.frames, everything.frames[out.indices], err_msg=str(kwargs))
        with monkeypatch.context() as m:
            m.setattr(media_video_seek, "SKIPPING_DECODERS", frozenset())  # as before skipping
            before = decode_video(data, **kwargs)
        assert before.indices == out.indices and before.timestamps_s == out.timestamps_s, kwargs
        np.testing.assert_array_equal(before.frames, out.frames, err_msg=str(kwargs))
        assert out.packets_decoded == before.packets_decoded and out.seeks == before.seeks
        with_skips, plain = with_skips + out.frames_decoded, plain + before.frames_decoded
    if skips:  # B-frames shown before a target were dropped undecoded
        assert with_skips < plain, (with_skips, plain)
    else:
        assert with_skips == plain


def test_skip_policy_per_decoder():
    def policy(container, codec, gop=12):
        with av.open(io.BytesIO(_video(container, codec, gop))) as c:
            return media_video_seek.nonref_skip_policy(c.streams.video[0].codec_context)

    assert policy("mp4", "h264-medium") is not None and policy("ts", "h264") is not None  # H.264: any stream
    assert policy("webm", "vp9") is None and policy("mkv", "av1") is None  # libdav1d: read once, at open
    may_skip = policy("mkv", "hevc-layers", 60)
    with av.open(io.BytesIO(_video("mkv", "hevc-layers", 60))) as c:
        allowed = [may_skip(p) for p in c.demux(c.streams.video[0]) if p.size]
    assert any(allowed) and not all(allowed)  # the top temporal sub-layer only


@pytest.mark.parametrize("container,codec", [("avi", "mpeg4"), ("ts", "h264")])
def test_avi_and_mpegts_when_allowed(container, codec):
    data = _video(container, codec, 12)
    with pytest.raises(MediaError) as e:
        probe_video(data)  # not in the default formats: their demuxers never even run
    assert _code(e) == "media_format"
    limits = VideoDecodeLimits(formats=("avi", "ts"))
    assert probe_video(data, limits).format == container
    out = decode_video(data, limits, fps=2, start_s=0.1)  # TS has no keyframe index: seeks land mid-GOP
    assert out.indices == _painted(out) == [3, 18, 33, 48, 63, 78]


@pytest.mark.parametrize("container,codec", [("mp4", "h264"), ("mkv", "h264"), ("webm", "vp9")])
def test_sparse_targets_seek_to_keyframes(container, codec):
    data = _video(container, codec, gop=12, n=150)
    out = decode_video(data, fps=1)  # targets 0, 30, 60, 90, 120; keyframes every 12 frames
    assert out.indices == _painted(out) == [0, 30, 60, 90, 120]
    assert out.seeks == 5  # each target has a keyframe (24, 60, 84, 120) past the previous one
    assert out.frames_decoded <= 20  # 1 + 7 + 1 + 7 + 1, plus codec delay; decoding all would be 150
    everything = decode_all_frames(data, every_nth=30)
    assert everything.indices == out.indices and everything.frames_decoded == 150
    np.testing.assert_array_equal(everything.frames, out.frames)


def test_close_targets_decode_forward_without_seeking_again():
    data = _video("mp4", "h264", gop=60)
    out = decode_video(data, num_frames=6, end_s=1.0)  # frames 0, 5, ... 25: one GOP
    assert out.indices == _painted(out) == [0, 5, 10, 15, 20, 25]
    assert out.seeks == 1 and out.frames_decoded == 26


def test_content_hash_names_bytes_and_config():
    data = _video("mp4", "h264", 12)
    a, b = decode_video(data, fps=2), decode_video(data, fps=2)
    assert a.content_hash == b.content_hash
    assert decode_video(data, fps=3).content_hash != a.content_hash
    assert decode_video(_video("mp4", "h264", 60), fps=2).content_hash != a.content_hash
    back = pickle.loads(pickle.dumps(a))  # as it crosses the worker pipe
    assert back.indices == a.indices and not back.frames.flags.writeable


def test_sampling_arguments_are_validated():
    for kwargs in (dict(fps=1, num_frames=2), dict(fps=0), dict(num_frames=0), dict(start_s=-1),
                   dict(start_s=2, end_s=1)):
        with pytest.raises(ValueError):
            VideoSampling(**kwargs)


# -- limits, checked on headers before decoding ----------------------------------------------

def test_hours_long_tiny_file_is_rejected_from_its_header():
    for container in ("mp4", "mkv"):
        data = _hours_long(container)
        assert len(data) < 3000
        with pytest.raises(MediaError) as e:
            probe_video(data)
        assert _code(e) == "media_duration" and "21600.0 s" in e.value.message and "3600" in e.value.message


def test_pixel_bomb_is_rejected_from_its_header():
    with pytest.raises(MediaError) as e:
        decode_video(_gif_declaring(16000, 16000))  # decoding would fill a 1 GB canvas
    assert _code(e) == "media_pixels" and "16000x16000" in e.value.message
    with pytest.raises(MediaError) as e:
        probe_video(_video("mp4", "h264", 12), VideoDecodeLimits(max_pixels=W * H - 1))
    assert _code(e) == "media_pixels"


def test_frame_and_decoded_size_limits():
    data = _video("mp4", "h264", 12)
    with pytest.raises(MediaError) as e:
        decode_video(data, VideoDecodeLimits(max_frames=5), fps=2)
    assert _code(e) == "media_frames" and "6 frames" in e.value.message and "limit is 5" in e.value.message
    assert probe_video(data, VideoDecodeLimits(max_frames=5)).frame_count == N  # no sampling asked: no check
    with pytest.raises(MediaError) as e:
        probe_video(data, VideoDecodeLimits(max_frames=5), sampling=VideoSampling(num_frames=6))
    assert _code(e) == "media_frames"
    with pytest.raises(MediaError) as e:  # every frame: 90 * 96 * 64 * 3 bytes = 1.6 MB
        decode_video(data, VideoDecodeLimits(max_decoded_mb=1))
    assert _code(e) == "media_frames" and "max_decoded_mb=1" in e.value.message
    with pytest.raises(MediaError) as e:
        decode_video(data, start_s=5.0)
    assert _code(e) == "media_duration" and e.value.param == "start_s"


def test_bytes_and_format_limits():
    data = _video("webm", "vp9", 12)
    with pytest.raises(MediaError) as e:
        decode_video(data, VideoDecodeLimits(max_bytes=len(data) - 1))
    assert _code(e) == "media_bytes"
    with pytest.raises(MediaError) as e:
        probe_video(data, VideoDecodeLimits(formats=("mkv",)))  # same demuxer, other DocType
    assert _code(e) == "media_format" and "webm" in e.value.message
    with pytest.raises(MediaError) as e:
        probe_video(data, VideoDecodeLimits(formats=("mp4",)))  # the matroska demuxer may not even run
    assert _code(e) == "media_format"
    with pytest.raises(ValueError, match="unknown"):
        VideoDecodeLimits(formats=("flv",))


def test_garbage_and_truncated_input_is_media_corrupt():
    mp4 = _video("mp4", "h264", 12)
    for data in (b"", b"not a video" * 50, mp4[: len(mp4) // 2], mp4[:64]):
        with pytest.raises(MediaError) as e:
            decode_video(data, fps=1)
        assert _code(e) == "media_corrupt", len(data)


def test_damaged_files_fail_cleanly():
    rng = np.random.default_rng(0)
    for container, codec in (("mp4", "h264"), ("webm", "vp9"), ("mkv", "h264")):
        data = _video(container, codec, 12)
        variants = [data[:cut] for cut in (len(data) // 3, len(data) * 2 // 3, len(data) - 7)]
        for _ in range(12):
            flipped = bytearray(data)
            for pos in rng.integers(0, len(data), 8):
                flipped[pos] ^= 1 << int(rng.integers(0, 8))
            variants.append(bytes(flipped))
        for damaged in variants:
            try:
                out = decode_video(damaged, fps=5)
            except MediaError as e:  # any other exception type fails the test
                assert e.code in {"media_corrupt", "media_format", "media_duration", "media_pixels", "media_frames"}
            else:
                assert out.frames.shape[1:] == (H, W, 3)


# -- in a media worker -------------------------------------------------------------------------

def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the worker's peak RSS from /proc")
def test_decode_in_worker_and_bombs_stay_small():
    data = _video("mp4", "h264", 12)
    assert {"probe_video", "decode_video", "encode_video"} <= set(WORKER_FUNCTIONS)
    assert worker_function("decode_video") is decode_video
    with MediaPool(workers=1, task_cpu_s=30, task_memory_mb=1024, task_timeout_s=60,
                   extra_functions=TEST_FUNCTIONS) as pool:
        out = pool.run("decode_video", data, fps=2, start_s=0.1)
        assert out.indices == _painted(out) == [3, 18, 33, 48, 63, 78] and not out.frames.flags.writeable
        pid = pool.run("_test_echo", None)[0]
        before = _peak_rss_mb(pid)
        for bomb, code in ((_gif_declaring(16000, 16000), "media_pixels"), (_hours_long(), "media_duration")):
            with pytest.raises(MediaError) as e:
                pool.run("decode_video", bomb, fps=1)
            assert _code(e) == code
        assert pool.run("_test_echo", None)[0] == pid  # same worker: rejected, not crashed
        assert _peak_rss_mb(pid) - before < 20  # the GIF alone would need 1 GB of canvas


# -- encoding ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,max_error", [("mp4", 6), ("webm", 8), ("gif", 6)])
def test_encode_round_trip(fmt, max_error):
    src = np.stack([_paint(i) for i in range(20)])
    data = encode_video(src, 10, fmt)
    out = decode_video(data)
    assert out.format == fmt and (out.width, out.height) == (W, H)
    assert out.frames.shape == src.shape and _painted(out) == list(range(20))
    assert out.fps == pytest.approx(10) and out.duration_s == pytest.approx(2.0, abs=0.05)
    assert np.abs(out.frames.astype(int) - src).mean() < max_error
    if fmt != "gif":
        assert len(encode_video(src, 10, fmt, crf=50)) < len(data)  # crf reaches the encoder


def test_encode_odd_sizes():
    src = np.stack([_paint(i)[:33, :47] for i in range(4)])
    assert decode_video(encode_video(src, 8, "mp4")).frames.shape == (4, 34, 48, 3)  # H.264 4:2:0: padded
    for fmt in ("webm", "gif"):
        assert decode_video(encode_video(src, 8, fmt)).frames.shape == (4, 33, 47, 3)


def test_encode_rejects_bad_arguments():
    frames = np.zeros((2, 16, 16, 3), np.uint8)
    with pytest.raises(MediaError) as e:
        encode_video(frames, 10, "avi")
    assert _code(e) == "media_format"
    for bad in (frames[0], frames.astype(np.float32), frames[..., :1]):
        with pytest.raises(ValueError, match=r"\[T, H, W, 3\]"):
            encode_video(bad, 10, "mp4")
    with pytest.raises(ValueError, match="crf"):
        encode_video(frames, 10, "gif", crf=20)
    with pytest.raises(ValueError, match="crf"):
        encode_video(frames, 10, "mp4", crf=60)


def test_fragmented_mp4_chunks_concatenate_to_one_video():
    writer = FragmentedMP4Writer(W, H, FPS, fragment_s=0.2)  # a keyframe, so a fragment, every 6 frames
    chunks = [writer.write(np.stack([_paint(i) for i in range(start, start + 10)])) for start in range(0, 40, 10)]
    chunks.append(writer.close())
    assert writer.close() == b""
    assert chunks[0][4:8] == b"ftyp" and b"moov" in chunks[0]
    assert all(c[4:8] == b"moof" for c in chunks[1:] if c) and sum(bool(c) for c in chunks[1:]) >= 3
    out = decode_video(b"".join(chunks))
    assert out.format == "mp4" and _painted(out) == list(range(40))
    with pytest.raises(ValueError, match="96x64"):
        FragmentedMP4Writer(W, H, FPS).write(np.zeros((1, H, W + 2, 3), np.uint8))


# -- the benchmark script ----------------------------------------------------------------------

def test_benchmark_script_prints_speedup(tmp_path):
    script = Path(__file__).resolve().parent.parent / "examples" / "bench_video_sampling.py"
    run = subprocess.run([sys.executable, str(script), "--seconds", "4", "--fps", "10", "--width", "128",
                          "--height", "96", "--gop", "20", "--repeats", "1", "--preset", "ultrafast", "veryfast",
                          "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    ratios = re.findall(r"^speedup: ([0-9.]+)x", run.stdout, re.M)
    assert len(ratios) == 2 and all(float(r) > 0 and math.isfinite(float(r)) for r in ratios), run.stdout
    bounds = [float(b) for b in re.findall(r"^ideal speedup .*?: ([0-9.]+)x", run.stdout, re.M)]
    assert len(bounds) == 2 and bounds[1] > bounds[0] >= 1, run.stdout  # B-frames: fewer frames are needed
    assert run.stdout.count("identical all three ways") == 2 and "== summary" in run.stdout
    for preset in ("ultrafast", "veryfast"):
        assert (tmp_path / f"clip_4s_10fps_128x96_gop20_{preset}.mp4").exists()
