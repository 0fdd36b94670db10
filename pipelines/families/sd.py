"""Stable Diffusion 1.x / 2.x: UNet + CLIP text encoder + AutoencoderKL."""

from __future__ import annotations

import functools
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline, StableDiffusionPipeline

from pipelines.families.base import ImageFamily
from pipelines.image_request import ImageRequest, Task
from stages.diffusion.block_stack import CacheSpec
from stages.stage import WorkItem


class StableDiffusionFamily(ImageFamily):
    family = "sd"
    class_names = ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline")
    pipeline_classes = {
        Task.TEXT_TO_IMAGE: StableDiffusionPipeline,
        Task.IMAGE_TO_IMAGE: StableDiffusionImg2ImgPipeline,
        Task.INPAINTING: StableDiffusionInpaintPipeline,
    }
    load_kwargs = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    default_steps = 50
    default_guidance = 7.5

    @property
    def default_size(self) -> int:
        return self.pipe.unet.config.sample_size * self.vae_scale_factor

    # -- 1. text ----------------------------------------------------------------------------
    def text_key(self, text: str) -> Hashable:
        tok = self.pipe.tokenizer
        return tuple(tok(text, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids)

    def encode_text(self, text: str) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(text, self.device, 1, False)
        return {"embeds": embeds}  # [1, L, D]

    def conditioning(self, prompt: dict, negative: dict | None, request: ImageRequest) -> dict[str, Any]:
        n = request.n
        embeds = prompt["embeds"].repeat(n, 1, 1)  # as diffusers' num_images_per_prompt repeat
        if negative is not None:
            embeds = torch.cat([negative["embeds"].repeat(n, 1, 1), embeds])  # [uncond x n, cond x n]
        return {"embeds": embeds, "cfg": negative is not None}

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        dtype = cond["embeds"].dtype

        # 2.1 timesteps (image-to-image and inpainting start part-way, by strength), 2.2 latents
        state, latents = self.unet_start(view, req, scheduler, dtype, generator, cond["cfg"])

        # 2.3 scheduler extras and the guidance embedding of distilled UNets
        state["step_kwargs"] = view.prepare_extra_step_kwargs(generator, 0.0)
        state["timestep_cond"] = None
        if view.unet.config.time_cond_proj_dim is not None:
            assert req.guidance_scale is not None  # validate() filled it
            g = torch.tensor(req.guidance_scale - 1).repeat(req.n * (2 if cond["cfg"] else 1))
            state["timestep_cond"] = view.get_guidance_scale_embedding(
                g, embedding_dim=view.unet.config.time_cond_proj_dim).to(device=self.device, dtype=latents.dtype)
        state["latents"] = latents
        item.state.update(state)

    # -- 3. denoise ------------------------------------------------------------------------
    def _concat_mask(self, state: dict) -> bool:
        """Inpainting UNets (9 input channels) see the mask and the masked image's latents."""
        return "mask" in state and self.pipe.unet.config.in_channels == 9

    def denoise_key(self, item: WorkItem) -> Hashable:
        # CFG on/off need not match: each item brings its own (doubled or not) rows, and every row
        # of a UNet forward is independent of the others.
        s, cond = item.state, item.inputs["cond"]
        return (tuple(s["latents"].shape[1:]), s["latents"].dtype, tuple(cond["embeds"].shape[1:]),
                self._concat_mask(s), s["timestep_cond"] is not None) + self.added_key(item)

    def added_key(self, item: WorkItem) -> tuple:
        """Shapes of the added conditioning (none for SD; SDXL's pooled text and time ids)."""
        return ()

    def added_conditions(self, items: list[WorkItem]) -> dict[str, torch.Tensor] | None:
        """The UNet's `added_cond_kwargs` for a batch (none for SD)."""
        return None

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        inputs, timesteps, embeds, tconds = [], [], [], []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            t = s["timesteps"][s["i"]]
            x = torch.cat([s["latents"]] * 2) if cond["cfg"] else s["latents"]
            x = s["scheduler"].scale_model_input(x, t)
            if self._concat_mask(s):
                x = torch.cat([x, s["mask"], s["masked_image_latents"]], dim=1)
            inputs.append(x)
            timesteps.append(t.expand(x.shape[0]))  # per-sample timesteps: items sit at different steps
            embeds.append(cond["embeds"])
            tconds.append(s["timestep_cond"])
        batched = {"sample": torch.cat(inputs), "timestep": torch.cat(timesteps),
                   "encoder_hidden_states": torch.cat(embeds),
                   "timestep_cond": torch.cat(tconds) if tconds[0] is not None else None,
                   **(self.added_conditions(items) or {})}
        return self.denoise("unet", items, [x.shape[0] for x in inputs], batched)

    def call_denoiser(self, key: str, sample, timestep, encoder_hidden_states, timestep_cond=None, text_embeds=None,
                      time_ids=None) -> torch.Tensor:
        added = None if text_embeds is None else {"text_embeds": text_embeds, "time_ids": time_ids}
        return self.pipe.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states,
                              timestep_cond=timestep_cond, added_cond_kwargs=added, return_dict=False)[0]

    # -- speed-ups ----------------------------------------------------------------------------
    def compile_regions(self, module) -> tuple:
        return (*module.down_blocks, module.mid_block, *module.up_blocks)

    def cache_spec(self, key: str, module) -> CacheSpec:
        # Model level: a skipped step reuses the UNet's noise prediction (skip connections leave no
        # single residual stream to cache); TeaCache's input is the UNet's first timestep-modulated features.
        return CacheSpec(key, (module,), hidden="sample", out_hidden=0, residual=False,
                         indicator=functools.partial(unet_indicator, module))

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s, req = item.state, item.inputs["request"]
        i, timesteps = s["i"], s["timesteps"]
        noise_pred = self.guide(model_output, item.inputs["cond"]["cfg"], req.guidance_scale)
        latents = s["scheduler"].step(noise_pred, timesteps[i], s["latents"], **s["step_kwargs"], return_dict=False)[0]
        if s.get("image_latents") is not None:
            # Inpainting with a plain UNet: keep the unmasked area on the input image's noise path.
            init_mask = s["mask"].chunk(2)[0] if item.inputs["cond"]["cfg"] else s["mask"]
            latents = self.keep_unmasked(s, latents, init_mask, lambda x, t: s["scheduler"].add_noise(x, s["noise"], t))
        s["latents"] = latents
        s["i"] = i + 1

    # -- 4. decode ---------------------------------------------------------------------------
    takes_preview_vae = True

    def vae_pixels(self, vae: Any, latents: torch.Tensor, extras: dict) -> np.ndarray:
        # (a TAESD's scaling_factor is 1.0: it decodes the UNet's latents as they are)
        image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
        return self.postprocess(image)


def unet_indicator(unet, args: dict[str, Any]) -> torch.Tensor:
    """conv_in(sample) shifted by the first resnet's timestep projection: what the first block sees
    change from step to step (TeaCache's "timestep-modulated input" for a UNet)."""
    sample, timestep = args["sample"], args["timestep"]
    t_emb = unet.time_proj(timestep.expand(sample.shape[0])).to(sample.dtype)
    emb = unet.time_embedding(t_emb, args.get("timestep_cond"))
    resnet = unet.down_blocks[0].resnets[0]
    return unet.conv_in(sample) + resnet.time_emb_proj(torch.nn.functional.silu(emb))[:, :, None, None]
