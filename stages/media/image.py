"""Image codecs that run inside media worker processes.

Pure functions with picklable arguments and results, so `stages.media.pool` can run them in
a child process: codecs are attack surface, and a crash or stall there must not reach the
API process. Imports only the stdlib, numpy and PIL (never torch), which keeps a worker's
start-up cheap and its address space small.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from stages.events import ErrorKind

ERROR_CODES = frozenset({
    "media_bytes", "media_pixels", "media_frames", "media_duration", "media_format",
    "media_corrupt", "media_fetch", "media_timeout", "media_worker", "media_worker_lost",
})

# Our lower-case names -> PIL's format names.
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP", "tiff": "TIFF"}
_FROM_PIL = {v: k for k, v in _PIL_FORMATS.items()}
_ENCODE_FORMATS = ("png", "jpeg", "webp")
_DECODE_MODES = ("RGB", "L", "RGBA")

# What a malformed file makes PIL raise while it parses headers or pixels.
_CORRUPT_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError, KeyError, TypeError)


_OVER_LIMIT = ("media_bytes", "media_pixels", "media_frames", "media_duration")


class MediaError(Exception):
    """A media input or task rejected or failed; `code` is stable, `message` says what to change."""

    def __init__(self, code: str, message: str, param: str | None = None):
        assert code in ERROR_CODES, code
        super().__init__(code, message, param)
        self.code = code  # one of ERROR_CODES; mapped to an HTTP error by the serving layer
        self.message = message  # names the limit and the value that broke it
        self.param = param  # request field at fault, when known

    @property
    def kind(self) -> ErrorKind:
        """A limit passed (bytes, pixels, frames, duration), an input that is wrong, or (media_worker_lost) a
        worker killed from outside while it ran the task: not the input's fault, worth a retry."""
        if self.code == "media_worker_lost":
            return ErrorKind.UNAVAILABLE
        return ErrorKind.TOO_LARGE if self.code in _OVER_LIMIT else ErrorKind.INVALID

    def __reduce__(self):
        # Crosses the worker pipe: rebuild from the three fields, not from Exception.args magic.
        return (MediaError, (self.code, self.message, self.param))

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True)
class ImageDecodeLimits:
    max_bytes: int = 20 * 1024 * 1024  # encoded size, checked before anything is parsed
    max_pixels: int = 4096 * 4096  # width * height declared by the header, checked before decoding
    max_frames: int = 1000  # frames in an animated file (only the first is decoded)
    formats: tuple[str, ...] = ("png", "jpeg", "webp", "gif", "bmp", "tiff")  # accepted containers

    def __post_init__(self):
        unknown = [f for f in self.formats if f not in _PIL_FORMATS]
        if unknown:
            raise ValueError(f"ImageDecodeLimits.formats has unknown {unknown}; known: {sorted(_PIL_FORMATS)}")


@dataclass
class DecodedImage:
    pixels: np.ndarray  # uint8 [H, W, C]; C = 3 (RGB), 1 (L) or 4 (RGBA)
    width: int  # after EXIF orientation
    height: int  # after EXIF orientation
    format: str  # container it came in: "png", "jpeg", ...
    content_hash: str  # sha256 of the bytes and the decode config: identity for caches

    def __post_init__(self):
        # Read-only: a decoded image may be shared by every request whose input has this hash.
        self.pixels.flags.writeable = False

    def __setstate__(self, state: dict) -> None:
        # Unpickling (coming back from a worker) skips __post_init__ and yields a writeable copy.
        self.__dict__.update(state)
        self.__post_init__()

    def to_pil(self) -> Image.Image:
        """The pixels as a PIL image ("RGB", "L" or "RGBA"); it may share memory with `pixels`."""
        if self.pixels.shape[2] == 1:
            return Image.fromarray(self.pixels[:, :, 0])  # [H, W] -> mode "L"
        return Image.fromarray(self.pixels)


def encode_image(pixels: np.ndarray, fmt: str, quality: int | None = None) -> bytes:
    """Encode uint8 [H, W, 3] (or [H, W] / [H, W, 1] grey) pixels as png, jpeg or webp."""
    fmt = fmt.lower()
    fmt = "jpeg" if fmt == "jpg" else fmt
    if fmt not in _ENCODE_FORMATS:
        raise MediaError("media_format", f"cannot encode images as {fmt!r}; supported: {list(_ENCODE_FORMATS)}",
                         param="output_format")
    if pixels.dtype != np.uint8 or pixels.ndim not in (2, 3) or (pixels.ndim == 3 and pixels.shape[2] not in (1, 3)):
        raise ValueError(f"encode_image wants uint8 [H, W, 3] or [H, W] pixels, got {pixels.dtype} {pixels.shape}")
    if quality is not None and not 1 <= quality <= 100:
        raise ValueError(f"quality must be in 1..100, got {quality}")
    if pixels.ndim == 3 and pixels.shape[2] == 1:
        pixels = pixels[:, :, 0]
    img = Image.fromarray(np.ascontiguousarray(pixels))
    out = io.BytesIO()
    if fmt == "png":
        img.save(out, format="PNG", compress_level=6)  # lossless; quality does not apply
    else:
        img.save(out, format=_PIL_FORMATS[fmt], quality=90 if quality is None else quality)
    return out.getvalue()


