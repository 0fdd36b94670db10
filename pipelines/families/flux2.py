"""FLUX.2: an MMDiT on patchified, packed latents, a Mistral3 text encoder, AutoencoderKLFlux2 (batch-norm latents).

Mirrors diffusers' Flux2Pipeline step by step, text-to-image and multi-reference editing. What differs from FLUX.1
(pipelines/families/flux.py):

* one text encoder: the prompt, under the pipeline's system message, through the processor's chat template padded to
  request.extra['max_sequence_length'] (512), and hidden states 10, 20 and 30 of the Mistral3 stacked per token
  ([1, L, 3D]); no pooled embedding. Text ids are 4-D (t, h, w, l) = (0, 0, 0, token);
* latents are the VAE's, patchified 2x2 into channels and packed per position ([n, h * w, 4C]); image ids are
  (0, row, column, 0). The decode unpacks, undoes the VAE's batch-norm normalisation and unpatchifies;
* the guidance is embedded (guidance_scale, default 4.0) and there is no CFG: no negative prompt (refused);
* the shift mu is the pipeline's empirical one, from the noise's token count *and the step count*: requests at
  different step counts still share forwards (per-sample timesteps), each with its own schedule;
* edits (/v1/images/edits): each input image is a *reference*, not a starting point: checked (at least 64 px a side,
  aspect ratio at most 8), shrunk to 1024 x 1024 pixels when larger, cut down to the size factor and center-cropped,
  VAE-encoded (the distribution's mode: no draw from the generator), normalised, packed and concatenated to the
  noise tokens of every step with ids (10 + 10 i, row, column, 0); the prediction is cut back to the noise tokens.
  The output size defaults to the *first* reference's (__call__ sets height and width from the first image only).
  The denoising starts from pure noise: `strength` is ignored.

Step caching cuts at the single-stream blocks (one stream of [text, image] tokens, one output tensor): the
double-stream blocks before them return a (text, image) pair and take two modulations, which the block-stack
machinery's one-format stacks cannot hold together, so they always run and the single-stream stack is the one
skipped (48 of FLUX.2-dev's 56 blocks).

FLUX.2 [klein] (Flux2KleinPipeline: a Qwen3 encoder and true CFG) is the subclass in flux2_klein.py; the hooks it
turns are `embeds_guidance`, `no_cfg_reason` and `uses_negative` (the conditioning, forward and commit below take a
[negative x n, prompt x n] CFG batch when a request has one).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, format_input, retrieve_timesteps
from PIL import Image

from pipelines.families.base import ImageFamily, PackedLatents
from pipelines.image_request import ImageLimits, ImageRequest, RequestError, Task
from stages.diffusion.block_stack import CacheSpec
from stages.diffusion.memory import Size
from stages.stage import WorkItem

MAX_SEQUENCE_LENGTH = 512  # Flux2Pipeline.__call__'s default (its tokenizer_max_length)
REFERENCE_AREA = 1024 * 1024  # __call__ shrinks a larger reference image to this many pixels
REFERENCE_MIN_SIDE, REFERENCE_MAX_ASPECT = 64, 8  # Flux2ImageProcessor.check_image_input's limits


class Flux2Family(PackedLatents, ImageFamily):
    family = "flux2"
    class_names = ("Flux2Pipeline",)
    # One pipeline does both: with reference images it edits, without one it generates.
    pipeline_classes = {Task.TEXT_TO_IMAGE: Flux2Pipeline, Task.IMAGE_TO_IMAGE: Flux2Pipeline}
    default_steps = 50  # Flux2Pipeline.__call__ num_inference_steps
    default_guidance = 4.0  # its guidance_scale: the embedded guidance, not CFG
    request_knobs = frozenset({"max_sequence_length"})
    embeds_guidance = True  # guidance_scale is a transformer input (Flux2Pipeline passes `guidance`)

    @property
    def several_images(self) -> bool:
        return True  # multi-reference editing: every input image is a reference

    # -- request knobs (request.extra) --------------------------------------------------------
    @staticmethod
    def max_sequence_length(request: ImageRequest) -> int:
        return int(request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))

    def validate(self, request: ImageRequest, limits: ImageLimits) -> ImageRequest:
        reason = self.no_cfg_reason()
        if request.negative_prompt is not None and reason is not None:
            raise RequestError("negative_prompt",
                               f"model {self.name} ({self.family}) takes no negative_prompt: {reason}")
        refs = self.references(request)
        for image in refs:
            width, height = image.size
            if min(width, height) < REFERENCE_MIN_SIDE:
                raise RequestError("image", f"image is {width}x{height}; this model needs at least "
                                            f"{REFERENCE_MIN_SIDE}x{REFERENCE_MIN_SIDE}", code="image_too_small")
            if max(width / height, height / width) > REFERENCE_MAX_ASPECT:
                raise RequestError("image", f"image is {width}x{height}; its aspect ratio must be at most "
                                            f"{REFERENCE_MAX_ASPECT}:1")
        if refs and request.width is None and request.height is None:
            # the first reference's size as __call__ adjusts it (the base would take the last's, rounded down)
            width, height = self.reference_size(refs[0])
            request = dataclasses.replace(request, width=width, height=height)
        request = super().validate(request, limits)
        msl = request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH)
        if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= MAX_SEQUENCE_LENGTH:
            raise RequestError("max_sequence_length",
                               f"max_sequence_length must be an integer between 1 and {MAX_SEQUENCE_LENGTH}; "
                               f"got {msl!r}")
        return request

    def no_cfg_reason(self) -> str | None:
        """Why this model runs no CFG (a negative prompt is refused, naming it); None: it takes one."""
        return "FLUX.2 embeds its guidance (guidance_scale) and runs no CFG"

    def uses_negative(self, request: ImageRequest) -> bool:
        return False  # no CFG: guidance_scale is a transformer input

    def request_rows(self, request: ImageRequest) -> int:
        return request.n * (2 if self.uses_negative(request) else 1)  # FLUX.2: one row per image whatever the guidance

    @staticmethod
    def references(request: ImageRequest) -> list[Image.Image]:
        """The edit's reference images (decoded), in order; none for text-to-image."""
        if request.task is not Task.IMAGE_TO_IMAGE or request.image is None:
            return []
        return list(request.image) if isinstance(request.image, (list, tuple)) else [request.image]

    def reference_size(self, image: Image.Image) -> tuple[int, int]:
        """(width, height) a reference is encoded at: shrunk to REFERENCE_AREA pixels when larger (as
        _resize_to_target_area computes it), then rounded down to the size factor, as __call__'s step 4."""
        width, height = image.size
        if width * height > REFERENCE_AREA:
            scale = math.sqrt(REFERENCE_AREA / (width * height))
            width, height = int(width * scale), int(height * scale)
        factor = self.size_factor
        return width // factor * factor, height // factor * factor

    def edit_size(self, image: Image.Image) -> tuple[int, int] | None:
        return None  # validate sizes an edit: from the first reference, where the server hands over the last

    def request_size(self, request: ImageRequest) -> Size:
        """The references' tokens ride along as extra 'frames' of the output's size (rounded up), so that memory
        estimates (stages/diffusion/memory.py) grow with all the tokens one forward holds."""
        width, height = request.width or 0, request.height or 0
        refs = self.references(request)
        if not refs or not width * height:
            return (width, height, 1)
        area = sum(w * h for w, h in map(self.reference_size, refs))
        return (width, height, 1 + math.ceil(area / (width * height)))

    # -- 1. text ----------------------------------------------------------------------------
    def text_options(self, request: ImageRequest) -> dict:
        return {"max_sequence_length": self.max_sequence_length(request)}

    def text_key(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> Hashable:
        pipe = self.pipe  # the tokens _get_mistral_3_small_prompt_embeds feeds the encoder
        inputs = pipe.tokenizer.apply_chat_template(
            format_input(prompts=[text], system_message=pipe.system_message), add_generation_prompt=False,
            tokenize=True, return_dict=True, padding="max_length", truncation=True, max_length=max_sequence_length)
        # (PixtralProcessor returns tensors by default: as plain ints, hashable by value)
        ids, mask = (np.asarray(inputs[k][0]).tolist() for k in ("input_ids", "attention_mask"))
        return tuple(ids), tuple(mask)

    def encode_text(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(text, self.device, 1, max_sequence_length=max_sequence_length)
        return {"embeds": embeds}  # [1, L, 3D]: three hidden states of the encoder side by side

    def conditioning(self, prompt: dict, negative: dict | None, request: ImageRequest) -> dict[str, Any]:
        embeds = prompt["embeds"].repeat(request.n, 1, 1)  # as encode_prompt's num_images_per_prompt
        if negative is not None:  # true CFG (klein): [negative x n, prompt x n]; both padded to one length
            embeds = torch.cat([negative["embeds"].repeat(request.n, 1, 1), embeds])
        text_ids = Flux2Pipeline._prepare_text_ids(embeds[:1]).to(self.device)  # [1, L, 4]: shared by every row
        return {"embeds": embeds, "text_ids": text_ids, "cfg": negative is not None}

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        dtype = cond["embeds"].dtype
        h, w, steps = req.height, req.width, req.num_inference_steps
        assert h is not None and w is not None and steps is not None  # validate() filled them

        # 2.1 the references, sized and preprocessed as __call__'s step 4 (the size is validate's; crop, no pad)
        refs = []
        for image in self.references(req):
            width, height = self.reference_size(image)
            if image.size[0] * image.size[1] > REFERENCE_AREA:
                image = view.image_processor._resize_to_target_area(image, REFERENCE_AREA)
            refs.append(view.image_processor.preprocess(image, height=height, width=width, resize_mode="crop"))

        # 2.2 latents: packed noise [n, L, 4C] with its ids, then the references' (the VAE's mode: no draw)
        channels = view.transformer.config.in_channels // 4
        latents, latent_ids = view.prepare_latents(req.n, channels, h, w, dtype, self.device, generator)
        image_latents = image_ids = None
        if refs:
            with self._vae_lock:
                image_latents, image_ids = view.prepare_image_latents(refs, req.n, generator, self.device,
                                                                      view.vae.dtype)
            image_ids = image_ids[:1]  # [1, L_ref, 4]: equal for every row

        # 2.3 timesteps: the pipeline's sigmas, shifted by its empirical mu (token count and step count)
        sigmas: np.ndarray | None = np.linspace(1.0, 1 / steps, steps)
        if getattr(scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        mu = compute_empirical_mu(image_seq_len=latents.shape[1], num_steps=steps)
        # diffusers annotates sigmas as list[float]; its own pipeline passes this numpy array
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)  # type: ignore[arg-type]
        scheduler.set_begin_index(0)

        # 2.4 the embedded guidance, one value per row (None: klein passes none)
        assert req.guidance_scale is not None  # validate() filled it
        guidance = None
        if self.embeds_guidance:
            guidance = torch.full([1], req.guidance_scale, device=self.device, dtype=torch.float32).expand(req.n)
        ids = latent_ids[:1] if image_ids is None else torch.cat([latent_ids[:1], image_ids], dim=1)
        refs_key = tuple(tuple(r.shape[-2:]) for r in refs)
        item.state.update(scheduler=scheduler, timesteps=timesteps, total=len(timesteps), latents=latents,
                          image_latents=image_latents, image_ids=ids, guidance=guidance, refs=refs_key,
                          decode_extras={"height": h, "width": w})

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        s, cond = item.state, item.inputs["cond"]
        extras = s["decode_extras"]
        # the ids are one tensor per forward: the latent grid, the references' sizes and the text length set them
        grid = (extras["height"] // self.size_factor, extras["width"] // self.size_factor)
        return grid, s["refs"], tuple(s["latents"].shape[1:]), s["latents"].dtype, tuple(cond["embeds"].shape[1:])

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        dtype = self.pipe.transformer.dtype
        hidden, timesteps, guidance, embeds, sizes = [], [], [], [], []
        for item in items:
            s = item.state
            x = s["latents"] if s["image_latents"] is None else torch.cat([s["latents"], s["image_latents"]], dim=1)
            x = torch.cat([x] * 2) if item.inputs["cond"]["cfg"] else x  # [rows, L (+ L_ref), 4C]
            hidden.append(x.to(dtype))
            t = s["timesteps"][s["i"]]
            timesteps.append(t.expand(x.shape[0]).to(s["latents"].dtype))  # per sample: items sit at different steps
            guidance.append(s["guidance"])
            embeds.append(item.inputs["cond"]["embeds"])
            sizes.append(x.shape[0])
        first = items[0]
        batched = {"hidden_states": torch.cat(hidden), "timestep": torch.cat(timesteps) / 1000,
                   "guidance": torch.cat(guidance) if self.embeds_guidance else None,
                   "encoder_hidden_states": torch.cat(embeds)}
        shared = {"txt_ids": first.inputs["cond"]["text_ids"], "img_ids": first.state["image_ids"]}
        out = self.denoise("transformer", items, sizes, batched, shared)
        # the noise tokens' predictions only (the references' come to nothing)
        return [o[:, :item.state["latents"].shape[1]] for o, item in zip(out, items, strict=True)]

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s, req = item.state, item.inputs["request"]
        scale = req.guidance_scale if item.inputs["cond"]["cfg"] else 1.0  # true CFG's scale (klein); else unused
        s["latents"] = self.scheduler_step(item, model_output, scale, s["latents"])
        s["i"] += 1

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return (*module.transformer_blocks, *module.single_transformer_blocks)

    def cache_spec(self, key: str, module) -> CacheSpec | None:
        # the single-stream stack (see the module docstring): `hidden_states` is the [text, image] stream, the output
        # one tensor; its per-row modulation `temb_mod` is cut with the rows
        blocks = tuple(module.single_transformer_blocks)
        if not blocks:
            return None
        return CacheSpec(key, blocks, indicator=functools.partial(_modulated_input, blocks[0]))

    # -- 4. decode ---------------------------------------------------------------------------
    def latents_to_pixels(self, latents: torch.Tensor, extras: dict) -> np.ndarray:
        vae, factor = self.pipe.vae, self.size_factor
        n, _, channels = latents.shape
        rows, cols = extras["height"] // factor, extras["width"] // factor
        # [N, h * w, 4C] -> [N, 4C, h, w]: _unpack_latents_with_ids' scatter for the row-major ids prepare made
        latents = latents.reshape(n, rows, cols, channels).permute(0, 3, 1, 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                               latents.dtype)
        latents = Flux2Pipeline._unpatchify_latents(latents * std + mean)
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]  # [N, 3, H, W]
        return self.postprocess(image)


def _modulated_input(block, args: dict) -> torch.Tensor:
    """TeaCache's input for FLUX.2: the first single-stream block's norm(x) * (1 + scale) + shift, from its
    per-row modulation."""
    from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

    ((shift, scale, _),) = Flux2Modulation.split(args["temb_mod"], 1)
    return (1 + scale) * block.norm(args["hidden_states"]) + shift
