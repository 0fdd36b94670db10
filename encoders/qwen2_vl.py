"""Qwen2-VL and Qwen2.5-VL: dynamic resolution, patch grids (t, h, w), M-RoPE, images and video.

Each image is resized (aspect kept) to a multiple of patch * merge within a pixel budget; its
grid decides its token count and its 3-D positions. The tower takes variable-length input
(patches of many items concatenated, `grid_thw` row per item, attention kept within an item),
so items of one kind share a forward without any padding. `detail="low"` lowers the image
pixel budget. Videos are sampled frames with their timing: `second_per_grid` spaces the
temporal positions.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Hashable

import torch

from encoders.vision import EncoderAdapter, EncodeTask, Geometry, MediaItem, Prepared


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's resize rule (transformers' Qwen2-VL image/video processors)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as resize

    try:
        return resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as e:  # aspect ratio beyond 200:1
        raise ValueError(f"image of {width}x{height} pixels cannot be encoded: {e}") from None


class Qwen2VLAdapter(EncoderAdapter):
    family = "qwen2_vl"
    uses_mrope = True

    def __init__(self, model, processor, **kwargs):
        super().__init__(model, processor, **kwargs)
        config = model.config
        self.token_ids = {"image": config.image_token_id, "video": config.video_token_id}
        self.merge = config.vision_config.spatial_merge_size
        # The processor may leave this unset (it then warns and does not cap); we pass the resolved value.
        self.cap_frames = bool(getattr(processor.video_processor, "cap_pixels_per_frame", None))

    # -- planning (sizes only) -------------------------------------------------------------------
    def options(self, media: MediaItem) -> tuple[tuple[str, Any], ...]:
        if media.kind == "image" and media.detail == "low":
            size = self.processor.image_processor.size
            low = max(size["shortest_edge"], min(size["longest_edge"], self.low_detail_max_pixels))
            return (("size", (("longest_edge", low), ("shortest_edge", size["shortest_edge"]))),)
        return ()

    def plan(self, media: MediaItem, options: dict[str, Any]) -> Geometry:
        proc = self.processor.image_processor if media.kind == "image" else self.processor.video_processor
        size = dict(options["size"]) if "size" in options else proc.size
        factor = proc.patch_size * proc.merge_size
        max_pixels = size["longest_edge"]
        if media.kind == "video" and self.cap_frames:  # the video processor's per-frame share of a total budget
            total = int(proc.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * proc.temporal_patch_size // media.num_frames),
                             int(size["shortest_edge"] * 1.05))
        h, w = smart_resize(media.height, media.width, factor, size["shortest_edge"], max_pixels)
        t = 1 if media.kind == "image" else math.ceil(media.num_frames / proc.temporal_patch_size)
        grid = (t, h // proc.patch_size, w // proc.patch_size)
        tokens = grid[0] * grid[1] * grid[2] // proc.merge_size**2
        second = None
        if media.kind == "video":
            second = proc.temporal_patch_size / self._sampled_fps(media)
        return Geometry(media.kind, tokens, grid, second)

    @staticmethod
    def _sampled_fps(media: MediaItem) -> float:
        """transformers' VideoMetadata.sampled_fps for the frames we sampled."""
        if not media.indices or not media.frame_count or not media.fps:
            return media.fps or 24
        return len(media.indices) / media.frame_count * media.fps

    # -- pixels ----------------------------------------------------------------------------------
    def prepare(self, task: EncodeTask) -> Prepared:
        media, options = task.media, dict(task.options)
        if "size" in options:
            options["size"] = dict(options["size"])
        if media.kind == "image":
            out = self.processor.image_processor(images=[media.pixels], return_tensors="pt", **options)
            pixels, grid = out["pixel_values"], out["image_grid_thw"]
        else:
            with warnings.catch_warnings():  # decoded frames are read-only on purpose; the processor only reads
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                out = self.processor.video_processor(videos=[media.pixels], return_tensors="pt",
                                                     do_sample_frames=False, cap_pixels_per_frame=self.cap_frames,
                                                     **options)
            pixels, grid = out["pixel_values_videos"], out["video_grid_thw"]
        if tuple(grid[0].tolist()) != task.geometry.grid_thw:  # the plan decided the prompt: it must hold
            raise ValueError(f"processor made grid {tuple(grid[0].tolist())} for a {media.kind} planned as "
                             f"{task.geometry.grid_thw}")
        return Prepared(task, {"pixel_values": pixels, "grid_thw": grid})  # [patches, C*t*p*p], [1, 3]

    def bucket(self, prepared: Prepared) -> Hashable:
        return prepared.task.media.kind  # variable-length packing: no padding between sizes

    @torch.inference_mode()
    def encode(self, batch: list[Prepared]) -> list[torch.Tensor]:
        pixels = torch.cat([p.tensors["pixel_values"] for p in batch]).to(self.device)
        grid = torch.cat([p.tensors["grid_thw"] for p in batch]).to(self.device)
        fn = self.model.model.get_video_features if batch[0].task.media.kind == "video" \
            else self.model.model.get_image_features
        return list(fn(pixels, grid, return_dict=True).pooler_output)

    # -- positions -------------------------------------------------------------------------------
    def rope_positions(self, input_ids: list[int], geometries: list) -> tuple[torch.Tensor, int]:
        """The model's own get_rope_index for one prompt: positions [3, T] and the delta after it."""
        ids = torch.tensor([input_ids], dtype=torch.long)
        types = torch.zeros_like(ids)
        types[ids == self.token_ids["image"]] = 1
        types[ids == self.token_ids["video"]] = 2
        images = [g.grid_thw for g in geometries if g.kind == "image"]
        videos = [g for g in geometries if g.kind == "video"]
        kwargs = {}
        if videos:
            kwargs["second_per_grid_ts"] = torch.tensor([g.second_per_grid for g in videos])
        positions, delta = self.model.model.get_rope_index(
            ids, mm_token_type_ids=types, image_grid_thw=torch.tensor(images) if images else None,
            video_grid_thw=torch.tensor([g.grid_thw for g in videos]) if videos else None, **kwargs)
        return positions[:, 0].cpu(), int(delta.reshape(-1)[0])
