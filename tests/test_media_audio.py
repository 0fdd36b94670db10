"""Audio probe / decode / encode (stages.media.audio). CPU only, offline; media made in memory."""

from __future__ import annotations

import io
import pickle
import shutil
import struct
import subprocess
import tracemalloc

import av
import numpy as np
import pytest

from stages.media.audio import (
    AudioDecodeLimits,
    AudioStreamEncoder,
    DecodedAudio,
    RawPCM,
    decode_audio,
    encode_audio,
    probe_audio,
)
from stages.media.image import MediaError
from stages.media.pool import MediaPool

RATE = 16_000


def _sine(freq: float = 440.0, seconds: float = 1.0, rate: int = RATE, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)  # [N]


def _peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum)) * rate / len(samples)


def _av_file(muxer: str, codec: str, samples: np.ndarray, rate: int, codec_rate: int | None = None) -> bytes:
    """Containers encode_audio does not write (webm, m4a), made with PyAV directly."""
    out = io.BytesIO()
    with av.open(out, "w", format=muxer) as container:
        stream = container.add_stream(codec, rate=codec_rate or rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def _code(excinfo: pytest.ExceptionInfo) -> str:
    return excinfo.value.code


# -- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,container,codec", [
    ("wav", "wav", "pcm_s16le"), ("mp3", "mp3", "mp3"), ("opus", "ogg", "opus"), ("flac", "flac", "flac"),
    ("aac", "aac", "aac"),
])
@pytest.mark.parametrize("channels", [1, 2])
def test_encoded_formats_round_trip(fmt, container, codec, channels):
    src = _sine(440.0, 1.0, 24_000)
    data = encode_audio(src if channels == 1 else np.stack([src, src], axis=1), 24_000, fmt)
    info = probe_audio(data)
    assert (info.format, info.codec, info.channels) == (container, codec, channels)
    out = decode_audio(data)
    assert out.samples.dtype == np.float32 and out.samples.ndim == 1 and out.sample_rate == RATE
    assert abs(_peak_hz(out.samples, RATE) - 440.0) < 3
    # Codec delay: AAC in ADTS keeps its 1024 priming samples (~43 ms at 24 kHz).
    assert abs(out.duration_s - 1.0) < 0.1
    assert np.abs(out.samples).max() <= 1.0
    assert abs(np.sqrt(np.mean(out.samples ** 2)) - 0.5 / np.sqrt(2)) < 0.05  # mono down-mix averages


@pytest.mark.parametrize("fmt", ["wav", "flac"])
@pytest.mark.parametrize("channels", [1, 2])
def test_lossless_round_trip_is_exact_up_to_int16(fmt, channels):
    rng = np.random.default_rng(0)
    src = rng.uniform(-1, 1, size=(4000, channels)).astype(np.float32)
    src[:, -1] = src[:, 0]  # equal channels: the average down-mix is then exact too
    out = decode_audio(encode_audio(src, RATE, fmt), sample_rate=RATE)
    assert out.source_channels == channels and len(out.samples) == len(src)
    # Encode rounds to x * 32767; FFmpeg decodes s16 as v / 32768.
    np.testing.assert_array_equal(out.samples * 32768, np.round(src[:, 0] * 32767))


@pytest.mark.parametrize("channels", [3, 6, 8])
def test_flac_with_more_channels_round_trips(channels):
    src = np.stack([_sine(440.0, 0.5)] * channels, axis=1)  # FLAC takes up to 8 channels (2.1 ... 7.1)
    data = encode_audio(src, RATE, "flac")
    assert probe_audio(data).channels == channels
    assert abs(_peak_hz(decode_audio(data, sample_rate=RATE).samples, RATE) - 440.0) < 3


def test_pcm_round_trip_is_exact_and_needs_rawpcm():
    src = _sine(1000.0, 0.5)
    data = encode_audio(src, RATE, "pcm")
    assert len(data) == 2 * len(src)  # headerless s16le
    out = decode_audio(data, sample_rate=RATE, raw=RawPCM("s16le", RATE, 1))
    np.testing.assert_array_equal(out.samples * 32768, np.round(src * 32767))
    assert out.source_format == "pcm"
    floats = decode_audio(src.astype("<f4").tobytes(), sample_rate=RATE, raw=RawPCM("f32le", RATE, 1))
    np.testing.assert_array_equal(floats.samples, src)  # already mono flt at the asked rate: untouched
    with pytest.raises(MediaError) as e:
        decode_audio(data)  # no header to sniff
    assert _code(e) == "media_format" and "RawPCM" in e.value.message


