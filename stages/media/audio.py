"""Audio decoding (probe, then decode) that runs inside media worker processes.

The container is recognised from its magic bytes by us, and only then handed to FFmpeg with
that one demuxer named: FFmpeg's own probing would consider every format it knows (playlists
that open other files among them), which is attack surface we do not need. Every limit is
checked on the header first; the duration is checked again while decoding, because a header
can lie. Imports only the stdlib, numpy and av (never torch). Encoding lives in
`stages.media.audio_encode` and is re-exported here.
"""

from __future__ import annotations

import hashlib
import io
import struct
from dataclasses import dataclass

import av
import av.error
import numpy as np

from stages.media.audio_encode import AudioStreamEncoder, encode_audio
from stages.media.image import MediaError

__all__ = [
    "AudioDecodeLimits", "AudioInfo", "AudioStreamEncoder", "DecodedAudio", "RawPCM",
    "decode_audio", "encode_audio", "probe_audio", "sniff_audio_format",
]

_MB = 1024 * 1024

# Format name -> (FFmpeg demuxer, codecs accepted inside it). A codec outside the set is
# media_format: each extra decoder is more attack surface, and nothing we serve needs them.
AUDIO_FORMATS: dict[str, tuple[str, frozenset[str]]] = {
    "wav": ("wav", frozenset({"pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_f32le", "pcm_f64le", "pcm_u8",
                              "pcm_alaw", "pcm_mulaw"})),
    "mp3": ("mp3", frozenset({"mp3"})),
    "flac": ("flac", frozenset({"flac"})),
    "ogg": ("ogg", frozenset({"opus", "vorbis", "flac"})),
    "webm": ("matroska", frozenset({"opus", "vorbis"})),  # also reads .mka/.mkv with those codecs
    "m4a": ("mov", frozenset({"aac"})),  # .m4a and .mp4 (the audio track of a video too)
    "aac": ("aac", frozenset({"aac"})),  # raw ADTS stream, what encode_audio("aac") writes
    "pcm": ("", frozenset({"pcm_s16le", "pcm_f32le"})),  # headerless; only with RawPCM, never sniffed
}
# The down-mix averages channels ((L + R) / 2): FFmpeg's default, (L + R) / sqrt(2), clips
# loud stereo; rematrix_maxval=1 scales the mix matrix so no output can exceed full scale.
_DOWNMIX = {"rematrix_maxval": "1.0"}
_RAW_BYTES = {"s16le": 2, "f32le": 4}  # RawPCM.format -> bytes per sample
_MIN_RATE, _MAX_RATE = 1000, 768_000  # outside this a sample rate is a broken header, not audio

# What FFmpeg / PyAV raise on malformed input (av.error.MemoryError is handled apart).
_CORRUPT_ERRORS = (av.error.FFmpegError, ValueError, EOFError, OSError, struct.error, IndexError, KeyError,
                   TypeError, OverflowError, ZeroDivisionError)


@dataclass(frozen=True)
class AudioDecodeLimits:
    max_bytes: int = 50 * _MB  # encoded size, checked before anything is parsed
    max_duration_s: float = 3600.0  # audio length, from the header and again while decoding
    max_channels: int = 8  # channels declared by the stream
    max_decoded_mb: float = 1024.0  # size of the decoded mono float32 output at the requested rate
    formats: tuple[str, ...] = tuple(AUDIO_FORMATS)  # accepted containers ("pcm" = headerless RawPCM)

    def __post_init__(self):
        unknown = [f for f in self.formats if f not in AUDIO_FORMATS]
        if unknown:
            raise ValueError(f"AudioDecodeLimits.formats has unknown {unknown}; known: {sorted(AUDIO_FORMATS)}")
        if self.max_bytes <= 0 or self.max_duration_s <= 0 or self.max_channels <= 0 or self.max_decoded_mb <= 0:
            raise ValueError(f"AudioDecodeLimits values must be > 0, got {self}")


@dataclass(frozen=True)
class RawPCM:
    format: str  # "s16le" (signed 16-bit) or "f32le" (float32), little-endian, interleaved
    sample_rate: int  # samples per second per channel
    channels: int  # interleaved channels, 1..8

    def __post_init__(self):
        if self.format not in _RAW_BYTES:
            raise ValueError(f"RawPCM.format must be one of {sorted(_RAW_BYTES)}, got {self.format!r}")
        if not _MIN_RATE <= self.sample_rate <= _MAX_RATE:
            raise ValueError(f"RawPCM.sample_rate must be in {_MIN_RATE}..{_MAX_RATE}, got {self.sample_rate}")
        if not 1 <= self.channels <= 8:
            raise ValueError(f"RawPCM.channels must be in 1..8, got {self.channels}")


