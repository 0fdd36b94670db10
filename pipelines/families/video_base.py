"""What the video families share: loading, request checks, prompt caching, the temporal VAE decode.

A video family is an ImageFamily on the same three stages (text_encode -> denoise -> vae_decode):
the latents gain a frame axis ([B, C, T, H, W]) and the denoise batch key holds the frames and size.
"""

from __future__ import annotations

import inspect
import json
import threading
from pathlib import Path
from typing import Any, Hashable

import numpy as np
import torch

from encoders.cache import EncoderCache
from pipelines.families.base import DTYPES, ImageFamily
from pipelines.image_request import RequestError
from pipelines.video import VideoConfig, VideoRequest, VideoTask
from stages.diffusion.denoiser import DenoiserCall, Speedups
from stages.stage import WorkItem


class VideoFamily(ImageFamily):
    # model_index.json `_class_name` -> {task: diffusers pipeline class} served from that checkpoint
    pipelines_by_class: dict[str, dict[VideoTask, type[Any]]] = {}
    default_size: tuple[int, int] = (832, 480)  # (width, height) of the pipelines' __call__
    default_frames: int = 81
    default_fps: float = 16.0
    max_sequence_length: int = 512

    def __init__(self, name: str, path: str, *, device: str = "cpu", dtype: str = "float32",
                 prompt_cache: EncoderCache | None = None, video: VideoConfig | None = None):
        self.name, self.path = name, path
        self.device, self.dtype = torch.device(device), DTYPES[dtype]
        self.video = video or VideoConfig()
        self.prompt_cache = prompt_cache if prompt_cache is not None else EncoderCache(f"{name}/prompt", 0)
        class_name = json.loads((Path(path) / "model_index.json").read_text())["_class_name"]
        if class_name not in self.pipelines_by_class:
            raise ValueError(f"{path}: {class_name} is not a {self.family} pipeline; "
                             f"expected one of {sorted(self.pipelines_by_class)}")
        (first_task, first_cls), *rest = self.pipelines_by_class[class_name].items()
        base = first_cls.from_pretrained(path, dtype=self.dtype)
        base.set_progress_bar_config(disable=True)
        base.to(self.device)
        # The variants share the same module objects (no extra weights) and the base's own settings.
        self.pipes = {first_task: base}
        for task, cls in [*rest, *self.extra_variants(base).items()]:
            params = inspect.signature(cls.__init__).parameters
            config = {k: v for k, v in base.config.items()
                      if k in params and k not in base.components and not k.startswith("_")}
            self.pipes[task] = cls(**base.components, **config)
            self.pipes[task].set_progress_bar_config(disable=True)
        if self.video.vae_tiling:
            base.vae.enable_tiling()
        if self.video.vae_slicing:
            base.vae.enable_slicing()
        self.weights_id = f"{self.family}:{path}"
        self._vae_lock = threading.Lock()
        self.speedups = Speedups()
        self.denoiser = DenoiserCall(name)

    def extra_variants(self, base) -> dict[VideoTask, type[Any]]:
        """Pipelines a checkpoint serves beyond its class's (decided by its config)."""
        return {}

    @property
    def pipe(self):
        return next(iter(self.pipes.values()))

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

    def validate(self, request, limits=None) -> VideoRequest:
        if not isinstance(request, VideoRequest):
            raise RequestError("model", f"model {self.name} makes videos ({list(self.tasks)}); use /v1/videos")
        request = request.validate(tasks=self.tasks, model=self.name, size_factor=self.size_factor,
                                   frame_factor=self.frame_factor, default_size=self.request_default_size,
                                   default_frames=self.request_default_frames, default_fps=self.default_fps,
                                   default_steps=self.default_steps, default_guidance=self.default_guidance,
                                   limits=self.video.limits)
        self.check_step_cache(request.step_cache)
        return request

    def begin(self, item: WorkItem):
        req: VideoRequest = item.inputs["request"]
        scheduler = self.new_scheduler()
        assert req.seed is not None  # validate() drew one
        return req, item.inputs["cond"], scheduler, self.view(req.task, scheduler), self.generator(req.seed)

    # -- text_encode ------------------------------------------------------------------------
    def text_key(self, text: str) -> Hashable:
        ids = self.pipe.tokenizer(text, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                  add_special_tokens=True).input_ids
        return tuple(ids)

    @torch.inference_mode()
    def encode_prompts(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        out = []
        for item in items:
            req: VideoRequest = item.inputs["request"]
            prompt = self.cached_text(req.prompt, req.tenant)
            assert req.guidance_scale is not None  # validate() filled it
            negative = self.cached_text(req.negative_prompt or "", req.tenant) if req.guidance_scale > 1.0 else None
            out.append({"cond": self.conditioning(prompt, negative, req)})
        return out

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

    def preview(self, item: WorkItem):
        raise NotImplementedError("video requests stream no previews")
