"""Qwen-Image: an MMDiT on packed latents, a Qwen2.5-VL text encoder, a 3-D VAE (AutoencoderKLQwenImage).

Mirrors diffusers' QwenImagePipeline (text-to-image) step by step. What differs from FLUX.1 (flux.py):

* the prompt is wrapped in the pipeline's chat template and run through the Qwen2.5-VL language model; the last
  hidden states lose the template's first `prompt_template_encode_start_idx` tokens and are cut to
  request.extra['max_sequence_length'] (the pipeline's 512; at most 1024). Prompts are not padded: each has its
  own length, and a single prompt has no mask (encode_prompt drops an all-ones mask);
* no pooled embedding, no text / image ids: the transformer takes `img_shapes` (RoPE) and an optional
  `encoder_hidden_states_mask`;
* guidance is *true* CFG: the request's guidance_scale is the pipeline's `true_cfg_scale` (default 4.0), and it
  applies only when the request has a negative prompt (and the scale is above 1). The guided prediction is rescaled
  to the conditional prediction's norm (per token) before the scheduler step;
* decode de-normalises with the VAE's latents_mean / latents_std and decodes one frame of the 3-D VAE.

Step-level batching: the prompt and the negative prompt of one request may differ in length; one forward takes them
padded to a common length with a mask (the pipeline runs two unpadded forwards: a mask moves the result by float
error only, ~1e-7). Requests share forwards when their latent grid, their padded text length and whether they need
a mask are equal, so that a request's numerics never depend on who else is in the batch.
"""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

from pipelines.families.base import ImageFamily, PackedLatents
from pipelines.image_request import ImageLimits, ImageRequest, RequestError, Task
from stages.stage import WorkItem

MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default
SEQUENCE_LIMIT = 1024  # its check_inputs' upper limit


