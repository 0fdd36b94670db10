"""Video probing and seek-based frame sampling; runs inside media worker processes.

Sampling seeks to the keyframe before each target frame and decodes forward, and keeps decoding
forward when no keyframe lies between it and the next target; it never decodes a whole file to
keep a few frames. On the way to a target, non-reference frames shown before it (most B-frames)
are skipped undecoded (stages.media.video_seek). Limits are checked on container and stream
headers before any frame is decoded. Imports only the stdlib, numpy and PyAV, like the other
worker modules.
"""

from __future__ import annotations

import hashlib
import io
import math
import struct
from dataclasses import dataclass

import av
import numpy as np

from stages.media.image import MediaError
from stages.media.video_encode import FragmentedMP4Writer, encode_video  # re-exported: workers find encode_video here
from stages.media.video_seek import SeekCursor
from stages.redact import redact_url

__all__ = ["VideoDecodeLimits", "VideoSampling", "VideoInfo", "DecodedVideo", "probe_video", "decode_video",
           "decode_all_frames", "encode_video", "FragmentedMP4Writer"]

_MB = 1024 * 1024
# Our format name -> the FFmpeg demuxer that reads it; only these demuxers may touch the bytes,
# so probing never reaches playlist-style demuxers (hls, concat) that open other files or URLs.
_DEMUXER = {"mp4": "mov", "mov": "mov", "webm": "matroska", "mkv": "matroska", "gif": "gif",
            "avi": "avi", "ts": "mpegts"}
# What PyAV raises on malformed input while demuxing, decoding or converting.
_CORRUPT_ERRORS = (av.error.FFmpegError, OSError, EOFError, ValueError, IndexError, KeyError, TypeError,
                   struct.error, OverflowError, ZeroDivisionError, RuntimeError)
_THREADS = 1  # one decoder thread: parallelism comes from the worker count, and threads eat address space


@dataclass(frozen=True)
class VideoDecodeLimits:
    max_bytes: int = 200 * _MB  # encoded size, checked before anything is parsed
    max_pixels: int = 3840 * 2160  # width * height of a frame, from the stream header
    max_frames: int = 512  # frames one request may get back
    max_duration_s: float = 3600.0  # declared duration, from the container header
    # frames returned * W * H * 3 bytes: the decompression bound. With the result's copy on its way
    # back, it must fit twice in a media worker (MediaConfig.task_memory_mb, 2048 by default).
    max_decoded_mb: int = 768
    formats: tuple[str, ...] = ("mp4", "mov", "webm", "mkv", "gif")  # accepted containers

    def __post_init__(self):
        unknown = [f for f in self.formats if f not in _DEMUXER]
        if unknown:
            raise ValueError(f"VideoDecodeLimits.formats has unknown {unknown}; known: {sorted(_DEMUXER)}")


@dataclass(frozen=True)
class VideoSampling:
    fps: float | None = None  # frames per second of video time; None (and no num_frames) = every frame
    num_frames: int | None = None  # this many frames evenly spaced over [start_s, end_s)
    start_s: float = 0.0  # first instant sampled, seconds from the stream start
    end_s: float | None = None  # sampling stops before this instant; None = the end of the video

    def __post_init__(self):
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("give fps or num_frames, not both")
        if self.fps is not None and not (math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"fps must be a positive number, got {self.fps}")
        if self.num_frames is not None and self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {self.num_frames}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"start_s must be >= 0, got {self.start_s}")
        if self.end_s is not None and not self.end_s > self.start_s:
            raise ValueError(f"end_s must be greater than start_s={self.start_s}, got {self.end_s}")

    def key(self) -> str:
        """The decode configuration, as it enters the content hash."""
        return f"fps={self.fps};num_frames={self.num_frames};start_s={self.start_s};end_s={self.end_s}"


@dataclass(frozen=True)
class VideoInfo:
    format: str  # container: "mp4", "mov", "webm", "mkv", "gif", ...
    codec: str  # codec name: "h264", "vp9", "hevc", "av1", ...
    width: int  # frame width in pixels
    height: int  # frame height in pixels
    fps: float  # average frame rate
    duration_s: float  # declared duration (or, when none is declared, the last packet's end)
    frame_count: int  # declared, or estimated as duration * fps
    has_audio: bool  # the container also holds an audio stream


