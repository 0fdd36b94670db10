"""The media stages, run in the media worker processes: media_decode (uploaded bytes -> the images a request
edits) and media_encode (a request's pixels -> encoded files).

They begin and end the server's image graphs (media_decode -> text_encode -> denoise -> vae_decode ->
media_encode), so the route only parses and replies. A worker thread of their pools holds no torch threads: it
hands the work to the process pool (stages/media/pool.py) and waits, so N replicas keep N tasks in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stages.events import StageError
from stages.media.image import DecodedImage, ImageDecodeLimits, MediaError
from stages.media.pool import MediaPool
from stages.stage import Stage, WorkItem

# Media errors that are about size are 413s; the rest (corrupt, unsupported, ...) 400s.
# Outputs of the node before media_encode that the request's final outputs keep.
_PASSED_ON = ("images", "pixels", "seed")


@dataclass(frozen=True)
class EncodeImages:
    """The media_encode task of a request: every output image in one format."""

    format: str  # "png", "jpeg" or "webp"
    quality: int | None = None  # jpeg and webp: 1..100; None: the encoder's default

    def __post_init__(self):
        if self.quality is not None and not 1 <= self.quality <= 100:
            raise ValueError(f"EncodeImages.quality must be in 1..100, got {self.quality}")


@dataclass(frozen=True)
class DecodeImages:
    """The media_decode task of an edit: the uploaded image (and mask) bytes, and the fields errors name."""

    image: bytes | tuple[bytes, ...]  # one image, or several (a tuple: the edit's image is a list) in order
    mask: bytes | None = None
    image_param: str = "image"  # "image" (multipart) or "images" (JSON references)

    def __repr__(self) -> str:  # never the bytes in a log line
        mask = f", mask {len(self.mask)} bytes" if self.mask is not None else ""
        sizes = [len(data) for data in self.image] if isinstance(self.image, tuple) else len(self.image)
        return f"DecodeImages({sizes} bytes{mask}, param {self.image_param!r})"


# decode(pool, task) -> what the task's bytes are, decoded in the pool's workers (it may submit several at once).
Decode = Callable[[MediaPool, Any], Any]
# finalize(request, decoded) -> the node's outputs: the request as it runs (its checks that need the media).
Finalize = Callable[[Any, Any], dict[str, Any]]


class MediaDecodeStage(Stage):
    """media_decode: the request's `decode` task through `decode`, then `finalize` with what came out."""

    kind = "media_decode"
    torch_threads = False  # the work runs in the media worker processes

    def __init__(self, model: str, media: Callable[[], MediaPool], decode: Decode, finalize: Finalize):
        self.model = model
        self._media = media
        self._decode = decode
        self._finalize = finalize

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        return [self._finalize(item.inputs["request"], self._decode(self._media(), item.inputs["decode"]))
                for item in items]


def decode_images(limits: ImageDecodeLimits):
    """The decode of an edit's upload: (image RGB, mask in the engine's convention or None), all at once. Several
    images (a tuple of bytes) decode to a list of RGB images; an error names the first failing one's field."""
    def decode(pool: MediaPool, task: DecodeImages):
        sources = task.image if isinstance(task.image, tuple) else (task.image,)
        futures = [pool.submit("decode_image", data, limits, mode="RGB") for data in sources]
        mask = None if task.mask is None else pool.submit("decode_image", task.mask, limits, mode="RGBA")
        decoded: list[DecodedImage] = [result_of(future, task.image_param) for future in futures]
        images = [image.to_pil() for image in decoded]
        image = images if isinstance(task.image, tuple) else images[0]
        return image, None if mask is None else edit_mask(result_of(mask, "mask").to_pil())
    return decode


def edit_mask(mask_rgba):
    """A mask upload -> the engine's convention (mode "L", white = repaint).

    OpenAI's convention is an RGBA mask whose transparent pixels mark where to edit; a mask
    with no transparency is read the diffusers way (white = repaint), so both kinds work.
    """
    from PIL import ImageOps

    alpha = mask_rgba.getchannel("A")
    if alpha.getextrema()[0] < 255:
        return ImageOps.invert(alpha)
    return mask_rgba.convert("L")


class MediaEncodeStage(Stage):
    kind = "media_encode"
    torch_threads = False  # the work runs in the media worker processes

    def __init__(self, model: str, media: Callable[[], MediaPool]):
        self.model = model
        self._media = media  # the engine's pool, started on first use

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        pending = [(item, self._submit(item)) for item in items]  # every image in flight before any wait
        return [{**{k: item.inputs[k] for k in _PASSED_ON if k in item.inputs},
                 "encoded": [result_of(future, "output_format") for future in futures]} for item, futures in pending]

    def _submit(self, item: WorkItem) -> list:
        task: EncodeImages = item.inputs["encode"]
        pool = self._media()
        return [pool.submit("encode_image", np.asarray(image.convert("RGB")), task.format, task.quality)
                for image in item.inputs["images"]]


def result_of(future, param: str):
    """A media task's result; its MediaError becomes the request's error, naming `param`."""
    try:
        return future.result()
    except MediaError as exc:
        raise StageError(exc.code, exc.message, param=param, kind=exc.kind) from exc
