"""Z-Image: a single-stream DiT over [image tokens, caption tokens], a Qwen3 text encoder, flow-matching Euler.

Mirrors diffusers' ZImagePipeline (text-to-image) step by step. What differs from the other image families:

* the prompt is wrapped in the tokenizer's chat template (one user message, add_generation_prompt, enable_thinking),
  padded to request.extra['max_sequence_length'] (the pipeline's 512), and the encoder's second-to-last hidden state
  is kept for the prompt's own tokens only: every caption has its own length, no mask;
* the transformer takes *lists*: one latent [C, 1, h, w] and one caption [L, D] per row, padded inside (captions to
  multiples of 32, the unified sequence to the batch's longest with an attention mask). It is called with the
  timestep (1000 - t) / 1000 and predicts the negated flow: the pipeline negates it before the scheduler step;
* CFG whenever guidance_scale > 0 (default 5.0) as `pos + scale * (pos - neg)`, the negative prompt "" unless given,
  rows in the pipeline's order [prompt x n, negative x n]. request.extra knobs, with the pipeline's defaults:
  `cfg_normalization` (False; a number > 0 caps each guided sample's norm at that multiple of the conditional
  one's) and `cfg_truncation` (1.0; steps whose (1000 - t) / 1000 exceeds it run without CFG, one row per image);
* sigmas linspace(1, 1 / steps), shifted by mu from the image's token count (the scheduler applies mu only with
  dynamic shifting), begin index 0; latents are float32 whatever the model's dtype;
* decode: latents / scaling_factor + shift_factor through the AutoencoderKL.

Step-level batching: a row's numerics depend on its own caption length (padded to 32), on the length every row of
the forward is padded to and on whether an attention mask exists. Requests share a forward when their latent shape,
the longest padded caption of the rows they run this step and whether their rows differ in length are equal: each
row is then padded and masked exactly as when its request runs alone. The key is taken per step (a request's rows
change when cfg_truncation ends its guidance).
"""

from __future__ import annotations

import functools
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import ZImagePipeline
from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF
from diffusers.pipelines.z_image.pipeline_z_image import (
    calculate_shift,
    get_default_z_image_sigmas,
    retrieve_timesteps,
)
from torch.nn.utils.rnn import pad_sequence

from pipelines.families.base import ImageFamily
from pipelines.image_request import ImageLimits, ImageRequest, RequestError, Task
from stages.diffusion.block_stack import CacheSpec
from stages.stage import WorkItem

MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline.__call__'s default
DEFAULT_SIZE = 1024  # __call__: height = height or 1024
CFG_TRUNCATION = 1.0  # __call__'s default: never truncates ((1000 - t) / 1000 < 1)


