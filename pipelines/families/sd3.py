"""Stable Diffusion 3 / 3.5: MMDiT transformer + two CLIPs (with projection) + optional T5 + flow matching."""

from __future__ import annotations

import functools
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline, StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift, retrieve_timesteps

from pipelines.families.base import ImageFamily
from pipelines.families.speedups import norm1_indicator
from pipelines.image_request import ImageRequest, RequestError, Task
from stages.diffusion.block_stack import CacheSpec
from stages.stage import WorkItem

MAX_SEQUENCE_LENGTH = 256  # diffusers' default length of the T5 part of the joint-attention text
MAX_SEQUENCE_LENGTH_LIMIT = 512  # diffusers' check_inputs refuses more


class StableDiffusion3Family(ImageFamily):
    family = "sd3"
    class_names = ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline")
    pipeline_classes = {
        Task.TEXT_TO_IMAGE: StableDiffusion3Pipeline,
        Task.IMAGE_TO_IMAGE: StableDiffusion3Img2ImgPipeline,
        Task.INPAINTING: StableDiffusion3InpaintPipeline,
    }
    default_steps = 28  # StableDiffusion3Pipeline.__call__ defaults
    default_guidance = 7.0
    request_knobs = frozenset({"max_sequence_length"})  # T5's
    # diffusers' SD3 inpainting pipeline decodes `latents / scaling_factor` without adding the VAE's
    # shift_factor (text-to-image and image-to-image add it). We mirror that to equal its output.
    mask_batch_args = (1, "n")  # SD3's prepare_mask_latents takes (batch_size, num_images_per_prompt)
    inpaint_decode_shift = False

    def __init__(self, name: str, path: str, **kwargs):
        # Checkpoints without T5 (SD3 "no T5" variants, the demo checkpoint) list text_encoder_3 /
        # tokenizer_3 as [null, null]; from_pretrained then wants them passed explicitly as None.
        self.load_kwargs = {**type(self).load_kwargs, **self._absent_components(path)}
        super().__init__(name, path, **kwargs)

    @staticmethod
    def _absent_components(path: str) -> dict[str, None]:
        from pipelines.registry import _read_index

        index, _ = _read_index(path)
        if index is None:
            return {}
        return {c: None for c in ("text_encoder_3", "tokenizer_3")
                if c in index and (index[c] is None or list(index[c]) == [None, None])}

    @property
    def default_size(self) -> int:
        return self.pipe.default_sample_size * self.vae_scale_factor

    @property
    def size_factor(self) -> int:
        # The latents are cut into patch_size x patch_size tokens (check_inputs demands this multiple).
        return self.vae_scale_factor * self.pipe.patch_size

    def validate(self, request: ImageRequest, limits) -> ImageRequest:
        request = super().validate(request, limits)
        msl = request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH)
        if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= MAX_SEQUENCE_LENGTH_LIMIT:
            raise RequestError("max_sequence_length",
                               f"max_sequence_length must be an integer between 1 and {MAX_SEQUENCE_LENGTH_LIMIT}; "
                               f"got {msl!r}")
        return request

    @staticmethod
    def max_sequence_length(request: ImageRequest) -> int:
        return request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH)

    # -- 1. text ----------------------------------------------------------------------------
    # The cache holds, per prompt text (batch size 1): both CLIPs' penultimate hidden states side by
    # side (not yet padded), both pooled projections side by side, and T5's embeddings when the
    # checkpoint has T5. Without T5 the pipeline uses zeros, built in conditioning() (not cached).
    def text_options(self, request: ImageRequest) -> dict:
        return {"max_sequence_length": self.max_sequence_length(request)}

    def text_key(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> Hashable:
        pipe = self.pipe
        key: tuple = tuple(
            tuple(tok(text, padding="max_length", max_length=pipe.tokenizer_max_length, truncation=True).input_ids)
            for tok in (pipe.tokenizer, pipe.tokenizer_2))
        if pipe.text_encoder_3 is not None:
            key += (tuple(pipe.tokenizer_3(text, padding="max_length", max_length=max_sequence_length, truncation=True,
                                           add_special_tokens=True).input_ids),)
        return key

    def encode_text(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> dict[str, torch.Tensor]:
        pipe = self.pipe
        # clip_skip None: the pipeline's default for the prompt and what it always uses for negatives.
        embeds_1, pooled_1 = pipe._get_clip_prompt_embeds(text, 1, self.device, clip_skip=None, clip_model_index=0)
        embeds_2, pooled_2 = pipe._get_clip_prompt_embeds(text, 1, self.device, clip_skip=None, clip_model_index=1)
        out = {"clip": torch.cat([embeds_1, embeds_2], dim=-1),  # [1, 77, D1 + D2]
               "pooled": torch.cat([pooled_1, pooled_2], dim=-1)}  # [1, P1 + P2]
        if pipe.text_encoder_3 is not None:
            out["t5"] = pipe._get_t5_prompt_embeds(text, 1, max_sequence_length, self.device)  # [1, L, J]
        return out

    def _joint_text(self, enc: dict[str, torch.Tensor], max_sequence_length: int) -> torch.Tensor:
        """encode_prompt's joint-attention text: CLIP zero-padded to T5's width, then T5 (or zeros) after it."""
        t5 = enc.get("t5")
        if t5 is None:  # _get_t5_prompt_embeds without text_encoder_3
            t5 = torch.zeros((1, max_sequence_length, self.pipe.transformer.config.joint_attention_dim),
                             device=self.device, dtype=self.pipe.text_encoder.dtype)
        clip = torch.nn.functional.pad(enc["clip"], (0, t5.shape[-1] - enc["clip"].shape[-1]))
        return torch.cat([clip, t5], dim=-2)

    def conditioning(self, prompt: dict, negative: dict | None, request: ImageRequest) -> dict[str, Any]:
        n, msl = request.n, self.max_sequence_length(request)
        uncond = None if negative is None else (self._joint_text(negative, msl), negative["pooled"])
        return self.pooled_conditioning(self._joint_text(prompt, msl), prompt["pooled"], uncond, n)

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        dtype = cond["embeds"].dtype
        transformer_channels = view.transformer.config.in_channels

        # 2.1 timesteps: dynamic shifting (SD3.5-style configs) takes mu from the image token count
        scheduler_kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            patch = view.transformer.config.patch_size
            image_seq_len = ((req.height // view.vae_scale_factor // patch)
                             * (req.width // view.vae_scale_factor // patch))
            scheduler_kwargs["mu"] = calculate_shift(
                image_seq_len,
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        timesteps, steps = retrieve_timesteps(scheduler, req.num_inference_steps, self.device, **scheduler_kwargs)
        if req.task is not Task.TEXT_TO_IMAGE:
            timesteps = self.strength_timesteps(view, req, steps)
        state: dict[str, Any] = {"scheduler": scheduler, "timesteps": timesteps, "total": len(timesteps),
                                 "decode_extras": {}}

        # 2.2 latents (the VAE encodes draw from the generator: same order as the pipelines)
        if req.task is Task.TEXT_TO_IMAGE:
            latents = view.prepare_latents(req.n, transformer_channels, req.height, req.width, dtype, self.device,
                                           generator)
        else:
            latents = self.edit_latents(view, req, timesteps, dtype, generator, cond["cfg"], state)
            if req.task is Task.INPAINTING and not self.inpaint_decode_shift:
                state["decode_extras"] = {"shift": False}
        state["latents"] = latents
        item.state.update(state)

    # -- 3. denoise ------------------------------------------------------------------------
    def _concat_mask(self, item: WorkItem) -> bool:
        """Inpainting transformers (33 input channels) see the mask and the masked image's latents."""
        return "mask" in item.state and self.pipe.transformer.config.in_channels == 33

    def denoise_key(self, item: WorkItem) -> Hashable:
        # CFG on/off need not match: each item contributes its own rows and gets them back.
        s, cond = item.state, item.inputs["cond"]
        return (tuple(s["latents"].shape[1:]), s["latents"].dtype, tuple(cond["embeds"].shape[1:]),
                tuple(cond["pooled"].shape[1:]), self._concat_mask(item))

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        inputs, timesteps, embeds, pooled = [], [], [], []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            t = s["timesteps"][s["i"]]
            x = torch.cat([s["latents"]] * 2) if cond["cfg"] else s["latents"]
            if self._concat_mask(item):
                x = torch.cat([x, s["mask"], s["masked_image_latents"]], dim=1)
            inputs.append(x)
            timesteps.append(t.expand(x.shape[0]))  # per-sample timesteps: items sit at different steps
            embeds.append(cond["embeds"])
            pooled.append(cond["pooled"])
        batched = {"hidden_states": torch.cat(inputs), "timestep": torch.cat(timesteps),
                   "encoder_hidden_states": torch.cat(embeds), "pooled_projections": torch.cat(pooled)}
        return self.denoise("transformer", items, [x.shape[0] for x in inputs], batched)

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return tuple(module.transformer_blocks)

    def cache_spec(self, key: str, module) -> CacheSpec:
        # No published TeaCache polynomial for SD3: the raw relative change (identity).
        return CacheSpec(key, self.repeated_blocks(module), encoder="encoder_hidden_states", out_hidden=1,
                         out_encoder=0, indicator=functools.partial(norm1_indicator, module.transformer_blocks[0]))

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s, req = item.state, item.inputs["request"]
        i, scheduler = s["i"], s["scheduler"]
        latents = self.scheduler_step(item, model_output, req.guidance_scale, s["latents"])
        if s.get("image_latents") is not None:
            # Inpainting with a plain (16-channel) transformer: keep the unmasked area on the input
            # image's noise path (scale_noise reads the scheduler's current step index).
            init_mask = s["mask"].chunk(2)[0] if item.inputs["cond"]["cfg"] else s["mask"]
            latents = self.keep_unmasked(s, latents, init_mask, lambda x, t: scheduler.scale_noise(x, t, s["noise"]))
        s["latents"] = latents
        s["i"] = i + 1

    # -- 4. decode ---------------------------------------------------------------------------
    takes_preview_vae = True

    def vae_pixels(self, vae: Any, latents: torch.Tensor, extras: dict) -> np.ndarray:
        latents = latents / vae.config.scaling_factor
        if extras.get("shift", True):
            latents = latents + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return self.postprocess(image)
