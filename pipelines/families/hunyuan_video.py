"""HunyuanVideo: a dual/single-stream 3-D DiT with embedded (distilled) guidance + Llama and CLIP text +
AutoencoderKLHunyuanVideo.

Mirrors diffusers' HunyuanVideoPipeline (text-to-video) step by step: the Llama's hidden state
num_hidden_layers_to_skip (2) layers before the last, of the prompt formatted into DEFAULT_PROMPT_TEMPLATE and
cropped by its crop_start (95), with its attention mask (256 tokens after the crop); CLIP's pooled output; the
flow-matching scheduler on sigmas linspace(1, 0, steps + 1)[:-1]; float32 latents [B, C, F, H, W]; the request's
guidance_scale (default 6) as the transformer's embedded guidance (x 1000); the decode by 1 / scaling_factor.

Guidance: guidance_scale is the distilled guidance the transformer embeds, one forward per step. True CFG (a second,
unconditional forward) runs only as diffusers runs it: request.true_cfg_scale > 1 (default 1.0) with a negative
prompt; the two halves are one batched forward here, noise = neg + true_cfg_scale * (cond - neg).

HunyuanVideo 1.5 (a Qwen2.5-VL + ByT5 text stack, a different transformer and VAE, and a cond-latent layout) is its
own family, pipelines/families/hunyuan_video15.py. Not served: HunyuanVideoImageToVideoPipeline /
HunyuanVideoFramepackPipeline; prompt_2 (diffusers' encode_prompt gives CLIP `prompt` either way), custom sigmas and
prompt templates.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import HunyuanVideoPipeline
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

from pipelines.families.speedups import norm1_indicator
from pipelines.families.video_base import VideoFamily
from pipelines.image_request import RequestError
from pipelines.video import VideoRequest, VideoTask
from stages.diffusion.block_stack import CacheSpec
from stages.stage import WorkItem


class HunyuanVideoFamily(VideoFamily):
    family = "hunyuan_video"
    class_names = ("HunyuanVideoPipeline",)
    pipelines_by_class = {"HunyuanVideoPipeline": {VideoTask.TEXT_TO_VIDEO: HunyuanVideoPipeline}}
    default_steps = 50  # HunyuanVideoPipeline.__call__ defaults
    default_guidance = 6.0  # embedded (distilled) guidance
    default_true_cfg = 1.0  # true CFG off
    request_knobs = frozenset({"true_cfg_scale"})
    default_size = (1280, 720)  # (width, height)
    default_frames = 129
    default_fps = 24.0  # HunyuanVideo's training clips and its reference sampler's output are 24 fps
    max_sequence_length = 256  # Llama tokens after the crop
    prompt_template: dict[str, Any] = DEFAULT_PROMPT_TEMPLATE  # __call__'s (Llama 3 chat headers, crop_start 95)
    clip_sequence_length = 77
    cond_keys = ("embeds", "mask", "pooled")  # [negative, prompt] rows with true CFG

    @property
    def size_factor(self) -> int:
        # check_inputs asks for multiples of 16; the transformer's patches need the latents divisible by patch_size
        return max(16, self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size)

    @property
    def frame_factor(self) -> int:
        return self.pipe.vae_scale_factor_temporal

    # -- requests -----------------------------------------------------------------------------
    @staticmethod
    def true_cfg_scale(request: VideoRequest) -> float:
        return request.true_cfg_scale if request.true_cfg_scale is not None else HunyuanVideoFamily.default_true_cfg

    def validate(self, request: VideoRequest) -> VideoRequest:
        request = super().validate(request)
        scale = self.true_cfg_scale(request)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.0 <= scale <= \
                self.video.limits.max_guidance:
            raise RequestError("true_cfg_scale", f"true_cfg_scale must be between 0 and "
                                                 f"{self.video.limits.max_guidance}; got {scale!r}")
        return replace(request, true_cfg_scale=float(scale))

    def uses_negative(self, request: VideoRequest) -> bool:
        # diffusers: do_true_cfg = true_cfg_scale > 1 and has_neg_prompt
        return self.true_cfg_scale(request) > 1.0 and request.negative_prompt is not None

    def request_rows(self, request: VideoRequest) -> int:
        return 2 if self.uses_negative(request) else 1  # guidance_scale is embedded: no CFG rows of its own

    # -- 1. text ----------------------------------------------------------------------------
    def text_key(self, text: str) -> Hashable:
        crop_start = self.prompt_template["crop_start"]
        llama = self.pipe.tokenizer(self.prompt_template["template"].format(text),
                                    max_length=self.max_sequence_length + crop_start, truncation=True).input_ids
        clip = self.pipe.tokenizer_2(text, max_length=self.clip_sequence_length, truncation=True).input_ids
        return (tuple(llama), tuple(clip))

    def encode_text(self, text: str) -> dict[str, torch.Tensor]:
        # encode_prompt: the Llama's embeddings and mask, CLIP's pooled output of the same text; __call__ casts all
        # three to the transformer's dtype
        pipe, dtype = self.pipe, self.pipe.transformer.dtype
        embeds, mask = pipe._get_llama_prompt_embeds(text, self.prompt_template, 1, device=self.device,
                                                     max_sequence_length=self.max_sequence_length)
        pooled = pipe._get_clip_prompt_embeds(text, 1, device=self.device,
                                              max_sequence_length=self.clip_sequence_length)
        # [1, 256, D], [1, 256], [1, D_clip]
        return {"embeds": embeds.to(dtype), "mask": mask.to(dtype), "pooled": pooled.to(dtype)}

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        h, w, frames = req.height, req.width, req.num_frames
        assert h is not None and w is not None and frames is not None and req.num_inference_steps is not None

        # 2.1 timesteps: retrieve_timesteps(scheduler, steps, device, sigmas=linspace(1, 0, steps + 1)[:-1])
        sigmas = np.linspace(1.0, 0.0, req.num_inference_steps + 1)[:-1]
        scheduler.set_timesteps(sigmas=sigmas, device=self.device)
        timesteps = scheduler.timesteps

        # 2.2 latents [1, C, (F - 1) // 4 + 1, H / 8, W / 8] in float32
        latents = view.prepare_latents(1, view.transformer.config.in_channels, h, w, frames, torch.float32,
                                       self.device, generator)

        # 2.3 the embedded guidance condition, in the transformer's dtype
        guidance = torch.tensor([req.guidance_scale], dtype=view.transformer.dtype, device=self.device) * 1000.0
        scheduler.set_begin_index(0)
        item.state.update(scheduler=scheduler, timesteps=timesteps, total=len(timesteps), latents=latents,
                          guidance=guidance, decode_extras={})

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        # the rotary grid follows the latents' shape; the text tokens (and so the attention mask) their length
        s, cond = item.state, item.inputs["cond"]
        return (tuple(s["latents"].shape[1:]), s["latents"].dtype, tuple(cond["embeds"].shape[1:]),
                tuple(cond["mask"].shape[1:]), tuple(cond["pooled"].shape[1:]))

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        dtype = self.pipe.transformer.dtype
        hidden, timesteps, guidance, embeds, masks, pooled, sizes = [], [], [], [], [], [], []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            t = s["timesteps"][s["i"]]
            rows = 2 if cond["cfg"] else 1
            hidden.append(torch.cat([s["latents"]] * rows).to(dtype))
            timesteps.append(t.expand(rows).to(s["latents"].dtype))
            guidance.append(s["guidance"].expand(rows))
            embeds.append(cond["embeds"])
            masks.append(cond["mask"])
            pooled.append(cond["pooled"])
            sizes.append(rows)
        batched = {"hidden_states": torch.cat(hidden), "timestep": torch.cat(timesteps),
                   "encoder_hidden_states": torch.cat(embeds), "encoder_attention_mask": torch.cat(masks),
                   "pooled_projections": torch.cat(pooled), "guidance": torch.cat(guidance)}
        return self.denoise("transformer", items, sizes, batched)

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return (*module.transformer_blocks, *module.single_transformer_blocks)

    def cache_spec(self, key: str, module) -> CacheSpec:
        # dual- then single-stream blocks, both -> (video, text); the dual blocks get the rotary positionally as
        # `freqs_cis` ([tokens, D], the same for every row)
        return dual_stream_cache_spec(key, self.repeated_blocks(module))

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s, req = item.state, item.inputs["request"]
        i = s["i"]
        noise_pred = self.guide(model_output, item.inputs["cond"]["cfg"], self.true_cfg_scale(req))
        s["latents"] = s["scheduler"].step(noise_pred, s["timesteps"][i], s["latents"], return_dict=False)[0]
        s["i"] = i + 1

    # -- 4. decode ---------------------------------------------------------------------------
    def latents_to_video(self, latents: torch.Tensor, items: list[WorkItem]) -> torch.Tensor:
        """[B, C, F, h, w] latents -> [B, 3, frames, H, W]."""
        return decode_hunyuan_latents(self.pipe.vae, latents)


def dual_stream_cache_spec(key: str, blocks: tuple) -> CacheSpec:
    """Step caching of HunyuanVideo's (and 1.5's) blocks: each -> (video, text), the first's norm1 the TeaCache input,
    the rotary passed positionally as `freqs_cis` ([tokens, D], the same for every row)."""
    return CacheSpec(key, blocks, encoder="encoder_hidden_states", out_hidden=0, out_encoder=1,
                     indicator=functools.partial(norm1_indicator, blocks[0]), shared=frozenset({"freqs_cis"}))


def decode_hunyuan_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """The HunyuanVideo pipelines' decode (1.0 and 1.5): [B, C, F, h, w] latents / scaling_factor -> [B, 3, T, H, W]."""
    return vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
