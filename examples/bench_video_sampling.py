"""Benchmark: seek-based video frame sampling vs decoding every frame and dropping.

    python examples/bench_video_sampling.py [--seconds 20] [--fps 30] [--width 1280] [--height 720]
                                            [--gop 60] [--sample-fps 1] [--repeats 3]
                                            [--preset ultrafast medium]

1. Makes one H.264 clip per libx264 --preset (a keyframe every --gop frames, moving content so
   predicted frames cost real work), once: they are cached under ~/.cache/mmserve/bench/.
   "ultrafast" makes no B-frames, so every frame is a reference; the other presets (libx264's
   default is "medium") make B-frames, most of them non-reference.
2. Samples --sample-fps frames per second of each clip three ways, interleaved, median of
   --repeats: `decode_video(fps=...)` (seek to the keyframe before each target, decode forward,
   skipping non-reference frames shown before the target), the same with skipping turned off,
   and the baseline `decode_all_frames(every_nth=...)` (decode every frame, keep every n-th).
3. Prints the times (wall and CPU: CPU time is steadier on a loaded machine), the speedup over
   decoding everything, frames decoded per second per core (all run here on one decoder
   thread), and the best speedup, in frames, that an exact-frame sampler skipping
   non-reference frames could reach on the clip: a target needs every reference frame from
   the keyframe before it up to itself, in decode order.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from stages.media import video_seek as media_video_seek  # noqa: E402
from stages.media.video import DecodedVideo, VideoDecodeLimits, decode_all_frames, decode_video  # noqa: E402


def make_clip(seconds: int, fps: int, width: int, height: int, gop: int, preset: str = "ultrafast") -> bytes:
    out = io.BytesIO()
    y, x = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(0).integers(0, 40, (height, width), dtype=np.uint8)
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt, stream.gop_size = width, height, "yuv420p", gop
        stream.options = {"preset": preset, "keyint_min": str(gop), "sc_threshold": "0"}  # fixed keyframe interval
        img = np.empty((height, width, 3), np.uint8)
        for i in range(seconds * fps):
            img[..., 0] = (x + 4 * i) % 256 + np.roll(noise, 3 * i, axis=1)  # pans, with texture
            img[..., 1] = (y + 2 * i) % 256
            img[..., 2] = ((x + y) // 4 + i) % 256
            container.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        container.mux(stream.encode(None))
    return out.getvalue()


def cached_clip(args: argparse.Namespace, preset: str) -> bytes:
    name = f"clip_{args.seconds}s_{args.fps}fps_{args.width}x{args.height}_gop{args.gop}_{preset}.mp4"
    path = Path(args.cache_dir).expanduser() / name
    if path.exists():
        return path.read_bytes()
    data = make_clip(args.seconds, args.fps, args.width, args.height, args.gop, preset)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # atomic: a concurrent run never reads half a file
    return data


def packet_table(data: bytes) -> list[tuple[int, bool, bool]]:
    """(pts, keyframe, reference) of each H.264 packet, in decode order, from the NAL headers."""
    rows = []
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        length_size = (stream.codec_context.extradata[4] & 3) + 1  # avcC: NAL units are length-prefixed
        for packet in container.demux(stream):
            if packet.size == 0:
                continue
            buf, pos, reference = bytes(packet), 0, False
            while pos + length_size < len(buf):
                size = int.from_bytes(buf[pos:pos + length_size], "big")
                header = buf[pos + length_size]
                if header & 0x1F in (1, 5) and header >> 5 & 3:  # a slice with nal_ref_idc != 0
                    reference = True
                pos += length_size + size
            rows.append((packet.pts, packet.is_keyframe, reference))
    return rows


def ideal_speedup(table: list[tuple[int, bool, bool]], target_pts: list[int]) -> float:
    """Frames decoded by decode-all over the fewest a non-reference-skipping exact sampler must decode."""
    needed: set[int] = set()
    for pts in target_pts:
        t = min(range(len(table)), key=lambda i: abs(table[i][0] - pts))  # its packet
        k = max(i for i in range(t + 1) if table[i][1])  # the keyframe before it, in decode order
        needed.update(i for i in range(k, t) if table[i][2])
        needed.add(t)
    return len(table) / len(needed)


@contextlib.contextmanager
def no_skipping():
    """Seek sampling as it was before non-reference skipping: every packet decoded."""
    saved = media_video_seek.SKIPPING_DECODERS
    media_video_seek.SKIPPING_DECODERS = frozenset()
    try:
        yield
    finally:
        media_video_seek.SKIPPING_DECODERS = saved


def bench_preset(args: argparse.Namespace, preset: str) -> dict:
    start = time.perf_counter()
    data = cached_clip(args, preset)
    table = packet_table(data)
    nonref = sum(not ref for _, _, ref in table)
    print(f"== preset {preset}: {args.seconds} s, {args.fps} fps, {args.width}x{args.height}, H.264 keyframe every "
          f"{args.gop} frames, {nonref} of {len(table)} frames non-reference, {len(data) / 1e6:.1f} MB "
          f"(ready in {time.perf_counter() - start:.1f} s)")
    limits = VideoDecodeLimits(max_frames=100_000, max_decoded_mb=1 << 20)
    every_nth = round(args.fps / args.sample_fps)
    times: dict[str, list[float]] = {"seek": [], "noskip": [], "all": []}
    cpu_times: dict[str, list[float]] = {name: [] for name in times}
    runs: dict[str, DecodedVideo] = {}
    for _ in range(args.repeats):  # interleaved, so load on a shared machine hits all alike
        for name in times:
            t, cpu = time.perf_counter(), time.process_time()
            if name == "all":
                runs[name] = decode_all_frames(data, limits, every_nth=every_nth)
            else:
                with no_skipping() if name == "noskip" else contextlib.nullcontext():
                    runs[name] = decode_video(data, limits, fps=args.sample_fps)
            times[name].append(time.perf_counter() - t)
            cpu_times[name].append(time.process_time() - cpu)
    sampled, baseline = runs["seek"], runs["all"]
    for name in ("seek", "noskip"):
        assert runs[name].indices == baseline.indices, (name, runs[name].indices, baseline.indices)
        assert np.array_equal(runs[name].frames, baseline.frames), f"{name} sampling returned different pixels"
    med = {name: statistics.median(ts) for name, ts in times.items()}
    cpu = {name: statistics.median(ts) for name, ts in cpu_times.items()}  # steadier than wall time under load
    print(f"frames returned: {len(sampled.indices)} (indices {sampled.indices[:4]}...), identical all three ways")
    for label, name in (("seek sampling:  ", "seek"), ("seek, no skip:  ", "noskip"), ("decode all:     ", "all")):
        run = runs[name]
        print(f"{label} {med[name]:.3f} s ({cpu[name]:.3f} s CPU), {run.packets_decoded} packets read, "
              f"{run.frames_decoded} frames decoded, {run.seeks} seeks, "
              f"{run.frames_decoded / med[name]:.0f} decoded frames/s/core")
    # The timestamps of the returned frames, back in stream ticks, name their packets.
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        origin, tick = stream.start_time or 0, stream.time_base
    target_pts = sorted({origin + round(t / tick) for t in sampled.timestamps_s})
    bound = ideal_speedup(table, target_pts)
    speedup = med["all"] / med["seek"]
    print(f"ideal speedup for exact frames at this keyframe interval: {bound:.2f}x "
          f"(every reference frame from the keyframe to each target)")
    print(f"speedup: {speedup:.2f}x (CPU time {cpu['all'] / cpu['seek']:.2f}x; without skipping "
          f"{med['all'] / med['noskip']:.2f}x; target >= 5x)")
    return {"preset": preset, "seek": med["seek"], "all": med["all"], "speedup": speedup, "bound": bound,
            "cpu_speedup": cpu["all"] / cpu["seek"], "noskip_speedup": med["all"] / med["noskip"],
            "seek_fps": sampled.frames_decoded / med["seek"], "all_fps": baseline.frames_decoded / med["all"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=int, default=20)
    p.add_argument("--fps", type=int, default=30)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--gop", type=int, default=60, help="keyframe interval in frames (60 = 2 s at 30 fps)")
    p.add_argument("--sample-fps", type=float, default=1.0, help="frames sampled per second of video")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--preset", nargs="+", default=["ultrafast", "medium"],
                   help="libx264 presets, one clip each (ultrafast: no B-frames; medium, the default: B-frames)")
    p.add_argument("--cache-dir", default="~/.cache/mmserve/bench")
    args = p.parse_args()

    results = [bench_preset(args, preset) for preset in args.preset]
    print("== summary (seconds are medians; frames/s per core, one decoder thread)")
    print(f"{'preset':<12}{'seek s':>8}{'all s':>8}{'speedup':>9}{'CPU':>8}{'no skip':>9}{'bound':>8}"
          f"{'seek f/s':>10}{'all f/s':>9}")
    for r in results:
        print(f"{r['preset']:<12}{r['seek']:>8.3f}{r['all']:>8.3f}{r['speedup']:>8.2f}x{r['cpu_speedup']:>7.2f}x"
              f"{r['noskip_speedup']:>8.2f}x{r['bound']:>7.2f}x{r['seek_fps']:>10.0f}{r['all_fps']:>9.0f}")


if __name__ == "__main__":
    main()
