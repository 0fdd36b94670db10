"""Image codecs (stages.media.image) and the media worker pool (stages.media.pool). CPU only, offline."""

from __future__ import annotations

import io
import os
import pickle
import signal
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from serve.errors import http_status
from stages.events import ErrorKind, StageError
from stages.media.image import WORKER_FUNCTIONS, DecodedImage, ImageDecodeLimits, MediaError, decode_image, encode_image
from stages.media.pool import MediaPool
from stages.metrics import Metrics

try:
    from tests.media_worker_tasks import TEST_FUNCTIONS
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from media_worker_tasks import TEST_FUNCTIONS


def _gradient(h: int = 48, w: int = 64) -> np.ndarray:
    # Smooth content, so lossy codecs stay close to the source.
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x + y) * 255 // (w + h - 2)], axis=-1).astype(np.uint8)


def _blocks(h: int = 32, w: int = 32) -> np.ndarray:
    # Four flat colours: survives a GIF palette exactly.
    img = np.zeros((h, w, 3), np.uint8)
    img[: h // 2, : w // 2] = (255, 0, 0)
    img[: h // 2, w // 2:] = (0, 255, 0)
    img[h // 2:, : w // 2] = (0, 0, 255)
    img[h // 2:, w // 2:] = (255, 255, 255)
    return img


def _save(img: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kwargs)
    return out.getvalue()


def _bomb_png(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose IHDR is patched to declare width x height (CRC recomputed)."""
    png = bytearray(_save(Image.new("RGB", (1, 1)), "PNG"))
    assert png[12:16] == b"IHDR"
    png[16:24] = struct.pack(">II", width, height)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))  # CRC over type + data
    return bytes(png)


def _code(excinfo: pytest.ExceptionInfo) -> str:
    return excinfo.value.code


# -- codecs ------------------------------------------------------------------------------------

def test_png_round_trip_is_exact():
    src = _gradient()
    out = decode_image(encode_image(src, "png"))
    assert (out.width, out.height, out.format) == (64, 48, "png")
    np.testing.assert_array_equal(out.pixels, src)


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_lossy_round_trip_is_close(fmt):
    src = _gradient()
    data = encode_image(src, fmt)
    assert data[:4] == (b"\xff\xd8\xff\xe0" if fmt == "jpeg" else b"RIFF")
    out = decode_image(data)
    assert out.format == fmt and out.pixels.shape == src.shape
    assert np.abs(out.pixels.astype(int) - src).mean() < 3
    assert len(encode_image(src, fmt, quality=20)) < len(data)  # quality reaches the encoder


def test_encode_rejects_unknown_format():
    with pytest.raises(MediaError) as e:
        encode_image(_gradient(), "avif")
    assert _code(e) == "media_format" and "avif" in e.value.message


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF"])
def test_decodes_other_containers(fmt):
    src = _blocks()
    out = decode_image(_save(Image.fromarray(src), fmt))
    assert out.format == fmt.lower()
    np.testing.assert_array_equal(out.pixels, src)


def test_gif_first_frame_and_frame_limit():
    frames = [Image.new("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    data = _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    out = decode_image(data)
    assert tuple(out.pixels[0, 0]) == (255, 0, 0)
    with pytest.raises(MediaError) as e:
        decode_image(data, ImageDecodeLimits(max_frames=2))
    assert _code(e) == "media_frames" and "3 frames" in e.value.message


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    data = _save(Image.fromarray(_gradient(20, 40)), "JPEG", exif=exif.tobytes())
    out = decode_image(data)
    assert (out.width, out.height) == (20, 40)
    assert out.pixels.shape == (40, 20, 3)


def test_grey_mode_for_masks():
    src = _gradient()
    out = decode_image(encode_image(src, "png"), mode="L")
    assert out.pixels.shape == (48, 64, 1)
    pil = out.to_pil()
    assert pil.mode == "L" and pil.size == (64, 48)
    assert decode_image(encode_image(src, "png")).to_pil().mode == "RGB"


def test_content_hash_covers_bytes_and_decode_config():
    data = encode_image(_gradient(), "png")
    a, b = decode_image(data), decode_image(data)
    assert a.content_hash == b.content_hash and len(a.content_hash) == 64
    assert decode_image(data, mode="L").content_hash != a.content_hash
    assert decode_image(encode_image(_blocks(), "png")).content_hash != a.content_hash


@pytest.mark.parametrize("side", [50_000, 5_000])  # past PIL's own bomb guard, and past only ours
def test_pixel_bomb_is_rejected_from_the_header(side):
    data = _bomb_png(side, side)
    assert len(data) < 4096
    start = time.monotonic()
    with pytest.raises(MediaError) as e:
        decode_image(data)
    assert _code(e) == "media_pixels" and str(4096 * 4096) in e.value.message
    assert time.monotonic() - start < 0.5  # nothing was decoded


@pytest.mark.parametrize("side", [50_000, 5_000])
def test_pixel_bomb_error_gives_our_limit_and_the_image_size_only(side):
    with pytest.raises(MediaError) as e:
        decode_image(_bomb_png(side, side))
    assert e.value.message == f"image is {side}x{side} = {side * side} pixels; the limit is {4096 * 4096} pixels"
    assert "decompression bomb" not in str(e.value) and str(2 * Image.MAX_IMAGE_PIXELS) not in str(e.value)


def test_truncated_and_garbage_are_corrupt():
    data = encode_image(_gradient(), "png")
    for bad in (data[: len(data) // 2], b"\x00garbage" * 100, b""):
        with pytest.raises(MediaError) as e:
            decode_image(bad)
        assert _code(e) == "media_corrupt", bad[:16]


def test_byte_and_format_limits():
    data = encode_image(_gradient(), "jpeg")
    with pytest.raises(MediaError) as e:
        decode_image(data, ImageDecodeLimits(max_bytes=100))
    assert _code(e) == "media_bytes" and str(len(data)) in e.value.message
    with pytest.raises(MediaError) as e:
        decode_image(data, ImageDecodeLimits(formats=("png",)))
    assert _code(e) == "media_format"
    with pytest.raises(MediaError) as e:
        decode_image(_save(Image.fromarray(_blocks()), "ICO"))  # PIL reads it; we do not accept it
    assert _code(e) == "media_format"


def test_media_error_pickles():
    err = pickle.loads(pickle.dumps(MediaError("media_pixels", "too big", param="image")))
    assert (err.code, err.message, err.param) == ("media_pixels", "too big", "image")


# -- worker pool ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool():
    with MediaPool(workers=2, task_cpu_s=5, task_memory_mb=768, task_timeout_s=10, metrics=Metrics(),
                   extra_functions=TEST_FUNCTIONS) as p:
        yield p


def test_results_come_back_from_worker_processes(pool):
    pid, value = pool.run("_test_echo", {"a": 1})
    assert value == {"a": 1} and pid != os.getpid()
    data = encode_image(_gradient(), "png")
    out = pool.run("decode_image", data, ImageDecodeLimits(), mode="RGB")
    assert isinstance(out, DecodedImage) and out.content_hash == decode_image(data).content_hash
    assert not out.pixels.flags.writeable and not decode_image(data).pixels.flags.writeable  # shared via caches
    np.testing.assert_array_equal(out.pixels, _gradient())
    assert decode_image(pool.run("encode_image", _gradient(), "png")).pixels.shape == (48, 64, 3)
    with pytest.raises(MediaError) as e:
        pool.run("decode_image", _bomb_png(50_000, 50_000))  # rejected in the worker, under its memory limit
    assert _code(e) == "media_pixels"


def test_metrics_observe_queue_age_and_run_time(pool):
    before = pool.tasks_done
    pool.run("_test_echo", 1)
    reg, labels = pool.metrics.registry, {"stage": "media/_test_echo", "model": ""}
    assert reg.get_sample_value("mmserve_stage_queue_age_seconds_count", labels) >= 1
    assert reg.get_sample_value("mmserve_stage_run_seconds_count", labels) >= 1
    assert reg.get_sample_value("mmserve_media_tasks_total", {"function": "_test_echo", "outcome": "ok"}) >= 1
    assert pool.tasks_done == before + 1


@pytest.mark.parametrize("how", ["exit", "segv"])
def test_crash_fails_only_its_task(pool, how):
    replaced = pool.workers_replaced
    others = [pool.submit("_test_sleep", 0.2) for _ in range(3)]
    crash = pool.submit("_test_crash", how)
    with pytest.raises(MediaError) as e:
        crash.result(timeout=10)
    assert _code(e) == "media_worker" and ("exit code 3" if how == "exit" else "SIGSEGV") in e.value.message
    assert all(f.result(timeout=10)[0] != os.getpid() for f in others)
    assert pool.workers_replaced == replaced + 1
    assert pool.run("_test_echo", "still here")[1] == "still here"


def test_a_worker_killed_from_outside_fails_its_task_as_retryable(pool):
    """SIGKILL comes from outside (kill -9, the out-of-memory killer), never from the input: media_worker_lost, a
    retryable kind (503 with Retry-After), not the 400 of a worker its input crashed."""
    replaced = pool.workers_replaced
    with pytest.raises(MediaError) as e:
        pool.submit("_test_crash", "kill").result(timeout=10)
    assert _code(e) == "media_worker_lost" and e.value.kind is ErrorKind.UNAVAILABLE and "SIGKILL" in e.value.message
    assert http_status(StageError(e.value.code, e.value.message, kind=e.value.kind)) == 503
    assert pool.workers_replaced == replaced + 1
    assert pool.run("_test_echo", "still here")[1] == "still here"


def test_a_worker_that_died_idle_costs_its_next_task_nothing():
    with MediaPool(workers=1, task_cpu_s=5, task_memory_mb=0, task_timeout_s=10,
                   extra_functions=TEST_FUNCTIONS) as pool:
        pid, _ = pool.run("_test_echo", 1)
        os.kill(pid, signal.SIGKILL)  # dies between tasks: the next task finds its pipe broken when sending
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _state(pid) not in ("Z", None):
            time.sleep(0.02)
        new_pid, value = pool.run("_test_echo", "delivered")  # sent again to a fresh worker, not failed
        assert value == "delivered" and new_pid != pid
        assert pool.workers_replaced == 1 and pool.tasks_failed == 0


def _state(pid: int) -> str | None:
    """The /proc state letter of `pid` (Z: exited, not yet reaped), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_cpu_burn_past_the_limit_is_a_timeout():
    # A wall clock far above the CPU limit: on a busy host 2 CPU seconds can take many wall seconds.
    with MediaPool(workers=1, task_cpu_s=1, task_memory_mb=0, task_timeout_s=60,
                   extra_functions=TEST_FUNCTIONS) as pool:
        with pytest.raises(MediaError) as e:
            pool.run("_test_burn_cpu", 30)
        assert _code(e) == "media_timeout" and "task_cpu_s=1" in e.value.message
        assert pool.workers_replaced == 1
        # The budget is per task, not per worker life: two tasks of 0.9 s pass a 1 s limit.
        assert pool.run("_test_burn_cpu", 0.9) >= 0.9
        assert pool.run("_test_burn_cpu", 0.9) >= 0.9


def test_allocation_past_the_memory_limit_fails_cleanly(pool):
    with pytest.raises(MediaError) as e:
        pool.run("_test_allocate", 2048)
    assert _code(e) == "media_worker" and "task_memory_mb=768" in e.value.message
    assert pool.run("_test_allocate", 64) == 64 * 1024 * 1024


def test_bad_calls_are_refused_without_losing_a_worker(pool):
    replaced = pool.workers_replaced
    with pytest.raises(ValueError, match="not a media worker function"):
        pool.submit("os.system", "true")
    with pytest.raises(Exception, match="pickle|lambda"):
        pool.run("_test_echo", lambda: None)
    with pytest.raises(ValueError, match="quality"):
        pool.run("encode_image", _gradient(), "jpeg", quality=0)  # the function's own error crosses back
    assert pool.workers_replaced == replaced


def test_test_functions_exist_only_where_a_test_registers_them():
    import stages.media.image as media

    assert not [name for name in dir(media) if name.startswith("_test")]
    assert not [name for name in WORKER_FUNCTIONS if name.startswith("_test")]
    with MediaPool(workers=1, task_cpu_s=5, task_memory_mb=0, task_timeout_s=5) as production:  # as the engine's
        for name in TEST_FUNCTIONS:
            with pytest.raises(ValueError, match="not a media worker function"):
                production.submit(name, 1)
        assert production.run("encode_image", _gradient(), "png")[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="may not replace"):
        MediaPool(workers=1, task_cpu_s=5, task_memory_mb=0, task_timeout_s=5,
                  extra_functions={"decode_image": TEST_FUNCTIONS["_test_echo"]})


def test_tasks_beyond_the_workers_queue_and_all_finish(pool):
    start = time.monotonic()
    futures = [pool.submit("_test_sleep", 0.3) for _ in range(6)]
    spans = [f.result(timeout=20) for f in futures]
    assert time.monotonic() - start >= 0.9  # 6 tasks, 2 at a time
    assert len({pid for pid, _, _ in spans}) <= 2
    events = sorted([(s, 1) for _, s, _ in spans] + [(e, -1) for _, _, e in spans])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak <= 2


def test_hang_hits_the_wall_timeout_and_the_worker_is_replaced():
    with MediaPool(workers=1, task_cpu_s=60, task_memory_mb=0, task_timeout_s=0.5,
                   extra_functions=TEST_FUNCTIONS) as pool:
        first_pid = pool.run("_test_echo", 0)[0]
        start = time.monotonic()
        with pytest.raises(MediaError) as e:
            pool.run("_test_sleep", 30)
        assert _code(e) == "media_timeout" and "task_timeout_s=0.5" in e.value.message
        assert time.monotonic() - start < 5
        assert pool.workers_replaced == 1
        assert pool.run("_test_echo", 1)[0] != first_pid


def test_closed_pool_refuses_work():
    pool = MediaPool(workers=1, task_cpu_s=5, task_memory_mb=0, task_timeout_s=5, extra_functions=TEST_FUNCTIONS)
    assert pool.run("_test_echo", 1)[1] == 1
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("_test_echo", 1)


def test_memory_limit_below_the_worker_baseline_teaches():
    with MediaPool(workers=1, task_cpu_s=5, task_memory_mb=100, task_timeout_s=5,
                   extra_functions=TEST_FUNCTIONS) as pool:
        with pytest.raises(MediaError) as e:
            pool.run("_test_echo", 1)
    assert _code(e) == "media_worker" and "task_memory_mb=100" in e.value.message