@pytest.mark.parametrize("muxer,codec,fmt,codec_rate", [("webm", "libopus", "webm", 48_000),
                                                        ("matroska", "libopus", "webm", 48_000),
                                                        ("ipod", "aac", "m4a", None),
                                                        ("mp4", "aac", "m4a", None)])
def test_containers_made_elsewhere_decode(muxer, codec, fmt, codec_rate):
    data = _av_file(muxer, codec, _sine(440.0, 1.0), RATE, codec_rate)
    out = decode_audio(data)
    assert out.source_format == fmt
    assert abs(_peak_hz(out.samples, RATE) - 440.0) < 3 and abs(out.duration_s - 1.0) < 0.1


def test_codec_outside_the_containers_allowlist_is_refused():
    data = _av_file("matroska", "libmp3lame", _sine(), RATE)  # MP3 in Matroska: valid, but not accepted as webm
    with pytest.raises(MediaError) as e:
        probe_audio(data)
    assert _code(e) == "media_format" and "codec mp3" in e.value.message


@pytest.mark.parametrize("rate", [44_100, 48_000])
def test_stereo_resampled_to_16k_mono_keeps_frequency(rate):
    left, right = _sine(1000.0, 1.0, rate, 0.4), _sine(1000.0, 1.0, rate, 0.2)
    out = decode_audio(encode_audio(np.stack([left, right], axis=1), rate, "wav"), sample_rate=RATE)
    assert (out.source_sample_rate, out.source_channels, out.sample_rate) == (rate, 2, RATE)
    assert len(out.samples) == pytest.approx(RATE, abs=2)
    assert abs(_peak_hz(out.samples, RATE) - 1000.0) < 2
    assert np.abs(out.samples[100:-100]).max() == pytest.approx(0.3, abs=0.01)  # (0.4 + 0.2) / 2


@pytest.mark.parametrize("fmt,channels", [("s16le", 1), ("s16le", 2), ("f32le", 1), ("f32le", 2)])
def test_raw_pcm_input(fmt, channels):
    src = _sine(300.0, 0.5, 8000)
    frames = np.repeat(src[:, None], channels, axis=1)  # [N, C] interleaved
    data = (np.round(frames * 32767).astype("<i2") if fmt == "s16le" else frames.astype("<f4")).tobytes()
    out = decode_audio(data + b"\x01", raw=RawPCM(fmt, 8000, channels))  # a stray partial sample is dropped
    assert (out.source_channels, out.source_sample_rate) == (channels, 8000)
    assert abs(out.duration_s - 0.5) < 0.01 and abs(_peak_hz(out.samples, RATE) - 300.0) < 3
    with pytest.raises(ValueError, match="RawPCM.format"):
        RawPCM("s24le", 8000, 1)


def test_decoded_audio_is_read_only_and_hashed_with_its_config():
    data = encode_audio(_sine(), RATE, "wav")
    a, b, c = decode_audio(data), decode_audio(data), decode_audio(data, sample_rate=8000)
    assert a.content_hash == b.content_hash != c.content_hash
    assert not a.samples.flags.writeable
    back = pickle.loads(pickle.dumps(a))  # the way results come back from a worker
    assert isinstance(back, DecodedAudio) and not back.samples.flags.writeable


def test_encode_rejects_bad_requests():
    with pytest.raises(MediaError) as e:
        encode_audio(_sine(), RATE, "wma")
    assert _code(e) == "media_format" and e.value.param == "response_format"
    with pytest.raises(ValueError, match="float"):
        encode_audio(np.zeros(10, np.int16), RATE, "wav")
    with pytest.raises(ValueError, match="channels"):
        encode_audio(np.zeros((10, 3), np.float32), RATE, "mp3")


def test_bitrate_reaches_the_encoder():
    src = _sine(440.0, 2.0)
    assert len(encode_audio(src, RATE, "mp3", bitrate=32_000)) < len(encode_audio(src, RATE, "mp3", bitrate=96_000))


