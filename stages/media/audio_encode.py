"""Audio encoding, whole or chunk by chunk, for media worker processes.

WAV and PCM are written with numpy (exact, and trivially streamable). MP3, Opus, FLAC and AAC
go through PyAV. AAC is written as ADTS, not M4A: it is what OpenAI's /v1/audio/speech returns
for "aac" (audio/aac), and every ADTS frame carries its own header, so a stream can be cut and
concatenated anywhere on a frame boundary, where M4A needs its index written at the end.
Imports only the stdlib, numpy and av (never torch).
"""

from __future__ import annotations

import io
import struct
from fractions import Fraction

import av
import numpy as np

from stages.media.image import MediaError

ENCODE_FORMATS = ("wav", "pcm", "mp3", "opus", "flac", "aac")
# fmt -> (PyAV muxer, encoder, default bit rate per channel; None = lossless)
_AV_ENCODERS = {
    "mp3": ("mp3", "libmp3lame", 64_000),
    "opus": ("ogg", "libopus", 32_000),
    "flac": ("flac", "flac", None),
    "aac": ("adts", "aac", 96_000),  # FFmpeg's native AAC needs more than LAME to sound clean
}
_OPUS_RATE = 48_000  # Ogg Opus is always written at 48 kHz; decoders output 48 kHz anyway
# Ogg pages are flushed every 100 ms of audio (FFmpeg's default is 1 s): a streamed chunk then
# reaches the client within ~100 ms, for ~2 kbit/s of page headers.
_OGG_PAGE_US = 100_000
_WAV_STREAMING_SIZE = 0xFFFFFFFF  # "unknown length" in the RIFF and data sizes, as FFmpeg writes when streaming


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str, *, bitrate: int | None = None) -> bytes:
    """Encode float32 samples [N] (mono) or [N, C] as wav, pcm (raw s16le), mp3, opus (Ogg), flac or aac (ADTS).

    Values are clipped to [-1, 1]. `bitrate` (bits/s) applies to mp3, opus and aac; the
    lossless formats ignore it. Opus is resampled to 48 kHz, mp3/aac to the nearest rate the
    codec supports.
    """
    channels = 1 if np.ndim(samples) == 1 else int(np.shape(samples)[1])
    fmt = _check_request(fmt, sample_rate, channels, bitrate)
    pcm = _as_float32(samples, channels)  # [N, C]
    if fmt == "pcm":
        return _to_s16le(pcm)
    if fmt == "wav":
        data = _to_s16le(pcm)
        return _wav_header(sample_rate, channels, len(data)) + data
    # A seekable output lets muxers finish their headers (MP3 Xing/LAME gapless info, FLAC STREAMINFO).
    encoder = _AvEncoder(fmt, sample_rate, channels, bitrate, seekable=True)
    return encoder.write(pcm) + encoder.close()


class AudioStreamEncoder:
    """Encodes audio chunk by chunk; the bytes of all `write` calls plus `close` form one valid file.

    pcm: raw s16le per chunk. wav: a header declaring unknown length (0xFFFFFFFF), then PCM.
    mp3, opus (Ogg), aac (ADTS), flac: container bytes as the muxer produces them; codec
    look-ahead means the last few ms only arrive with `close`. Lengths and seek tables that a
    muxer would write at the end are absent (streamed FLAC declares no total sample count).
    """

    def __init__(self, fmt: str, sample_rate: int, *, channels: int = 1, bitrate: int | None = None):
        self.fmt = _check_request(fmt, sample_rate, channels, bitrate)  # one of ENCODE_FORMATS
        self.sample_rate = sample_rate  # of the samples passed to write()
        self.channels = channels  # of the samples passed to write()
        self.samples_written = 0  # per channel, so far
        self._closed = False
        self._header_sent = False  # wav: the header goes out with the first bytes
        self._av: _AvEncoder | None = None  # mp3, opus, flac, aac: PyAV writing to a non-seekable sink
        if self.fmt in _AV_ENCODERS:
            self._av = _AvEncoder(self.fmt, sample_rate, channels, bitrate, seekable=False)

    def write(self, samples: np.ndarray) -> bytes:
        """Encode float32 [n] (mono) or [n, channels]; returns the bytes ready so far (maybe b"")."""
        if self._closed:
            raise RuntimeError("AudioStreamEncoder.write after close")
        pcm = _as_float32(samples, self.channels)  # [n, C]
        self.samples_written += len(pcm)
        if self._av is not None:
            return self._av.write(pcm)
        return self._wav_header_once() + _to_s16le(pcm)

    def close(self) -> bytes:
        """Flush the encoder; returns the remaining bytes. Idempotent (a second call returns b"")."""
        if self._closed:
            return b""
        self._closed = True
        if self._av is not None:
            return self._av.close()
        return self._wav_header_once()  # a wav stream with no audio is still a valid file

    def _wav_header_once(self) -> bytes:
        if self.fmt != "wav" or self._header_sent:
            return b""
        self._header_sent = True
        return _wav_header(self.sample_rate, self.channels, None)