@dataclass
class DecodedVideo:
    frames: np.ndarray  # uint8 [T, H, W, 3] RGB, read-only
    timestamps_s: list[float]  # pts of each returned frame, seconds from the stream start
    indices: list[int]  # frame index of each returned frame: round(timestamp * fps)
    fps: float  # the video's average frame rate
    duration_s: float  # the video's duration
    width: int  # W
    height: int  # H
    frame_count: int  # frames in the whole video (declared or estimated)
    format: str  # container
    codec: str  # decoder
    content_hash: str  # sha256 of the bytes and the decode config: identity for caches
    frames_decoded: int = 0  # frames the decoder produced to get these (the cost)
    seeks: int = 0  # seeks made
    # Packets fed to the decoder; those beyond frames_decoded are mostly non-reference frames it
    # skipped without decoding (shown before a target), plus frames still in its reorder delay.
    packets_decoded: int = 0

    def __post_init__(self):
        # Read-only: decoded frames may be shared by every request whose input has this hash.
        self.frames.flags.writeable = False

    def __setstate__(self, state: dict) -> None:
        # Unpickling (coming back from a worker) skips __post_init__ and yields a writeable copy.
        self.__dict__.update(state)
        self.__post_init__()


def probe_video(data: bytes, limits: VideoDecodeLimits = VideoDecodeLimits(), *,
                sampling: VideoSampling | None = None) -> VideoInfo:
    """Read container and stream headers (no frame is decoded) and check every limit.

    With `sampling`, also checks that the frames it asks for fit max_frames and max_decoded_mb.
    """
    with _open(data, limits) as container:
        info = _read_info(container, data, limits)
    if sampling is not None:
        _target_indices(info, sampling, limits)
    return info


def decode_video(data: bytes, limits: VideoDecodeLimits = VideoDecodeLimits(), *, fps: float | None = None,
                 num_frames: int | None = None, start_s: float = 0.0, end_s: float | None = None) -> DecodedVideo:
    """Sample frames by `fps` or by `num_frames` (evenly spaced) over [start_s, end_s), using seeks.

    Target instants snap to the first frame at or after them on the stream's frame grid; that
    frame is found as the first decoded frame whose pts is past the half-way point before it
    (robust to millisecond-rounded timestamps). Neither `fps` nor `num_frames` = every frame.
    """
    sampling = VideoSampling(fps=fps, num_frames=num_frames, start_s=start_s, end_s=end_s)
    with _open(data, limits) as container:
        info = _read_info(container, data, limits)
        indices = _target_indices(info, sampling, limits)
        try:
            frames, times, cursor = _sample(container, info, indices, limits)
        except _CORRUPT_ERRORS as e:
            raise _corrupt(info, e) from None
    return _result(info, frames, times, data, "decode_video:" + sampling.key(), decoded=cursor.frames_decoded,
                   seeks=cursor.seeks, packets=cursor.packets_decoded)


def decode_all_frames(data: bytes, limits: VideoDecodeLimits = VideoDecodeLimits(),
                      every_nth: int = 1) -> DecodedVideo:
    """BASELINE for benchmarks, not for serving: decode every frame in order, keep every n-th."""
    if every_nth < 1:
        raise ValueError(f"every_nth must be >= 1, got {every_nth}")
    with _open(data, limits) as container:
        info = _read_info(container, data, limits)
        max_kept = math.ceil(info.frame_count / every_nth)
        _check_output(info, max_kept, limits)
        stream, origin = _prepare_decoder(container, limits)
        kept: list[np.ndarray] = []
        times: list[float] = []
        decoded, packets = 0, 0
        try:
            for packet in container.demux(stream):
                packets += packet.size > 0  # not the final, empty flush packet
                for frame in stream.codec_context.decode(packet):
                    if decoded % every_nth == 0 and frame.pts is not None and len(kept) < max_kept:
                        kept.append(frame.to_ndarray(format="rgb24", width=info.width, height=info.height))
                        times.append(_seconds(stream, frame.pts - origin))
                    decoded += 1
        except _CORRUPT_ERRORS as e:
            raise _corrupt(info, e) from None
    frames = np.stack(kept) if kept else np.zeros((0, info.height, info.width, 3), np.uint8)
    return _result(info, frames, times, data, f"decode_all_frames:every_nth={every_nth}", decoded=decoded, seeks=0,
                   packets=packets)


# -- probing -------------------------------------------------------------------------------------

