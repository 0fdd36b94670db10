"""Benchmark: seek-based video frame sampling vs decoding every frame and dropping.

    python examples/bench_video_sampling.py [--seconds 20] [--fps 30] [--width 1280] [--height 720]
                                            [--gop 60] [--sample-fps 1] [--repeats 3]

1. Makes an H.264 clip (libx264 preset ultrafast, a keyframe every --gop frames, moving content
   so predicted frames cost real work), once: it is cached under ~/.cache/mmserve/bench/.
2. Samples --sample-fps frames per second of it two ways, interleaved, median of --repeats:
   `decode_video(fps=...)` (seek to the keyframe before each target, decode forward) and the
   baseline `decode_all_frames(every_nth=...)` (decode every frame, keep every n-th).
3. Prints both times, the speedup, frames decoded per second per core (both run here on one
   decoder thread), and the best speedup any exact-frame sampler could reach on this clip: a
   target between keyframes needs every frame from the keyframe before it.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from stages.media_video import VideoDecodeLimits, decode_all_frames, decode_video  # noqa: E402


def make_clip(seconds: int, fps: int, width: int, height: int, gop: int) -> bytes:
    out = io.BytesIO()
    y, x = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(0).integers(0, 40, (height, width), dtype=np.uint8)
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt, stream.gop_size = width, height, "yuv420p", gop
        stream.options = {"preset": "ultrafast", "keyint_min": str(gop), "sc_threshold": "0"}  # fixed keyframe interval
        img = np.empty((height, width, 3), np.uint8)
        for i in range(seconds * fps):
            img[..., 0] = (x + 4 * i) % 256 + np.roll(noise, 3 * i, axis=1)  # pans, with texture
            img[..., 1] = (y + 2 * i) % 256
            img[..., 2] = ((x + y) // 4 + i) % 256
            container.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        container.mux(stream.encode(None))
    return out.getvalue()


def cached_clip(args: argparse.Namespace) -> bytes:
    name = f"clip_{args.seconds}s_{args.fps}fps_{args.width}x{args.height}_gop{args.gop}.mp4"
    path = Path(args.cache_dir).expanduser() / name
    if path.exists():
        return path.read_bytes()
    data = make_clip(args.seconds, args.fps, args.width, args.height, args.gop)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # atomic: a concurrent run never reads half a file
    return data


def ideal_speedup(frame_count: int, indices: list[int], gop: int) -> float:
    """Frames decoded by decode-all over the fewest an exact sampler must decode (fixed gop)."""
    needed: set[int] = set()
    for idx in indices:
        needed.update(range(idx - idx % gop, idx + 1))
    return frame_count / len(needed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=int, default=20)
    p.add_argument("--fps", type=int, default=30)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--gop", type=int, default=60, help="keyframe interval in frames (60 = 2 s at 30 fps)")
    p.add_argument("--sample-fps", type=float, default=1.0, help="frames sampled per second of video")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-dir", default="~/.cache/mmserve/bench")
    args = p.parse_args()

    start = time.perf_counter()
    data = cached_clip(args)
    print(f"clip: {args.seconds} s, {args.fps} fps, {args.width}x{args.height}, H.264 keyframe every {args.gop} "
          f"frames, {len(data) / 1e6:.1f} MB (ready in {time.perf_counter() - start:.1f} s)")
    limits = VideoDecodeLimits(max_frames=100_000, max_decoded_mb=1 << 20)
    every_nth = round(args.fps / args.sample_fps)
    seek_times, all_times = [], []
    for _ in range(args.repeats):  # interleaved, so load on a shared machine hits both alike
        t = time.perf_counter()
        sampled = decode_video(data, limits, fps=args.sample_fps)
        seek_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        baseline = decode_all_frames(data, limits, every_nth=every_nth)
        all_times.append(time.perf_counter() - t)
    assert sampled.indices == baseline.indices, (sampled.indices, baseline.indices)
    assert np.array_equal(sampled.frames, baseline.frames), "seek sampling returned different pixels"
    seek_s, all_s = statistics.median(seek_times), statistics.median(all_times)
    print(f"frames returned: {len(sampled.indices)} (indices {sampled.indices[:4]}...), identical both ways")
    print(f"seek sampling:   {seek_s:.3f} s, {sampled.frames_decoded} frames decoded, {sampled.seeks} seeks, "
          f"{sampled.frames_decoded / seek_s:.0f} decoded frames/s/core")
    print(f"decode all:      {all_s:.3f} s, {baseline.frames_decoded} frames decoded, "
          f"{baseline.frames_decoded / all_s:.0f} decoded frames/s/core")
    bound = ideal_speedup(baseline.frames_decoded, sampled.indices, args.gop)
    print(f"ideal speedup for exact frames at this keyframe interval: {bound:.2f}x")
    print(f"speedup: {all_s / seek_s:.2f}x (target >= 5x)")


if __name__ == "__main__":
    main()
