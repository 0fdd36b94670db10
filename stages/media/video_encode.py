"""Video encoders: whole files (MP4/H.264, WebM/VP9, GIF) and streaming fragmented MP4.

`encode_video` and `encode_fmp4_segment` run inside media worker processes (listed in
`stages.media.image.WORKER_FUNCTIONS`). `FragmentedMP4Writer` holds an encoder between calls,
so it lives in the process that streams. `encode_fmp4_segment` is its stateless form for
streams that cross the worker boundary: each call encodes one self-contained run of frames
(starting with a keyframe) as fragments numbered and timed to continue the stream, so the
segments concatenate into one valid MP4. Imports only the stdlib, numpy, PIL and PyAV.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from PIL import Image

from stages.media.audio_encode import _AV_ENCODERS, _as_float32
from stages.media.image import MediaError

VIDEO_ENCODE_FORMATS = ("mp4", "webm", "gif")
_CRF = {"mp4": (23, 51), "webm": (32, 63)}  # format -> (default, max) constant-quality factor
_THREADS = 1  # one encoder thread: parallelism comes from the worker count, and threads eat address space
# fMP4: an empty moov (init segment) first, then a moof+mdat fragment at every keyframe, each
# fragment self-contained (default_base_moof), so a player can start from the chunks as they come.
_FRAGMENT_FLAGS = "frag_keyframe+empty_moov+default_base_moof"


def encode_video(frames: np.ndarray, fps: float, fmt: str = "mp4", *, crf: int | None = None,
                 audio: np.ndarray | None = None, sample_rate: int | None = None) -> bytes:
    """Encode uint8 [T, H, W, 3] RGB frames as mp4 (H.264), webm (VP9) or gif; with `audio` (float samples [N] or
    [N, C] in [-1, 1] at `sample_rate`), mp4 and webm also carry it as a second stream (AAC, Opus).

    H.264 in 4:2:0 needs even sizes: an odd width or height is padded by repeating the last
    column or row, so an mp4 decodes one pixel larger there. GIF stores delays in hundredths of
    a second, so its frame rate is rounded to one such delay (30 fps plays at 33.3 fps).
    """
    fmt = fmt.lower()
    if fmt not in VIDEO_ENCODE_FORMATS:
        raise MediaError("media_format", f"cannot encode video as {fmt!r}; supported: {list(VIDEO_ENCODE_FORMATS)}",
                         param="output_format")
    _check_frames(frames)
    if not (math.isfinite(fps) and 0 < fps <= 1000):
        raise ValueError(f"fps must be in (0, 1000], got {fps}")
    if fmt == "gif":
        if crf is not None:
            raise ValueError("crf does not apply to gif (a palette format); leave it None")
        if audio is not None:
            raise ValueError("gif carries no audio; encode mp4 or webm, or leave audio None")
        return _encode_gif(frames, fps)
    default, highest = _CRF[fmt]
    if crf is not None and not 0 <= crf <= highest:
        raise ValueError(f"crf for {fmt} must be in 0..{highest}, got {crf}")
    crf = default if crf is None else crf
    if audio is not None and not (sample_rate and sample_rate > 0):
        raise ValueError(f"audio needs its sample_rate (> 0), got {sample_rate}")
    if fmt == "mp4":
        frames = _pad_even(frames)
    out = io.BytesIO()
    # No "+faststart": it rewrites the file through a second open, which an in-memory buffer cannot serve.
    with av.open(out, "w", format=fmt) as container:
        stream = _add_stream(container, fmt, frames.shape[2], frames.shape[1], fps, crf)
        sound = None if audio is None else _AudioTrack(container, fmt, audio, int(sample_rate or 0))
        for i, pixels in enumerate(frames):
            container.mux(stream.encode(_frame(pixels, i)))
        container.mux(stream.encode(None))  # drain the encoder's delayed frames
        if sound is not None:
            sound.write()
    return out.getvalue()


class _AudioTrack:
    """A soundtrack muxed beside the video: AAC in mp4, Opus (48 kHz) in webm; the encoder converts the float
    samples' format, rate and frame size itself (PyAV's encode-side resampler)."""

    def __init__(self, container, fmt: str, samples: np.ndarray, sample_rate: int):
        channels = 1 if np.ndim(samples) == 1 else int(np.shape(samples)[1])
        self.pcm = _as_float32(samples, channels)  # [N, C]
        self.rate = sample_rate
        self.layout = av.AudioLayout(f"{channels}c").name
        name, codec, rate = ("aac", "aac", sample_rate) if fmt == "mp4" else ("opus", "libopus", 48_000)
        self.stream = container.add_stream(codec, rate=rate, layout=self.layout)
        # /v1/audio/speech's bit rates per channel (FFmpeg's AAC default, ~45 kbit/s here, smears a loud track)
        per_channel = _AV_ENCODERS[name][2]
        assert per_channel is not None  # aac and opus are lossy: they have a bit rate
        self.stream.codec_context.bit_rate = per_channel * channels
        self.container = container

    def write(self) -> None:
        frame = av.AudioFrame.from_ndarray(self.pcm.reshape(1, -1), format="flt", layout=self.layout)
        frame.sample_rate = self.rate
        frame.time_base = Fraction(1, self.rate)
        frame.pts = 0
        self.container.mux(self.stream.encode(frame))
        self.container.mux(self.stream.encode(None))


class FragmentedMP4Writer:
    """Streams H.264 frames as fragmented MP4 chunks whose concatenation is one valid MP4.

    The first chunk holds the init segment (ftyp + empty moov); later ones hold moof + mdat
    fragments. A fragment is cut when the next keyframe arrives, so a chunk lags the frames
    written by up to `fragment_s` seconds; `close` returns the rest.
    """

    def __init__(self, width: int, height: int, fps: float, *, crf: int | None = None, fragment_s: float = 1.0):
        if width < 1 or height < 1:
            raise ValueError(f"width and height must be >= 1, got {width}x{height}")
        if not (math.isfinite(fps) and 0 < fps <= 1000) or not fragment_s > 0:
            raise ValueError(f"fps must be in (0, 1000] and fragment_s > 0, got {fps} and {fragment_s}")
        if crf is not None and not 0 <= crf <= _CRF["mp4"][1]:
            raise ValueError(f"crf for mp4 must be in 0..{_CRF['mp4'][1]}, got {crf}")
        self.width, self.height = width, height  # size of the frames `write` accepts (odd sizes are padded)
        self.fps = fps  # frames per second of the stream
        self.frames_written = 0  # frames handed to the encoder so far
        self._sink = _ChunkSink()
        # A sink without seek(): the muxer cannot go back to patch earlier bytes, so every byte is final.
        self._container = av.open(self._sink, "w", format="mp4", options={"movflags": _FRAGMENT_FLAGS})
        gop = max(1, round(fps * fragment_s))
        self._stream = _add_stream(self._container, "mp4", width + width % 2, height + height % 2, fps,
                                   _CRF["mp4"][0] if crf is None else crf,
                                   {"tune": "zerolatency", "keyint_min": str(gop), "sc_threshold": "0"}, gop)
        self._closed = False

    def write(self, frames: np.ndarray) -> bytes:
        """Encode uint8 [T, H, W, 3] (or one [H, W, 3]) frames; return the fMP4 bytes produced so far."""
        if self._closed:
            raise RuntimeError("FragmentedMP4Writer is closed")
        frames = frames[None] if frames.ndim == 3 else frames
        _check_frames(frames)
        if frames.shape[1:3] != (self.height, self.width):
            raise ValueError(f"frames are {frames.shape[2]}x{frames.shape[1]}; this writer takes "
                             f"{self.width}x{self.height}")
        for pixels in _pad_even(frames):
            self._container.mux(self._stream.encode(_frame(pixels, self.frames_written)))
            self.frames_written += 1
        return self._sink.drain()

    def close(self) -> bytes:
        """Flush the encoder and the last fragment; return the remaining bytes. Idempotent."""
        if self._closed:
            return b""
        self._closed = True
        if self.frames_written:
            self._container.mux(self._stream.encode(None))
        self._container.close()
        return self._sink.drain()

    def __enter__(self) -> FragmentedMP4Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ChunkSink:
    """A write-only file for PyAV that hands back what was written since the last drain."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._chunks.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        out = b"".join(self._chunks)
        self._chunks.clear()
        return out