def _check_request(fmt: str, sample_rate: int, channels: int, bitrate: int | None) -> str:
    """The normalised format name; MediaError for a format a client chose, ValueError for caller bugs."""
    fmt = fmt.lower()
    if fmt not in ENCODE_FORMATS:
        raise MediaError("media_format", f"cannot encode audio as {fmt!r}; supported: {list(ENCODE_FORMATS)}",
                         param="response_format")
    if not 1000 <= sample_rate <= 768_000:
        raise ValueError(f"sample_rate must be in 1000..768000, got {sample_rate}")
    max_channels = 8 if fmt in ("wav", "pcm", "flac") else 2
    if not 1 <= channels <= max_channels:
        raise ValueError(f"{fmt} encodes 1..{max_channels} channels, got {channels}")
    if bitrate is not None and not 6_000 <= bitrate <= 512_000:
        raise ValueError(f"bitrate must be in 6000..512000 bits/s, got {bitrate}")
    return fmt


class _ChunkSink:
    """A write-only file for PyAV: no seek/tell, so muxers write a stream front to back."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class _AvEncoder:
    def __init__(self, fmt: str, sample_rate: int, channels: int, bitrate: int | None, seekable: bool):
        muxer, codec_name, per_channel = _AV_ENCODERS[fmt]
        codec = av.codec.Codec(codec_name, "w")
        self._rate = sample_rate
        self._layout = av.AudioLayout(f"{channels}c").name  # mono, stereo, 2.1, 4.0, 5.0, 5.1, 6.1, 7.1
        self._file: io.BytesIO | _ChunkSink = io.BytesIO() if seekable else _ChunkSink()
        options = {"page_duration": str(_OGG_PAGE_US)} if muxer == "ogg" else {}
        self._container = av.open(self._file, "w", format=muxer, options=options)
        stream = self._container.add_stream(codec_name, rate=_encode_rate(fmt, codec, sample_rate), layout=self._layout)
        assert isinstance(stream, av.AudioStream)  # the codecs of _AV_ENCODERS are audio codecs
        self._stream = stream
        self._lossless = per_channel is None
        if self._lossless:
            self._stream.codec_context.format = "s16"
        else:
            assert per_channel is not None  # not lossless
            self._stream.codec_context.bit_rate = bitrate or per_channel * channels
        self._container.start_encoding()  # header now: the file is valid even if no audio follows
        self._pts = 0

    def write(self, pcm: np.ndarray) -> bytes:
        if len(pcm):
            # Packed float32 frame at the caller's rate; the encoder converts format, rate and
            # frame size itself (PyAV's encode-side resampler).
            if self._lossless:  # quantise as WAV does, so FLAC and WAV hold the same integers
                frame = av.AudioFrame.from_ndarray(_to_int16(pcm).reshape(1, -1), format="s16", layout=self._layout)
            else:
                frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="flt", layout=self._layout)
            frame.sample_rate = self._rate
            frame.time_base = Fraction(1, self._rate)
            frame.pts = self._pts
            self._pts += len(pcm)
            self._mux(self._stream.encode(frame))
        return self._take()

    def close(self) -> bytes:
        self._mux(self._stream.encode(None))
        self._container.close()
        return self._take(final=True)

    def _mux(self, packets: list) -> None:
        for packet in packets:
            self._container.mux(packet)

    def _take(self, final: bool = False) -> bytes:
        if isinstance(self._file, _ChunkSink):
            return self._file.take()
        if not final:
            return b""  # a seekable muxer may still rewrite its header: hand out nothing until close
        return self._file.getvalue()


def _encode_rate(fmt: str, codec: av.codec.Codec, sample_rate: int) -> int:
    if fmt == "opus":
        return _OPUS_RATE
    rates = codec.audio_rates
    if not rates or sample_rate in rates:
        return sample_rate  # FLAC takes any rate
    higher = [r for r in rates if r >= sample_rate]
    return min(higher) if higher else max(rates)  # resample up rather than lose bandwidth


def _as_float32(samples: np.ndarray, channels: int) -> np.ndarray:
    """[n] or [n, C] float -> C-contiguous float32 [n, C], finite and clipped to [-1, 1]."""
    samples = np.asarray(samples)
    if not np.issubdtype(samples.dtype, np.floating):
        raise ValueError(f"audio samples must be float in [-1, 1], got {samples.dtype}")
    if samples.ndim == 1:
        samples = samples[:, None]
    if samples.ndim != 2 or samples.shape[1] != channels:
        raise ValueError(f"audio samples must be [N] or [N, {channels}], got shape {samples.shape}")
    pcm = np.nan_to_num(samples.astype(np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
    return np.ascontiguousarray(np.clip(pcm, -1.0, 1.0))


def _to_int16(pcm: np.ndarray) -> np.ndarray:
    return np.round(pcm * 32767.0).astype(np.int16)  # symmetric: +-1.0 -> +-32767


def _to_s16le(pcm: np.ndarray) -> bytes:
    return _to_int16(pcm).astype("<i2").tobytes()  # interleaved [n, C]


def _wav_header(sample_rate: int, channels: int, data_bytes: int | None) -> bytes:
    """44-byte PCM s16le WAV header; data_bytes None = streaming (length unknown)."""
    block_align = channels * 2
    riff = _WAV_STREAMING_SIZE if data_bytes is None else 36 + data_bytes
    data = _WAV_STREAMING_SIZE if data_bytes is None else data_bytes
    if data_bytes is not None and data_bytes > _WAV_STREAMING_SIZE - 36:
        riff = data = _WAV_STREAMING_SIZE  # past 4 GB RIFF cannot say; readers then go by the bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate,  # 16-byte PCM (tag 1) format chunk
                                    sample_rate * block_align, block_align, 16)
            + b"data" + struct.pack("<I", data))
