"""Wan 2.1 / 2.2: a 3-D DiT on video latents + UMT5 text + AutoencoderKLWan (temporal VAE).

Mirrors diffusers' WanPipeline (text-to-video) and WanImageToVideoPipeline (image-to-video) step
by step. A checkpoint serves what its own pipeline class serves: a WanPipeline checkpoint makes
videos from text, a WanImageToVideoPipeline one from an image (its transformer reads the
latents beside the encoded first frame and its mask). Also followed: Wan 2.1 I2V's CLIP image
embeddings (transformer.config.image_dim), Wan 2.2's second low-noise transformer
(boundary_ratio) and Wan 2.2 TI2V's per-token timesteps (expand_timesteps).

diffusers runs the conditional and unconditional halves of CFG as two forwards; here they are
two halves of one batched forward (the same math).
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from diffusers.pipelines.wan.pipeline_wan import prompt_clean

from pipelines.families.video_base import VideoFamily
from pipelines.parallel_vae import decode_tile, parallel_tiled_decode, tiles_apply
from pipelines.video import VideoTask
from stages.diffusion.block_stack import CacheSpec
from stages.diffusion.step_cache import TEACACHE_COEFFICIENTS
from stages.stage import WorkItem


class WanFamily(VideoFamily):
    family = "wan"
    class_names = ("WanPipeline", "WanImageToVideoPipeline")
    pipelines_by_class = {
        "WanPipeline": {VideoTask.TEXT_TO_VIDEO: WanPipeline},
        "WanImageToVideoPipeline": {VideoTask.IMAGE_TO_VIDEO: WanImageToVideoPipeline},
    }
    default_steps = 50  # WanPipeline.__call__ defaults
    default_guidance = 5.0
    default_size = (832, 480)
    default_frames = 81
    default_fps = 16.0  # Wan 2.1 is trained on 16 fps clips
    max_sequence_length = 512

    def extra_variants(self, base) -> dict[VideoTask, type]:
        # Wan 2.2 TI2V: one WanPipeline checkpoint (expand_timesteps) also animates an image.
        # diffusers' lazy exports are dummy classes to mypy: `config` is unknown on them
        if isinstance(base, WanPipeline) and base.config.expand_timesteps:  # type: ignore[attr-defined]
            return {VideoTask.IMAGE_TO_VIDEO: WanImageToVideoPipeline}
        return {}

    @property
    def size_factor(self) -> int:
        patch = (self.pipe.transformer or self.pipe.transformer_2).config.patch_size
        return self.pipe.vae_scale_factor_spatial * max(patch[1], patch[2])

    @property
    def frame_factor(self) -> int:
        return self.pipe.vae_scale_factor_temporal

    # -- 1. text ----------------------------------------------------------------------------
    def text_key(self, text: str) -> Hashable:
        return super().text_key(prompt_clean(text))  # what the encoder tokenizes (html-unescaped, spaces folded)

    def encode_text(self, text: str) -> dict[str, torch.Tensor]:
        # WanPipeline's encoder (WanImageToVideoPipeline's is the same but calls ftfy unguarded).
        embeds = WanPipeline._get_t5_prompt_embeds(self.pipe, text, 1, self.max_sequence_length, self.device)
        return {"embeds": embeds.to(self._transformer_dtype)}  # [1, L, D], zero past the prompt's tokens

    @property
    def _transformer_dtype(self):
        return (self.pipe.transformer or self.pipe.transformer_2).dtype

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        h, w, frames = req.height, req.width, req.num_frames
        state: dict[str, Any] = {"scheduler": scheduler, "image_embeds": None, "condition": None,
                                 "first_frame_mask": None,
                                 "decode_extras": {"height": h, "width": w, "num_frames": frames}}

        # 2.1 Wan 2.1 I2V: CLIP embeddings of the reference image
        transformer = view.transformer
        if (req.task is VideoTask.IMAGE_TO_VIDEO and transformer is not None
                and transformer.config.image_dim is not None):
            state["image_embeds"] = view.encode_image(req.image, self.device).to(self._transformer_dtype)

        # 2.2 timesteps
        scheduler.set_timesteps(req.num_inference_steps, device=self.device)
        timesteps = scheduler.timesteps

        # 2.3 latents (image-to-video: plus the encoded first frame and its mask)
        if req.task is VideoTask.TEXT_TO_VIDEO:
            channels = (transformer or view.transformer_2).config.in_channels
            latents = view.prepare_latents(1, channels, h, w, frames, torch.float32, self.device, generator)
            if view.config.expand_timesteps:
                state["first_frame_mask"] = torch.ones(latents.shape, dtype=torch.float32, device=self.device)
        else:
            image = view.video_processor.preprocess(req.image, height=h, width=w).to(self.device, dtype=torch.float32)
            with self._vae_lock:
                outputs = view.prepare_latents(image, 1, view.vae.config.z_dim, h, w, frames, torch.float32,
                                               self.device, generator, None, None)
            latents, state["condition"] = outputs[0], outputs[1]
            if view.config.expand_timesteps:
                state["first_frame_mask"] = outputs[2]
        scheduler.set_begin_index(0)

        # 2.4 Wan 2.2: the low-noise transformer takes over below the boundary timestep
        ratio = view.config.boundary_ratio
        state["boundary"] = ratio * scheduler.config.num_train_timesteps if ratio is not None else None
        state.update(timesteps=timesteps, total=len(timesteps), latents=latents)
        item.state.update(state)

    def _stage_model(self, item: WorkItem) -> str:
        s = item.state
        t = s["timesteps"][s["i"]]
        return "transformer" if s["boundary"] is None or t >= s["boundary"] else "transformer_2"

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        s, cond = item.state, item.inputs["cond"]
        return (self._stage_model(item), tuple(s["latents"].shape[1:]), s["latents"].dtype,
                tuple(cond["embeds"].shape[1:]), s["condition"] is not None, s["image_embeds"] is not None,
                s["first_frame_mask"] is not None)

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        hidden, timesteps, embeds, image_embeds, sizes = [], [], [], [], []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            t = s["timesteps"][s["i"]]
            rows = 2 if cond["cfg"] else 1
            latents, mask = s["latents"], s["first_frame_mask"]
            if mask is not None:  # TI2V: the first frame stays the reference's; per-token timesteps
                x = (1 - mask) * s["condition"] + mask * latents if s["condition"] is not None else latents
                timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(rows, -1)
            else:
                x = torch.cat([latents, s["condition"]], dim=1) if s["condition"] is not None else latents
                timestep = t.expand(rows)
            hidden.append(torch.cat([x] * rows).to(self._transformer_dtype))
            timesteps.append(timestep)
            embeds.append(cond["embeds"])
            if s["image_embeds"] is not None:
                image_embeds.append(torch.cat([s["image_embeds"]] * rows))
            sizes.append(rows)
        batched = {"hidden_states": torch.cat(hidden), "timestep": torch.cat(timesteps),
                   "encoder_hidden_states": torch.cat(embeds),
                   "encoder_hidden_states_image": torch.cat(image_embeds) if image_embeds else None}
        return self.denoise(self._stage_model(items[0]), items, sizes, batched)

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer", "transformer_2")  # Wan 2.2: the low-noise expert is a second stack

    def repeated_blocks(self, module) -> tuple:
        return tuple(module.blocks)

    def cache_spec(self, key: str, module) -> CacheSpec:
        # TeaCache4Wan2.1's "ret steps" mode: the indicator is the timestep projection e0 (the blocks'
        # temb), the first five steps always run; the polynomial follows the model size (1.3B: dim 1536).
        dim = module.config.num_attention_heads * module.config.attention_head_dim
        coefficients = TEACACHE_COEFFICIENTS["wan-1.3b" if dim <= 1536 else "wan-14b"]
        return CacheSpec(key, self.repeated_blocks(module), indicator=_timestep_projection, coefficients=coefficients,
                         first_steps=5)

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s, req = item.state, item.inputs["request"]
        i = s["i"]
        noise_pred = self.guide(model_output, item.inputs["cond"]["cfg"], req.guidance_scale)
        s["latents"] = s["scheduler"].step(noise_pred, s["timesteps"][i], s["latents"], return_dict=False)[0]
        s["i"] = i + 1
        if s["i"] == s["total"] and s["first_frame_mask"] is not None and s["condition"] is not None:
            mask = s["first_frame_mask"]  # TI2V: the decoded first frame is the reference
            s["latents"] = (1 - mask) * s["condition"] + mask * s["latents"]

    # -- 4. decode ---------------------------------------------------------------------------
    def latents_to_video(self, latents: torch.Tensor, items: list[WorkItem]) -> torch.Tensor:
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                            latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                                     latents.dtype)
        z = latents / inv_std + mean
        if self.parallel.vae and self.ranks is not None and tiles_apply(vae, z):  # the tiles over the ranks
            if vae.use_slicing:  # one video at a time, as vae.decode slices a batch
                return torch.cat([parallel_tiled_decode(self, one) for one in z.split(1)])
            return parallel_tiled_decode(self, z)
        return vae.decode(z, return_dict=False)[0]

    def decode_vae_tile(self, key: str, z: torch.Tensor) -> torch.Tensor:
        """A rank's part of the parallel VAE decode: one tile (pipelines/parallel_vae.py)."""
        return decode_tile(self.pipe.vae, z)


def _timestep_projection(args: dict) -> torch.Tensor:
    return args["temb"]