@dataclass(frozen=True)
class AudioInfo:
    format: str  # container: a key of AUDIO_FORMATS
    codec: str  # FFmpeg codec name ("opus", "pcm_s16le", ...)
    sample_rate: int  # source samples per second
    channels: int  # source channels
    duration_s: float | None  # header's length (PCM: capped by the bytes); None when nothing tells
    duration_estimated: bool  # True when duration_s comes from bytes / bitrate, not a length field


@dataclass
class DecodedAudio:
    samples: np.ndarray  # float32 [N], mono, in [-1, 1]; read-only
    sample_rate: int  # of `samples`: the rate the caller asked for
    duration_s: float  # N / sample_rate
    source_format: str  # container it came in: a key of AUDIO_FORMATS
    source_codec: str  # FFmpeg codec name
    source_channels: int  # channels before the down-mix
    source_sample_rate: int  # rate before resampling
    content_hash: str  # sha256 of the bytes and the decode config: identity for caches

    def __post_init__(self):
        # Read-only: decoded audio may be shared by every request whose input has this hash.
        self.samples.flags.writeable = False

    def __setstate__(self, state: dict) -> None:
        # Unpickling (coming back from a worker) skips __post_init__ and yields a writeable copy.
        self.__dict__.update(state)
        self.__post_init__()


def probe_audio(data: bytes, limits: AudioDecodeLimits = AudioDecodeLimits(), *, raw: RawPCM | None = None,
                sample_rate: int | None = None) -> AudioInfo:
    """Read the header only and check every limit; raises MediaError, returns what was found.

    `sample_rate` is the rate a decode would produce (None: the source rate); it sizes the
    decoded-output check.
    """
    container, _, info = _open_checked(data, limits, raw, sample_rate)
    container.close()
    return info


def decode_audio(data: bytes, limits: AudioDecodeLimits = AudioDecodeLimits(), *, sample_rate: int = 16000,
                 raw: RawPCM | None = None) -> DecodedAudio:
    """Decode to mono float32 at `sample_rate`, checking limits on the header and while decoding.

    Headerless PCM needs `raw` to say its layout. Raises MediaError for anything wrong with the
    input (media_bytes, media_format, media_duration, media_corrupt).
    """
    if not _MIN_RATE <= sample_rate <= _MAX_RATE:
        raise ValueError(f"decode_audio sample_rate must be in {_MIN_RATE}..{_MAX_RATE}, got {sample_rate}")
    container, stream, info = _open_checked(data, limits, raw, sample_rate)
    try:
        samples = _decode_stream(container, stream, info, limits, sample_rate)
    except MediaError:
        raise
    except av.error.MemoryError as e:
        raise _refused_allocation(info.format, e) from None
    except _CORRUPT_ERRORS as e:
        raise MediaError("media_corrupt", f"{info.format}/{info.codec} audio data is truncated or malformed: "
                                          f"{type(e).__name__}: {e}") from None
    finally:
        container.close()
    h = hashlib.sha256(data)
    h.update(f"|decode_audio:rate={sample_rate};layout=mono;fmt=flt".encode())
    if raw is not None:
        h.update(f";raw={raw.format},{raw.sample_rate},{raw.channels}".encode())
    return DecodedAudio(samples=samples, sample_rate=sample_rate, duration_s=len(samples) / sample_rate,
                        source_format=info.format, source_codec=info.codec, source_channels=info.channels,
                        source_sample_rate=info.sample_rate, content_hash=h.hexdigest())


# -- header ------------------------------------------------------------------------------------

def sniff_audio_format(data: bytes) -> str | None:
    """The container named by the magic bytes (a key of AUDIO_FORMATS), or None."""
    head = data[:12]
    if head[:4] in (b"RIFF", b"RF64") and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska / WebM
        return "webm"
    if head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):
        return "m4a"
    if head[:3] == b"ID3" and len(head) >= 10:
        # An ID3v2 tag (syncsafe size) may precede MP3, ADTS or FLAC; look past it.
        size = (head[6] & 0x7F) << 21 | (head[7] & 0x7F) << 14 | (head[8] & 0x7F) << 7 | (head[9] & 0x7F)
        size += 20 if head[5] & 0x10 else 10  # header, plus the footer when flagged
        return _sniff_frames(data[size:size + 4]) or "mp3"
    return _sniff_frames(head[:4])


