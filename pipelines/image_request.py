"""Image requests as the engine runs them, and the checks that run before any model work."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from stages.diffusion.step_cache import StepCacheParams
from stages.events import ErrorKind, StageError

if TYPE_CHECKING:
    from stages.media.stage import DecodeImages, EncodeImages


class Task(str, enum.Enum):
    TEXT_TO_IMAGE = "text-to-image"
    IMAGE_TO_IMAGE = "image-to-image"
    INPAINTING = "inpainting"


class RequestError(StageError):
    """Bad input, found before any model work: a 4xx naming the field and the limit."""

    def __init__(self, param: str, message: str, *, code: str = "invalid_value", kind: ErrorKind = ErrorKind.INVALID):
        super().__init__(code, message, param=param, kind=kind)


class ModelNotFound(RequestError):
    """The `model` a request names is not served here, or not for what the request asks."""

    def __init__(self, message: str):
        super().__init__("model", message, code="model_not_found", kind=ErrorKind.NOT_FOUND)


@dataclass(frozen=True)
class ImageLimits:
    max_pixels: int = 1024 * 1024  # width * height of one output image
    max_n: int = 10
    max_steps: int = 200
    max_guidance: float = 50.0
    max_prompt_chars: int = 4000
    max_images: int = 4  # input images of one edit, for the models that edit several (Qwen-Image-Edit-Plus)

    def __post_init__(self):
        if self.max_pixels < 64 or self.max_n < 1 or self.max_steps < 1 or self.max_images < 1:
            raise ValueError("image limits must allow at least one small image, one input image and one step")


@dataclass
class ImageRequest:
    """What the caller asked for, after parsing; `validate` turns it into what will run."""

    prompt: str
    task: Task = Task.TEXT_TO_IMAGE
    negative_prompt: str | None = None
    width: int | None = None  # None: the model's default size
    height: int | None = None
    n: int = 1  # images per prompt
    num_inference_steps: int | None = None  # None: the family default
    guidance_scale: float | None = None  # None: the family default
    seed: int | None = None  # None: a random seed, reported back
    strength: float = 0.8  # image-to-image / inpainting: how far from the input image
    image: Any = None  # PIL.Image for image-to-image and inpainting; a list of them for models that edit several
    mask: Any = None  # PIL.Image (white = repaint) for inpainting
    tenant: str = "default"  # enters every cache identity
    previews: int = 0  # how many partial images to stream (each costs a VAE decode)
    preview_every: int = 0  # a partial image after every this many steps instead (0: `previews` spread out)
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific knobs (max_sequence_length, ...)
    # Opt-in approximate step caching: {"method": "teacache" | "fbcache" | "interval", "threshold" | "interval"}
    step_cache: StepCacheParams | dict | None = None
    # The server's requests end in encoded files (the media_encode node); None: the outputs stay pixels.
    output: EncodeImages | None = None
    # The server's edits start from uploaded bytes (the media_decode node fills image and mask); None: given.
    source: DecodeImages | None = None
    # The server's edits: how many input images the upload carries, counted before they are fetched (checked with
    # the other fields); None: count `image`, else `source`.
    uploaded_images: int | None = None
    # A realtime session's id: all its frames go to one replica of a placed pool (Stage.affinity); None: any.
    session: str | None = None
    # LoRA adapters of the model (`[[models.loras]]`) and their weights: ((name, scale or None: the declared), ...)
    lora: tuple[tuple[str, float | None], ...] = ()

    @property
    def image_count(self) -> int:
        """Input images the request carries: decoded in `image`, still bytes in `source`, or as uploaded."""
        if self.image is None and self.source is None and self.uploaded_images is not None:
            return self.uploaded_images
        image = self.image if self.image is not None or self.source is None else self.source.image
        if image is None:
            return 0
        return len(image) if isinstance(image, (list, tuple)) else 1

    def check_fields(self, *, size_factor: int, default_size: int, limits: ImageLimits,
                     several_images: bool = False) -> None:
        """The checks of the request's own fields, before its input image is decoded or the family's defaults are
        known. What depends on those (an edit's size when it names none, default steps and guidance, the image
        and mask themselves) `validate` checks later. `several_images`: the model edits up to limits.max_images
        images (else one). Raises RequestError."""
        self._check(size_factor=size_factor, default_size=default_size, default_steps=None, default_guidance=None,
                    limits=limits, images=False, several_images=several_images)

    def validate(self, *, size_factor: int, default_size: int, default_steps: int, default_guidance: float,
                 limits: ImageLimits, several_images: bool = False) -> "ImageRequest":
        """Check every field against the limits and fill defaults. Raises RequestError."""
        if not several_images and isinstance(self.image, (list, tuple)) and len(self.image) == 1:
            return replace(self, image=self.image[0]).validate(
                size_factor=size_factor, default_size=default_size, default_steps=default_steps,
                default_guidance=default_guidance, limits=limits)  # a list of one, for a model that edits one
        width, height, steps, guidance, step_cache = self._check(
            size_factor=size_factor, default_size=default_size, default_steps=default_steps,
            default_guidance=default_guidance, limits=limits, images=True, several_images=several_images)
        assert width is not None and height is not None and steps is not None and guidance is not None
        seed = self.seed
        if seed is None:
            import secrets
            seed = secrets.randbits(63)
        return ImageRequest(
            prompt=self.prompt, task=self.task, negative_prompt=self.negative_prompt, width=width, height=height,
            n=self.n, num_inference_steps=steps, guidance_scale=guidance, seed=seed, strength=self.strength,
            image=self.image, mask=self.mask, tenant=self.tenant, previews=self.previews,
            preview_every=self.preview_every, extra=dict(self.extra),
            step_cache=step_cache, output=self.output, session=self.session, lora=self.lora)

    def _check(self, *, size_factor: int, default_size: int, default_steps: int | None,
               default_guidance: float | None, limits: ImageLimits,
               images: bool, several_images: bool = False,
               ) -> tuple[int | None, int | None, int | None, float | None, StepCacheParams | None]:
        """(width, height, steps, guidance, step cache) as they will run, None where not known yet (`images` False:
        before the input image is decoded and without the family's defaults)."""
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise RequestError("prompt", "prompt must be a non-empty string")
        if len(self.prompt) > limits.max_prompt_chars:
            raise RequestError("prompt", f"prompt is {len(self.prompt)} characters; "
                                         f"the limit is {limits.max_prompt_chars}", code="prompt_too_long")
        width: int | None
        height: int | None
        edit_sized = self.task is not Task.TEXT_TO_IMAGE and not (self.width or self.height)
        self._check_image_count(several_images, limits)
        if edit_sized and images and self.image is not None:
            # Edits default to the input image's size (the last one's of several), rounded down to the model's factor.
            last = self.image[-1] if isinstance(self.image, (list, tuple)) else self.image
            width = max(size_factor, last.size[0] // size_factor * size_factor)
            height = max(size_factor, last.size[1] // size_factor * size_factor)
        elif edit_sized and not images:
            width = height = None  # the input image's: known once it is decoded
        else:
            width = self.width or default_size
            height = self.height or default_size
        if width is not None and height is not None:
            for name, v in (("size", width), ("size", height)):
                if v < size_factor or v % size_factor:
                    raise RequestError(name, f"width and height must be positive multiples of {size_factor} "
                                             f"for this model; got {width}x{height}",
                                       code="unsupported_size")
            if width * height > limits.max_pixels:
                raise RequestError("size", f"{width}x{height} is {width * height} pixels; the limit is "
                                           f"{limits.max_pixels}", code="unsupported_size")
        if not 1 <= self.n <= limits.max_n:
            raise RequestError("n", f"n must be between 1 and {limits.max_n}; got {self.n}")
        check_lora(self.lora)
        steps = self.num_inference_steps if self.num_inference_steps is not None else default_steps
        if steps is not None and not 1 <= steps <= limits.max_steps:
            raise RequestError("num_inference_steps", f"num_inference_steps must be between 1 and {limits.max_steps}; "
                                                      f"got {steps}")
        guidance = self.guidance_scale if self.guidance_scale is not None else default_guidance
        if guidance is not None and not 0.0 <= guidance <= limits.max_guidance:
            raise RequestError("guidance_scale", f"guidance_scale must be between 0 and {limits.max_guidance}; "
                                                 f"got {guidance}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError("seed", f"seed must be between 0 and 2**63-1; got {self.seed}")
        if not 0 <= self.previews <= (steps if steps is not None else limits.max_steps):
            raise RequestError("partial_images", f"partial_images must be between 0 and the step count {steps}")
        if self.preview_every < 0:
            raise RequestError("preview_every", f"preview_every must be >= 1 (steps between previews); got "
                                                f"{self.preview_every}")
        if self.preview_every and self.previews:
            raise RequestError("preview_every", "give partial_images or preview_every, not both")
        if self.task is not Task.TEXT_TO_IMAGE:
            if images and self.image is None:
                raise RequestError("image", f"{self.task.value} needs an input image")
            if not 0.0 < self.strength <= 1.0:
                raise RequestError("strength", f"strength must be in (0, 1]; got {self.strength}")
        if self.task is Task.INPAINTING and images:
            if self.mask is None:
                raise RequestError("mask", "inpainting needs a mask image")
            if self.mask.size != self.image.size:
                raise RequestError("mask", f"mask is {self.mask.size[0]}x{self.mask.size[1]} but the image is "
                                           f"{self.image.size[0]}x{self.image.size[1]}; they must match")
        return width, height, steps, guidance, StepCacheParams.parse(self.step_cache)

    def _check_image_count(self, several_images: bool, limits: ImageLimits) -> None:
        """A list of input images: not empty, and at most limits.max_images where the model edits several, else
        one. Raises RequestError naming `image`."""
        count = self.image_count
        if isinstance(self.image, (list, tuple)) and count == 0:
            raise RequestError("image", "image is an empty list; send at least one input image")
        if count > 1 and not several_images:
            raise RequestError("image", f"image has {count} images; this model edits one image (the limit is 1)",
                               code="too_many_images")
        if count > limits.max_images:
            raise RequestError("image", f"image has {count} images; the limit is {limits.max_images} a request",
                               code="too_many_images")


MAX_LORAS = 4  # adapters in one request


def check_lora(lora) -> None:
    """A request's `lora` list on its own (names known to the model are the family's to check): at most MAX_LORAS,
    each a distinct name with a scale of at most MAX_LORA_SCALE in size. Raises RequestError naming the entry."""
    from pipelines.config import MAX_LORA_SCALE

    if len(lora) > MAX_LORAS:
        raise RequestError("lora", f"lora names {len(lora)} adapters; at most {MAX_LORAS} a request",
                           code="too_many_loras")
    seen = set()
    for i, (name, scale) in enumerate(lora):
        if not isinstance(name, str) or not name or name in seen:
            raise RequestError(f"lora[{i}].name", f"lora[{i}].name must be a non-empty adapter name, each named "
                                                  f"once; got {name!r}")
        seen.add(name)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not abs(scale) <= MAX_LORA_SCALE):
            raise RequestError(f"lora[{i}].scale", f"lora[{i}].scale must be a number in [-{MAX_LORA_SCALE:g}, "
                                                   f"{MAX_LORA_SCALE:g}]; got {scale!r}")
