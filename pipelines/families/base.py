"""What every image family shares: loading, per-request pipeline views, caching, batched decode.

A family subclass reads like the diffusers pipeline it mirrors, in numbered steps. The
diffusers pipeline object is used for its components and its helper methods (prompt
encoding, latent preparation) on a per-request *view* that carries the request's own
scheduler; the denoise loop itself is ours (stages/diffusion/stages.py).
"""

from __future__ import annotations

import copy
import inspect
import threading
from typing import TYPE_CHECKING, Any, Hashable

import numpy as np
import torch
from PIL import Image

from encoders.cache import EncoderCache
from pipelines.families.speedups import DenoiserSpeedups
from pipelines.image_request import ImageRequest, RequestError, Task
from stages.diffusion.denoiser import DenoiserCall, Speedups
from stages.stage import WorkItem

if TYPE_CHECKING:
    from pipelines.video import VideoTask

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ImageFamily(DenoiserSpeedups):
    """An image family; also the base of the video families (pipelines/families/video_base.py), which serve
    VideoRequests: where the two differ (default_size, validate's result, conditioning's request), the
    annotations here are Any. Satisfies stages.diffusion.stages.DiffusionAdapter."""

    family: str = ""  # short name used in config and detection ("sd", "sdxl", ...)
    class_names: tuple[str, ...] = ()  # model_index.json `_class_name`s this family loads
    # diffusers pipelines per task, sharing components (type[Any]: mypy sees diffusers' lazy exports as dummies)
    pipeline_classes: dict[Task, type[Any]] = {}
    default_steps: int = 50
    default_guidance: float = 7.5
    load_kwargs: dict[str, Any] = {}  # extra from_pretrained arguments

    def __init__(self, name: str, path: str, *, device: str = "cpu", dtype: str = "float32",
                 prompt_cache: EncoderCache | None = None):
        self.name = name
        self.path = path
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.prompt_cache = prompt_cache if prompt_cache is not None else EncoderCache(f"{name}/prompt", 0)
        base_cls = self.pipeline_classes[Task.TEXT_TO_IMAGE]
        base = base_cls.from_pretrained(path, dtype=self.dtype, **self.load_kwargs)
        base.set_progress_bar_config(disable=True)
        base.to(self.device)
        # The variants share the same module objects: no extra weights in memory.
        self.pipes: dict[Task | VideoTask, Any] = {Task.TEXT_TO_IMAGE: base}
        for task, cls in self.pipeline_classes.items():
            if task is not Task.TEXT_TO_IMAGE:
                params = inspect.signature(cls.__init__).parameters
                config = {k: v for k, v in base.config.items()
                          if k in params and k not in base.components and not k.startswith("_")}
                self.pipes[task] = cls(**base.components, **config)
                self.pipes[task].set_progress_bar_config(disable=True)
        self.weights_id = f"{self.family}:{path}"  # enters cache identities; a reload gets a new object anyway
        self._vae_lock = threading.Lock()  # the VAE is shared by prepare (encode), previews and decode
        self.speedups = Speedups()
        self.denoiser = DenoiserCall(name)  # every speed-up off until `accelerate`

    # -- facts the API layer needs --------------------------------------------------------
    @property
    def pipe(self):
        return self.pipes[Task.TEXT_TO_IMAGE]

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(t.value for t in self.pipes)

    @property
    def vae_scale_factor(self) -> int:
        return self.pipe.vae_scale_factor

    @property
    def size_factor(self) -> int:
        """Width and height must be multiples of this."""
        return self.vae_scale_factor

    @property
    def default_size(self) -> Any:
        """An image family's default width and height (an int); a video family's (width, height)."""
        raise NotImplementedError

    def validate(self, request: ImageRequest, limits) -> Any:
        """The request checked and completed (an ImageRequest; a video family's: a VideoRequest)."""
        if request.task.value not in self.tasks:
            raise RequestError("model", f"model {self.name} does not support {request.task.value}; "
                                        f"it supports {list(self.tasks)}")
        request = request.validate(size_factor=self.size_factor, default_size=self.default_size,
                                   default_steps=self.default_steps, default_guidance=self.default_guidance,
                                   limits=limits)
        self.check_step_cache(request.step_cache)
        return request

    # -- per-request objects ----------------------------------------------------------------
    def new_scheduler(self):
        """A scheduler private to one request: its position never lives on a shared object."""
        base = self.pipe.scheduler
        return type(base).from_config(base.config)

    def view(self, task: Task | VideoTask, scheduler):
        """A shallow copy of the task's pipeline whose scheduler belongs to one request."""
        view = copy.copy(self.pipes[task])
        object.__setattr__(view, "scheduler", scheduler)  # bypass register_to_config: the view is private
        return view

    def begin(self, item: WorkItem) -> tuple[ImageRequest, dict, Any, Any, torch.Generator]:
        """A request's parameters and conditioning, and its private scheduler, pipeline view and generator."""
        req: ImageRequest = item.inputs["request"]
        scheduler = self.new_scheduler()
        assert req.seed is not None  # validate() drew one
        return req, item.inputs["cond"], scheduler, self.view(req.task, scheduler), self.generator(req.seed)

    def generator(self, seed: int) -> torch.Generator:
        # Seeds mean what diffusers means with torch.Generator("cpu").manual_seed(seed).
        return torch.Generator("cpu").manual_seed(seed)

    # -- text_encode ------------------------------------------------------------------------
    def text_key(self, text: str) -> Hashable:
        """The token ids of every tokenizer the family uses (the prompt cache identity)."""
        raise NotImplementedError

    def encode_text(self, text: str) -> dict[str, torch.Tensor]:
        """Embeddings of one prompt, batch size 1, no guidance."""
        raise NotImplementedError

    def conditioning(self, prompt: dict, negative: dict | None, request: Any) -> dict[str, Any]:
        """Per-request conditioning for the denoiser (guidance halves, repeated n times); `request`: the family's
        ImageRequest or VideoRequest."""
        raise NotImplementedError

    def uses_negative(self, request: ImageRequest) -> bool:
        assert request.guidance_scale is not None  # validate() filled it
        return request.guidance_scale > 1.0

    def text_options(self, request: ImageRequest) -> dict[str, Any]:
        """Encoder settings of a request that change the embeddings (they enter the cache identity)."""
        return {}

    def negative(self, request: ImageRequest, prompt: dict, options: dict) -> dict | None:
        """The unconditional half: the encoded negative prompt ("" when none), or None without guidance."""
        if not self.uses_negative(request):
            return None
        return self.cached_text(request.negative_prompt or "", request.tenant, options)

    def cached_text(self, text: str, tenant: str, options: dict | None = None) -> dict[str, torch.Tensor]:
        options = options or {}
        key = (tenant, self.weights_id, str(self.dtype), self.text_key(text, **options), tuple(sorted(options.items())))
        return self.prompt_cache.get_or_compute(key, lambda: self.encode_text(text, **options))

    @torch.inference_mode()
    def encode_prompts(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        out = []
        for item in items:
            req: ImageRequest = item.inputs["request"]
            options = self.text_options(req)
            prompt = self.cached_text(req.prompt, req.tenant, options)
            out.append({"cond": self.conditioning(prompt, self.negative(req, prompt, options), req)})
        return out

    # -- denoise: each family's loop body (the DiffusionAdapter contract) ---------------------
    def prepare(self, item: WorkItem) -> None:
        """denoise start: the request's scheduler, timesteps and initial latents into item.state."""
        raise NotImplementedError

    def denoise_key(self, item: WorkItem) -> Hashable:
        """Items with equal keys share one denoiser forward."""
        raise NotImplementedError

    def forward(self, items: list[WorkItem]) -> list[Any]:
        """One batched denoiser call over items that may sit at different timesteps."""
        raise NotImplementedError

    def commit(self, item: WorkItem, model_output: Any) -> None:
        """Guidance and the scheduler step for one item; advances item.state['i']."""
        raise NotImplementedError

    # -- prepare helpers shared by the families ------------------------------------------------
    mask_batch_args: tuple[int | str, ...] = ("n",)  # how prepare_mask_latents takes the batch: ("n",) or (1, "n")

    def strength_timesteps(self, view, req: ImageRequest, steps: int) -> torch.Tensor:
        """Image-to-image and inpainting start part-way through the schedule (sets the begin index)."""
        timesteps, steps = view.get_timesteps(steps, req.strength, self.device)
        if steps < 1:
            raise RequestError("strength", f"strength {req.strength} with {req.num_inference_steps} steps "
                                           "leaves no step to run")
        return timesteps

    def edit_latents(self, view, req: ImageRequest, timesteps: torch.Tensor, dtype, generator, cfg: bool,
                     state: dict) -> torch.Tensor:
        """Initial latents of image-to-image and inpainting (the VAE encodes draw from the generator
        in the pipelines' order). Inpainting adds mask, noise and image latents to `state`."""
        latent_timestep = timesteps[:1].repeat(req.n)
        if req.task is Task.IMAGE_TO_IMAGE:
            image = view.image_processor.preprocess(req.image, height=req.height, width=req.width)
            with self._vae_lock:  # may upcast the shared VAE (force_upcast) for the encode
                return view.prepare_latents(image, latent_timestep, 1, req.n, dtype, self.device, generator)
        init_image = view.image_processor.preprocess(req.image, height=req.height, width=req.width).to(torch.float32)
        mask_condition = view.mask_processor.preprocess(req.mask, height=req.height, width=req.width)
        masked_image = init_image * (mask_condition < 0.5)
        latent_channels = view.vae.config.latent_channels
        plain = self.denoiser_channels == latent_channels  # no mask channels: blend each step instead
        batch = [req.n if a == "n" else a for a in self.mask_batch_args]
        with self._vae_lock:
            latents, noise, *image_latents = view.prepare_latents(
                req.n, latent_channels, req.height, req.width, dtype, self.device, generator, image=init_image,
                timestep=latent_timestep, is_strength_max=req.strength == 1.0, return_noise=True,
                return_image_latents=plain)
            mask, masked_image_latents = view.prepare_mask_latents(
                mask_condition, masked_image, *batch, req.height, req.width, dtype, self.device, generator, cfg)
        state.update(mask=mask, masked_image_latents=masked_image_latents, noise=noise,
                     image_latents=image_latents[0] if image_latents else None)
        return latents

    @property
    def denoiser_channels(self) -> int:
        denoiser = getattr(self.pipe, "unet", None) or self.pipe.transformer
        return denoiser.config.in_channels

    # -- denoise helpers shared by the families -----------------------------------------------
    @staticmethod
    def guide(model_output: torch.Tensor, cfg: bool, scale: float) -> torch.Tensor:
        if not cfg:
            return model_output
        uncond, cond = model_output.chunk(2)
        return uncond + scale * (cond - uncond)

    @staticmethod
    def keep_unmasked(state: dict, latents: torch.Tensor, mask: torch.Tensor, renoise) -> torch.Tensor:
        """Inpainting with a plain denoiser: the unmasked area follows the input image's noise path.

        `renoise(image_latents, next_timestep)` noises the input image's latents to the next step.
        """
        i, timesteps = state["i"], state["timesteps"]
        proper = state["image_latents"]
        if i < len(timesteps) - 1:
            proper = renoise(proper, torch.tensor([timesteps[i + 1]]))
        return (1 - mask) * proper + mask * latents

    @staticmethod
    def split(batched: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return list(torch.split(batched, sizes))

    def preview(self, item: WorkItem) -> Image.Image:
        with torch.inference_mode(), self._vae_lock:
            pixels = self.latents_to_pixels(item.state["latents"], item.state.get("decode_extras", {}))
        return numpy_to_pil(pixels)[0]

    # -- vae_decode -------------------------------------------------------------------------
    def decode_key(self, item: WorkItem) -> Hashable:
        lat = item.inputs["latents"]
        return (tuple(lat.shape[1:]), lat.dtype, tuple(sorted(item.inputs.get("decode_extras", {}).items())))

    def latents_to_pixels(self, latents: torch.Tensor, extras: dict) -> np.ndarray:
        """[N, ...] latents -> [N, H, W, 3] float pixels in [0, 1]."""
        raise NotImplementedError

    @torch.inference_mode()
    def decode(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        latents = torch.cat([it.inputs["latents"] for it in items])
        with self._vae_lock:
            pixels = self.latents_to_pixels(latents, items[0].inputs.get("decode_extras", {}))
        out, start = [], 0
        for item in items:
            n = item.inputs["latents"].shape[0]
            chunk = pixels[start:start + n]
            start += n
            out.append({"pixels": chunk, "images": numpy_to_pil(chunk), "seed": item.inputs["request"].seed})
        return out

    def postprocess(self, image: torch.Tensor) -> np.ndarray:
        return self.pipe.image_processor.postprocess(image, output_type="np")


def numpy_to_pil(pixels: np.ndarray) -> list[Image.Image]:
    return [Image.fromarray((p * 255).round().astype("uint8")) for p in pixels]
