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
MEDIA_STATUS = {"media_bytes": 413, "media_pixels": 413, "media_frames": 413, "media_duration": 413}

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

    image: bytes
    mask: bytes | None = None
    image_param: str = "image"  # "image" (multipart) or "images" (JSON references)

    def __repr__(self) -> str:  # never the bytes in a log line
        mask = f", mask {len(self.mask)} bytes" if self.mask is not None else ""
        return f"DecodeImages({len(self.image)} bytes{mask}, param {self.image_param!r})"


# finalize(request, image, mask or None) -> the request as it runs (its checks that need the images).
Finalize = Callable[[Any, Any, Any], Any]


class MediaDecodeStage(Stage):
    kind = "media_decode"
    torch_threads = False  # the work runs in the media worker processes

    def __init__(self, model: str, media: Callable[[], MediaPool], limits: ImageDecodeLimits, finalize: Finalize):
        self.model = model
        self._media = media
        self._limits = limits
        self._finalize = finalize

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        pending = [(item, self._submit(item.inputs["decode"])) for item in items]
        return [self._finish(item, *futures) for item, futures in pending]

    def _submit(self, task: DecodeImages) -> tuple:
        pool = self._media()
        image = pool.submit("decode_image", task.image, self._limits, mode="RGB")
        mask = None if task.mask is None else pool.submit("decode_image", task.mask, self._limits, mode="RGBA")
        return image, mask

    def _finish(self, item: WorkItem, image_future, mask_future) -> dict[str, Any]:
        task: DecodeImages = item.inputs["decode"]
        image: DecodedImage = _result(image_future, task.image_param)
        mask = None if mask_future is None else edit_mask(_result(mask_future, "mask").to_pil())
        return {"request": self._finalize(item.inputs["request"], image.to_pil(), mask)}


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
                 "encoded": [_result(future, "output_format") for future in futures]} for item, futures in pending]

    def _submit(self, item: WorkItem) -> list:
        task: EncodeImages = item.inputs["encode"]
        pool = self._media()
        return [pool.submit("encode_image", np.asarray(image.convert("RGB")), task.format, task.quality)
                for image in item.inputs["images"]]


def _result(future, param: str):
    """A media task's result; its MediaError becomes the request's error, naming `param`."""
    try:
        return future.result()
    except MediaError as exc:
        raise StageError(exc.code, exc.message, param=param, status=MEDIA_STATUS.get(exc.code, 400)) from exc
