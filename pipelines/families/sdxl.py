"""Stable Diffusion XL: UNet with added (pooled text + micro-conditioning) embeddings, two CLIP
text encoders, AutoencoderKL.

Mirrors StableDiffusionXLPipeline / StableDiffusionXLImg2ImgPipeline / StableDiffusionXLInpaintPipeline
(diffusers 0.42) step for step, with the denoise loop in stages/diffusion/stages.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline, StableDiffusionXLPipeline

from pipelines.families.sd import StableDiffusionFamily
from pipelines.image_request import ImageLimits, ImageRequest, Task
from stages.stage import WorkItem

# Micro-conditioning defaults of the diffusers SDXL pipelines (__call__ arguments).
CROPS_COORDS_TOP_LEFT = (0, 0)
AESTHETIC_SCORE = 6.0  # img2img / inpaint, only when the pipeline config requires_aesthetics_score
NEGATIVE_AESTHETIC_SCORE = 2.5
INPAINT_DEFAULT_GUIDANCE = 7.5  # StableDiffusionXLInpaintPipeline's default; the other two use 5.0


class StableDiffusionXLFamily(StableDiffusionFamily):
    """SD with two text encoders and added conditioning; the step loop (forward, commit) is SD's."""


    family = "sdxl"
    class_names = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline")
    pipeline_classes = {
        Task.TEXT_TO_IMAGE: StableDiffusionXLPipeline,
        Task.IMAGE_TO_IMAGE: StableDiffusionXLImg2ImgPipeline,
        Task.INPAINTING: StableDiffusionXLInpaintPipeline,
    }
    load_kwargs = {}
    default_steps = 50
    default_guidance = 5.0  # text-to-image and image-to-image; inpainting: 7.5 (see validate)

    @property
    def default_size(self) -> int:
        return self.pipe.default_sample_size * self.vae_scale_factor

    @property
    def size_factor(self) -> int:
        # check_inputs demands multiples of 8 whatever the VAE; latents need the VAE's factor.
        return math.lcm(8, self.vae_scale_factor)

    def validate(self, request: ImageRequest, limits: ImageLimits) -> ImageRequest:
        if request.task is Task.INPAINTING and request.guidance_scale is None:
            request = dataclasses.replace(request, guidance_scale=INPAINT_DEFAULT_GUIDANCE)
        return super().validate(request, limits)

    # -- 1. text ----------------------------------------------------------------------------
    def _tokenizers(self) -> list:
        pipe = self.pipe  # as encode_prompt: encoder 1 is optional (refiner-style checkpoints)
        return [pipe.tokenizer, pipe.tokenizer_2] if pipe.tokenizer is not None else [pipe.tokenizer_2]

    def text_key(self, text: str) -> Hashable:
        return tuple(tuple(tok(text, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids)
                     for tok in self._tokenizers())

    def encode_text(self, text: str) -> dict[str, torch.Tensor]:
        # Penultimate hidden states of both encoders side by side; pooled (projected) output of encoder 2.
        # A negative text is encoded the same way (diffusers pads it to the prompt's length, 77 either way).
        embeds, _, pooled, _ = self.pipe.encode_prompt(text, device=self.device, num_images_per_prompt=1,
                                                       do_classifier_free_guidance=False)
        return {"embeds": embeds, "pooled": pooled}  # [1, L, D1 + D2], [1, P]

    def cfg(self, request: ImageRequest) -> bool:
        # do_classifier_free_guidance: guidance-distilled UNets (time_cond_proj_dim) run without.
        assert request.guidance_scale is not None  # validate() filled it
        return request.guidance_scale > 1.0 and self.pipe.unet.config.time_cond_proj_dim is None

    def zero_negative(self, request: ImageRequest) -> bool:
        # encode_prompt: `negative_prompt is None and force_zeros_for_empty_prompt` -> zeros, not "".
        return request.negative_prompt is None and bool(self.pipe.config.force_zeros_for_empty_prompt)

    def uses_negative(self, request: ImageRequest) -> bool:
        """Whether a negative TEXT must be encoded (zero negatives need no encoder)."""
        return self.cfg(request) and not self.zero_negative(request)

    def negative(self, request: ImageRequest, prompt: dict, options: dict) -> dict | None:
        if self.uses_negative(request):
            return self.cached_text(request.negative_prompt or "", request.tenant, options)
        if self.cfg(request):  # force_zeros_for_empty_prompt: no negative prompt means zeros
            return {k: torch.zeros_like(v) for k, v in prompt.items()}
        return None

    def conditioning(self, prompt: dict, negative: dict | None, request: ImageRequest) -> dict[str, Any]:
        n = request.n
        dtype = self.pipe.text_encoder_2.dtype if self.pipe.text_encoder_2 is not None else self.pipe.unet.dtype
        uncond = None if negative is None else (negative["embeds"].to(dtype), negative["pooled"])
        return self.pooled_conditioning(prompt["embeds"], prompt["pooled"], uncond, n)

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        dtype = cond["embeds"].dtype

        # 2.1 timesteps (edits start part-way, by strength; text-to-image sets the begin index), 2.2 latents
        state, latents = self.unet_start(view, req, scheduler, dtype, generator, cond["cfg"], begin_index=True)

        # 2.3 scheduler extras
        state["step_kwargs"] = view.prepare_extra_step_kwargs(generator, 0.0)

        # 2.4 added time ids: (original size, crop corner, target size | aesthetic score), from the latents' size
        height, width = (d * view.vae_scale_factor for d in latents.shape[-2:])
        size = (height, width)
        if view.text_encoder_2 is None:
            projection_dim = int(cond["pooled"].shape[-1])
        else:
            projection_dim = view.text_encoder_2.config.projection_dim
        if req.task is Task.TEXT_TO_IMAGE:
            add_time_ids = view._get_add_time_ids(size, CROPS_COORDS_TOP_LEFT, size, dtype=dtype,
                                                  text_encoder_projection_dim=projection_dim)
            if cond["cfg"]:
                add_time_ids = torch.cat([add_time_ids, add_time_ids])  # negative = positive by default
            time_ids = add_time_ids.repeat(req.n, 1)
        else:
            add_time_ids, add_neg_time_ids = view._get_add_time_ids(
                size, CROPS_COORDS_TOP_LEFT, size, AESTHETIC_SCORE, NEGATIVE_AESTHETIC_SCORE,
                size, CROPS_COORDS_TOP_LEFT, size, dtype=dtype, text_encoder_projection_dim=projection_dim)
            time_ids = add_time_ids.repeat(req.n, 1)
            if cond["cfg"]:
                time_ids = torch.cat([add_neg_time_ids.repeat(req.n, 1), time_ids])
        state["time_ids"] = time_ids.to(self.device)

        # 2.5 the guidance embedding of distilled UNets
        state["timestep_cond"] = None
        if view.unet.config.time_cond_proj_dim is not None:
            assert req.guidance_scale is not None  # validate() filled it
            g = torch.tensor(req.guidance_scale - 1).repeat(req.n)
            state["timestep_cond"] = view.get_guidance_scale_embedding(
                g, embedding_dim=view.unet.config.time_cond_proj_dim).to(device=self.device, dtype=latents.dtype)
        state["latents"] = latents
        item.state.update(state)

    # -- 3. denoise ------------------------------------------------------------------------
    def added_key(self, item: WorkItem) -> tuple:
        return tuple(item.inputs["cond"]["pooled"].shape[1:]), tuple(item.state["time_ids"].shape[1:])

    def added_conditions(self, items: list[WorkItem]) -> dict[str, torch.Tensor]:
        return {"text_embeds": torch.cat([it.inputs["cond"]["pooled"] for it in items]),
                "time_ids": torch.cat([it.state["time_ids"] for it in items])}

    # -- 4. decode ---------------------------------------------------------------------------
    def vae_pixels(self, vae: Any, latents: torch.Tensor, extras: dict) -> np.ndarray:
        """Called under the VAE's lock (base.decode / base.preview)."""
        pipe = self.pipe
        # SDXL's VAE overflows in float16: diffusers upcasts it for the decode and casts it back.
        needs_upcasting = vae.dtype == torch.float16 and vae.config.force_upcast
        if needs_upcasting:
            vae.to(dtype=torch.float32)
            latents = latents.to(torch.float32)
        try:
            mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
            if mean is not None and std is not None:
                mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
                std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
                latents = latents * std / vae.config.scaling_factor + mean
            else:
                latents = latents / vae.config.scaling_factor
            image = vae.decode(latents, return_dict=False)[0]
        finally:
            if needs_upcasting:
                vae.to(dtype=torch.float16)
        if pipe.watermark is not None:
            image = pipe.watermark.apply_watermark(image)
        return self.postprocess(image)