def _sniff_frames(head: bytes) -> str | None:
    if head[:4] == b"fLaC":
        return "flac"
    if len(head) >= 2 and head[0] == 0xFF:
        if head[1] & 0xF6 == 0xF0:  # 12-bit sync, layer 00: ADTS
            return "aac"
        if head[1] & 0xE0 == 0xE0 and head[1] & 0x06:  # 11-bit sync, layer I/II/III: MPEG audio
            return "mp3"
    return None


def _open_checked(data: bytes, limits: AudioDecodeLimits, raw: RawPCM | None, out_rate: int | None):
    """Open the container with one named demuxer and check every header limit; returns (container, stream, info)."""
    if len(data) > limits.max_bytes:
        raise MediaError("media_bytes", f"audio is {len(data)} bytes; the limit is {limits.max_bytes} bytes")
    fmt = "pcm" if raw is not None else sniff_audio_format(data)
    if fmt is None:
        raise MediaError("media_format", f"{len(data)} bytes are not a recognisable audio container; accepted: "
                                         f"{list(limits.formats)} (headerless PCM needs raw=RawPCM(...))")
    if fmt not in limits.formats:
        raise MediaError("media_format", f"audio format {fmt} is not accepted; accepted: {list(limits.formats)}")
    try:
        if raw is not None:
            layout = {1: "mono", 2: "stereo"}.get(raw.channels, f"{raw.channels} channels")
            container = av.open(io.BytesIO(data), format=raw.format,
                                options={"sample_rate": str(raw.sample_rate), "ch_layout": layout})
        else:
            container = av.open(io.BytesIO(data), format=AUDIO_FORMATS[fmt][0])
    except av.error.MemoryError as e:
        raise _refused_allocation(fmt, e) from None
    except _CORRUPT_ERRORS as e:
        raise MediaError("media_corrupt", f"{fmt} header is malformed: {type(e).__name__}: {e}") from None
    try:
        stream, info = _check_header(container, data, fmt, limits, out_rate)
    except BaseException:
        container.close()
        raise
    return container, stream, info


def _check_header(container, data: bytes, fmt: str, limits: AudioDecodeLimits, out_rate: int | None):
    try:
        if not container.streams.audio:
            raise MediaError("media_corrupt", f"{fmt} container has no audio stream")
        stream = container.streams.audio[0]
        ctx = stream.codec_context
        if ctx is None or ctx.codec is None:  # FFmpeg has no decoder for the codec id the header names
            raise MediaError("media_format", f"{fmt} audio stream has an unknown codec")
        codec, rate, channels, bit_rate = ctx.codec.canonical_name, ctx.sample_rate, ctx.channels, ctx.bit_rate
        duration = _header_duration(container, stream)
    except MediaError:
        raise
    except av.error.MemoryError as e:
        raise _refused_allocation(fmt, e) from None
    except _CORRUPT_ERRORS as e:
        raise MediaError("media_corrupt", f"{fmt} stream header is malformed: {type(e).__name__}: {e}") from None
    if codec not in AUDIO_FORMATS[fmt][1]:
        raise MediaError("media_format", f"codec {codec} in {fmt} is not accepted; accepted: "
                                         f"{sorted(AUDIO_FORMATS[fmt][1])}")
    if not _MIN_RATE <= rate <= _MAX_RATE:
        raise MediaError("media_corrupt", f"{fmt} header declares a sample rate of {rate} Hz; "
                                          f"audio is {_MIN_RATE}..{_MAX_RATE} Hz")
    if channels < 1:
        raise MediaError("media_corrupt", f"{fmt} header declares {channels} channels")
    if channels > limits.max_channels:
        raise MediaError("media_format", f"audio has {channels} channels; "
                                         f"the limit is max_channels={limits.max_channels}")
    estimated = False
    if codec.startswith("pcm_") and bit_rate:
        # Uncompressed: the bytes bound the length, whatever the header claims (a streamed WAV
        # says 0xFFFFFFFF bytes on purpose; a hostile one says hours).
        by_bytes = len(data) * 8 / bit_rate
        if duration is None or duration > by_bytes:
            duration, estimated = by_bytes, True
    elif duration is None and (bit_rate or container.bit_rate):
        duration, estimated = len(data) * 8 / (bit_rate or container.bit_rate), True
    _check_length(duration, out_rate or rate, limits, "estimated from the bytes" if estimated else "header says")
    return stream, AudioInfo(format=fmt, codec=codec, sample_rate=rate, channels=channels,
                             duration_s=duration, duration_estimated=estimated)


