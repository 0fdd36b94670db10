"""LLaVA-1.5-style models: a CLIP or SigLIP tower, a feature layer and select strategy, an MLP projector.

Every image is resized and cropped to the tower's fixed input size, so every image of a
checkpoint has the same number of placeholder tokens and every prepared image has the same
shape: one bucket, stacked into one forward. Videos arrive as sampled frames, one image each.
The feature layer(s) and the select strategy ("default" drops CLS, "full" keeps it) are the
checkpoint's config values, applied by the model's own `get_image_features`.
"""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np
import torch
from PIL import Image

from encoders.vision import EncoderAdapter, EncodeTask, Geometry, MediaItem, Prepared


class LlavaAdapter(EncoderAdapter):
    family = "llava"
    video_as_images = True

    def __init__(self, model, processor, **kwargs):
        super().__init__(model, processor, **kwargs)
        self.token_ids = {"image": model.config.image_token_id}
        # The processor's own count of placeholder tokens for one image (it is the same for every image).
        probe = processor.image_processor(images=[Image.new("RGB", (8, 8))], return_tensors="pt")
        self.num_tokens = processor.replace_image_token(probe, image_idx=0).count(processor.image_token)

    def plan(self, media: MediaItem, options: dict[str, Any]) -> Geometry:
        if media.kind != "image":
            raise ValueError("LLaVA takes videos as frames: plan each frame as an image")
        return Geometry("image", self.num_tokens)

    def prepare(self, task: EncodeTask) -> Prepared:
        out = self.processor.image_processor(images=[task.media.pixels], return_tensors="pt")
        return Prepared(task, {"pixel_values": out["pixel_values"]})  # [1, 3, H, W]

    def bucket(self, prepared: Prepared) -> Hashable:
        return tuple(prepared.tensors["pixel_values"].shape[1:])

    @torch.inference_mode()
    def encode(self, batch: list[Prepared]) -> list[torch.Tensor]:
        pixels = torch.cat([p.tensors["pixel_values"] for p in batch]).to(self.device, self.dtype)  # [B, 3, H, W]
        out = self.model.model.get_image_features(pixel_values=pixels, return_dict=True)
        return list(out.pooler_output)  # B x [num_tokens, hidden]


def frame_images(frames: np.ndarray) -> list[Image.Image]:
    """uint8 [T, H, W, 3] -> one RGB image per frame."""
    return [Image.fromarray(np.ascontiguousarray(f)) for f in frames]
