"""Any other diffusers pipeline: served through its own `__call__`, one request at a time per replica.

A checkpoint whose model_index.json names a diffusers pipeline class with no native family (pipelines/families/)
still serves /v1/images/generations. Its requests are checked as a native family's are (`ImageRequest.validate`,
with the defaults of the pipeline's `__call__` signature), then one `pipeline` node calls the pipeline with a seeded
CPU generator, and `media_encode` encodes the images. `callback_on_step_end` (or an older pipeline's `callback`)
reports each step and stops a cancelled request at the next one. Given up against a native family: step batching
across requests, the prompt-embedding cache, step caching, CUDA graphs, compile, LoRA and edits.

Nothing of the checkpoint's own code runs: the class is one diffusers defines (pipelines/registry.py), every
component names a diffusers or transformers class, and nothing is loaded with custom_pipeline or trust_remote_code.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable

import numpy as np
import torch

from pipelines.config import ModelSpec
from pipelines.families.base import numpy_to_pil
from pipelines.families.diffusion_base import DTYPES
from pipelines.image_request import ImageRequest, RequestError, Task
from pipelines.registry import _read_index, diffusers_pipeline_class
from pipelines.served import Execution, LoadContext, ModelInfo, chain
from pipelines.served_diffusion import ServedImages
from stages.events import ErrorKind, EventKind, StageError
from stages.media.stage import MediaEncodeStage
from stages.stage import Stage, WorkItem

if TYPE_CHECKING:
    from pipelines.engine import Engine

log = logging.getLogger(__name__)

POOL = "pipeline"  # the pool kind of the pipeline's stage ([models.pools.pipeline])
EXECUTION = "pipeline"  # ModelInfo.execution of a model served here
TRUSTED_LIBRARIES = ("diffusers", "transformers")  # a component of any other library is code from the checkpoint
# __call__ parameters a text-to-image pipeline must take for mmserve to drive it
NEEDED = ("prompt", "width", "height", "num_inference_steps", "generator", "output_type")
# ... and ones that say it needs an input (an image, a video) or makes something else than images
INPUTS = ("image", "mask_image", "control_image", "video", "num_frames", "audio_length_in_s")
# __call__ parameters mmserve fills itself: a request's `extra` may not name them
FILLED = (*NEEDED, "negative_prompt", "guidance_scale", "num_images_per_prompt", "return_dict", "callback",
          "callback_steps", "callback_on_step_end", "callback_on_step_end_tensor_inputs")


@dataclass(frozen=True)
class PipelineCall:
    """What a pipeline class's `__call__` takes, read once from its signature."""

    pipeline: str  # the class name, for errors
    takes: frozenset[str]  # its parameter names
    knobs: dict[str, type]  # parameters a request's `extra` may set (scalar defaults mmserve does not fill) -> type
    default_steps: int  # num_inference_steps' default
    guidance: bool  # it takes guidance_scale
    default_guidance: float | None  # guidance_scale's default; None: none (the pipeline decides when not given)
    default_height: int | None  # height's default when the signature has one (else the denoiser's sample size)
    progress: str | None  # "callback_on_step_end", "callback" (older pipelines) or None: no per-step hook

    @classmethod
    def of(cls, pipeline_class: type) -> PipelineCall:
        """The call of `pipeline_class`, or a ValueError saying why mmserve cannot drive it."""
        name = pipeline_class.__name__
        params = {p.name: p for p in inspect.signature(pipeline_class.__call__).parameters.values()
                  if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        missing = [p for p in NEEDED if p not in params]
        required = [p for p, param in params.items() if param.default is param.empty and p not in FILLED]
        inputs = [p for p in INPUTS if p in params]
        if missing or required or inputs:
            why = (f"it takes {inputs} (an input image or video, or it makes something else than images)" if inputs
                   else f"its __call__ lacks {missing}" if missing else f"its __call__ requires {required}")
            raise ValueError(f"{name} cannot be served through its own __call__: {why}. The diffusers fallback serves "
                             f"text-to-image pipelines whose __call__ takes {list(NEEDED)}")
        steps, guidance = params["num_inference_steps"].default, getattr(params.get("guidance_scale"), "default", None)
        if not isinstance(steps, int):
            raise ValueError(f"{name}: num_inference_steps has no integer default ({steps!r})")
        knobs = {p: type(param.default) for p, param in params.items()
                 if p not in FILLED and type(param.default) in (bool, int, float, str)}
        progress = next((hook for hook in ("callback_on_step_end", "callback") if hook in params), None)
        height = params["height"].default
        return cls(name, frozenset(params), knobs, steps, "guidance_scale" in params,
                   float(guidance) if isinstance(guidance, (int, float)) else None,
                   height if isinstance(height, int) and not isinstance(height, bool) else None, progress)

    def arguments(self, request: ImageRequest) -> dict[str, Any]:
        """The keyword arguments of a checked request's call (hooks and generator aside)."""
        args: dict[str, Any] = {"prompt": request.prompt, "width": request.width, "height": request.height,
                                "num_inference_steps": request.num_inference_steps, "output_type": "np"}
        if "num_images_per_prompt" in self.takes:
            args["num_images_per_prompt"] = request.n
        if request.guidance_scale is not None:  # None: the pipeline's own default
            args["guidance_scale"] = request.guidance_scale
        if request.negative_prompt is not None:  # None: the pipeline's own default ("" or None)
            args["negative_prompt"] = request.negative_prompt
        return {**args, **request.extra}


def pipeline_class(path: str) -> type[Any]:
    """The diffusers pipeline class of a checkpoint, or a ValueError: no model_index.json, a class diffusers does not
    define (custom pipeline code), or a component of another library than diffusers and transformers."""
    index, _ = _read_index(path)
    if index is None:
        raise ValueError(f"{path}: no model_index.json; family 'diffusers' serves diffusers pipeline checkpoints")
    name = index.get("_class_name")
    if not isinstance(name, str):
        raise ValueError(f"{path}: model_index.json names custom pipeline code {name!r}; mmserve never runs code "
                         "from a checkpoint or the hub (custom_pipeline, trust_remote_code)")
    cls = diffusers_pipeline_class(name)
    if cls is None:
        raise ValueError(f"{path}: model_index.json names {name!r}, which is not a diffusers pipeline class")
    for component, entry in index.items():
        library = entry[0] if isinstance(entry, list) and entry and not component.startswith("_") else None
        if library is not None and library not in TRUSTED_LIBRARIES:
            raise ValueError(f"{path}: component {component!r} is {entry!r}, code from the checkpoint; mmserve never "
                             f"runs code from a checkpoint or the hub (components of {list(TRUSTED_LIBRARIES)} only)")
    return cls


class _Stopped(Exception):
    """Raised from a step hook: the request was cancelled (or passed its deadline) during the step."""


class PipelineStage(Stage):
    """One request per `__call__` of the pipeline. A pipeline keeps per-call attributes on itself (its scheduler's
    position, guidance, ...), so it runs one call at a time: replicas that share it (no `devices`) take turns; a
    placed pool's replicas each have their own copy."""

    kind = POOL

    def __init__(self, model: str, pipe, call: PipelineCall):
        self.model, self.pipe, self.call = model, pipe, call
        self._one_call = threading.Lock()

    def batch_key(self, item: WorkItem) -> Hashable:
        return item.request_id  # never shared: the pipeline batches nothing across requests

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        return [self._run(item) for item in items]

    def _run(self, item: WorkItem) -> dict[str, Any]:
        request: ImageRequest = item.inputs["request"]
        assert request.num_inference_steps is not None and request.seed is not None  # checked: ServedPipeline.check
        pipe = self.pipe
        try:
            with self._one_call:
                if item.request.should_stop():
                    raise _Stopped
                # A scheduler fresh from the checkpoint's config: nothing of an earlier call (one stopped mid-loop
                # included) carries over.
                pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
                output = pipe(**self.call.arguments(request), **self._hooks(item, request.num_inference_steps),
                              generator=torch.Generator("cpu").manual_seed(request.seed))  # as native families seed
        except _Stopped:
            if item.request.expired():
                raise StageError("deadline_exceeded", "the request passed its deadline",
                                 kind=ErrorKind.DEADLINE) from None
            raise StageError("cancelled", "the request was cancelled", kind=ErrorKind.CANCELLED) from None
        pixels = getattr(output, "images", None)  # [n, H, W, 3] floats in [0, 1]
        if not (isinstance(pixels, np.ndarray) and pixels.ndim == 4 and pixels.shape[-1] == 3):
            raise StageError("internal_error", f"{self.call.pipeline} returned no images (output_type 'np'); the "
                                               "diffusers fallback serves text-to-image pipelines")
        return {"pixels": pixels, "images": numpy_to_pil(pixels), "seed": request.seed}

    def _hooks(self, item: WorkItem, steps: int) -> dict[str, Any]:
        """The step hook: PROGRESS {"step", "total"} per step, or _Stopped once the request should stop."""

        def step_done(step: int, total: int) -> None:
            if item.request.should_stop():
                raise _Stopped
            item.emit(EventKind.PROGRESS, step=step, total=total)

        def on_step_end(pipe, i: int, t, tensors: dict) -> dict:
            step_done(i + 1, len(pipe.scheduler.timesteps) or steps)  # (a 2nd-order scheduler's loop is longer)
            return {}

        if self.call.progress == "callback_on_step_end":
            return {"callback_on_step_end": on_step_end}
        if self.call.progress == "callback":  # older pipelines: callback(step, timestep, latents)
            return {"callback": lambda i, t, latents: step_done(i + 1, steps), "callback_steps": 1}
        return {}


class ServedPipeline(ServedImages):
    """A diffusers pipeline with no native family: pipeline [-> media_encode], one request per call."""

    def __init__(self, spec: ModelSpec, family_name: str, ctx: LoadContext, random_weights: bool):
        _refuse_options(spec)
        cls = pipeline_class(spec.path)
        self.call = PipelineCall.of(cls)
        if self.call.progress is None:
            log.warning("model %s: %s has no step callback: no progress events, and a cancel stops it only before it "
                        "starts", spec.name, cls.__name__)
        pipe = cls.from_pretrained(spec.path, dtype=DTYPES[spec.dtype]).to(spec.device)
        pipe.set_progress_bar_config(disable=True)
        self.name, self.model, self.limits = spec.name, pipe, ctx.limits
        self.media, self.media_pool = ctx.media, ctx.media_pool
        scale = _vae_scale_factor(pipe)
        self.size_factor = scale * (2 if getattr(pipe, "transformer", None) is not None else 1)  # DiT patches
        self.default_size = _default_size(pipe, self.call, scale, self.size_factor)
        self.info = ModelInfo(spec.name, family_name, spec.path, (Task.TEXT_TO_IMAGE.value,), self.size_factor,
                              self.default_size, random_weights=random_weights, execution=EXECUTION)

    def stages(self):
        return ((POOL, PipelineStage(self.name, self.model, self.call), None),
                ("media_encode", MediaEncodeStage(self.name, self.media), self.media_pool))

    def execution(self, request: ImageRequest) -> Execution:
        inputs: dict[str, Any] = {"request": self.check(request)}
        if request.output is None:
            return Execution(chain(self.name, POOL), inputs)
        return Execution(chain(self.name, POOL, "media_encode"), {**inputs, "encode": request.output})

    def check_fields(self, request: ImageRequest) -> None:
        """What the pipeline cannot do is a RequestError naming the field; then the checks of a native family."""
        call, what = self.call, f"model {self.name} runs {self.call.pipeline}'s own __call__ (execution 'pipeline')"
        if request.task is not Task.TEXT_TO_IMAGE:
            raise RequestError("model", f"model {self.name} does not support {request.task.value}; it supports "
                                        f"{list(self.info.tasks)}")
        lacks = {"lora": "LoRA adapters" if request.lora else None,
                 "step_cache": "step caching" if request.step_cache else None,
                 "partial_images": "partial images" if request.previews else None,
                 "preview_every": "previews" if request.preview_every else None,
                 "negative_prompt": "negative_prompt" if request.negative_prompt is not None
                 and "negative_prompt" not in call.takes else None,
                 "guidance_scale": "guidance_scale" if request.guidance_scale is not None and not call.guidance
                 else None,
                 "n": "num_images_per_prompt (n > 1)" if request.n != 1 and "num_images_per_prompt" not in call.takes
                 else None}
        for param, lacked in lacks.items():
            if lacked is not None:
                raise RequestError(param, f"{what}, which has no {lacked}")
        for key, value in request.extra.items():
            kind = call.knobs.get(key)
            if kind is None or not (isinstance(value, kind) or kind is float and type(value) is int):
                raise RequestError(f"extra.{key}", f"{what}: extra may set {sorted(call.knobs)} (of the type of "
                                                   f"their defaults); got {key}={value!r}")
        if not self.default_size and not (request.width and request.height):
            raise RequestError("size", f"{what}, whose default size mmserve cannot tell; name a size")
        request.check_fields(size_factor=self.size_factor, default_size=self.default_size, limits=self.limits)

    def check(self, request: ImageRequest) -> ImageRequest:
        """The request as it will run (the pipeline's defaults filled, a seed drawn), or the field-naming
        RequestError."""
        self.check_fields(request)
        call = self.call
        checked = request.validate(size_factor=self.size_factor, default_size=self.default_size,
                                   default_steps=call.default_steps, default_guidance=call.default_guidance or 0.0,
                                   limits=self.limits)
        if request.guidance_scale is None and call.default_guidance is None:  # left to the pipeline
            checked = dataclasses.replace(checked, guidance_scale=None)
        return checked

    def warm(self, engine: Engine) -> None:
        """A small request: the pipeline runs end to end (and says it makes images) before the server is ready."""
        size = self.size_factor * 4
        engine.submit(self.name, ImageRequest(prompt="warm-up", width=size, height=size, num_inference_steps=2,
                                              seed=0)).result(timeout=600)

    def describe(self) -> str:
        return f"{self.call.pipeline} through its own __call__, one request at a time"


def _refuse_options(spec: ModelSpec) -> None:
    """The model options a pipeline run through its own __call__ cannot honour: a ValueError naming the first."""
    asked = {"quantize": bool(spec.quantize), "offload": bool(spec.offload), "loras": bool(spec.loras),
             "lora_dirs": bool(spec.lora_dirs), "max_lora_rank": spec.max_lora_rank is not None,
             "memory_budget_mb": spec.memory_budget_mb is not None, "parallel": spec.parallel.world > 1,
             "graphs": spec.graphs.enabled, "compile": spec.compile.enabled, "step_cache": spec.step_cache.enabled,
             "fused_kernels": spec.fused_kernels}
    for key, on in asked.items():
        if on:
            raise ValueError(f"model {spec.name}: {key} is not available for a diffusers pipeline served through its "
                             "own __call__ (family 'diffusers'); it is for the native families")


def _vae_scale_factor(pipe) -> int:
    """Pixels per latent pixel: the pipeline's own `vae_scale_factor` (Kandinsky's `movq_scale_factor`), else 8."""
    for attr in ("vae_scale_factor", "movq_scale_factor"):
        factor = getattr(pipe, attr, None)
        if isinstance(factor, int) and factor > 0:
            return factor
    return 8


def _default_size(pipe, call: PipelineCall, scale: int, factor: int) -> int:
    """The size the pipeline makes when given none, rounded down to `factor`; 0 when it cannot be told."""
    size = call.default_height
    if size is None:  # its own default_sample_size (Flux-like) or the denoiser's sample_size, in latent pixels
        sample = getattr(pipe, "default_sample_size", None)
        if not isinstance(sample, int):
            denoiser = next((c for c in (getattr(pipe, "transformer", None), getattr(pipe, "unet", None))
                             if c is not None), None)
            sample = getattr(getattr(denoiser, "config", None), "sample_size", None)
        sample = sample[0] if isinstance(sample, (list, tuple)) else sample
        size = sample * scale if isinstance(sample, int) else 0
    return max(factor, size // factor * factor) if size else 0
