"""Fuzzing the decoders: random, truncated, bit-flipped and lying inputs give a MediaError, never
another exception, a crash or a hang; and through the server, a clean 4xx that harms no one."""

from __future__ import annotations

import io
import struct
import zlib

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from stages.media.image import ImageDecodeLimits, MediaError, decode_image, encode_image

SMALL = ImageDecodeLimits(max_bytes=1 << 20, max_pixels=512 * 512)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _samples() -> dict[str, bytes]:
    pixels = (np.random.RandomState(0).rand(24, 32, 3) * 255).astype("uint8")
    out = {fmt: encode_image(pixels, fmt) for fmt in ("png", "jpeg", "webp")}
    for fmt in ("gif", "bmp", "tiff"):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format=fmt.upper())
        out[fmt] = buf.getvalue()
    return out


SAMPLES = _samples()


def _decodes_or_refuses(data: bytes) -> None:
    try:
        decoded = decode_image(data, SMALL)
    except MediaError as e:
        assert e.code.startswith("media_"), e.code
        return
    assert decoded.width * decoded.height <= SMALL.max_pixels
    assert decoded.pixels.shape[:2] == (decoded.height, decoded.width)


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes(data):
    _decodes_or_refuses(data)


@FUZZ
@given(st.sampled_from(sorted(SAMPLES)), st.floats(0, 1))
def test_truncated_files(fmt, fraction):
    data = SAMPLES[fmt]
    _decodes_or_refuses(data[: int(len(data) * fraction)])


@FUZZ
@given(st.sampled_from(sorted(SAMPLES)), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 7)),
                                                   min_size=1, max_size=8))
def test_bit_flips(fmt, flips):
    data = bytearray(SAMPLES[fmt])
    for pos, bit in flips:
        data[pos % len(data)] ^= 1 << bit
    _decodes_or_refuses(bytes(data))


def _png_declaring(width: int, height: int) -> bytes:
    """A valid small PNG whose IHDR is rewritten to declare width x height (CRC fixed)."""
    data = bytearray(SAMPLES["png"])
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr) & 0xFFFFFFFF)
    return bytes(data)


@FUZZ
@given(st.integers(1, (1 << 31) - 1), st.integers(1, (1 << 31) - 1))
def test_lying_headers(width, height):
    data = _png_declaring(width, height)
    if width * height > SMALL.max_pixels:
        with pytest.raises(MediaError) as err:
            decode_image(data, SMALL)
        assert err.value.code in ("media_pixels", "media_corrupt")
    else:
        _decodes_or_refuses(data)


# -- video and audio ---------------------------------------------------------------------------

def _media_samples() -> dict[str, tuple[str, bytes]]:
    from stages.media.audio import encode_audio
    from stages.media.video import encode_video

    frames = (np.random.RandomState(1).rand(6, 32, 32, 3) * 255).astype("uint8")
    tone = np.sin(np.linspace(0, 200 * np.pi, 8000)).astype("float32") * 0.5
    out = {f"video/{fmt}": ("video", encode_video(frames, 6, fmt)) for fmt in ("mp4", "webm", "gif")}
    out.update({f"audio/{fmt}": ("audio", encode_audio(tone, 16000, fmt))
                for fmt in ("wav", "mp3", "opus", "flac", "aac")})
    return out


MEDIA = _media_samples()


def _av_decodes_or_refuses(kind: str, data: bytes) -> None:
    from stages.media.audio import AudioDecodeLimits, decode_audio
    from stages.media.video import VideoDecodeLimits, decode_video

    try:
        if kind == "video":
            out = decode_video(data, VideoDecodeLimits(max_bytes=1 << 20, max_frames=64), num_frames=4)
            assert out.frames.shape[0] <= 64
        else:
            out = decode_audio(data, AudioDecodeLimits(max_bytes=1 << 20, max_duration_s=60))
            assert out.samples.ndim == 1 and len(out.samples) <= 60 * out.sample_rate
    except MediaError as e:
        assert e.code.startswith("media_"), e.code


@FUZZ
@given(st.sampled_from(sorted(MEDIA)), st.floats(0, 1),
       st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6))
def test_video_and_audio_truncated_and_corrupted(name, fraction, edits):
    kind, data = MEDIA[name]
    data = bytearray(data[: max(1, int(len(data) * fraction))])
    for pos, value in edits:
        data[pos % len(data)] = value
    _av_decodes_or_refuses(kind, bytes(data))


@FUZZ
@given(st.sampled_from(["video", "audio"]), st.binary(max_size=2048))
def test_video_and_audio_random_bytes(kind, data):
    _av_decodes_or_refuses(kind, data)


# -- through the server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, sd_path):
    from tests.test_serve_support import Server

    srv = Server(tmp_path_factory.mktemp("fuzz"), f'[[models]]\nname = "sd"\npath = "{sd_path}"\n')
    yield srv
    srv.stop()


def _edit(url: str, image: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/edits", data={"model": "sd", "prompt": "x", "num_inference_steps": "2"},
                      files={"image": ("in.png", image, "image/png")}, timeout=60)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(sorted(SAMPLES)), cut=st.floats(0, 0.95),
       flips=st.lists(st.integers(0, 1 << 20), max_size=4))
def test_server_answers_bad_uploads_with_4xx(server, fmt, cut, flips):
    data = bytearray(SAMPLES[fmt][: max(1, int(len(SAMPLES[fmt]) * cut))])
    for pos in flips:
        data[pos % len(data)] ^= 0x5A
    reply = _edit(server.url, bytes(data))
    assert reply.status_code < 500, reply.text
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert error["param"] == "image" and error["message"]


def test_server_unharmed_after_fuzzing(server):
    good = _edit(server.url, SAMPLES["png"])
    assert good.status_code == 200, good.text
    assert httpx.get(f"{server.url}/health").status_code == 200
    bomb = _edit(server.url, _png_declaring(50_000, 50_000))
    assert bomb.status_code == 413 and bomb.json()["error"]["code"] == "media_pixels"
