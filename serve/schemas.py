"""Wire schemas of the image endpoints: OpenAI's fields, mmserve's extensions, and the response shapes.

Extensions are extra fields with their own names (DESIGN §10); no OpenAI field changes meaning.
OpenAI-only knobs that a diffusion model cannot act on (`quality`, `style`, `moderation`, ...)
are accepted and ignored so that stock clients work; unknown fields are refused, as OpenAI does.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipelines.config import MAX_LORA_SCALE
from pipelines.image_request import MAX_LORAS, ImageRequest, RequestError, Task
from stages.diffusion.step_cache import MAX_INTERVAL, MAX_THRESHOLD
from stages.media.stage import EncodeImages

ResponseFormat = Literal["b64_json", "url"]
OutputFormat = Literal["png", "jpeg", "webp"]
# Every value the OpenAI API has documented for `quality`; none changes what a diffusion model does.
Quality = Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"]

# The extension fields that carry family knobs into ImageRequest.extra (each family declares the ones it takes).
KNOBS = ("max_sequence_length", "true_cfg_scale", "max_area", "target_area")
_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX×]\s*(\d{1,5})\s*$")


def parse_size(size: str | None) -> tuple[int, int] | None:
    """"WxH" -> (width, height); None or "auto" -> None (the model's default). Raises RequestError(param="size")."""
    if size is None or size.strip().lower() == "auto":
        return None
    m = _SIZE.match(size)
    if not m:
        raise RequestError("size", f"size must be 'WIDTHxHEIGHT' (for example '512x512') or 'auto'; got {size!r}",
                           code="invalid_size")
    width, height = int(m.group(1)), int(m.group(2))
    if width < 1 or height < 1:
        raise RequestError("size", f"width and height must be positive; got {size!r}", code="invalid_size")
    return width, height


class StepCacheBody(BaseModel):
    """Extension `step_cache`: opt-in approximate step caching (the model must allow it)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["teacache", "fbcache", "interval"]
    threshold: float | None = Field(None, ge=0, le=MAX_THRESHOLD)  # teacache / fbcache; 0 computes every step
    interval: int | None = Field(None, ge=1, le=MAX_INTERVAL)  # interval: compute every interval-th step

    def params(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def json_object(value: Any) -> Any:
    """Multipart forms carry objects as JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError("must be a JSON object") from None
    return value


class LoraRef(BaseModel):
    """Extension `lora`: one of the model's adapters (`/v1/models` lists them) and its weight."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    scale: float | None = Field(None, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)  # None: the adapter's declared scale


class ImageParams(BaseModel):
    """Fields shared by /v1/images/generations (JSON) and /v1/images/edits (multipart)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # -- OpenAI fields --------------------------------------------------------------------
    model: str | None = None  # None: the server's first configured model
    prompt: str = Field(min_length=1)
    n: int = Field(1, ge=1)  # the upper bound is the engine's configured limit (ImageLimits.max_n)
    size: str | None = "auto"  # "WxH" or "auto"
    response_format: ResponseFormat | None = None  # None: b64_json (as the GPT image models answer)
    output_format: OutputFormat = "png"
    output_compression: int | None = Field(None, ge=0, le=100)  # jpeg/webp quality; ignored for png
    quality: Quality | None = None  # accepted, ignored
    background: Literal["auto", "opaque"] | None = None  # transparent output is not something these models make
    moderation: Literal["auto", "low"] | None = None  # accepted, ignored: no moderation model is loaded
    user: str | None = None  # accepted; never a metric label
    safety_identifier: str | None = None  # accepted; the newer name of `user`
    stream: bool = False  # server-sent events: progress per step, partial images, the final image(s)
    partial_images: int | None = Field(None, ge=0, le=3)  # previews while streaming (each costs a VAE decode)
    # -- mmserve extensions -----------------------------------------------------------------
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1)  # None: the family default; upper bound: the engine limit
    guidance_scale: float | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)  # None: random, reported back in the response
    step_cache: StepCacheBody | None = None  # approximate step caching; the model must allow it
    lora: list[LoraRef] | None = Field(None, max_length=MAX_LORAS)  # the model's LoRA adapters, weighted
    preview_every: int | None = Field(None, ge=1, description=(
        "With stream: a partial image after every this many denoise steps (OpenAI's partial_images stops at 3); "
        "each costs a VAE decode, or a tiny one with the model's preview_vae. Not with partial_images"))
    # Family knobs (the diffusers pipelines' own arguments): a model whose family does not take one refuses it (400
    # naming the field); the family checks its limits. None: the pipeline's default.
    max_sequence_length: int | None = Field(None, ge=1, description=(
        "Text-encoder tokens the prompt is cut to (flux, flux_kontext, sd3, qwen_image text-to-image, sana, "
        "z_image; the pipeline's own default and limit)"))
    true_cfg_scale: float | None = Field(None, ge=0, description=(
        "True classifier-free guidance of FLUX.1 and FLUX.1 Kontext: applies when above 1 and a negative_prompt "
        "is given (default 1, off)"))
    max_area: int | None = Field(None, ge=1, description=(
        "FLUX.1 Kontext: the output is fitted to this many pixels at the requested aspect ratio (default: the "
        "requested width x height)"))
    target_area: int | None = Field(None, ge=1, description=(
        "Qwen-Image-Edit: pixels the input image is resized to, keeping its aspect ratio (default 1024 x 1024)"))

    _step_cache_json = field_validator("step_cache", mode="before")(json_object)
    _lora_json = field_validator("lora", mode="before")(json_object)

    @field_validator("prompt")
    @classmethod
    def _prompt_has_text(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("prompt must contain some text, not only whitespace")
        return v

    @field_validator("size")
    @classmethod
    def _size_parses(cls, v: str | None) -> str | None:
        try:
            parse_size(v)
        except RequestError as e:  # pydantic reports only ValueErrors as field errors
            raise ValueError(e.message) from None
        return v

    def image_request(self, *, task: Task, tenant: str, image=None, mask=None, strength: float | None = None,
                      default_size: tuple[int, int] | None = None) -> ImageRequest:
        """The engine's request. `default_size` applies when the caller left size at auto (edits use the image's)."""
        width, height = parse_size(self.size) or default_size or (None, None)
        request = ImageRequest(
            prompt=self.prompt, task=task, negative_prompt=self.negative_prompt, width=width, height=height,
            n=self.n, num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
            seed=self.seed, image=image, mask=mask, tenant=tenant,
            step_cache=self.step_cache.params() if self.step_cache is not None else None,
            lora=tuple((ref.name, ref.scale) for ref in self.lora or ()),
            # Previews only make sense on a stream; computing them otherwise would waste VAE decodes.
            previews=(self.partial_images or 0) if self.stream else 0,
            preview_every=(self.preview_every or 0) if self.stream else 0, output=self.encoding, extra=self.knobs())
        if strength is not None:
            request.strength = strength
        return request

    def knobs(self) -> dict[str, Any]:
        """The family knobs the caller set, as the request's `extra` (the family refuses those it does not take)."""
        return {name: getattr(self, name) for name in KNOBS if getattr(self, name) is not None}

    @property
    def encoding(self) -> EncodeImages:
        """How the reply's images are encoded (the graph's media_encode node)."""
        quality = None
        if self.output_format != "png" and self.output_compression is not None:
            quality = max(1, self.output_compression)  # encoders take 1..100
        return EncodeImages(self.output_format, quality)

    @property
    def wants_url(self) -> bool:
        return self.response_format == "url"


class ImageGenerationRequest(ImageParams):
    """POST /v1/images/generations (JSON)."""

    style: Literal["vivid", "natural"] | None = None  # accepted, ignored (a DALL-E 3 knob)


class ImageEditRequest(ImageParams):
    """The text fields of POST /v1/images/edits (multipart); `image` and `mask` arrive as files."""

    strength: float | None = Field(None, gt=0, le=1)  # extension: how far from the input image (default 0.8)
    input_fidelity: Literal["high", "low"] | None = None  # accepted, ignored


def size_string(image) -> str:
    """"WxH" of a PIL image."""
    width, height = image.size
    return f"{width}x{height}"