class ZImageFamily(ImageFamily):
    family = "z_image"
    class_names = ("ZImagePipeline",)
    pipeline_classes = {Task.TEXT_TO_IMAGE: ZImagePipeline}
    default_steps = 50  # ZImagePipeline.__call__ num_inference_steps
    default_guidance = 5.0  # its guidance_scale (CFG whenever > 0)
    request_knobs = frozenset({"max_sequence_length", "cfg_normalization", "cfg_truncation"})

    @property
    def default_size(self) -> int:
        return DEFAULT_SIZE

    @property
    def size_factor(self) -> int:
        return self.vae_scale_factor * 2  # __call__: height and width divisible by vae_scale_factor * 2

    # -- request knobs (request.extra) --------------------------------------------------------
    @staticmethod
    def max_sequence_length(request: ImageRequest) -> int:
        return int(request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))

    @staticmethod
    def cfg_normalization(request: ImageRequest) -> float:
        return float(request.extra.get("cfg_normalization", False))  # as __call__'s float(cfg_normalization)

    @staticmethod
    def cfg_truncation(request: ImageRequest) -> float | None:
        value = request.extra.get("cfg_truncation", CFG_TRUNCATION)
        return None if value is None else float(value)

    def sequence_limit(self) -> int:
        # ours (the pipeline sets none): caption positions and the image's after them fit the RoPE table
        return self.pipe.transformer.config.axes_lens[0] - 2 * SEQ_MULTI_OF

    def validate(self, request: ImageRequest, limits: ImageLimits) -> ImageRequest:
        request = super().validate(request, limits)
        extra, limit = request.extra, self.sequence_limit()
        msl = extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH)
        if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= limit:
            raise RequestError("max_sequence_length",
                               f"max_sequence_length must be an integer between 1 and {limit}; got {msl!r}")
        norm = extra.get("cfg_normalization", False)
        if not isinstance(norm, (bool, int, float)) or not 0 <= float(norm) <= 1000:
            raise RequestError("cfg_normalization",
                               f"cfg_normalization must be a boolean or a number between 0 and 1000; got {norm!r}")
        trunc = extra.get("cfg_truncation", CFG_TRUNCATION)
        if trunc is not None and (isinstance(trunc, bool) or not isinstance(trunc, (int, float))
                                  or not 0 <= trunc <= 1000):
            raise RequestError("cfg_truncation",
                               f"cfg_truncation must be a number between 0 and 1000 (or null); got {trunc!r}")
        return request

    def uses_negative(self, request: ImageRequest) -> bool:
        assert request.guidance_scale is not None  # validate() filled it
        return request.guidance_scale > 0  # ZImagePipeline.do_classifier_free_guidance

    # -- 1. text ----------------------------------------------------------------------------
    def text_options(self, request: ImageRequest) -> dict:
        return {"max_sequence_length": self.max_sequence_length(request)}

    def text_key(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> Hashable:
        tokenizer = self.pipe.tokenizer  # as _encode_prompt templates and tokenizes (its padding is masked off)
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=True)
        tokens = tokenizer([templated], max_length=max_sequence_length, truncation=True)
        return tuple(tokens.input_ids[0])

    def encode_text(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> dict[str, torch.Tensor]:
        # one prompt padded to max_length alone is what the pipeline's batch gives it
        (embeds,) = self.pipe._encode_prompt([text], self.device, max_sequence_length=max_sequence_length)
        return {"embeds": embeds}  # [L, D]: the prompt's own tokens, no padding

    def conditioning(self, prompt: dict, negative: dict | None, request: ImageRequest) -> dict[str, Any]:
        # captions per row, as __call__ repeats them for num_images_per_prompt: [prompt x n] (+ [negative x n])
        return {"prompt": [prompt["embeds"]] * request.n,
                "negative": None if negative is None else [negative["embeds"]] * request.n,
                "cfg": negative is not None}

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        h, w, steps = req.height, req.width, req.num_inference_steps
        assert h is not None and w is not None and steps is not None  # validate() filled them

        # 2.1 latents: float32 noise [n, C, 2 * (h // 2f), 2 * (w // 2f)], whatever the transformer's dtype
        channels = view.transformer.in_channels
        latents = view.prepare_latents(req.n, channels, h, w, torch.float32, self.device, generator)
        image_seq_len = (latents.shape[2] // 2) * (latents.shape[3] // 2)

        # 2.2 timesteps: sigmas linspace(1, 1 / steps), mu from the image's token count
        mu = calculate_shift(
            image_seq_len,
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=get_default_z_image_sigmas(steps),
                                          mu=mu)
        scheduler.set_begin_index(0)

        # 2.3 CFG truncation: the steps whose normalised time passes cfg_truncation run without guidance
        truncation = self.cfg_truncation(req)
        t_norms = None
        if cond["cfg"] and truncation is not None and truncation <= 1:
            t_norms = ((1000 - timesteps.float()) / 1000).tolist()
        item.state.update(scheduler=scheduler, timesteps=timesteps, total=len(timesteps), latents=latents,
                          t_norms=t_norms, truncation=truncation, decode_extras={})

    # -- 3. denoise ------------------------------------------------------------------------
    @staticmethod
    def applies_cfg(item: WorkItem) -> bool:
        """Whether this step of the item runs the negative rows (CFG on and not truncated at this step)."""
        s = item.state
        if not item.inputs["cond"]["cfg"]:
            return False
        return s["t_norms"] is None or not s["t_norms"][s["i"]] > s["truncation"]

    def captions(self, item: WorkItem) -> list[torch.Tensor]:
        """This step's caption per row: [prompt x n] (+ [negative x n] with CFG)."""
        cond = item.inputs["cond"]
        return cond["prompt"] + (cond["negative"] if self.applies_cfg(item) else [])

    def denoise_key(self, item: WorkItem) -> Hashable:
        lat = item.state["latents"]
        padded = {-(-len(c) // SEQ_MULTI_OF) * SEQ_MULTI_OF for c in self.captions(item)}
        # the length every row is padded to and whether a mask exists are the request's own (see the docstring)
        return tuple(lat.shape[1:]), lat.dtype, max(padded), len(padded) > 1

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        dtype = self.pipe.transformer.dtype
        hidden, timesteps, captions, sizes = [], [], [], []
        for item in items:
            s = item.state
            rows = self.captions(item)
            x = s["latents"].to(dtype)
            x = x.repeat(2, 1, 1, 1) if len(rows) > x.shape[0] else x  # [rows, C, h, w]
            hidden.append(x)
            timesteps.append((1000 - s["timesteps"][s["i"]].expand(x.shape[0])) / 1000)  # per row: own step
            captions += rows
            sizes.append(x.shape[0])
        batched = {"x": torch.cat(hidden).unsqueeze(2),  # [R, C, 1, h, w]
                   "t": torch.cat(timesteps),
                   "cap_feats": pad_sequence(captions, batch_first=True),  # [R, L, D]; cut back per row below
                   "cap_lens": torch.tensor([len(c) for c in captions])}
        return self.denoise("transformer", items, sizes, batched)

    def call_denoiser(self, key: str, *args: Any, **inputs: Any) -> torch.Tensor:
        """The transformer on its lists: one latent and one unpadded caption per row; the outputs stacked."""
        x, t, cap_feats, cap_lens = inputs["x"], inputs["t"], inputs["cap_feats"], inputs["cap_lens"]
        caps = [cap_feats[i, :n] for i, n in enumerate(cap_lens.tolist())]
        out = getattr(self.pipe, key)(list(x.unbind(dim=0)), t, caps, return_dict=False)[0]
        return torch.stack(out)  # [R, C, 1, h, w]

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return tuple(module.layers)

    def cache_spec(self, key: str, module) -> CacheSpec:
        # the main layers run on one unified stream `x` (image tokens, then the caption's, padded per row); the
        # refiners before them always run. Their rotary `freqs_cis` is per row ([R, L, D]): cut by rows.
        return CacheSpec(key, self.repeated_blocks(module), hidden="x",
                         indicator=functools.partial(_modulated_input, module.layers[0]))

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s, req = item.state, item.inputs["request"]
        n = s["latents"].shape[0]
        if model_output.shape[0] > n:  # CFG, per sample as __call__ (its renormalisation is per sample)
            norm, scale = self.cfg_normalization(req), req.guidance_scale
            assert scale is not None  # validate() filled it
            preds = []
            for j in range(n):
                pos, neg = model_output[j].float(), model_output[n + j].float()
                pred = pos + scale * (pos - neg)
                if norm > 0.0:
                    ori_pos_norm = torch.linalg.vector_norm(pos)
                    new_pos_norm = torch.linalg.vector_norm(pred)
                    max_new_norm = ori_pos_norm * norm
                    if new_pos_norm > max_new_norm:
                        pred = pred * (max_new_norm / new_pos_norm)
                preds.append(pred)
            noise_pred = torch.stack(preds)
        else:
            noise_pred = model_output.float()
        noise_pred = -noise_pred.squeeze(2)  # the transformer predicts the negated flow
        t = s["timesteps"][s["i"]]
        s["latents"] = s["scheduler"].step(noise_pred.to(torch.float32), t, s["latents"], return_dict=False)[0]
        s["i"] += 1

    # -- 4. decode ---------------------------------------------------------------------------
    def latents_to_pixels(self, latents: torch.Tensor, extras: dict) -> np.ndarray:
        vae = self.pipe.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]  # [N, 3, H, W]
        return self.postprocess(image)


def _modulated_input(block, args: dict) -> torch.Tensor:
    """TeaCache's input for Z-Image: layer 0's attention_norm1(x) * (1 + scale_msa), scale_msa from its adaLN
    modulation of the timestep embedding."""
    scale_msa = block.adaLN_modulation(args["adaln_input"]).unsqueeze(1).chunk(4, dim=2)[0]
    return block.attention_norm1(args["x"]) * (1.0 + scale_msa)