def _check_frames(frames: np.ndarray) -> None:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3 or 0 in frames.shape:
        raise ValueError(f"video frames must be uint8 [T, H, W, 3] with T, H, W >= 1, "
                         f"got {frames.dtype} {frames.shape}")


def _pad_even(frames: np.ndarray) -> np.ndarray:  # [T, H, W, 3] -> [T, H + H % 2, W + W % 2, 3]
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if not (pad_h or pad_w):
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def _add_stream(container, fmt: str, width: int, height: int, fps: float, crf: int,
                extra: dict[str, str] | None = None, gop: int | None = None):
    rate = Fraction(fps).limit_denominator(1001)  # 29.97 -> 2997/100; 30000/1001 stays exact enough
    if fmt == "mp4":
        stream = container.add_stream("libx264", rate=rate)
        options = {"crf": str(crf), "preset": "veryfast"}
    else:  # constant quality needs the bitrate target off (b=0); realtime keeps VP9 fast enough to serve
        stream = container.add_stream("libvpx-vp9", rate=rate)
        options = {"crf": str(crf), "b": "0", "deadline": "realtime", "cpu-used": "8", "row-mt": "1"}
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    stream.codec_context.time_base = 1 / rate
    stream.codec_context.thread_count = _THREADS
    if gop is not None:
        stream.gop_size = gop
    stream.options = {**options, **(extra or {})}
    return stream


def _frame(pixels: np.ndarray, index: int) -> av.VideoFrame:
    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
    frame.pts = index  # in the codec time base 1/fps: one tick per frame
    return frame


