"""The decoding cursor behind seek sampling (stages.media.video): seek, then decode forward.

While decoding forward toward a target frame, packets shown safely before it (more than a
reordering margin earlier) are decoded with `skip_frame = NONREF`: the decoder drops the
non-reference frames among them (most B-frames) without decoding them. Nothing later reads
a non-reference frame, and none of them is shown at or after the target, so the frames
returned stay exactly those that decoding everything would give. Only decoders for which that
holds skip (H.264; HEVC's top temporal layer); the rest decode every packet, as before.
Imports only the stdlib and PyAV.
"""

from __future__ import annotations

import bisect
import collections
import math
from typing import Iterator

import av

_SEEK_ATTEMPTS = 3  # a seek landing past its target: one keyframe back, then from the stream start
# Decoders that read skip_frame on every frame (so it can change between packets) and then drop
# only frames that no later frame reads. Left out: libdav1d (AV1) reads it once, when it opens,
# and would drop non-reference frames for good; FFmpeg's vp9 ignores it, and a VP9 frame that
# refreshes no reference slot still lends its motion vectors and segmentation map to the next
# frame, so it is not safe to skip anyway. HEVC: see `nonref_skip_policy`.
SKIPPING_DECODERS = frozenset({"h264", "hevc"})
# Packets shown less than a margin before a target are always decoded in full: the stream's
# reorder depth (has_b_frames: how many frames B-frames are shown late), and at least this many
# frames. Exactness does not rest on it: a skipped frame is shown before the target and nothing
# refers to it. The margin is slack for timestamps that are rounded (matroska: milliseconds) or
# off by a frame; each frame of it costs about half a decoded frame per target with B-frames.
SKIP_MARGIN_MIN_FRAMES = 1


def nonref_skip_policy(codec_context: av.codec.context.CodecContext):
    """How skip_frame=NONREF may be used on this stream so that it drops only unread frames.

    None: never. Otherwise a function of a packet: whether that packet may be decoded with it.
    H.264: a NAL unit with nal_ref_idc 0 is never read again, so any packet. HEVC: FFmpeg drops
    every sub-layer non-reference picture (TRAIL_N, ...), which pictures of a higher temporal
    sub-layer may still read; so only packets of the highest temporal sub-layer, as the hvcC
    (mp4, matroska) declares it, and nothing where the layers are unknown (MPEG-TS).
    """
    name = codec_context.codec.name
    if name not in SKIPPING_DECODERS:
        return None
    if name != "hevc":
        return _any_packet
    hvcc = codec_context.extradata or b""
    # hvcC: configurationVersion 1; byte 21 = constantFrameRate:2 numTemporalLayers:3 nested:1 lengthSizeMinusOne:2
    if len(hvcc) < 23 or hvcc[0] != 1 or not (hvcc[21] >> 3) & 7:
        return None
    layers, length_size = (hvcc[21] >> 3) & 7, (hvcc[21] & 3) + 1
    if layers == 1:
        return _any_packet
    return lambda packet: _hevc_temporal_id(memoryview(packet), length_size) == layers - 1


def _any_packet(packet: av.Packet) -> bool:
    return True


def _hevc_temporal_id(buf: memoryview, length_size: int) -> int | None:
    """TemporalId of the first picture NAL unit in a length-prefixed HEVC packet; None if none."""
    pos = 0
    while pos + length_size + 2 <= len(buf):
        size = int.from_bytes(buf[pos:pos + length_size], "big")
        header = buf[pos + length_size:pos + length_size + 2]
        if (header[0] >> 1) & 0x3F < 32:  # a VCL (picture) NAL unit
            return (header[1] & 7) - 1
        pos += length_size + size
    return None


