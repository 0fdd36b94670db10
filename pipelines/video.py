"""Video requests (text-to-video, image-to-video) as the engine runs them, and their checks.

The contract the /v1/videos routes code against:

    Engine.submit_video(model, VideoRequest, *, request_id=None) -> RequestHandle
      validates first (RequestError naming the field), then runs text_encode -> denoise -> vae_decode.
      PROGRESS events {"step": i, "total": n}; FINAL outputs {"frames": uint8 [T, H, W, 3], "fps": float, "seed": int}.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from pipelines.image_request import RequestError
from stages.diffusion.step_cache import StepCacheParams


class VideoTask(str, enum.Enum):
    TEXT_TO_VIDEO = "text-to-video"
    IMAGE_TO_VIDEO = "image-to-video"


@dataclass(frozen=True)
class VideoLimits:
    max_frames: int = 257  # frames of one video
    max_pixels: int = 1280 * 720  # width * height of one frame
    min_fps: float = 1.0  # the MP4 time base is 1/fps: below one frame a second it stops being a video
    max_fps: float = 60.0
    max_steps: int = 200
    max_guidance: float = 50.0
    max_prompt_chars: int = 4000

    def __post_init__(self):
        if self.max_frames < 1 or self.max_pixels < 64 or self.max_steps < 1 or not 0 < self.min_fps <= self.max_fps:
            raise ValueError("video limits must allow at least one small frame, one step and an fps range "
                             "0 < min_fps <= max_fps")


@dataclass(frozen=True)
class VideoConfig:
    """Per-model video settings (ModelSpec.video)."""

    vae_tiling: bool = False  # decode in overlapping spatial tiles (vae.enable_tiling): bounds peak memory
    # (tile, stride) in pixels of those tiles (both sides); None: the VAE's own (Wan: 256, 192)
    vae_tile: tuple[int, int] | None = None
    vae_slicing: bool = False  # decode one video of a batch at a time (vae.enable_slicing)
    limits: VideoLimits = VideoLimits()
    # What a request that names none gets; None: the family's (its diffusers pipeline's __call__ defaults).
    default_size: tuple[int, int] | None = None  # (width, height)
    default_frames: int | None = None

    def __post_init__(self):
        if self.vae_tile is not None:
            object.__setattr__(self, "vae_tile", tuple(self.vae_tile))
            if len(self.vae_tile) != 2 or not 8 <= self.vae_tile[1] <= self.vae_tile[0] or any(
                    v % 8 for v in self.vae_tile):
                raise ValueError(f"video.vae_tile must be [tile, stride] in pixels, multiples of 8 with "
                                 f"8 <= stride <= tile, got {self.vae_tile!r}")
        if self.default_size is not None and (len(self.default_size) != 2 or min(self.default_size) < 1):
            raise ValueError(f"video.default_size must be (width, height) in pixels, got {self.default_size!r}")
        if self.default_frames is not None and self.default_frames < 1:
            raise ValueError(f"video.default_frames must be >= 1, got {self.default_frames}")


@dataclass
class VideoRequest:
    """What the caller asked for; `validate` (through the family) fills defaults and checks every field."""

    prompt: str
    negative_prompt: str | None = None
    width: int | None = None  # None: the family default
    height: int | None = None
    num_frames: int | None = None  # None: the family default
    fps: float | None = None  # None: the family default (16 for Wan, 25 for LTX)
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None  # HunyuanVideo: true CFG (> 1, with a negative prompt); None: 1.0, off
    seed: int | None = None  # None: a random seed, reported back
    image: Any = None  # PIL.Image.Image: the image-to-video reference (the first frame)
    tenant: str = "default"  # enters every cache identity
    step_cache: StepCacheParams | dict | None = None  # opt-in approximate step caching (see ImageRequest)
    # OpenAI's duration, used when num_frames is None: num_frames = k * frame_factor + 1 with k = round(seconds *
    # fps / frame_factor) (at least 1), so the video lasts (num_frames - 1) / fps ~ seconds. Errors name `seconds`.
    seconds: float | None = None
    session: str | None = None  # a realtime session's id: all its chunks go to one replica (see ImageRequest)

    previews: ClassVar[int] = 0  # the denoise stage's preview count: videos stream none

    @property
    def task(self) -> VideoTask:
        return VideoTask.IMAGE_TO_VIDEO if self.image is not None else VideoTask.TEXT_TO_VIDEO

    def validate(self, *, tasks: tuple[str, ...], model: str, size_factor: int, frame_factor: int,
                 default_size: tuple[int, int], default_frames: int, default_fps: float, default_steps: int,
                 default_guidance: float, limits: VideoLimits) -> "VideoRequest":
        """Check every field against the model's factors and the limits; fill defaults. Raises RequestError."""
        if self.task.value not in tasks:
            field = "image" if self.task is VideoTask.IMAGE_TO_VIDEO else "model"
            raise RequestError(field, f"model {model} does not support {self.task.value}; it supports {list(tasks)}")
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise RequestError("prompt", "prompt must be a non-empty string")
        if len(self.prompt) > limits.max_prompt_chars:
            raise RequestError("prompt", f"prompt is {len(self.prompt)} characters; "
                                         f"the limit is {limits.max_prompt_chars}", code="prompt_too_long")
        width, height = self.width or default_size[0], self.height or default_size[1]
        for v in (width, height):
            if isinstance(v, bool) or not isinstance(v, int) or v < size_factor or v % size_factor:
                raise RequestError("size", f"width and height must be positive multiples of {size_factor} for this "
                                           f"model; got {width}x{height}", code="unsupported_size")
        if width * height > limits.max_pixels:
            raise RequestError("size", f"{width}x{height} is {width * height} pixels a frame; the limit is "
                                       f"{limits.max_pixels}", code="unsupported_size")
        fps = self.fps if self.fps is not None else default_fps
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not limits.min_fps <= fps <= limits.max_fps:
            raise RequestError("fps", f"fps must be in [{limits.min_fps:g}, {limits.max_fps:g}]; got {fps!r}")
        if self.num_frames is None and self.seconds is not None:
            frames = self._frames_of_seconds(fps, frame_factor, limits)
        else:
            frames = self.num_frames if self.num_frames is not None else default_frames
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or (frames - 1) % frame_factor:
            raise RequestError("num_frames", f"num_frames must be {frame_factor}k+1 (1, {frame_factor + 1}, "
                                             f"{2 * frame_factor + 1}, ...) for this model; got {frames!r}")
        if frames > limits.max_frames:
            raise RequestError("num_frames", f"num_frames {frames} is over the limit {limits.max_frames}")
        steps = self.num_inference_steps if self.num_inference_steps is not None else default_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= limits.max_steps:
            raise RequestError("num_inference_steps", f"num_inference_steps must be between 1 and {limits.max_steps}; "
                                                      f"got {steps!r}")
        guidance = self.guidance_scale if self.guidance_scale is not None else default_guidance
        if (isinstance(guidance, bool) or not isinstance(guidance, (int, float))
                or not 0.0 <= guidance <= limits.max_guidance):
            raise RequestError("guidance_scale", f"guidance_scale must be between 0 and {limits.max_guidance}; "
                                                 f"got {guidance!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise RequestError("seed", f"seed must be an integer between 0 and 2**63-1; got {self.seed!r}")
        if self.image is not None and not hasattr(self.image, "convert"):
            raise RequestError("input_reference", "the reference image must be a decoded image")
        step_cache = StepCacheParams.parse(self.step_cache)
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        return replace(self, width=width, height=height, num_frames=frames, fps=float(fps), num_inference_steps=steps,
                       guidance_scale=float(guidance), seed=seed, step_cache=step_cache,
                       image=self.image.convert("RGB") if self.image is not None else None)

    def _frames_of_seconds(self, fps: float, frame_factor: int, limits: VideoLimits) -> int:
        """num_frames for `seconds` at `fps`; an error says the limit in seconds, as the caller asked in seconds."""
        seconds = self.seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
            raise RequestError("seconds", f"seconds must be a positive number; got {seconds!r}")
        blocks = seconds * fps / frame_factor  # inf for a huge (finite) seconds: past the limit, not a crash
        frames = max(1, round(blocks)) * frame_factor + 1 if blocks < limits.max_frames else None
        if frames is None or frames > limits.max_frames:
            longest = (limits.max_frames - 1) // frame_factor * frame_factor / fps  # the longest the limit allows
            shown = f"{frames} frames" if frames is not None else f"more than {limits.max_frames} frames"
            raise RequestError("seconds", f"seconds {seconds:g} is {shown} at {fps:g} fps; the limit is "
                                          f"{longest:g} seconds ({limits.max_frames} frames) for this model")
        return frames