def _refused_allocation(fmt: str, e: Exception) -> MediaError:
    # FFmpeg answers ENOMEM when a size field asks for an absurd buffer: the file's fault. (A
    # Python MemoryError still propagates: the pool reports it as the worker's memory limit.)
    return MediaError("media_corrupt", f"{fmt} data asks FFmpeg for a buffer it could not allocate (a malformed "
                                       f"size field, or more than the worker's memory limit): {e}")


def _header_duration(container, stream) -> float | None:
    if stream.duration is not None and stream.duration > 0 and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None and container.duration > 0:
        return container.duration / av.time_base
    return None


def _check_length(duration: float | None, out_rate: int, limits: AudioDecodeLimits, source: str) -> None:
    if duration is None:
        return  # nothing tells; the decode loop enforces the limit sample by sample
    if duration > limits.max_duration_s:
        raise MediaError("media_duration", f"audio is {duration:.1f} s long ({source}); "
                                           f"the limit is max_duration_s={limits.max_duration_s:g}")
    decoded_mb = duration * out_rate * 4 / _MB
    if decoded_mb > limits.max_decoded_mb:
        raise MediaError("media_duration", f"{duration:.1f} s at {out_rate} Hz decodes to {decoded_mb:.0f} MB of "
                                           f"float32; the limit is max_decoded_mb={limits.max_decoded_mb:g}")


# -- decode ------------------------------------------------------------------------------------

def _decode_stream(container, stream, info: AudioInfo, limits: AudioDecodeLimits, out_rate: int) -> np.ndarray:
    out = _Output(limits, out_rate, info.duration_s)
    resampler, resampler_input = None, None
    for packet in container.demux(stream):
        for frame in packet.decode():
            if frame.layout.nb_channels > limits.max_channels:  # a chained Ogg may change layout mid-stream
                raise MediaError("media_format", f"audio switches to {frame.layout.nb_channels} channels; "
                                                 f"the limit is max_channels={limits.max_channels}")
            key = (frame.format.name, frame.layout.name, frame.sample_rate)
            if key != resampler_input:
                # PyAV's resampler is fixed to its first frame's layout; a change needs a new one.
                if resampler is not None:
                    out.add(resampler.resample(None))
                resampler = av.AudioResampler(format="flt", layout="mono", rate=out_rate, options=_DOWNMIX)
                resampler_input = key
            frame.pts = None  # timestamps are irrelevant here; odd ones must not upset the filter graph
            assert resampler is not None  # made for the first frame
            out.add(resampler.resample(frame))
    if resampler is not None:
        out.add(resampler.resample(None))
    if out.total == 0 and (info.duration_s is None or info.duration_s >= 0.01):
        # The header promised sound and none came: every packet was unusable.
        raise MediaError("media_corrupt", f"{info.format}/{info.codec} audio decoded to no samples")
    samples = np.concatenate(out.chunks) if out.chunks else np.zeros(0, np.float32)
    # Resampling filters can overshoot full scale slightly; keep the promised range.
    np.nan_to_num(samples, copy=False, nan=0.0, posinf=1.0, neginf=-1.0)
    np.clip(samples, -1.0, 1.0, out=samples)
    return samples


class _Output:
    """Decoded chunks, refused as soon as they pass the limits, whatever the header said."""

    def __init__(self, limits: AudioDecodeLimits, out_rate: int, header_s: float | None):
        self.limits = limits
        self.out_rate = out_rate
        self.header_s = header_s  # the length the header claimed, for the error message
        self.max_samples = int(min(limits.max_duration_s * out_rate, limits.max_decoded_mb * _MB / 4))
        self.chunks: list[np.ndarray] = []  # float32 [n] each
        self.total = 0  # samples in chunks

    def add(self, frames: list) -> None:
        for frame in frames:
            chunk = frame.to_ndarray().reshape(-1)  # packed mono flt: [1, n] -> [n]
            self.total += len(chunk)
            if self.total > self.max_samples:
                said = ("the header gave no length" if self.header_s is None
                        else f"the header said {self.header_s:.1f} s")
                raise MediaError("media_duration", f"audio decodes past {self.max_samples / self.out_rate:.1f} s at "
                                                   f"{self.out_rate} Hz; the limits are max_duration_s="
                                                   f"{self.limits.max_duration_s:g} and max_decoded_mb="
                                                   f"{self.limits.max_decoded_mb:g} ({said})")
            self.chunks.append(chunk)


