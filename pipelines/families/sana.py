"""Sana: a linear-attention DiT on 32x-compressed latents (AutoencoderDC), a Gemma2 text encoder, DPM-Solver++ on
flow sigmas.

Mirrors diffusers' SanaPipeline (text-to-image) step by step. What differs from the other image families:

* the prompt is prefixed with the pipeline's `complex_human_instruction` (request.extra['complex_human_instruction'],
  the pipeline's default list; an empty list turns it off), lower-cased, padded right to the instruction's tokens +
  max_sequence_length - 2, run through Gemma2, and cut by `select_index` to its first token and its last
  max_sequence_length - 1 (request.extra['max_sequence_length'], the pipeline's 300). The negative prompt ("" unless
  given) gets no instruction and is padded to max_sequence_length. Every row keeps its attention mask
  (`prompt_attention_mask`): the transformer masks the padding;
* CFG whenever guidance_scale > 1 (default 4.5), as the pipeline's do_classifier_free_guidance;
* `use_resolution_binning` (request.extra, the pipeline's default True): the request's size is mapped to the nearest
  aspect-ratio bin of the transformer's sample_size (ASPECT_RATIO_{512,1024,2048,4096}_BIN), generated there, and the
  decoded image resized and centre-cropped back to the requested size;
* latents are float32 whatever the model's dtype; the transformer's output is cast back to float32 before guidance;
* decode divides by the VAE's scaling_factor (no shift).

Step-level batching: every row's text is max_sequence_length tokens with its own mask, so requests share forwards
when their latent shape (the binned size) and their max_sequence_length are equal; a row's mask and timestep are its
own, so a request's numerics never depend on its batch mates.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import SanaPipeline
from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_512_BIN, ASPECT_RATIO_1024_BIN
from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN
from diffusers.pipelines.sana.pipeline_sana import ASPECT_RATIO_4096_BIN, retrieve_timesteps

from pipelines.families.base import ImageFamily
from pipelines.image_request import ImageLimits, ImageRequest, RequestError, Task
from stages.diffusion.block_stack import CacheSpec
from stages.diffusion.memory import Size
from stages.stage import WorkItem

_CALL = inspect.signature(SanaPipeline.__call__).parameters
MAX_SEQUENCE_LENGTH: int = _CALL["max_sequence_length"].default  # 300
SEQUENCE_LIMIT = 2048  # ours (the pipeline sets none): bounds the text encoder's work per prompt
COMPLEX_HUMAN_INSTRUCTION: tuple[str, ...] = tuple(_CALL["complex_human_instruction"].default)
DEFAULT_SIZE: int = _CALL["height"].default  # 1024 x 1024, whatever the checkpoint
BINS = {128: ASPECT_RATIO_4096_BIN, 64: ASPECT_RATIO_2048_BIN, 32: ASPECT_RATIO_1024_BIN, 16: ASPECT_RATIO_512_BIN}


class SanaFamily(ImageFamily):
    family = "sana"
    class_names = ("SanaPipeline",)
    pipeline_classes = {Task.TEXT_TO_IMAGE: SanaPipeline}
    default_steps: int = _CALL["num_inference_steps"].default  # 20
    default_guidance: float = _CALL["guidance_scale"].default  # 4.5
    request_knobs = frozenset({"max_sequence_length", "complex_human_instruction", "use_resolution_binning"})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.refuse_guidance_embeds("Sana (Sana-Sprint)")

    @property
    def default_size(self) -> int:
        return DEFAULT_SIZE

    @property
    def size_factor(self) -> int:
        return 32  # SanaPipeline.check_inputs: height and width divisible by 32

    # -- request knobs (request.extra) --------------------------------------------------------
    @staticmethod
    def max_sequence_length(request: ImageRequest) -> int:
        return int(request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))

    @staticmethod
    def instruction(request: ImageRequest) -> tuple[str, ...]:
        return tuple(request.extra.get("complex_human_instruction", COMPLEX_HUMAN_INSTRUCTION) or ())

    @staticmethod
    def binning(request: ImageRequest) -> bool:
        return bool(request.extra.get("use_resolution_binning", True))

    def validate(self, request: ImageRequest, limits: ImageLimits) -> ImageRequest:
        request = super().validate(request, limits)
        extra = request.extra
        msl = extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH)
        if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= SEQUENCE_LIMIT:
            raise RequestError("max_sequence_length",
                               f"max_sequence_length must be an integer between 1 and {SEQUENCE_LIMIT}; got {msl!r}")
        chi = extra.get("complex_human_instruction", COMPLEX_HUMAN_INSTRUCTION)
        if chi is not None and (not isinstance(chi, (list, tuple)) or not all(isinstance(s, str) for s in chi)):
            raise RequestError("complex_human_instruction",
                               "complex_human_instruction must be a list of strings (empty or null: none)")
        binning = extra.get("use_resolution_binning", True)
        if not isinstance(binning, bool):
            raise RequestError("use_resolution_binning", f"use_resolution_binning must be a boolean; got {binning!r}")
        if binning and self.pipe.transformer.config.sample_size not in BINS:
            raise RequestError("use_resolution_binning",
                               f"model {self.name}'s transformer sample_size "
                               f"{self.pipe.transformer.config.sample_size} has no aspect-ratio bins (it needs one of "
                               f"{sorted(BINS)}); send use_resolution_binning: false")
        return request

    def generation_size(self, request: ImageRequest) -> tuple[int, int]:
        """(height, width) the latents have: the request's, or its aspect-ratio bin's."""
        h, w = request.height, request.width
        assert h is not None and w is not None  # validate() filled them
        if not self.binning(request):
            return h, w
        bins = BINS[self.pipe.transformer.config.sample_size]
        return self.pipe.image_processor.classify_height_width_bin(h, w, ratios=bins)

    def request_size(self, request: ImageRequest) -> Size:
        h, w = self.generation_size(request)  # the forward's activations follow the binned size
        return (w, h, 1)

    # -- 1. text ----------------------------------------------------------------------------
    def text_options(self, request: ImageRequest) -> dict:
        return {"max_sequence_length": self.max_sequence_length(request), "instruction": self.instruction(request)}

    def negative(self, request: ImageRequest, prompt: dict, options: dict) -> dict | None:
        if not self.uses_negative(request):
            return None
        # encode_prompt encodes the negative prompt with complex_human_instruction=False
        options = {**options, "instruction": ()}
        return self.cached_text(request.negative_prompt or "", request.tenant, options, request.lora)

    def _tokens(self, text: str, max_sequence_length: int, instruction: tuple[str, ...]) -> Any:
        pipe = self.pipe  # as _get_gemma_prompt_embeds tokenizes
        pipe.tokenizer.padding_side = "right"
        text = pipe._text_preprocessing(text, clean_caption=False)[0]
        max_length = max_sequence_length
        if instruction:
            chi_prompt = "\n".join(instruction)
            text = chi_prompt + text
            max_length = len(pipe.tokenizer.encode(chi_prompt)) + max_sequence_length - 2
        return pipe.tokenizer([text], padding="max_length", max_length=max_length, truncation=True,
                              add_special_tokens=True, return_tensors="pt")

    def text_key(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH,
                 instruction: tuple[str, ...] = COMPLEX_HUMAN_INSTRUCTION) -> Hashable:
        tokens = self._tokens(text, max_sequence_length, instruction)
        return tuple(tokens.input_ids[0].tolist()), tuple(tokens.attention_mask[0].tolist())

    def encode_text(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH,
                    instruction: tuple[str, ...] = COMPLEX_HUMAN_INSTRUCTION) -> dict[str, torch.Tensor]:
        pipe = self.pipe
        embeds, mask = pipe._get_gemma_prompt_embeds(
            text, self.device, pipe.text_encoder.dtype, clean_caption=False, max_sequence_length=max_sequence_length,
            complex_human_instruction=list(instruction) or None)
        # encode_prompt's select_index (Sana paper, 3.1): the first token and the last max_sequence_length - 1. The
        # negative prompt (no instruction) is already max_sequence_length long, where it selects every token.
        select_index = [0] + list(range(-max_sequence_length + 1, 0))
        return {"embeds": embeds[:, select_index], "mask": mask[:, select_index]}  # [1, msl, D], [1, msl]

    def conditioning(self, prompt: dict, negative: dict | None, request: ImageRequest) -> dict[str, Any]:
        n = request.n  # as num_images_per_prompt repeats (batch 1: repeat(n, ...) is the same layout)
        embeds, mask = prompt["embeds"].repeat(n, 1, 1), prompt["mask"].repeat(n, 1)
        if negative is None:
            return {"embeds": embeds, "mask": mask, "cfg": False}
        # [negative x n, prompt x n], as __call__ concatenates them
        return {"embeds": torch.cat([negative["embeds"].repeat(n, 1, 1), embeds]),
                "mask": torch.cat([negative["mask"].repeat(n, 1), mask]), "cfg": True}

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)

        # 2.1 size: the aspect-ratio bin (resized back after decode) or the request's own
        h, w = self.generation_size(req)
        decode_extras = {"width": req.width, "height": req.height} if self.binning(req) else {}

        # 2.2 timesteps: the scheduler as configured (DPM-Solver++ on flow sigmas for Sana)
        timesteps, _ = retrieve_timesteps(scheduler, req.num_inference_steps, self.device)

        # 2.3 latents: float32 noise [n, C, h / f, w / f], whatever the transformer's dtype
        channels = view.transformer.config.in_channels
        latents = view.prepare_latents(req.n, channels, h, w, torch.float32, self.device, generator)

        # 2.4 the scheduler step's extra arguments (DPM-Solver takes the generator: its SDE variants draw noise)
        step_kwargs = view.prepare_extra_step_kwargs(generator, 0.0)
        item.state.update(scheduler=scheduler, timesteps=timesteps, total=len(timesteps), latents=latents,
                          step_kwargs=step_kwargs, decode_extras=decode_extras)

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        s, cond = item.state, item.inputs["cond"]
        # every row carries its own mask and timestep: equal latent and text shapes are all a shared forward needs
        return tuple(s["latents"].shape[1:]), s["latents"].dtype, tuple(cond["embeds"].shape[1:])

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        transformer = self.pipe.transformer
        dtype, scale = transformer.dtype, transformer.config.timestep_scale
        hidden, timesteps, embeds, masks, sizes = [], [], [], [], []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            x = torch.cat([s["latents"]] * 2) if cond["cfg"] else s["latents"]  # [rows, C, h, w]
            hidden.append(x.to(dtype))
            timesteps.append(s["timesteps"][s["i"]].expand(x.shape[0]) * scale)  # per row: items at different steps
            embeds.append(cond["embeds"].to(dtype))
            masks.append(cond["mask"])
            sizes.append(x.shape[0])
        batched = {"hidden_states": torch.cat(hidden), "encoder_hidden_states": torch.cat(embeds),
                   "encoder_attention_mask": torch.cat(masks), "timestep": torch.cat(timesteps)}
        return self.denoise("transformer", items, sizes, batched)

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return tuple(module.transformer_blocks)

    def cache_spec(self, key: str, module) -> CacheSpec:
        # single-stream blocks (text by cross-attention) -> the image tokens
        return CacheSpec(key, self.repeated_blocks(module),
                         indicator=functools.partial(_modulated_input, module.transformer_blocks[0]))

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s, req = item.state, item.inputs["request"]
        noise_pred = self.guide(model_output.float(), item.inputs["cond"]["cfg"], req.guidance_scale)
        if self.pipe.transformer.config.out_channels // 2 == s["latents"].shape[1]:  # learned sigma: drop it
            noise_pred = noise_pred.chunk(2, dim=1)[0]
        t = s["timesteps"][s["i"]]
        s["latents"] = s["scheduler"].step(noise_pred, t, s["latents"], **s["step_kwargs"], return_dict=False)[0]
        s["i"] += 1

    # -- 4. decode ---------------------------------------------------------------------------
    def latents_to_pixels(self, latents: torch.Tensor, extras: dict) -> np.ndarray:
        pipe, vae = self.pipe, self.pipe.vae
        image = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]  # [N, 3, H, W]
        if extras:  # resolution binning: back to the requested size
            image = pipe.image_processor.resize_and_crop_tensor(image, extras["width"], extras["height"])
        return self.postprocess(image)


def _modulated_input(block, args: dict) -> torch.Tensor:
    """TeaCache's input for Sana: block 0's norm1(x) * (1 + scale_msa) + shift_msa (the adaLN-single modulation of
    its `timestep` embedding)."""
    hidden = args["hidden_states"]
    shift_msa, scale_msa = (block.scale_shift_table[None] + args["timestep"].reshape(hidden.shape[0], 6, -1)).chunk(
        6, dim=1)[:2]
    return block.norm1(hidden) * (1 + scale_msa) + shift_msa