def _refuse_nested_open(url: str, flags: int, options: dict) -> None:
    # A demuxer asking to open another file or URL (external references) gets nothing.
    raise PermissionError(f"media input may not open {redact_url(url)!r}")


def _open(data: bytes, limits: VideoDecodeLimits) -> av.container.InputContainer:
    if len(data) > limits.max_bytes:
        raise MediaError("media_bytes", f"video is {len(data)} bytes; the limit is {limits.max_bytes} bytes")
    whitelist = ",".join(sorted({_DEMUXER[f] for f in limits.formats}))
    try:
        return av.open(io.BytesIO(data), "r", container_options={"format_whitelist": whitelist},
                       io_open=_refuse_nested_open, metadata_errors="replace")
    except av.error.ArgumentError:  # probing found a demuxer outside the whitelist
        raise MediaError("media_format", f"video container is not one of the accepted {list(limits.formats)}") from None
    except _CORRUPT_ERRORS as e:
        raise MediaError("media_corrupt", f"{len(data)} bytes are not a readable video "
                                          f"(accepted: {list(limits.formats)}): {e}") from None


def _read_info(container: av.container.InputContainer, data: bytes, limits: VideoDecodeLimits) -> VideoInfo:
    if not container.streams.video:
        raise MediaError("media_corrupt", "the file holds no video stream")
    stream = container.streams.video[0]
    fmt = _format_name(container, data)
    if fmt not in limits.formats:
        raise MediaError("media_format", f"video container {fmt} is not accepted; accepted: {list(limits.formats)}")
    if stream.codec_context is None:
        raise MediaError("media_format", f"this server has no decoder for the {fmt} file's video codec")
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0:
        raise MediaError("media_corrupt", f"the video stream declares no frame size ({width}x{height})")
    if width * height > limits.max_pixels:
        raise MediaError("media_pixels", f"video frames are {width}x{height} = {width * height} pixels; "
                                         f"the limit is {limits.max_pixels} pixels")
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    if not (math.isfinite(fps) and fps > 0):
        raise MediaError("media_corrupt", f"the video stream declares no frame rate ({rate})")
    duration: float | None
    if stream.duration and stream.time_base:
        duration = float(stream.duration * stream.time_base)
    elif container.duration:
        duration = container.duration / 1_000_000  # AV_TIME_BASE units
    else:  # e.g. WebM from a browser's MediaRecorder: find the end by demuxing
        duration = _scanned_duration(data, limits)
    if not duration or duration <= 0:
        raise MediaError("media_corrupt", f"the video stream declares no duration ({duration})")
    if duration > limits.max_duration_s:
        raise MediaError("media_duration", f"video lasts {duration:.1f} s; the limit is {limits.max_duration_s:g} s")
    frame_count = stream.frames if stream.frames > 0 else max(1, round(duration * fps))
    return VideoInfo(format=fmt, codec=stream.codec_context.codec.canonical_name, width=width, height=height, fps=fps,
                     duration_s=duration, frame_count=frame_count, has_audio=bool(container.streams.audio))


def _format_name(container: av.container.InputContainer, data: bytes) -> str:
    demuxer = container.format.name.split(",")[0]  # "mov,mp4,m4a,..." -> "mov"
    if demuxer == "mov":  # QuickTime files carry the "qt  " brand; everything else here is ISO MP4
        return "mov" if container.metadata.get("major_brand", "").startswith("qt") else "mp4"
    if demuxer == "matroska":  # the EBML header's DocType, within its first bytes, says "webm"
        return "webm" if b"webm" in data[:64] else "mkv"
    return {"mpegts": "ts"}.get(demuxer, demuxer)


def _scanned_duration(data: bytes, limits: VideoDecodeLimits) -> float | None:
    # Demuxing reads packet headers only: cheap, and bounded by max_bytes already checked.
    with _open(data, limits) as container:
        stream = container.streams.video[0]
        try:
            end = max((p.pts + (p.duration or 0) for p in container.demux(stream) if p.pts is not None), default=None)
        except _CORRUPT_ERRORS as e:
            raise MediaError("media_corrupt", f"video packets are malformed: {e}") from None
        return None if end is None else _seconds(stream, end - (stream.start_time or 0))