def _encode_gif(frames: np.ndarray, fps: float) -> bytes:
    # PIL gives each frame its own adaptive 256-colour palette (a local colour table).
    images = [Image.fromarray(np.ascontiguousarray(f)) for f in frames]
    delay_ms = max(10, round(100 / fps) * 10)  # GIF delays are whole hundredths of a second
    out = io.BytesIO()
    images[0].save(out, format="GIF", save_all=True, append_images=images[1:], duration=delay_ms, loop=0)
    return out.getvalue()


@dataclass(frozen=True)
class Fmp4Segment:
    """What `encode_fmp4_segment` returns."""

    data: bytes  # [ftyp + moov when with_init] then moof + mdat fragments
    fragments: int  # moof boxes in `data`: the next segment's first_fragment is first_fragment + fragments
    frames: int  # frames encoded: the next segment's first_frame is first_frame + frames


def encode_fmp4_segment(frames: np.ndarray, fps: float, *, first_frame: int = 0, first_fragment: int = 1,
                        with_init: bool = True, crf: int | None = None) -> Fmp4Segment:
    """Encode uint8 [T, H, W, 3] frames as fragmented-MP4 bytes that continue a stream.

    The frames go through a fresh H.264 encoder (one GOP, so the segment starts with a keyframe
    and needs nothing before it but the init segment); then each fragment's sequence number
    (mfhd) starts at `first_fragment` and its decode time (tfdt) at frame `first_frame`. The init
    segment (ftyp + moov) depends only on the size, fps and crf, so one stream sends it once
    (`with_init` on its first segment) until the size changes.
    """
    frames = frames[None] if frames.ndim == 3 else frames
    _check_frames(frames)
    if first_frame < 0 or first_fragment < 1:
        raise ValueError(f"first_frame must be >= 0 and first_fragment >= 1, got {first_frame} and {first_fragment}")
    # One GOP longer than the segment: a single keyframe, hence a single fragment.
    writer = FragmentedMP4Writer(frames.shape[2], frames.shape[1], fps, crf=crf, fragment_s=(len(frames) + 1) / fps)
    encoded = writer.write(frames) + writer.close()
    tick = _frame_ticks(_child(encoded, "moov"), fps)
    parts, fragments = [], 0
    for kind, box in _boxes(encoded):
        if kind in ("ftyp", "moov") and with_init:
            parts.append(box)
        elif kind == "moof":
            parts.append(_renumber_fragment(box, first_fragment + fragments, first_frame * tick))
            fragments += 1
        elif kind == "mdat":
            parts.append(box)  # trun data offsets count from the moof (default_base_moof): moving it is safe
    return Fmp4Segment(b"".join(parts), fragments, len(frames))


def _boxes(data: bytes | bytearray, start: int = 0, end: int | None = None):
    """(type, box bytes) of the ISO-BMFF boxes in data[start:end], in order."""
    end = len(data) if end is None else end
    while start + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, start)
        if size < 8:
            raise ValueError(f"malformed MP4 box {kind!r} of size {size}")
        yield kind.decode("latin-1"), data[start:start + size]
        start += size


def _child(data: bytes, *path: str) -> bytes:
    """The first box along `path` (top level first)."""
    box = data
    for depth, kind in enumerate(path):
        inner = box if depth == 0 else box[8:]
        found = next((b for k, b in _boxes(inner) if k == kind), None)
        if found is None:
            raise ValueError(f"no {'/'.join(path)} box in the encoded segment")
        box = found
    return box


def _frame_ticks(moov: bytes, fps: float) -> int:
    """One frame's duration in the track's timescale (mdhd); the muxer picks a multiple of the rate."""
    mdhd = _child(moov[8:], "trak", "mdia", "mdhd")
    timescale = struct.unpack_from(">I", mdhd, 20 if mdhd[8] == 0 else 28)[0]
    rate = Fraction(fps).limit_denominator(1001)
    ticks = Fraction(timescale) / rate
    if ticks.denominator != 1:
        raise ValueError(f"timescale {timescale} does not hold whole frames at {fps} fps")
    return int(ticks)


def _renumber_fragment(moof: bytes, sequence: int, time_offset: int) -> bytes:
    """A moof with its mfhd sequence number set and its tfdt decode times moved by `time_offset`."""
    out = bytearray(moof)
    pos = 8
    while pos + 8 <= len(out):
        size, kind = struct.unpack_from(">I4s", out, pos)
        if kind == b"mfhd":
            struct.pack_into(">I", out, pos + 12, sequence)
        elif kind == b"traf":
            inner = pos + 8
            while inner + 8 <= pos + size:
                inner_size, inner_kind = struct.unpack_from(">I4s", out, inner)
                if inner_kind == b"tfdt":
                    fmt = ">Q" if out[inner + 8] == 1 else ">I"
                    struct.pack_into(fmt, out, inner + 12, struct.unpack_from(fmt, out, inner + 12)[0] + time_offset)
                inner += inner_size
        pos += size
    return bytes(out)
