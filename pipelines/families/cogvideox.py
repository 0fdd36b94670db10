"""CogVideoX: a 3-D DiT (expert adaptive LayerNorm over text and video tokens) + T5 text + AutoencoderKLCogVideoX.

Mirrors diffusers' CogVideoXPipeline (text-to-video) step by step: T5 embeddings of 226 tokens, latents in
CogVideoX's [B, F, C, H, W] layout (frames before channels), CogVideoXDDIMScheduler or CogVideoXDPMScheduler as the
checkpoint's config says (the DPM one carries the previous step's x0 prediction and draws noise from the request's
generator), rotary embeddings when the transformer uses them, CogVideoX 1.5's padding of the latent frames to its
temporal patch (cut off again before the decode), and the decode by 1 / scaling_factor.

A CogVideoXImageToVideoPipeline checkpoint (CogVideoX-5b-I2V, 1.5-I2V) animates the request's image (VideoRequest.image,
/v1/videos' input_reference) as that pipeline's __call__ does: the image, resized to the output size, is VAE-encoded (a
draw from the request's generator), scaled, and zero-padded to the latent frames; each step its latents ride beside the
noisy ones on the channel axis (the transformer's in_channels are twice the latents'), with CogVideoX 1.5's `ofs`
embedding when the transformer has one. A request that names no frame count gets that __call__'s 49.

diffusers' use_dynamic_cfg (off by default) is not served: guidance is the request's constant guidance_scale.
"""

from __future__ import annotations

import functools
from typing import Hashable

import torch
from diffusers import CogVideoXImageToVideoPipeline, CogVideoXPipeline
from diffusers.schedulers.scheduling_dpm_cogvideox import CogVideoXDPMScheduler

from pipelines.families.video_base import VideoFamily
from pipelines.video import VideoTask
from stages.diffusion.block_stack import CacheSpec
from stages.stage import WorkItem


