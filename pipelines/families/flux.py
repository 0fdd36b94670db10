"""FLUX.1: MMDiT transformer on packed latents + CLIP (pooled) + T5 (sequence) + AutoencoderKL.

Mirrors diffusers' FluxPipeline / FluxImg2ImgPipeline / FluxInpaintPipeline step by step. FLUX.1
has no classic CFG batch: guidance_scale is an *input* of guidance-distilled transformers (a
per-sample tensor), so requests with different guidance scales still share one forward. The
pipelines' optional "true CFG" (request.extra['true_cfg_scale'] > 1 with a negative prompt) runs
the negative prompt as extra samples of the same forward.
"""

from __future__ import annotations

import functools
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from pipelines.families.base import ImageFamily, PackedLatents
from pipelines.families.speedups import norm1_indicator
from pipelines.image_request import ImageLimits, ImageRequest, RequestError, Task
from stages.diffusion.block_stack import CacheSpec
from stages.diffusion.step_cache import TEACACHE_COEFFICIENTS
from stages.stage import WorkItem

MAX_SEQUENCE_LENGTH = 512  # the pipelines' default and their upper limit


class FluxFamily(PackedLatents, ImageFamily):
    family = "flux"
    class_names = ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline")
    pipeline_classes = {
        Task.TEXT_TO_IMAGE: FluxPipeline,
        Task.IMAGE_TO_IMAGE: FluxImg2ImgPipeline,
        Task.INPAINTING: FluxInpaintPipeline,
    }
    default_steps = 28  # FluxPipeline.__call__ num_inference_steps
    default_guidance = 3.5  # the embedded (distilled) guidance, not CFG
    request_knobs = frozenset({"max_sequence_length", "true_cfg_scale"})

    # -- request knobs (request.extra) --------------------------------------------------------
    @staticmethod
    def max_sequence_length(request: ImageRequest) -> int:
        return int(request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))

    @staticmethod
    def true_cfg_scale(request: ImageRequest) -> float:
        return float(request.extra.get("true_cfg_scale", 1.0))

    def validate(self, request: ImageRequest, limits: ImageLimits) -> ImageRequest:
        request = super().validate(request, limits)
        msl = request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH)
        if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= MAX_SEQUENCE_LENGTH:
            raise RequestError("max_sequence_length",
                               f"max_sequence_length must be an integer between 1 and {MAX_SEQUENCE_LENGTH}; "
                               f"got {msl!r}")
        cfg = request.extra.get("true_cfg_scale", 1.0)
        if isinstance(cfg, bool) or not isinstance(cfg, (int, float)) or not 0.0 <= cfg <= limits.max_guidance:
            raise RequestError("true_cfg_scale", f"true_cfg_scale must be between 0 and {limits.max_guidance}; "
                                                 f"got {cfg!r}")
        return request

    def uses_negative(self, request: ImageRequest) -> bool:
        # diffusers: do_true_cfg = true_cfg_scale > 1 and negative_prompt is not None
        return self.true_cfg_scale(request) > 1.0 and request.negative_prompt is not None

    # -- 1. text ----------------------------------------------------------------------------
    def text_options(self, request: ImageRequest) -> dict:
        return {"max_sequence_length": self.max_sequence_length(request)}

    def text_key(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> Hashable:
        clip, t5 = self.pipe.tokenizer, self.pipe.tokenizer_2
        clip_ids = clip(text, padding="max_length", max_length=self.pipe.tokenizer_max_length,
                        truncation=True).input_ids
        t5_ids = t5(text, padding="max_length", max_length=max_sequence_length, truncation=True).input_ids
        return (tuple(clip_ids), tuple(t5_ids))

    def encode_text(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(text, text, self.device, 1,
                                                    max_sequence_length=max_sequence_length)
        return {"embeds": embeds, "pooled": pooled}  # T5 [1, L, D], CLIP pooled [1, P]

    def conditioning(self, prompt: dict, negative: dict | None, request: ImageRequest) -> dict[str, Any]:
        n = request.n
        # As encode_prompt's num_images_per_prompt repeat (batch 1: repeat(n, ...) is the same layout).
        embeds = prompt["embeds"].repeat(n, 1, 1)
        pooled = prompt["pooled"].repeat(n, 1)
        if negative is not None:  # [negative x n, prompt x n]: base.guide's (uncond, cond) order
            embeds = torch.cat([negative["embeds"].repeat(n, 1, 1), embeds])
            pooled = torch.cat([negative["pooled"].repeat(n, 1), pooled])
        te = self.pipe.text_encoder
        dtype = te.dtype if te is not None else self.pipe.transformer.dtype
        text_ids = torch.zeros(embeds.shape[1], 3).to(device=self.device, dtype=dtype)  # as encode_prompt
        return {"embeds": embeds, "pooled": pooled, "text_ids": text_ids, "cfg": negative is not None}

    # -- 2. prepare ---------------------------------------------------------------------------
    @staticmethod
    def shift(scheduler, seq_len: int) -> float:
        """The pipelines' mu: the flow-matching shift for `seq_len` image tokens, from the scheduler's config."""
        config = scheduler.config
        return calculate_shift(seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                               config.get("base_shift", 0.5), config.get("max_shift", 1.15))

    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        dtype = cond["embeds"].dtype
        channels = view.transformer.config.in_channels // 4
        h, w = req.height, req.width
        assert h is not None and w is not None  # validate() filled them
        state: dict[str, Any] = {"scheduler": scheduler, "decode_extras": {"height": h, "width": w}}

        # 2.1 latents of text-to-image come before the timesteps (the pipeline's order)
        if req.task is Task.TEXT_TO_IMAGE:
            latents, image_ids = view.prepare_latents(req.n, channels, h, w, dtype, self.device, generator)

        # 2.2 timesteps: flow-matching sigmas, shifted by mu from the image's token count
        steps = req.num_inference_steps
        assert steps is not None  # validate() filled it
        sigmas: np.ndarray | None = np.linspace(1.0, 1 / steps, steps)
        if req.task is Task.TEXT_TO_IMAGE and getattr(scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        image_seq_len = (int(h) // view.vae_scale_factor // 2) * (int(w) // view.vae_scale_factor // 2)
        mu = self.shift(scheduler, image_seq_len)
        # diffusers annotates sigmas as list[float]; its own Flux pipeline passes this numpy array
        timesteps, steps = retrieve_timesteps(scheduler, steps, self.device,
                                              sigmas=sigmas, mu=mu)  # type: ignore[arg-type]
        if req.task is Task.TEXT_TO_IMAGE:
            scheduler.set_begin_index(0)
        else:
            timesteps, steps = view.get_timesteps(steps, req.strength, self.device)
            if steps < 1:
                raise RequestError("strength", f"strength {req.strength} with {req.num_inference_steps} steps "
                                               "leaves no step to run")
            latent_timestep = timesteps[:1].repeat(req.n)

        # 2.3 latents of the edits: the input image noised to the first timestep
        if req.task is Task.IMAGE_TO_IMAGE:
            image = view.image_processor.preprocess(req.image, height=h, width=w).to(dtype=torch.float32)
            with self._vae_lock:
                latents, image_ids = view.prepare_latents(image, latent_timestep, req.n, channels, h, w, dtype,
                                                          self.device, generator)
        elif req.task is Task.INPAINTING:
            init_image = view.image_processor.preprocess(req.image, height=h, width=w).to(dtype=torch.float32)
            with self._vae_lock:
                latents, noise, image_latents, image_ids = view.prepare_latents(
                    init_image, latent_timestep, req.n, channels, h, w, dtype, self.device, generator)
            mask_condition = view.mask_processor.preprocess(req.mask, height=h, width=w)
            # The 64-channel transformer never reads masked_image_latents (the pipeline encodes the
            # masked image and drops it, after the last draw from the generator): hand the helper
            # a latent-shaped placeholder so it only builds the packed mask.
            lh, lw = 2 * (int(h) // (view.vae_scale_factor * 2)), 2 * (int(w) // (view.vae_scale_factor * 2))
            placeholder = torch.zeros(1, 16, lh, lw)
            mask, _ = view.prepare_mask_latents(mask_condition, placeholder, 1, channels, req.n, h, w, dtype,
                                                self.device, generator)
            state.update(mask=mask, noise=noise, image_latents=image_latents)

        # 2.4 the embedded guidance of guidance-distilled transformers: one value per sample
        state["guidance"] = None
        if view.transformer.config.guidance_embeds:
            rows = latents.shape[0] * (2 if cond["cfg"] else 1)
            assert req.guidance_scale is not None  # validate() filled it
            state["guidance"] = torch.full([1], req.guidance_scale, device=self.device,
                                           dtype=torch.float32).expand(rows)
        state.update(timesteps=timesteps, total=len(timesteps), latents=latents, image_ids=image_ids)
        item.state.update(state)

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        s, cond = item.state, item.inputs["cond"]
        extras = s["decode_extras"]
        # img_ids depend on the latent grid (not only on the token count); txt_ids on the T5 length.
        grid = (extras["height"] // self.size_factor, extras["width"] // self.size_factor)
        return (grid, tuple(s["latents"].shape[1:]), s["latents"].dtype, tuple(cond["embeds"].shape[1:]),
                tuple(cond["pooled"].shape[1:]), s["guidance"] is not None)

    def model_input(self, item: WorkItem) -> torch.Tensor:
        """The tokens one item sends through the transformer: its packed latents [n, L, 64]."""
        return item.state["latents"]

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        hidden, timesteps, guidance, embeds, pooled, sizes = [], [], [], [], [], []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            t = s["timesteps"][s["i"]]
            x = self.model_input(item)
            x = torch.cat([x] * 2) if cond["cfg"] else x
            hidden.append(x)
            timesteps.append(t.expand(x.shape[0]).to(x.dtype))  # per-sample: items sit at different steps
            guidance.append(s["guidance"])
            embeds.append(cond["embeds"])
            pooled.append(cond["pooled"])
            sizes.append(x.shape[0])
        first = items[0]
        batched = {"hidden_states": torch.cat(hidden), "timestep": torch.cat(timesteps) / 1000,
                   "guidance": torch.cat(guidance) if guidance[0] is not None else None,
                   "pooled_projections": torch.cat(pooled), "encoder_hidden_states": torch.cat(embeds)}
        # 2-D ids, equal for all items of one key (the latent grid and the T5 length are in it)
        shared = {"txt_ids": first.inputs["cond"]["text_ids"], "img_ids": first.state["image_ids"]}
        return self.denoise("transformer", items, sizes, batched, shared)

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return (*module.transformer_blocks, *module.single_transformer_blocks)

    def cache_spec(self, key: str, module) -> CacheSpec:
        return CacheSpec(key, self.repeated_blocks(module), encoder="encoder_hidden_states", out_hidden=1,
                         out_encoder=0, indicator=functools.partial(norm1_indicator, module.transformer_blocks[0]),
                         coefficients=TEACACHE_COEFFICIENTS["flux"])

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s, req = item.state, item.inputs["request"]
        latents = self.scheduler_step(item, model_output, self.true_cfg_scale(req), s["latents"])
        if "mask" in s:
            # Inpainting: keep the unmasked area on the input image's noise path.
            latents = self.keep_unmasked(s, latents, s["mask"],
                                         lambda x, t: s["scheduler"].scale_noise(x, t, s["noise"]))
        s["latents"] = latents
        s["i"] += 1

    # -- 4. decode ---------------------------------------------------------------------------
    takes_preview_vae = True

    def vae_pixels(self, vae: Any, latents: torch.Tensor, extras: dict) -> np.ndarray:
        # packed [N, tokens, C*4] -> [N, C, H/8, W/8]; a preview VAE (TAEF1) maps them by its own config's factors
        pipe = self.pipe
        latents = pipe._unpack_latents(latents, extras["height"], extras["width"], pipe.vae_scale_factor)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return self.postprocess(image)
