"""Encoder adapters: the contract every vision- or audio-language family implements, and what they share.

An adapter wraps one loaded multimodal model's encoder (its vision tower, or its audio encoder) and the
processor. It answers, for one decoded media item:

* `plan`: the geometry (placeholder tokens = feature rows, grid) from the item's size alone,
  before any pixel is preprocessed, so a request that is too long is refused before encoding;
* `prepare`: the processor's pixel tensors for the item;
* `bucket`: which prepared items may share one encoder forward (same shape, or packed
  variable-length input), so small images are never padded up to large ones;
* `encode`: one forward for a bucket, through the model's own feature functions (the tower,
  the feature layer and select strategy, the projector / merger), one feature tensor per item.

A family is one file (encoders/llava.py, encoders/qwen2_vl.py, encoders/audio.py) plus one line in ADAPTERS
(vision) or AUDIO_ADAPTERS (audio).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

# config.json `architectures` -> "module:Class" of the adapter that serves its vision input ...
ADAPTERS = {
    "LlavaForConditionalGeneration": "encoders.llava:LlavaAdapter",
    "Qwen2VLForConditionalGeneration": "encoders.qwen2_vl:Qwen2VLAdapter",
    "Qwen2_5_VLForConditionalGeneration": "encoders.qwen2_vl:Qwen2VLAdapter",
    "Qwen2_5OmniForConditionalGeneration": "encoders.omni:OmniVisionAdapter",
    "Qwen3OmniMoeForConditionalGeneration": "encoders.omni3:Omni3VisionAdapter",
}
# ... and its audio input.
AUDIO_ADAPTERS = {
    "Qwen2AudioForConditionalGeneration": "encoders.audio:Qwen2AudioAdapter",
    "Qwen2_5OmniForConditionalGeneration": "encoders.omni:OmniAudioAdapter",
    "Qwen3OmniMoeForConditionalGeneration": "encoders.omni3:Omni3AudioAdapter",
}


@dataclass(frozen=True)
class MediaItem:
    """One decoded media input, as an encoder takes it."""

    kind: str  # "image", "video" or "audio"
    pixels: Any  # image: PIL.Image (RGB); video: uint8 ndarray [T, H, W, 3]; audio: float32 [N] mono samples
    content_hash: str  # sha256 of the source bytes and the decode config (frame sampling included)
    height: int  # (0 for audio)
    width: int
    detail: str = "auto"  # resolution hint: "low" | "high" | "auto"
    fps: float | None = None  # video: the source's frame rate
    frame_count: int | None = None  # video: frames in the whole source
    indices: tuple[int, ...] = ()  # video: source frame index of each sampled frame

    @property
    def num_frames(self) -> int:
        return 1 if self.kind == "image" else int(self.pixels.shape[0])


@dataclass(frozen=True)
class Geometry:
    """Where an item's features go and how they are laid out."""

    kind: str  # "image", "video" or "audio": which placeholder token the span uses
    num_tokens: int  # placeholder tokens in the prompt = feature rows
    grid_thw: tuple[int, int, int] | None = None  # patch grid (t, h, w) before the spatial merge (Qwen2-VL)
    second_per_grid: float | None = None  # video: seconds of video per temporal grid step (M-RoPE)
    audio_frames: int | None = None  # audio: the clip's mel frames (Qwen2.5-Omni's M-RoPE places audio by them)


@dataclass(frozen=True)
class EncodeTask:
    """One media item of a request, planned: what the vision_encode stage runs (or finds cached)."""

    media: MediaItem
    geometry: Geometry
    options: tuple[tuple[str, Any], ...]  # processor call overrides for this item (resolution), sorted
    key: Hashable  # encoder-output cache key: (tenant, weights id, processor config hash, dtype, content hash)

    @property
    def identity(self) -> str:
        """The media's identity in the prefix-cache namespace (the key minus the tenant)."""
        return "|".join(str(part) for part in self.key[1:])


@dataclass
class Prepared:
    """Pixel tensors of one item, ready for the encoder."""

    task: EncodeTask
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def config_hash(config: dict[str, Any], options: tuple) -> str:
    """A stable hash of a processor's configuration plus per-item overrides."""
    blob = json.dumps({"config": config, "options": list(options)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class EncoderAdapter:
    """One family's encoder: the model's vision (or audio) parts and the processor; no per-request state."""

    family: str = ""
    uses_mrope: bool = False  # the language model takes 3-D positions (rope_positions)
    video_as_images: bool = False  # videos reach the model as one image per sampled frame

    def __init__(self, model, processor, *, weights_id: str, dtype: torch.dtype, device: torch.device,
                 low_detail_max_pixels: int):
        self.model = model
        self.processor = processor
        self.weights_id = weights_id  # checkpoint identity (path + file fingerprint)
        self.dtype = dtype
        self.device = device
        self.low_detail_max_pixels = low_detail_max_pixels  # detail="low": the image pixel budget, where it applies
        self.token_ids: dict[str, int] = {}  # "image" / "video" -> placeholder token id (set by the family)

    # -- identity --------------------------------------------------------------------------------------
    def options(self, media: MediaItem) -> tuple[tuple[str, Any], ...]:
        """Processor overrides this item needs (a resolution hint); () when the family ignores them."""
        return ()

    def processor_config(self, kind: str) -> dict[str, Any]:
        """The processor configuration that shapes this kind of item's pixels."""
        sub = self.processor.video_processor if kind == "video" and hasattr(self.processor, "video_processor") \
            else self.processor.image_processor
        return sub.to_dict()

    def task(self, media: MediaItem, tenant: str) -> EncodeTask:
        """Plan one item: its geometry and its full cache identity."""
        options = self.options(media)
        digest = config_hash(self.processor_config(media.kind), options)
        key = (tenant, self.weights_id, digest, str(self.dtype).removeprefix("torch."), media.content_hash)
        return EncodeTask(media, self.plan(media, dict(options)), options, key)

    # -- the family's part -----------------------------------------------------------------------------
    def plan(self, media: MediaItem, options: dict[str, Any]) -> Geometry:
        raise NotImplementedError

    def prepare(self, task: EncodeTask) -> Prepared:
        raise NotImplementedError

    def bucket(self, prepared: Prepared) -> Hashable:
        raise NotImplementedError

    def encode(self, batch: list[Prepared]) -> list[torch.Tensor]:
        """One forward for a bucket; one feature tensor [num_tokens, hidden] per item, in order."""
        raise NotImplementedError

    def rope_positions(self, input_ids: list[int], geometries: list[Geometry]) -> tuple[torch.Tensor, int] | None:
        """3-D positions [3, len(input_ids)] and the delta for later tokens (M-RoPE models), else None."""
        return None


def adapter_class(architecture: str, audio: bool = False) -> type[EncoderAdapter] | None:
    """The vision (or audio) adapter of an architecture; None when it has no such input."""
    table = AUDIO_ADAPTERS if audio else ADAPTERS
    if architecture not in table:
        return None
    module, cls = table[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
