"""What the video families share: loading by the checkpoint's own pipeline class, video requests, the temporal
VAE decode.

A video family is a sibling of the image families over the diffusion base (pipelines/families/diffusion_base.py),
on the same three stages (text_encode -> denoise -> vae_decode): the latents gain a frame axis ([B, C, T, H, W])
and the denoise batch key holds the frames and size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Hashable

import numpy as np
import torch

from encoders.cache import EncoderCache
from pipelines.families.diffusion_base import DiffusionFamily
from pipelines.video import VideoConfig, VideoRequest, VideoTask
from stages.stage import WorkItem


class VideoFamily(DiffusionFamily[VideoTask, VideoRequest]):
    """A video family: text-to-video and image-to-video on VideoRequests, with the limits and defaults of its
    VideoConfig. Satisfies stages.diffusion.stages.DiffusionAdapter."""

    # model_index.json `_class_name` -> {task: diffusers pipeline class} served from that checkpoint
    pipelines_by_class: dict[str, dict[VideoTask, type[Any]]] = {}
    default_size: tuple[int, int] = (832, 480)  # (width, height) of the pipelines' __call__
    default_frames: int = 81
    default_fps: float = 16.0
    max_sequence_length: int = 512
    cond_keys: tuple[str, ...] = ("embeds",)  # the tensors of encode_text's dict that `conditioning` stacks

    def __init__(self, name: str, path: str, *, device: str = "cpu", dtype: str = "float32",
                 prompt_cache: EncoderCache | None = None, video: VideoConfig | None = None,
                 quantize: dict[str, str] | None = None):
        self.video = video or VideoConfig()
        super().__init__(name, path, device=device, dtype=dtype, prompt_cache=prompt_cache, quantize=quantize)
        if self.video.vae_tiling:
            self.enable_vae_tiling()
        if self.video.vae_slicing:
            self.pipe.vae.enable_slicing()

    def conditioning(self, prompt: dict, negative: dict | None, request: VideoRequest) -> dict[str, Any]:
        """One video's text tensors (cond_keys), [negative, prompt] rows with guidance (base.guide's (uncond, cond)
        order, the pipelines' concatenation), else the prompt's alone."""
        rows = [negative, prompt] if negative is not None else [prompt]
        cond: dict[str, Any] = {k: torch.cat([r[k] for r in rows]) for k in self.cond_keys}
        cond["cfg"] = negative is not None
        return cond

    def enable_vae_tiling(self) -> None:
        """Decode in overlapping tiles, of the configured size (video.vae_tile) or the VAE's own."""
        if self.video.vae_tile is None:
            self.pipe.vae.enable_tiling()
            return
        tile, stride = self.video.vae_tile
        self.pipe.vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile,
                                    tile_sample_stride_height=stride, tile_sample_stride_width=stride)

    def _class_pipelines(self) -> dict[VideoTask, type[Any]]:
        """The tasks and pipelines of the checkpoint's own class, the one it loads as first."""
        class_name = json.loads((Path(self.path) / "model_index.json").read_text())["_class_name"]
        if class_name not in self.pipelines_by_class:
            raise ValueError(f"{self.path}: {class_name} is not a {self.family} pipeline; "
                             f"expected one of {sorted(self.pipelines_by_class)}")
        return self.pipelines_by_class[class_name]

    def base_pipeline(self) -> tuple[VideoTask, type[Any]]:
        return next(iter(self._class_pipelines().items()))

    def variants(self, base) -> dict[VideoTask, type[Any]]:
        _, *rest = self._class_pipelines().items()
        return {**dict(rest), **self.extra_variants(base)}

    def extra_variants(self, base) -> dict[VideoTask, type[Any]]:
        """Pipelines a checkpoint serves beyond its class's (decided by its config)."""
        return {}

    @property
    def frame_factor(self) -> int:
        """num_frames must be frame_factor * k + 1 (the VAE's temporal compression)."""
        raise NotImplementedError

    @property
    def video_defaults(self) -> dict:
        """What a request gets when it names no size, frames or fps (and the frame-count rule)."""
        width, height = self.request_default_size
        return {"width": width, "height": height, "num_frames": self.request_default_frames, "fps": self.default_fps,
                "frame_factor": self.frame_factor}

    @property
    def request_default_size(self) -> tuple[int, int]:
        return self.video.default_size or self.default_size

    @property
    def request_default_frames(self) -> int:
        return self.video.default_frames or self.default_frames

    def validate(self, request: VideoRequest) -> VideoRequest:
        """The request checked against the model and this model's video limits, completed (defaults filled, a
        seed drawn), or the field-naming RequestError."""
        self.refuse_knobs(["true_cfg_scale"] if request.true_cfg_scale is not None else [])
        request = request.validate(tasks=self.tasks, model=self.name, size_factor=self.size_factor,
                                   frame_factor=self.frame_factor, default_size=self.request_default_size,
                                   default_frames=self.request_default_frames, default_fps=self.default_fps,
                                   default_steps=self.default_steps, default_guidance=self.default_guidance,
                                   limits=self.video.limits)
        self.check_steps(request.num_inference_steps)
        self.check_step_cache(request.step_cache)
        return request

    # -- text_encode ------------------------------------------------------------------------
    def text_key(self, text: str) -> Hashable:
        ids = self.pipe.tokenizer(text, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                  add_special_tokens=True).input_ids
        return tuple(ids)

    # -- vae_decode -------------------------------------------------------------------------
    def decode_key(self, item: WorkItem) -> Hashable:
        lat = item.inputs["latents"]
        return (tuple(lat.shape[1:]), lat.dtype, tuple(sorted(item.inputs["decode_extras"].items())))

    def latents_to_video(self, latents: torch.Tensor, items: list[WorkItem]) -> torch.Tensor:
        """[B, C, T, h, w] latents -> [B, 3, F, H, W] VAE output in [-1, 1]."""
        raise NotImplementedError

    @torch.inference_mode()
    def decode(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        latents = torch.cat([it.inputs["latents"] for it in items])
        with self._vae_lock:
            video = self.latents_to_video(latents, items)
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")  # [B, F, H, W, 3] in [0, 1]
        out = []
        for item, clip in zip(items, frames, strict=True):
            req: VideoRequest = item.inputs["request"]
            out.append({"frames": (clip * 255).round().astype(np.uint8), "pixels": clip, "fps": req.fps,
                        "seed": req.seed})
        return out

    def preview(self, item: WorkItem) -> Any:
        raise NotImplementedError("video requests stream no previews")