class SeekCursor:
    """The decoding position in one stream: seek, then pull frames forward."""

    def __init__(self, container: av.container.InputContainer, stream: av.video.stream.VideoStream,
                 fps: float):
        self.container, self.stream = container, stream
        self.codec_context = stream.codec_context
        # demux iterator since the last seek; None before the first
        self.packets: Iterator[av.Packet[av.video.stream.VideoStream]] | None = None
        self.pending: collections.deque = collections.deque()  # frames decoded from the last packet
        self.last = None  # the last frame pulled (a VideoFrame)
        self.frames_decoded = 0  # frames the decoder gave back
        self.packets_decoded = 0  # packets fed to it: the difference is mostly frames it skipped
        self.seeks = 0
        self.resume_dts: int | None = None  # decode time of the first packet since the last seek
        self._keyframes: list[int] | None = None  # keyframe timestamps from the container index, sorted
        self._may_skip = nonref_skip_policy(self.codec_context)  # None: this decoder never skips
        self._skipping = False  # the decoder's skip_frame is NONREF now
        margin_frames = max(SKIP_MARGIN_MIN_FRAMES, min(self.codec_context.reorder_depth, 16))  # H.264 allows 16
        assert stream.time_base is not None  # a demuxed stream always has one
        self._margin = math.ceil(margin_frames / fps / float(stream.time_base))  # in stream ticks

    def seek(self, pts: int) -> None:
        """Seek so that decoding resumes at a frame shown at or before `pts`.

        A seek lands on the keyframe at or before `pts`, but mp4 indexes decode times: with
        B-frames it can land on a keyframe shown after `pts`, whose leading frames (an open GOP,
        as x265 makes) cannot be decoded from there; then step back one keyframe and retry.
        Containers without a keyframe index (MPEG-TS) may land mid-GOP, where the decoder shows
        nothing until the next keyframe; the last attempt starts from the stream start.
        """
        stream_start = self.stream.start_time or 0
        for attempt in range(_SEEK_ATTEMPTS):
            pts = stream_start if attempt == _SEEK_ATTEMPTS - 1 else pts
            self.container.seek(pts, stream=self.stream, backward=True)
            self.seeks += 1
            self.packets, self.resume_dts = self.container.demux(self.stream), None
            self.pending.clear()
            self.last = None
            first = self.advance_to(-math.inf)
            if first is None or first.pts is None or first.pts <= max(pts, stream_start) or self.resume_dts is None:
                return
            pts = min(pts, self.resume_dts) - 1  # just before the keyframe we landed on

    def keyframe_between(self, after: int, upto: int) -> bool:
        """Whether the index knows a keyframe with after < timestamp <= upto (asked after the first seek)."""
        if self._keyframes is None:  # mp4: every sample is indexed; matroska: the cues, read at the first seek
            self._keyframes = sorted(e.timestamp for e in self.stream.index_entries if e.is_keyframe)
        i = bisect.bisect_right(self._keyframes, after)
        return i < len(self._keyframes) and self._keyframes[i] <= upto

    def advance_to(self, threshold: float):
        """Decode forward to the first frame with pts >= threshold; None at the end of the stream.

        Non-reference frames shown before threshold - margin are skipped, not decoded.
        """
        skip_below = threshold - self._margin if self._may_skip else -math.inf
        assert self.packets is not None  # a seek comes first
        while self.last is None or self.last.pts is None or self.last.pts < threshold:
            while not self.pending:
                packet = next(self.packets, None)
                if packet is None:
                    self._set_skipping(False)
                    return None
                if self.resume_dts is None:
                    self.resume_dts = packet.dts  # decode time of the keyframe a seek landed on
                # A packet without a timestamp, or a keyframe, is always decoded in full.
                self._set_skipping(packet.pts is not None and packet.pts < skip_below and not packet.is_keyframe
                                   and self._may_skip(packet))
                self.packets_decoded += packet.size > 0  # not the final, empty flush packet
                self.pending.extend(self.codec_context.decode(packet))
            self.last = self.pending.popleft()
            self.frames_decoded += 1
        self._set_skipping(False)
        return self.last

    def _set_skipping(self, on: bool) -> None:
        if on != self._skipping:
            self.codec_context.skip_frame = "NONREF" if on else "DEFAULT"
            self._skipping = on