# -- streaming encoder -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["wav", "pcm", "mp3", "opus", "aac", "flac"])
def test_stream_encoder_chunks_concatenate_to_the_whole_signal(fmt):
    src = _sine(440.0, 2.0, 24_000)
    encoder = AudioStreamEncoder(fmt, 24_000)
    parts = [encoder.write(src[i:i + 2400]) for i in range(0, len(src), 2400)]  # 100 ms chunks
    tail = encoder.close()
    assert encoder.close() == b""
    # Bytes flow while writing, not only at close: at least one per 300 ms of audio.
    assert sum(1 for p in parts if p) >= len(parts) // 3
    data = b"".join(parts) + tail
    if fmt == "wav":
        assert data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"  # length unknown
    if fmt == "pcm":
        assert all(len(p) == 2 * 2400 for p in parts)
    out = decode_audio(data, raw=RawPCM("s16le", 24_000, 1) if fmt == "pcm" else None)
    assert abs(_peak_hz(out.samples, RATE) - 440.0) < 3 and abs(out.duration_s - 2.0) < 0.1


def test_streamed_wav_length_comes_from_the_bytes():
    encoder = AudioStreamEncoder("wav", RATE)
    data = encoder.write(_sine(440.0, 1.5)) + encoder.close()
    info = probe_audio(data)
    assert info.duration_s == pytest.approx(1.5, abs=0.01)  # not the ~37 h the 0xFFFFFFFF size implies


# -- limits ------------------------------------------------------------------------------------

def test_over_long_audio_is_refused_at_the_header():
    data = encode_audio(_sine(440.0, 3.0), RATE, "opus")
    with pytest.raises(MediaError) as e:
        probe_audio(data, AudioDecodeLimits(max_duration_s=2))
    assert _code(e) == "media_duration" and "max_duration_s=2" in e.value.message
    with pytest.raises(MediaError) as e:
        decode_audio(data, AudioDecodeLimits(max_duration_s=2))
    assert _code(e) == "media_duration"


def test_decoded_size_limit_counts_the_requested_rate():
    data = encode_audio(_sine(440.0, 1.0), RATE, "wav")
    limits = AudioDecodeLimits(max_decoded_mb=0.1)  # 1 s: 62.5 KB at 16 kHz, 187.5 KB at 48 kHz
    assert len(decode_audio(data, limits).samples) == RATE
    with pytest.raises(MediaError) as e:
        decode_audio(data, limits, sample_rate=48_000)
    assert _code(e) == "media_duration" and "max_decoded_mb" in e.value.message


def test_too_many_channels_and_too_many_bytes():
    data = encode_audio(np.zeros((RATE, 4), np.float32), RATE, "wav")
    with pytest.raises(MediaError) as e:
        probe_audio(data, AudioDecodeLimits(max_channels=2))
    assert _code(e) == "media_format" and "4 channels" in e.value.message
    with pytest.raises(MediaError) as e:
        decode_audio(data, AudioDecodeLimits(max_bytes=1000))
    assert _code(e) == "media_bytes" and "1000" in e.value.message


def test_formats_outside_the_limits_are_refused():
    with pytest.raises(MediaError) as e:
        decode_audio(encode_audio(_sine(), RATE, "mp3"), AudioDecodeLimits(formats=("wav", "flac")))
    assert _code(e) == "media_format" and "mp3" in e.value.message
    with pytest.raises(ValueError, match="unknown"):
        AudioDecodeLimits(formats=("wma",))


def test_wav_header_claiming_hours_is_capped_by_its_bytes():
    data = bytearray(encode_audio(_sine(440.0, 1.0), RATE, "wav"))
    data[4:8] = struct.pack("<I", 0xFFFFFFF0)  # RIFF size
    data[40:44] = struct.pack("<I", 0xFFFFFFC0)  # data size: ~37 hours of 16 kHz s16 mono
    assert probe_audio(bytes(data)).duration_s == pytest.approx(1.0, abs=0.01)
    tracemalloc.start()  # numpy's buffers are traced: the output, not the claim, sizes them
    out = decode_audio(bytes(data), AudioDecodeLimits(max_duration_s=60))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out.duration_s == pytest.approx(1.0, abs=0.01)
    assert peak < 2 * 1024 * 1024


def test_header_understating_the_length_is_stopped_while_decoding():
    data = bytearray(encode_audio(_sine(440.0, 10.0), RATE, "flac"))
    # STREAMINFO's 36-bit total-samples field (file bytes 18..25, low bits) now says 1 s.
    word = struct.unpack(">Q", data[18:26])[0]
    data[18:26] = struct.pack(">Q", (word & ~((1 << 36) - 1)) | RATE)
    limits = AudioDecodeLimits(max_duration_s=5)
    assert probe_audio(bytes(data), limits).duration_s == pytest.approx(1.0)  # the header passes
    with pytest.raises(MediaError) as e:
        decode_audio(bytes(data), limits)
    assert _code(e) == "media_duration" and "the header said 1.0 s" in e.value.message