def _target_indices(info: VideoInfo, sampling: VideoSampling, limits: VideoDecodeLimits) -> list[int]:
    """Frame indices (on the stream's frame grid) to return, after the frame limits are checked."""
    end = info.duration_s if sampling.end_s is None else min(sampling.end_s, info.duration_s)
    if sampling.start_s >= end:
        raise MediaError("media_duration", f"start_s={sampling.start_s} is not before the end of the video "
                                           f"({end:.3f} s)", param="start_s")
    span = end - sampling.start_s
    if sampling.num_frames is not None:
        count, step = sampling.num_frames, span / sampling.num_frames
    else:
        rate = sampling.fps or info.fps
        count, step = math.ceil(span * rate - 1e-6), 1.0 / rate  # 1e-6: float noise is no extra frame
    _check_output(info, count, limits)
    last = info.frame_count - 1
    return [min(last, math.ceil((sampling.start_s + k * step) * info.fps - 1e-6)) for k in range(count)]


def _check_output(info: VideoInfo, count: int, limits: VideoDecodeLimits) -> None:
    if count > limits.max_frames:
        raise MediaError("media_frames", f"the request selects {count} frames; the limit is {limits.max_frames} "
                                         f"(lower fps or num_frames, or narrow start_s/end_s)")
    decoded_mb = count * info.width * info.height * 3 / _MB
    if decoded_mb > limits.max_decoded_mb:
        raise MediaError("media_frames", f"{count} frames of {info.width}x{info.height} decode to "
                                         f"{decoded_mb:.0f} MB; the limit is max_decoded_mb={limits.max_decoded_mb}")


# -- sampling ------------------------------------------------------------------------------------

def _prepare_decoder(container: av.container.InputContainer, limits: VideoDecodeLimits):
    """The video stream, its decoder set up, and its start pts (timestamps count from it)."""
    stream = container.streams.video[0]
    stream.codec_context.thread_count = _THREADS
    # A later header in the stream must not grow frames past the limit that the probe checked.
    stream.codec_context.options = {"max_pixels": str(limits.max_pixels)}
    return stream, stream.start_time or 0


def _sample(container, info: VideoInfo, indices: list[int], limits: VideoDecodeLimits):
    stream, origin = _prepare_decoder(container, limits)
    ticks_per_s = 1 / float(stream.time_base)
    out = np.empty((len(indices), info.height, info.width, 3), np.uint8)  # [T, H, W, 3]
    times: list[float] = []
    cursor, returned = SeekCursor(container, stream, info.fps), None
    for idx in indices:
        # First frame past the half-way point before frame idx; seek to just after frame idx's nominal pts.
        threshold = origin + math.ceil((idx - 0.5) / info.fps * ticks_per_s)
        seek_pts = origin + math.floor((idx + 0.25) / info.fps * ticks_per_s)
        frame = cursor.last
        position = None if frame is None else frame.pts
        if position is None or position < threshold:
            if cursor.packets is None or position is None or cursor.keyframe_between(position, seek_pts):
                cursor.seek(seek_pts)
            frame = cursor.advance_to(threshold)
            if frame is None:
                break  # the stream ended early (its header overstated the duration)
        k = len(times)
        if frame is returned:
            out[k] = out[k - 1]  # the same frame again (sampling faster than the video's rate)
        else:
            out[k] = frame.to_ndarray(format="rgb24", width=info.width, height=info.height)
        returned = frame
        times.append(_seconds(stream, frame.pts - origin))
    if not times:
        raise MediaError("media_corrupt", f"no frame could be decoded from the {info.format}/{info.codec} video")
    return out[: len(times)], times, cursor


def _result(info: VideoInfo, frames: np.ndarray, times: list[float], data: bytes, config: str, *, decoded: int,
            seeks: int, packets: int) -> DecodedVideo:
    content_hash = hashlib.sha256(data)
    content_hash.update(f"|{config}".encode())  # the same bytes sampled differently are another item
    return DecodedVideo(frames=frames, timestamps_s=times, indices=[round(t * info.fps) for t in times],
                        fps=info.fps, duration_s=info.duration_s, width=info.width, height=info.height,
                        frame_count=info.frame_count, format=info.format, codec=info.codec,
                        content_hash=content_hash.hexdigest(), frames_decoded=decoded, seeks=seeks,
                        packets_decoded=packets)


def _corrupt(info: VideoInfo, error: Exception) -> MediaError:
    return MediaError("media_corrupt", f"{info.format}/{info.codec} video data is malformed: {error}")


def _seconds(stream: av.video.stream.VideoStream, pts: int) -> float:
    assert stream.time_base is not None  # a demuxed stream always has one
    return float(pts * stream.time_base)
