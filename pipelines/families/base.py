"""What every image family shares: image requests, the edits' latents, decode to PIL images.

A family subclass reads like the diffusers pipeline it mirrors, in numbered steps. Loading, the
per-request pipeline views, the prompt cache and the speed-ups are the diffusion base's
(pipelines/families/diffusion_base.py), shared with the video families.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Hashable

import numpy as np
import torch
from PIL import Image

from pipelines.families.diffusion_base import DiffusionFamily
from pipelines.image_request import ImageLimits, ImageRequest, RequestError, Task
from stages.stage import WorkItem

VAE_TILING_ABOVE_PX = 1024 * 1024  # with a memory budget, larger images decode in tiles

class ImageFamily(DiffusionFamily[Task, ImageRequest]):
    """An image family: text-to-image and its edits (image-to-image, inpainting) on ImageRequests; a sibling
    of the video families (pipelines/families/video_base.py). Satisfies stages.diffusion.stages.DiffusionAdapter."""

    # diffusers pipelines per task, sharing components (type[Any]: mypy sees diffusers' lazy exports as dummies)
    pipeline_classes: dict[Task, type[Any]] = {}

    def base_pipeline(self) -> tuple[Task, type[Any]]:
        return Task.TEXT_TO_IMAGE, self.pipeline_classes[Task.TEXT_TO_IMAGE]

    def variants(self, base) -> dict[Task, type[Any]]:
        return {task: cls for task, cls in self.pipeline_classes.items() if task is not Task.TEXT_TO_IMAGE}

    # -- facts the API layer needs --------------------------------------------------------
    @property
    def vae_scale_factor(self) -> int:
        return self.pipe.vae_scale_factor

    @property
    def size_factor(self) -> int:
        """Width and height must be multiples of this."""
        return self.vae_scale_factor

    @property
    def default_size(self) -> int:
        """The width and height of a request that names no size."""
        raise NotImplementedError

    @property
    def several_images(self) -> bool:
        """Whether an edit may carry several input images (up to ImageLimits.max_images); else one."""
        return False

    def refuse_guidance_embeds(self, what: str) -> None:
        """A guidance-distilled transformer (`guidance_embeds`) this family's loop does not feed: refused at load."""
        if self.pipe.transformer.config.guidance_embeds:
            raise ValueError(f"model {self.name}: a guidance-distilled {what} transformer (guidance_embeds) is not "
                             f"supported by the {self.family} family; serve it with family = \"diffusers\"")

    def validate(self, request: ImageRequest, limits: ImageLimits) -> ImageRequest:
        """The request checked and completed (defaults filled, a seed drawn), or the field-naming RequestError."""
        if request.task.value not in self.tasks:
            raise RequestError("model", f"model {self.name} does not support {request.task.value}; "
                                        f"it supports {list(self.tasks)}")
        self.refuse_knobs(request.extra)
        request = request.validate(size_factor=self.size_factor, default_size=self.default_size,
                                   default_steps=self.default_steps, default_guidance=self.default_guidance,
                                   limits=limits, several_images=self.several_images)
        self.check_steps(request.num_inference_steps)
        self.check_step_cache(request.step_cache)
        if request.lora:
            request = dataclasses.replace(request, lora=self.loras.resolve(request.lora))
        return request

    def edit_size(self, image: Image.Image) -> tuple[int, int] | None:
        """An edit's output size when the request names none, once its upload is decoded: the image's, rounded down
        to the size factor. None: the family's `validate` sizes it (a pipeline that resizes its input first)."""
        factor = self.size_factor
        return image.size[0] // factor * factor, image.size[1] // factor * factor

    def warm_request(self, width: int, height: int) -> ImageRequest:
        """The warm-up's tiny request at one size (pipelines/served.py): text-to-image, the fewest steps."""
        return ImageRequest(prompt="warm-up", width=width, height=height, num_inference_steps=self.min_steps, seed=0)

    # -- prepare helpers shared by the image families -----------------------------------------
    mask_batch_args: tuple[int | str, ...] = ("n",)  # how prepare_mask_latents takes the batch: ("n",) or (1, "n")

    @staticmethod
    def pooled_conditioning(embeds: torch.Tensor, pooled: torch.Tensor, negative: tuple | None,
                            n: int) -> dict[str, Any]:
        """Sequence and pooled text embeddings of one prompt, repeated for n images as num_images_per_prompt
        does; with CFG, `negative` = (embeds, pooled) of the negative prompt goes first: [uncond x n, cond x n]."""
        embeds, pooled = embeds.repeat(n, 1, 1), pooled.repeat(n, 1)
        if negative is not None:
            embeds = torch.cat([negative[0].repeat(n, 1, 1), embeds])
            pooled = torch.cat([negative[1].repeat(n, 1), pooled])
        return {"embeds": embeds, "pooled": pooled, "cfg": negative is not None}

    def unet_start(self, view, req: ImageRequest, scheduler, dtype, generator, cfg: bool, *,
                   begin_index: bool = False) -> tuple[dict[str, Any], torch.Tensor]:
        """A UNet family's first two prepare steps, as its pipelines do them: timesteps (image-to-image and
        inpainting start part-way, by strength; `begin_index`: text-to-image sets the scheduler's begin index,
        as SDXL's pipeline does) and initial latents. Returns the item's state so far and the latents."""
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

        timesteps, steps = retrieve_timesteps(scheduler, req.num_inference_steps, self.device)
        if req.task is not Task.TEXT_TO_IMAGE:
            timesteps = self.strength_timesteps(view, req, steps)
        elif begin_index and hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        state: dict[str, Any] = {"scheduler": scheduler, "timesteps": timesteps, "total": len(timesteps)}
        if req.task is Task.TEXT_TO_IMAGE:
            channels = view.unet.config.in_channels
            latents = view.prepare_latents(req.n, channels, req.height, req.width, dtype, self.device, generator)
        else:
            latents = self.edit_latents(view, req, timesteps, dtype, generator, cfg, state)
        return state, latents

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

    # -- denoise helpers shared by the image families -----------------------------------------
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

    # -- previews -------------------------------------------------------------------------------
    takes_preview_vae: bool = False  # `vae_pixels` decodes through another VAE too (a preview_vae): sd, sdxl, sd3, flux
    preview_vae: Any = None  # the AutoencoderTiny that decodes previews (load_preview_vae); None: the full VAE

    def load_preview_vae(self, path: str) -> None:
        """Decode previews with the AutoencoderTiny (TAESD) saved at `path`: it reads the full VAE's latents (same
        channels) and is cheaper by far; finals keep the full VAE. ValueError when it does not fit this model."""
        from diffusers import AutoencoderTiny

        assert self.takes_preview_vae  # ServedDiffusion refuses the other families before loading
        tiny = AutoencoderTiny.from_pretrained(path, torch_dtype=self.dtype).to(self.device).eval()
        have, want = tiny.config.latent_channels, self.pipe.vae.config.latent_channels
        if have != want:
            raise ValueError(f"model {self.name}: preview_vae {path} has {have} latent channels, the model's VAE "
                             f"{want}: it needs a tiny VAE trained for this model's latents")
        self.preview_vae = tiny
        self._preview_vae_lock = threading.Lock()  # the tiny VAE is the previews' alone, apart from the full VAE

    def preview(self, item: WorkItem) -> Image.Image:
        latents, extras = item.state["latents"], item.state.get("decode_extras", {})
        if self.preview_vae is not None:
            with torch.inference_mode(), self._preview_vae_lock:
                pixels = self.vae_pixels(self.preview_vae, latents, extras)
        else:
            with torch.inference_mode(), self._vae_lock:
                pixels = self.latents_to_pixels(latents, extras)
        return numpy_to_pil(pixels)[0]

    # -- vae_decode -------------------------------------------------------------------------
    def decode_key(self, item: WorkItem) -> Hashable:
        lat = item.inputs["latents"]
        return (tuple(lat.shape[1:]), lat.dtype, tuple(sorted(item.inputs.get("decode_extras", {}).items())))

    vae_tiling_above_px = VAE_TILING_ABOVE_PX

    def latents_to_pixels(self, latents: torch.Tensor, extras: dict) -> np.ndarray:
        """[N, ...] latents -> [N, H, W, 3] float pixels in [0, 1], through the model's own VAE."""
        return self.vae_pixels(self.pipe.vae, latents, extras)

    def vae_pixels(self, vae: Any, latents: torch.Tensor, extras: dict) -> np.ndarray:
        """latents_to_pixels through `vae`: the model's own, or its preview VAE (an AutoencoderTiny, whose config's
        scaling_factor and shift_factor map the latents as diffusers' pipelines do with `pipe.vae = tiny`).
        Families with `takes_preview_vae` define it; the others may define latents_to_pixels instead."""
        raise NotImplementedError

    @torch.inference_mode()
    def decode(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        latents = torch.cat([it.inputs["latents"] for it in items])
        request = items[0].inputs["request"]
        vae = self.pipe.vae
        # with a memory budget, images above VAE_TILING_ABOVE_PX decode in tiles (diffusers' tiled decode)
        tiled = self.memory_budget is not None and hasattr(vae, "use_tiling") and not vae.use_tiling \
            and request.width * request.height > self.vae_tiling_above_px
        with self._vae_lock:
            vae.use_tiling = vae.use_tiling or tiled
            try:
                pixels = self.latents_to_pixels(latents, items[0].inputs.get("decode_extras", {}))
            finally:
                if tiled:
                    vae.use_tiling = False
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


class PackedLatents:
    """Sizes of a family whose latents are packed in 2x2 patches (FLUX, Qwen-Image): multiples of twice the VAE's
    factor; by default the pipeline's default_sample_size latents."""

    pipe: Any
    vae_scale_factor: int

    @property
    def default_size(self) -> int:
        return self.pipe.default_sample_size * self.vae_scale_factor

    @property
    def size_factor(self) -> int:
        return self.vae_scale_factor * 2