def test_stream_without_a_length_is_bounded_while_decoding():
    encoder = AudioStreamEncoder("flac", RATE)  # streamed FLAC: STREAMINFO holds no total
    data = encoder.write(_sine(440.0, 3.0)) + encoder.close()
    assert probe_audio(data).duration_s is None
    with pytest.raises(MediaError) as e:
        decode_audio(data, AudioDecodeLimits(max_duration_s=2))
    assert _code(e) == "media_duration"


# -- malformed input ---------------------------------------------------------------------------

def _seed_files() -> dict[str, bytes]:
    src = _sine(440.0, 0.5)
    files = {fmt: encode_audio(src, RATE, fmt) for fmt in ("wav", "mp3", "opus", "flac", "aac")}
    files["webm"] = _av_file("webm", "libopus", src, RATE, 48_000)
    files["m4a"] = _av_file("ipod", "aac", src, RATE)
    return files


def test_malformed_inputs_only_raise_media_errors():
    rng = np.random.default_rng(1234)
    seeds = _seed_files()
    codes: dict[str, int] = {}
    for i in range(420):  # 60 per format: truncated, bit-flipped, header smashed, magic + garbage
        name = list(seeds)[i % len(seeds)]
        data = bytearray(seeds[name])
        kind = i // len(seeds) % 4
        if kind == 0:
            data = data[:rng.integers(0, len(data))]
        elif kind == 1:
            for _ in range(rng.integers(1, 20)):
                j = rng.integers(0, len(data))
                data[j] ^= 1 << int(rng.integers(0, 8))
        elif kind == 2:
            j = rng.integers(0, min(len(data), 200))
            data[j:j + 16] = rng.bytes(16)
        else:
            data = data[:rng.integers(4, 40)] + rng.bytes(int(rng.integers(0, 3000)))
        try:
            out = decode_audio(bytes(data))
            assert np.isfinite(out.samples).all() and np.abs(out.samples).max(initial=0) <= 1.0
            codes["ok"] = codes.get("ok", 0) + 1
        except MediaError as e:
            # A mangled length field may legitimately read as hours: media_duration.
            assert e.code in ("media_corrupt", "media_format", "media_duration"), (name, kind, e)
            codes[e.code] = codes.get(e.code, 0) + 1
    assert codes.get("media_corrupt", 0) > 50  # the cases reached the demuxers and decoders


@pytest.mark.parametrize("data", [b"", b"RIFF", b"OggS" + b"\x00" * 40, b"\x1a\x45\xdf\xa3", b"fLaC" + b"\x00" * 100,
                                  b"ID3\x04\x00\x00\x7f\x7f\x7f\x7f", b"\xff\xfb" * 50, b"not audio at all"])
def test_tiny_and_garbage_inputs(data):
    with pytest.raises(MediaError) as e:
        decode_audio(data)
    assert _code(e) in ("media_corrupt", "media_format")


# -- isolation, real speech --------------------------------------------------------------------

def test_decode_runs_in_a_media_worker():
    data = encode_audio(_sine(440.0, 1.0, 44_100), 44_100, "mp3")
    with MediaPool(workers=1, task_cpu_s=10, task_memory_mb=2048, task_timeout_s=30) as pool:
        out = pool.run("decode_audio", data, sample_rate=RATE, timeout=60)
        info = pool.run("probe_audio", data, timeout=60)
        with pytest.raises(MediaError) as e:
            pool.run("decode_audio", data[:100] + b"\x00" * 500, timeout=60)
    assert isinstance(out, DecodedAudio) and not out.samples.flags.writeable
    assert abs(_peak_hz(out.samples, RATE) - 440.0) < 3 and info.sample_rate == 44_100
    assert _code(e) in ("media_corrupt", "media_format")


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
def test_real_speech_from_espeak_decodes():
    wav = subprocess.run(["espeak-ng", "--stdout", "The quick brown fox jumps over the lazy dog."],
                         capture_output=True, check=True, timeout=30).stdout
    out = decode_audio(wav)
    assert out.source_format == "wav" and 1.0 < out.duration_s < 10.0
    assert np.sqrt(np.mean(out.samples ** 2)) > 0.01  # speech, not silence