class QwenImageFamily(PackedLatents, ImageFamily):
    family = "qwen_image"
    class_names = ("QwenImagePipeline",)
    pipeline_classes = {Task.TEXT_TO_IMAGE: QwenImagePipeline}
    default_steps = 50  # QwenImagePipeline.__call__ num_inference_steps
    default_guidance = 4.0  # its true_cfg_scale (applies with a negative prompt only)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.refuse_guidance_embeds("Qwen-Image")

    # -- request knobs (request.extra) --------------------------------------------------------
    @staticmethod
    def max_sequence_length(request: ImageRequest) -> int:
        return int(request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))

    def validate(self, request: ImageRequest, limits: ImageLimits) -> ImageRequest:
        request = super().validate(request, limits)
        msl = request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH)
        if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= SEQUENCE_LIMIT:
            raise RequestError("max_sequence_length",
                               f"max_sequence_length must be an integer between 1 and {SEQUENCE_LIMIT}; got {msl!r}")
        return request

    def uses_negative(self, request: ImageRequest) -> bool:
        # diffusers: do_true_cfg = true_cfg_scale > 1 and has_neg_prompt
        assert request.guidance_scale is not None  # validate() filled it
        return request.guidance_scale > 1.0 and request.negative_prompt is not None

    def request_rows(self, request: ImageRequest) -> int:
        return request.n * (2 if self.uses_negative(request) else 1)  # no CFG batch without a negative prompt

    # -- 1. text ----------------------------------------------------------------------------
    def text_options(self, request: ImageRequest) -> dict:
        return {"max_sequence_length": self.max_sequence_length(request)}

    def _template_tokens(self, text: str) -> Any:
        pipe = self.pipe  # as _get_qwen_prompt_embeds tokenizes
        return pipe.tokenizer([pipe.prompt_template_encode.format(text)],
                              max_length=pipe.tokenizer_max_length + pipe.prompt_template_encode_start_idx,
                              padding=True, truncation=True, return_tensors="pt")

    def text_key(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> Hashable:
        return tuple(self._template_tokens(text).input_ids[0].tolist())

    def encode_text(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> dict[str, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(text, self.device, 1, max_sequence_length=max_sequence_length)
        assert mask is None  # one prompt: no padding, encode_prompt drops the all-ones mask
        return {"embeds": embeds}  # [1, L, D]: the template's system part dropped, at most max_sequence_length

    def conditioning(self, prompt: dict, negative: dict | None, request: ImageRequest) -> dict[str, Any]:
        n = request.n
        # As encode_prompt's num_images_per_prompt repeat (batch 1: repeat(n, ...) is the same layout).
        embeds = prompt["embeds"].repeat(n, 1, 1)  # [n, Lp, D]
        if negative is None:
            return {"embeds": embeds, "mask": None, "cfg": False}
        neg = negative["embeds"].repeat(n, 1, 1)  # [n, Ln, D]
        length = max(embeds.shape[1], neg.shape[1])
        mask = None
        if embeds.shape[1] != neg.shape[1]:  # one forward holds both: pad the shorter, mask its padding
            mask = torch.cat([_valid(neg, length), _valid(embeds, length)])  # [2n, L]
            embeds, neg = _padded(embeds, length), _padded(neg, length)
        # [negative x n, prompt x n]: the (uncond, cond) order of the other families
        return {"embeds": torch.cat([neg, embeds]), "mask": mask, "cfg": True}

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        h, w = req.height, req.width
        assert h is not None and w is not None  # validate() filled them

        # 2.1 latents: packed noise [n, L, 4C], in the prompt embeddings' dtype
        channels = view.transformer.config.in_channels // 4
        latents = view.prepare_latents(req.n, channels, h, w, cond["embeds"].dtype, self.device, generator)

        # 2.2 timesteps: flow-matching sigmas, shifted by mu from the image's token count
        steps = req.num_inference_steps
        assert steps is not None  # validate() filled it
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            latents.shape[1],
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        # diffusers annotates sigmas as list[float]; its own pipeline passes this numpy array
        timesteps, steps = retrieve_timesteps(scheduler, steps, self.device,
                                              sigmas=sigmas, mu=mu)  # type: ignore[arg-type]
        scheduler.set_begin_index(0)

        # 2.3 the RoPE grid of one image: (frames, latent rows / 2, latent columns / 2)
        grid = (1, h // self.vae_scale_factor // 2, w // self.vae_scale_factor // 2)
        item.state.update(scheduler=scheduler, timesteps=timesteps, total=len(timesteps), latents=latents,
                          grid=grid, decode_extras={"height": h, "width": w})

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        s, cond = item.state, item.inputs["cond"]
        # img_shapes is one per forward (the grid); the text length and the mask are the request's own, so that
        # batching never pads (or masks) a request more than it is when alone
        return (s["grid"], tuple(s["latents"].shape[1:]), s["latents"].dtype, tuple(cond["embeds"].shape[1:]),
                cond["mask"] is not None)

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        hidden, timesteps, embeds, masks, sizes = [], [], [], [], []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            t = s["timesteps"][s["i"]]
            x = torch.cat([s["latents"]] * 2) if cond["cfg"] else s["latents"]  # [rows, L, 4C]
            hidden.append(x)
            timesteps.append(t.expand(x.shape[0]).to(x.dtype))  # per-sample: items sit at different steps
            embeds.append(cond["embeds"])
            masks.append(cond["mask"])
            sizes.append(x.shape[0])
        batched = {"hidden_states": torch.cat(hidden), "timestep": torch.cat(timesteps) / 1000,
                   "encoder_hidden_states": torch.cat(embeds),
                   "encoder_hidden_states_mask": torch.cat(masks) if masks[0] is not None else None}
        # one image shape for every row (the grid is in the key); the transformer reads the first entry
        shared = {"img_shapes": [[items[0].state["grid"]]] * sum(sizes)}
        return self.denoise("transformer", items, sizes, batched, shared)

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return tuple(module.transformer_blocks)

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s, req = item.state, item.inputs["request"]
        if not item.inputs["cond"]["cfg"]:
            s["latents"] = self.scheduler_step(item, model_output, 1.0, s["latents"])
        else:
            noise_pred = true_cfg(model_output, req.guidance_scale)
            s["latents"] = s["scheduler"].step(noise_pred, s["timesteps"][s["i"]], s["latents"], return_dict=False)[0]
        s["i"] += 1

    # -- 4. decode ---------------------------------------------------------------------------
    def latents_to_pixels(self, latents: torch.Tensor, extras: dict) -> np.ndarray:
        pipe, vae = self.pipe, self.pipe.vae
        latents = pipe._unpack_latents(latents, extras["height"], extras["width"], pipe.vae_scale_factor)
        latents = latents.to(vae.dtype)  # [N, C, 1, H, W]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        latents_mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = latents / latents_std + latents_mean
        image = vae.decode(latents, return_dict=False)[0][:, :, 0]  # the one frame: [N, 3, H, W]
        return self.postprocess(image)


def true_cfg(model_output: torch.Tensor, scale: float) -> torch.Tensor:
    """The pipeline's true CFG over [uncond x n, cond x n]: the guided prediction at the conditional one's norm."""
    neg_noise_pred, noise_pred = model_output.chunk(2)
    comb_pred = neg_noise_pred + scale * (noise_pred - neg_noise_pred)
    cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
    noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
    return comb_pred * (cond_norm / noise_norm)


def _padded(embeds: torch.Tensor, length: int) -> torch.Tensor:
    """[n, L, D] -> [n, length, D], zeros after (as _get_qwen_prompt_embeds pads a batch of prompts)."""
    return torch.cat([embeds, embeds.new_zeros(embeds.shape[0], length - embeds.shape[1], embeds.shape[2])], dim=1)


def _valid(embeds: torch.Tensor, length: int) -> torch.Tensor:
    """The mask of `embeds` padded to `length`: 1 on its own tokens, 0 after. [n, length]"""
    mask = torch.zeros(embeds.shape[0], length, dtype=torch.long, device=embeds.device)
    mask[:, :embeds.shape[1]] = 1
    return mask
