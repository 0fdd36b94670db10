"""LTX-Video: a 3-D DiT on packed video latents + T5 text + AutoencoderKLLTXVideo (temporal VAE).

Mirrors diffusers' LTXPipeline (text-to-video) and LTXImageToVideoPipeline (image-to-video), which
share one checkpoint: image-to-video pins the first latent frame to the encoded reference image
(its tokens get timestep 0, and the scheduler never moves them). The frame rate enters the
transformer (its RoPE interpolation scale), so it is part of the denoise batch key.
"""

from __future__ import annotations

import functools
from typing import Hashable

import numpy as np
import torch
from diffusers import LTXImageToVideoPipeline, LTXPipeline
from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift, retrieve_timesteps

from pipelines.families.video_base import VideoFamily
from pipelines.video import VideoTask
from stages.diffusion.block_stack import CacheSpec
from stages.diffusion.step_cache import TEACACHE_COEFFICIENTS
from stages.stage import WorkItem


class LTXFamily(VideoFamily):
    family = "ltx"
    class_names = ("LTXPipeline", "LTXImageToVideoPipeline")
    _both = {VideoTask.TEXT_TO_VIDEO: LTXPipeline, VideoTask.IMAGE_TO_VIDEO: LTXImageToVideoPipeline}
    pipelines_by_class = {"LTXPipeline": _both,
                          "LTXImageToVideoPipeline": dict(reversed(list(_both.items())))}
    default_steps = 50  # LTXPipeline.__call__ defaults
    default_guidance = 3.0
    default_size = (704, 512)
    default_frames = 161
    default_fps = 25.0
    max_sequence_length = 128
    cond_keys = ("embeds", "mask")  # [1, L, D], bool [1, L]

    @property
    def size_factor(self) -> int:
        return 32  # LTXPipeline.check_inputs: height and width divisible by 32

    @property
    def frame_factor(self) -> int:
        return self.pipe.vae_temporal_compression_ratio

    # -- 1. text ----------------------------------------------------------------------------
    def encode_text(self, text: str) -> dict[str, torch.Tensor]:
        embeds, mask = self.pipe._get_t5_prompt_embeds(text, 1, self.max_sequence_length, self.device)
        return {"embeds": embeds, "mask": mask}  # [1, L, D], bool [1, L]

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        h, w, frames = req.height, req.width, req.num_frames
        assert h is not None and w is not None and frames is not None  # validate() filled them
        channels = view.transformer.config.in_channels

        # 2.1 packed latents [1, tokens, C]; image-to-video: the first frame is the reference's
        if req.task is VideoTask.TEXT_TO_VIDEO:
            latents = view.prepare_latents(1, channels, h, w, frames, torch.float32, self.device, generator)
            conditioning_mask = None
        else:
            image = view.video_processor.preprocess(req.image, height=h, width=w).to(self.device,
                                                                                     dtype=cond["embeds"].dtype)
            with self._vae_lock:
                latents, conditioning_mask = view.prepare_latents(image, 1, channels, h, w, frames, torch.float32,
                                                                  self.device, generator)

        # 2.2 timesteps: flow-matching sigmas shifted by mu from the video's token count
        t_ratio, s_ratio = view.vae_temporal_compression_ratio, view.vae_spatial_compression_ratio
        grid = ((frames - 1) // t_ratio + 1, h // s_ratio, w // s_ratio)  # latent frames, height, width
        steps = req.num_inference_steps
        assert steps is not None  # validate() filled it
        mu = calculate_shift(grid[0] * grid[1] * grid[2], scheduler.config.get("base_image_seq_len", 256),
                             scheduler.config.get("max_image_seq_len", 4096), scheduler.config.get("base_shift", 0.5),
                             scheduler.config.get("max_shift", 1.15))
        # diffusers annotates sigmas as list[float]; its own LTX pipeline passes a numpy array
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, None,
                                          sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)  # type: ignore[arg-type]
        scheduler.set_begin_index(0)  # the loop starts at the first timestep (diffusers finds it by value)

        # 2.3 the frame rate scales the temporal RoPE
        rope_scale = (t_ratio / req.fps, s_ratio, s_ratio)
        item.state.update(scheduler=scheduler, timesteps=timesteps, total=len(timesteps), latents=latents,
                          conditioning_mask=conditioning_mask, grid=grid, rope_scale=rope_scale,
                          decode_extras={"grid": grid})

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        s, cond = item.state, item.inputs["cond"]
        return (s["grid"], s["rope_scale"], tuple(s["latents"].shape[1:]), s["latents"].dtype,
                tuple(cond["embeds"].shape[1:]), s["conditioning_mask"] is not None)

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        hidden, timesteps, embeds, masks, sizes = [], [], [], [], []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            rows = 2 if cond["cfg"] else 1
            timestep = s["timesteps"][s["i"]].expand(rows)
            if s["conditioning_mask"] is not None:  # the reference frame's tokens sit at t = 0
                timestep = timestep.unsqueeze(-1) * (1 - torch.cat([s["conditioning_mask"]] * rows))
            hidden.append(torch.cat([s["latents"]] * rows).to(cond["embeds"].dtype))
            timesteps.append(timestep)
            embeds.append(cond["embeds"])
            masks.append(cond["mask"])
            sizes.append(rows)
        frames, height, width = items[0].state["grid"]
        batched = {"hidden_states": torch.cat(hidden), "encoder_hidden_states": torch.cat(embeds),
                   "timestep": torch.cat(timesteps), "encoder_attention_mask": torch.cat(masks)}
        shared = {"num_frames": frames, "height": height, "width": width,
                  "rope_interpolation_scale": items[0].state["rope_scale"]}
        return [out.float() for out in self.denoise("transformer", items, sizes, batched, shared)]

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return tuple(module.transformer_blocks)

    def cache_spec(self, key: str, module) -> CacheSpec:
        return CacheSpec(key, self.repeated_blocks(module),
                         indicator=functools.partial(_modulated_input, module.transformer_blocks[0]),
                         coefficients=TEACACHE_COEFFICIENTS["ltx"])

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s, req = item.state, item.inputs["request"]
        i, t = s["i"], s["timesteps"][s["i"]]
        if s["conditioning_mask"] is None:
            s["latents"] = self.scheduler_step(item, model_output, req.guidance_scale, s["latents"])
        else:  # step every latent frame but the first (the reference's)
            noise_pred = self.guide(model_output, item.inputs["cond"]["cfg"], req.guidance_scale)
            pipe, grid = self.pipe, s["grid"]
            p, pt = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
            noise_pred = pipe._unpack_latents(noise_pred, *grid, p, pt)
            latents = pipe._unpack_latents(s["latents"], *grid, p, pt)
            stepped = s["scheduler"].step(noise_pred[:, :, 1:], t, latents[:, :, 1:], return_dict=False)[0]
            s["latents"] = pipe._pack_latents(torch.cat([latents[:, :, :1], stepped], dim=2), p, pt)
        s["i"] = i + 1

    # -- 4. decode ---------------------------------------------------------------------------
    def latents_to_video(self, latents: torch.Tensor, items: list[WorkItem]) -> torch.Tensor:
        pipe, vae = self.pipe, self.pipe.vae
        grid = items[0].inputs["decode_extras"]["grid"]
        latents = pipe._unpack_latents(latents, *grid, pipe.transformer_spatial_patch_size,
                                       pipe.transformer_temporal_patch_size)
        latents = pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        latents = latents.to(vae.dtype)
        # decode_timestep 0 and decode_noise_scale 0 (the pipelines' defaults): the latents are decoded as they are.
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.zeros(latents.shape[0], device=latents.device, dtype=latents.dtype)
        return vae.decode(latents, timestep, return_dict=False)[0]


def _modulated_input(block, args: dict) -> torch.Tensor:
    """TeaCache4LTX-Video's input: block 0's norm1(x) * (1 + scale_msa) + shift_msa."""
    hidden, temb = args["hidden_states"], args["temb"]
    n = block.scale_shift_table.shape[0]
    ada = block.scale_shift_table[None, None].to(temb.device) + temb.reshape(hidden.shape[0], temb.size(1), n, -1)
    shift_msa, scale_msa = ada[:, :, 0], ada[:, :, 1]
    return block.norm1(hidden) * (1 + scale_msa) + shift_msa