class CogVideoXFamily(VideoFamily):
    family = "cogvideox"
    class_names = ("CogVideoXPipeline", "CogVideoXImageToVideoPipeline")
    pipelines_by_class = {"CogVideoXPipeline": {VideoTask.TEXT_TO_VIDEO: CogVideoXPipeline},
                          "CogVideoXImageToVideoPipeline": {VideoTask.IMAGE_TO_VIDEO: CogVideoXImageToVideoPipeline}}
    default_steps = 50  # CogVideoXPipeline.__call__ defaults
    default_guidance = 6.0
    default_size = (720, 480)  # the size of the transformer's sample_width/height (the checkpoint's, see below)
    default_frames = 49
    default_fps = 8.0  # CogVideoX is trained on 8 fps clips (49 frames: 6 s + 1)
    max_sequence_length = 226

    @property
    def request_default_size(self) -> tuple[int, int]:
        # __call__: height = transformer.config.sample_height * vae_scale_factor_spatial (likewise the width)
        config, scale = self.pipe.transformer.config, self.pipe.vae_scale_factor_spatial
        return self.video.default_size or (config.sample_width * scale, config.sample_height * scale)

    @property
    def image_to_video(self) -> bool:
        """A CogVideoXImageToVideoPipeline checkpoint: its requests animate an image."""
        return isinstance(self.pipe, CogVideoXImageToVideoPipeline)

    @property
    def request_default_frames(self) -> int:
        # CogVideoXPipeline.__call__: the transformer's sample_frames; the image-to-video __call__: 49
        default = self.default_frames if self.image_to_video else self.pipe.transformer.config.sample_frames
        return self.video.default_frames or default

    @property
    def size_factor(self) -> int:
        # check_inputs asks for multiples of 8; the transformer's patches need the latents divisible by patch_size
        return self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size

    @property
    def frame_factor(self) -> int:
        return self.pipe.vae_scale_factor_temporal

    def enable_vae_tiling(self) -> None:
        """CogVideoX's VAE names its tiles by size and overlap factor, not stride."""
        if self.video.vae_tile is None:
            self.pipe.vae.enable_tiling()
            return
        tile, stride = self.video.vae_tile
        overlap = 1 - stride / tile
        self.pipe.vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile,
                                    tile_overlap_factor_height=overlap, tile_overlap_factor_width=overlap)

    # -- 1. text ----------------------------------------------------------------------------
    def encode_text(self, text: str) -> dict[str, torch.Tensor]:
        embeds = self.pipe._get_t5_prompt_embeds(text, 1, self.max_sequence_length, self.device)
        return {"embeds": embeds}  # [1, 226, D] in the text encoder's dtype, as __call__ keeps them

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        h, w, frames = req.height, req.width, req.num_frames
        assert h is not None and w is not None and frames is not None  # validate() filled them
        config = view.transformer.config

        # 2.1 timesteps
        scheduler.set_timesteps(req.num_inference_steps, device=self.device)
        timesteps = scheduler.timesteps

        # 2.2 CogVideoX 1.5 (patch_size_t): the latent frames padded up to whole temporal patches
        latent_frames = (frames - 1) // view.vae_scale_factor_temporal + 1
        additional_frames = 0
        if config.patch_size_t is not None and latent_frames % config.patch_size_t:
            additional_frames = config.patch_size_t - latent_frames % config.patch_size_t
            frames += additional_frames * view.vae_scale_factor_temporal

        # 2.3 latents [1, F, C, h, w] in the embeddings' dtype, times the scheduler's init_noise_sigma; image-to-video:
        # the image's latents (encoded with a draw from the generator, first) beside them, zero-padded to F frames
        dtype, image_latents = cond["embeds"].dtype, None
        if req.task is VideoTask.TEXT_TO_VIDEO:
            latents = view.prepare_latents(1, config.in_channels, frames, h, w, dtype, self.device, generator)
        else:
            image = view.video_processor.preprocess(req.image, height=h, width=w).to(self.device, dtype=dtype)
            with self._vae_lock:
                latents, image_latents = view.prepare_latents(image, 1, config.in_channels // 2, frames, h, w, dtype,
                                                              self.device, generator)

        # 2.4 rotary embeddings of the (latent frames, height, width) grid: one pair for every request of this shape
        rotary = None
        if config.use_rotary_positional_embeddings:
            rotary = view._prepare_rotary_positional_embeddings(h, w, latents.size(1), self.device)
        # 2.5 CogVideoX 1.5 I2V: the `ofs` embedding's input, one value for every row
        ofs = None if image_latents is None or config.ofs_embed_dim is None else latents.new_full((1,), 2.0)
        item.state.update(scheduler=scheduler, timesteps=timesteps, total=len(timesteps), latents=latents,
                          image_latents=image_latents, ofs=ofs,
                          rotary=rotary, generator=generator, old_pred_original_sample=None,
                          decode_extras={"additional_frames": additional_frames})

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        s, cond = item.state, item.inputs["cond"]
        return (tuple(s["latents"].shape[1:]), s["latents"].dtype, tuple(cond["embeds"].shape[1:]),
                s["rotary"] is not None, s["image_latents"] is not None, s["ofs"] is not None)

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        hidden, timesteps, embeds, sizes = [], [], [], []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            t = s["timesteps"][s["i"]]
            rows = 2 if cond["cfg"] else 1
            x = s["scheduler"].scale_model_input(torch.cat([s["latents"]] * rows), t)
            if s["image_latents"] is not None:  # image-to-video: [rows, F, 2C, h, w]
                x = torch.cat([x, torch.cat([s["image_latents"]] * rows)], dim=2)
            hidden.append(x)
            timesteps.append(t.expand(rows))
            embeds.append(cond["embeds"])
            sizes.append(rows)
        batched = {"hidden_states": torch.cat(hidden), "encoder_hidden_states": torch.cat(embeds),
                   "timestep": torch.cat(timesteps)}
        shared = {"image_rotary_emb": items[0].state["rotary"]}  # equal for every item of one denoise key
        if items[0].state["ofs"] is not None:
            shared["ofs"] = items[0].state["ofs"]
        return [out.float() for out in self.denoise("transformer", items, sizes, batched, shared)]

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return tuple(module.transformer_blocks)

    def cache_spec(self, key: str, module) -> CacheSpec:
        # expert blocks -> (video, text); after them only the video tokens are read (norm_final is per token)
        return CacheSpec(key, self.repeated_blocks(module), encoder="encoder_hidden_states", out_hidden=0,
                         out_encoder=1, indicator=functools.partial(_modulated_input, module.transformer_blocks[0]))

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s, req = item.state, item.inputs["request"]
        i, scheduler, timesteps = s["i"], s["scheduler"], s["timesteps"]
        dtype = s["latents"].dtype
        noise_pred = self.guide(model_output, item.inputs["cond"]["cfg"], req.guidance_scale)
        # prepare_extra_step_kwargs: eta 0 and the request's generator
        if isinstance(scheduler, CogVideoXDPMScheduler):
            latents, s["old_pred_original_sample"] = scheduler.step(
                noise_pred, s["old_pred_original_sample"], timesteps[i], timesteps[i - 1] if i > 0 else None,
                s["latents"], eta=0.0, generator=s["generator"], return_dict=False)
        else:
            latents = scheduler.step(noise_pred, timesteps[i], s["latents"], eta=0.0, generator=s["generator"],
                                     return_dict=False)[0]
        s["latents"] = latents.to(dtype)
        s["i"] = i + 1

    # -- 4. decode ---------------------------------------------------------------------------
    def latents_to_video(self, latents: torch.Tensor, items: list[WorkItem]) -> torch.Tensor:
        """[B, F, C, h, w] latents -> [B, 3, frames, H, W] (decode_latents, after the padding frames are cut)."""
        vae = self.pipe.vae
        latents = latents[:, items[0].inputs["decode_extras"]["additional_frames"]:]
        latents = latents.permute(0, 2, 1, 3, 4)  # [B, C, F, h, w]
        latents = 1 / self.pipe.vae_scaling_factor_image * latents
        return vae.decode(latents.to(vae.dtype)).sample


def _modulated_input(block, args: dict) -> torch.Tensor:
    """TeaCache's input for CogVideoX: block 0's video tokens through its norm1 (LayerNorm modulated by temb)."""
    return block.norm1(args["hidden_states"], args["encoder_hidden_states"], args["temb"])[0]