def decode_image(data: bytes, limits: ImageDecodeLimits = ImageDecodeLimits(), mode: str = "RGB") -> DecodedImage:
    """Decode the first frame of an image, checking every limit before pixels are allocated.

    EXIF orientation is applied, so width/height are as a viewer shows them. `mode="L"` keeps
    one grey channel (masks).
    """
    if mode not in _DECODE_MODES:
        raise ValueError(f"decode_image mode must be one of {_DECODE_MODES}, got {mode!r}")
    if len(data) > limits.max_bytes:
        raise MediaError("media_bytes", f"image is {len(data)} bytes; the limit is {limits.max_bytes} bytes")
    try:
        # Image.open reads headers only; PIL raises DecompressionBombError here for absurd sizes.
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise _too_many_pixels(_declared_size(data), limits) from None
    except UnidentifiedImageError:
        raise MediaError("media_corrupt", f"{len(data)} bytes are not a recognisable image") from None
    except _CORRUPT_ERRORS as e:
        raise MediaError("media_corrupt", f"image header is malformed: {e}") from None
    with img:
        fmt = _FROM_PIL.get(img.format or "")
        if fmt not in limits.formats:
            raise MediaError("media_format", f"image format {img.format} is not accepted; accepted: "
                                             f"{list(limits.formats)}")
        if img.size[0] * img.size[1] > limits.max_pixels:
            raise _too_many_pixels(img.size, limits)
        return _decode_checked(img, data, fmt, limits, mode)


def _too_many_pixels(size: tuple[int, int] | None, limits: ImageDecodeLimits) -> MediaError:
    """Our limit and the image's declared size; never PIL's own bomb limit, which is not the one that applies."""
    if size is None:
        return MediaError("media_pixels", f"image header declares more pixels than the limit of "
                                          f"{limits.max_pixels} pixels")
    width, height = size
    return MediaError("media_pixels", f"image is {width}x{height} = {width * height} pixels; "
                                      f"the limit is {limits.max_pixels} pixels")


def _declared_size(data: bytes) -> tuple[int, int] | None:
    """The (width, height) an image header declares, read as Image.open does but without PIL's bomb check
    (which refused the file before its size could be reported). Headers only: nothing is decoded."""
    prefix = data[:16]
    for name in Image.ID:
        factory, accept = Image.OPEN[name]
        if accept is not None and accept(prefix) is not True:
            continue
        try:
            with factory(io.BytesIO(data), "") as img:
                return img.size
        except _CORRUPT_ERRORS:
            continue
    return None


def _decode_checked(img: Image.Image, data: bytes, fmt: str, limits: ImageDecodeLimits, mode: str) -> DecodedImage:
    try:
        # GIF counts frames by skipping their data blocks (nothing decoded); others read a header.
        frames = getattr(img, "n_frames", 1)
        if frames > limits.max_frames:
            raise MediaError("media_frames", f"image has {frames} frames; the limit is {limits.max_frames}")
        img.seek(0)
        img.load()
        img = ImageOps.exif_transpose(img)  # a phone's portrait JPEG is stored landscape + tag 6
        if img.mode != mode:
            # Palette or grey+alpha images go through RGBA so transparency is resolved, not dropped oddly.
            if mode != "RGBA" and ("transparency" in img.info or img.mode in ("LA", "PA")):
                img = img.convert("RGBA")
            img = img.convert(mode)
        pixels = np.asarray(img, dtype=np.uint8)
    except _CORRUPT_ERRORS as e:
        raise MediaError("media_corrupt", f"{fmt} image data is truncated or malformed: {e}") from None
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]  # keep [H, W, C] for every mode
    h = hashlib.sha256(data)
    h.update(f"|decode_image:mode={mode};exif_transpose=1".encode())
    return DecodedImage(pixels=pixels, width=pixels.shape[1], height=pixels.shape[0], format=fmt,
                        content_hash=h.hexdigest())


# What a worker agrees to run, by name -> module: the API process can ask for nothing else. A
# worker imports only the module of the function it runs (video never loads for an image task).
WORKER_FUNCTIONS = {
    "encode_image": "stages.media.image", "decode_image": "stages.media.image",
    "probe_video": "stages.media.video", "decode_video": "stages.media.video", "encode_video": "stages.media.video",
    "encode_fmp4_segment": "stages.media.video_encode",
    "probe_audio": "stages.media.audio", "decode_audio": "stages.media.audio", "encode_audio": "stages.media.audio",
}


def worker_function(name: str, extra: Mapping[str, str] | None = None):
    """The function a worker runs for `name`, or None when it is not a media worker function.

    `extra` (name -> module) adds functions to WORKER_FUNCTIONS for one pool (the tests' crash, hang
    and memory functions); it never replaces one."""
    module = WORKER_FUNCTIONS.get(name) or (extra or {}).get(name)
    return None if module is None else getattr(importlib.import_module(module), name)
