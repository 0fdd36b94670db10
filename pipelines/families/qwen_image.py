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

A checkpoint saved as QwenImageEditPipeline serves instruction edits (image-to-image, /v1/images/edits) instead,
mirroring that pipeline's __call__: the input image is resized to `calculate_dimensions(target_area, its aspect
ratio)` (request.extra['target_area']; the pipeline's 1024 * 1024), then goes both through the Qwen2.5-VL encoder
(the processor's vision input, the edit template, whose first 64 tokens are dropped; the edit pipeline cuts nothing
at max_sequence_length) and through the VAE (the distribution's mode, normalised) as packed context latents
concatenated after the noise tokens, with their own img_shapes entry. The output size is the request's, else the
resized input's; the transformer's output is cut back to the noise tokens. The prompt cache keys an edit's
embeddings by a digest of the resized image too.

A QwenImageEditPlusPipeline checkpoint (Qwen-Image-Edit-2509 and later) edits one or several input images (a list in
request.image, up to ImageLimits.max_images), mirroring its __call__: each image goes to the text encoder resized to
about 384 * 384 pixels (CONDITION_IMAGE_SIZE; the template names them "Picture 1: ..., Picture 2: ...") and to the VAE
resized to target_area (its VAE_IMAGE_SIZE, 1024 * 1024), each packed as context latents after the noise tokens with
its own img_shapes entry; the output takes the last image's size at target_area unless the request names one. The
prompt cache keys the embeddings by the digests of all the text encoder's images, in order.

Step-level batching: the prompt and the negative prompt of one request may differ in length; one forward takes them
padded to a common length with a mask (the pipeline runs two unpadded forwards: a mask moves the result by float
error only, ~1e-7). Requests share forwards when their latent grid, their padded text length and whether they need
a mask are equal, so that a request's numerics never depend on who else is in the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE
from PIL import Image

from pipelines.families.base import ImageFamily, PackedLatents
from pipelines.image_request import ImageLimits, ImageRequest, RequestError, Task
from pipelines.registry import _read_index
from stages.diffusion.block_stack import CacheSpec
from stages.diffusion.memory import Size
from stages.stage import WorkItem

MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default
SEQUENCE_LIMIT = 1024  # its check_inputs' upper limit
EDIT_AREA = 1024 * 1024  # QwenImageEditPipeline.__call__'s calculate_dimensions target area
EDIT_ROUND = 32  # calculate_dimensions rounds both sides to multiples of this


@dataclasses.dataclass(frozen=True)
class PromptImage:
    """An edit's input images as the text encoder sees them (resized), identified in the prompt cache by a digest."""

    digest: str  # sha256 of each resized image's size, mode and pixels, in order
    images: tuple[Image.Image, ...] = dataclasses.field(compare=False, hash=False, repr=False)

    @classmethod
    def of(cls, *images: Image.Image) -> "PromptImage":
        digest = hashlib.sha256()
        for image in images:
            digest.update(f"{image.size}:{image.mode}:{len(image.tobytes())}:".encode() + image.tobytes())
        return cls(digest.hexdigest(), images)

    @property
    def image(self) -> Image.Image:
        """The one image of a single-image edit."""
        assert len(self.images) == 1
        return self.images[0]


class QwenImageFamily(PackedLatents, ImageFamily):
    family = "qwen_image"
    class_names = ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    pipeline_classes = {Task.TEXT_TO_IMAGE: QwenImagePipeline}
    # the edit checkpoints' classes (model_index.json `_class_name`): each serves image-to-image only
    edit_classes = {"QwenImageEditPipeline": QwenImageEditPipeline,
                    "QwenImageEditPlusPipeline": QwenImageEditPlusPipeline}
    default_steps = 50  # QwenImagePipeline.__call__ num_inference_steps
    default_guidance = 4.0  # its true_cfg_scale (applies with a negative prompt only)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.refuse_guidance_embeds("Qwen-Image")

    def base_pipeline(self) -> tuple[Task, type[Any]]:
        index, _ = _read_index(self.path)
        if index is not None and index.get("_class_name") in self.edit_classes:
            return Task.IMAGE_TO_IMAGE, self.edit_classes[index["_class_name"]]  # edits only: __call__ needs an image
        return super().base_pipeline()

    def variants(self, base) -> dict[Task, type[Any]]:
        return {} if isinstance(base, tuple(self.edit_classes.values())) else super().variants(base)

    # -- request knobs (request.extra) --------------------------------------------------------
    @staticmethod
    def max_sequence_length(request: ImageRequest) -> int:
        return int(request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))

    @staticmethod
    def target_area(request: ImageRequest) -> int:
        return int(request.extra.get("target_area", EDIT_AREA))

    def knobs(self) -> frozenset[str]:
        # an edit's prompt is not cut at max_sequence_length (QwenImageEditPipeline ignores it); target_area sizes
        # an edit's input image, which text-to-image has none of
        return frozenset({"target_area"} if self.edits else {"max_sequence_length"})

    @property
    def edits(self) -> bool:
        """A QwenImageEditPipeline or QwenImageEditPlusPipeline checkpoint: instruction edits of input images."""
        return isinstance(self.pipe, tuple(self.edit_classes.values()))

    @property
    def several_images(self) -> bool:
        """A QwenImageEditPlusPipeline checkpoint edits one or several images (request.image a list)."""
        return isinstance(self.pipe, QwenImageEditPlusPipeline)

    def validate(self, request: ImageRequest, limits: ImageLimits) -> ImageRequest:
        msl = request.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH)
        if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= SEQUENCE_LIMIT:
            raise RequestError("max_sequence_length",
                               f"max_sequence_length must be an integer between 1 and {SEQUENCE_LIMIT}; got {msl!r}")
        area = request.extra.get("target_area", EDIT_AREA)
        if isinstance(area, bool) or not isinstance(area, int) or not EDIT_ROUND ** 2 <= area <= limits.max_pixels:
            raise RequestError("target_area", f"target_area must be an integer between {EDIT_ROUND ** 2} and "
                                              f"{limits.max_pixels}; got {area!r}")
        contexts = self.context_sizes(request)
        if contexts:
            resized = [(image, size) for image, size in zip(self.input_images(request), contexts, strict=True)]
            resized += [(image, size) for image, size in zip(self.input_images(request),
                                                             self.condition_sizes(request), strict=True)]
            for image, (w, h) in resized:
                if min(w, h) < EDIT_ROUND:
                    raise RequestError("image", f"image is {image.size[0]}x{image.size[1]}: resized to keep its "
                                                f"aspect ratio it is {w}x{h}; this model needs at least "
                                                f"{EDIT_ROUND}x{EDIT_ROUND}", code="image_too_small")
            # as __call__: `height or calculated_height`, `width or calculated_width` (of the last image), then
            # down to the factor
            factor = self.size_factor
            width, height = request.width or contexts[-1][0], request.height or contexts[-1][1]
            request = dataclasses.replace(request, width=width // factor * factor, height=height // factor * factor)
        return super().validate(request, limits)

    def edit_size(self, image: Image.Image) -> tuple[int, int] | None:
        # an edit's output takes the (last) input resized to target_area (validate, from context_sizes), as __call__
        return None if self.edits else super().edit_size(image)

    def warm_request(self, width: int, height: int) -> ImageRequest:
        if not self.edits:
            return super().warm_request(width, height)
        # an edit checkpoint makes no text-to-image: a grey input image of the size, resized to about its own area
        return ImageRequest(prompt="warm-up", task=Task.IMAGE_TO_IMAGE, image=Image.new("RGB", (width, height),
                            (128, 128, 128)), width=width, height=height, num_inference_steps=self.min_steps, seed=0,
                            extra={"target_area": max(width * height, EDIT_ROUND ** 2)})

    @staticmethod
    def input_images(request: ImageRequest) -> list[Image.Image]:
        """An edit's input images in order (one, or Edit-Plus's several)."""
        image = request.image
        return [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]

    def _resized_sizes(self, request: ImageRequest, area: int) -> list[tuple[int, int]]:
        """(width, height) of each input image resized to about `area` pixels at its aspect ratio, as the edit
        pipelines' calculate_dimensions; [] without input images (or for text-to-image)."""
        if not self.edits or request.task is not Task.IMAGE_TO_IMAGE:
            return []
        sizes = []
        for image in self.input_images(request):
            width, height = image.size
            if min(width, height) < 1:
                sizes.append((0, 0))
                continue
            w, h, _ = calculate_dimensions(area, width / height)
            sizes.append((int(w), int(h)))
        return sizes

    def context_sizes(self, request: ImageRequest) -> list[tuple[int, int]]:
        """(width, height) each input image is resized to for the VAE (and, for Edit, the text encoder): at
        target_area, as QwenImageEditPipeline's calculate_dimensions (Edit-Plus's VAE_IMAGE_SIZE). []: none."""
        return self._resized_sizes(request, self.target_area(request))

    def condition_sizes(self, request: ImageRequest) -> list[tuple[int, int]]:
        """(width, height) each input image is resized to for the text encoder: Edit's context size, Edit-Plus's
        CONDITION_IMAGE_SIZE area."""
        if not self.several_images:
            return self.context_sizes(request)
        return self._resized_sizes(request, CONDITION_IMAGE_SIZE)

    def request_size(self, request: ImageRequest) -> Size:
        """The context images' tokens ride along as extra 'frames' of the output's size (rounded up), so that memory
        estimates grow with all the tokens one forward holds (as FLUX.1 Kontext's)."""
        width, height = request.width or 0, request.height or 0
        contexts = self.context_sizes(request)
        if not contexts or not width * height:
            return (width, height, 1)
        return (width, height, 1 + math.ceil(sum(w * h for w, h in contexts) / (width * height)))

    def prompt_image(self, request: ImageRequest) -> PromptImage | None:
        """The resized input images the text encoder sees (__call__'s `prompt_image` / `condition_images`); None
        without one."""
        sizes = self.condition_sizes(request)
        if not sizes:
            return None
        resize = self.pipe.image_processor.resize
        return PromptImage.of(*[resize(image, h, w) for image, (w, h) in zip(self.input_images(request), sizes,
                                                                                strict=True)])

    def uses_negative(self, request: ImageRequest) -> bool:
        # diffusers: do_true_cfg = true_cfg_scale > 1 and has_neg_prompt
        assert request.guidance_scale is not None  # validate() filled it
        return request.guidance_scale > 1.0 and request.negative_prompt is not None

    def request_rows(self, request: ImageRequest) -> int:
        return request.n * (2 if self.uses_negative(request) else 1)  # no CFG batch without a negative prompt

    # -- 1. text ----------------------------------------------------------------------------
    def text_options(self, request: ImageRequest) -> dict:
        options: dict[str, Any] = {"max_sequence_length": self.max_sequence_length(request)}
        if self.edits:  # the embeddings depend on the image: its digest enters the prompt cache key
            options["image"] = self.prompt_image(request)
        return options

    def _template_tokens(self, text: str) -> Any:
        pipe = self.pipe  # as _get_qwen_prompt_embeds tokenizes
        return pipe.tokenizer([pipe.prompt_template_encode.format(text)],
                              max_length=pipe.tokenizer_max_length + pipe.prompt_template_encode_start_idx,
                              padding=True, truncation=True, return_tensors="pt")

    def text_key(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH,
                 image: PromptImage | None = None) -> Hashable:
        if image is not None:  # the edit template's tokens before the image's expand; the image is in the key
            return (tuple(self.pipe.tokenizer(self.pipe.prompt_template_encode.format(text)).input_ids), image.digest)
        return tuple(self._template_tokens(text).input_ids[0].tolist())

    def encode_text(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH,
                    image: PromptImage | None = None) -> dict[str, torch.Tensor]:
        if image is not None:  # the edit pipelines' encode_prompt: the images through the processor's vision input
            images = list(image.images) if self.several_images else image.image  # Edit-Plus: "Picture i:" each
            embeds, mask = self.pipe.encode_prompt(text, image=images, device=self.device, num_images_per_prompt=1)
            assert mask is None  # one prompt: no padding
            return {"embeds": embeds}
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

        # 2.1 latents: packed noise [n, L, 4C], in the prompt embeddings' dtype; an edit's input images resized,
        # VAE-encoded (the mode: no draw) and packed as context [n, L_image (summed over the images), 4C]
        channels = view.transformer.config.in_channels // 4
        contexts, image_latents = self.context_sizes(req), None
        if not contexts:
            latents = view.prepare_latents(req.n, channels, h, w, cond["embeds"].dtype, self.device, generator)
        else:
            processor, images = view.image_processor, self.input_images(req)
            if self.several_images:  # Edit-Plus preprocesses each image straight to its size: a list
                image: Any = [processor.preprocess(im, ch, cw).unsqueeze(2) for im, (cw, ch) in zip(images, contexts,
                                                                                                      strict=True)]
            else:  # Edit resizes first
                (cw, ch), = contexts
                image = processor.preprocess(processor.resize(images[0], ch, cw), ch, cw).unsqueeze(2)  # [1,3,1,H,W]
            with self._vae_lock:
                latents, image_latents = view.prepare_latents(image, req.n, channels, h, w, cond["embeds"].dtype,
                                                              self.device, generator)

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

        # 2.3 the RoPE grids: (frames, latent rows / 2, latent columns / 2) of the output, then of each context
        factor = self.vae_scale_factor * 2
        grid: tuple[tuple[int, int, int], ...] = ((1, h // factor, w // factor),)  # as h // vae_scale_factor // 2
        grid += tuple((1, ch // factor, cw // factor) for cw, ch in contexts)
        item.state.update(scheduler=scheduler, timesteps=timesteps, total=len(timesteps), latents=latents,
                          image_latents=image_latents, grid=grid, decode_extras={"height": h, "width": w})

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        s, cond = item.state, item.inputs["cond"]
        # img_shapes is one per forward (the grids: the output's, and an edit's context's); the text length and the
        # mask are the request's own, so that batching never pads (or masks) a request more than it is when alone
        return (s["grid"], tuple(s["latents"].shape[1:]), s["latents"].dtype, tuple(cond["embeds"].shape[1:]),
                cond["mask"] is not None)

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        hidden, timesteps, embeds, masks, sizes = [], [], [], [], []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            t = s["timesteps"][s["i"]]
            x = s["latents"] if s["image_latents"] is None else torch.cat([s["latents"], s["image_latents"]], dim=1)
            x = torch.cat([x] * 2) if cond["cfg"] else x  # [rows, L (+ L_image), 4C]
            hidden.append(x)
            timesteps.append(t.expand(x.shape[0]).to(x.dtype))  # per-sample: items sit at different steps
            embeds.append(cond["embeds"])
            masks.append(cond["mask"])
            sizes.append(x.shape[0])
        batched = {"hidden_states": torch.cat(hidden), "timestep": torch.cat(timesteps) / 1000,
                   "encoder_hidden_states": torch.cat(embeds),
                   "encoder_hidden_states_mask": torch.cat(masks) if masks[0] is not None else None}
        # one grid for every row (the grids are in the key): hashable, so a graph's signature can hold it
        shared = {"grid": tuple(tuple(shape) for shape in items[0].state["grid"])}
        out = self.denoise("transformer", items, sizes, batched, shared)
        # the predictions of the noise tokens only (an edit's context tokens come to nothing)
        return [o[:, :item.state["latents"].shape[1]] for o, item in zip(out, items, strict=True)]

    def call_denoiser(self, key: str, *, grid: tuple, **inputs: Any) -> torch.Tensor:
        """The transformer with `img_shapes`, one entry per row of this call (a graph's padding rows included: a
        zero_cond_t transformer reads every entry, the others the first)."""
        rows = inputs["hidden_states"].shape[0]
        return self.pipe.transformer(**inputs, img_shapes=[list(grid)] * rows, return_dict=False)[0]

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return tuple(module.transformer_blocks)

    def cache_spec(self, key: str, module) -> CacheSpec | None:
        # dual-stream blocks -> (text, image); the image stream (and an edit's context tokens) is the cached one.
        # A zero_cond_t transformer (Qwen-Image-Edit-2511) doubles temb's rows inside the blocks: not cut by rows.
        if getattr(module.config, "zero_cond_t", False):
            return None
        return CacheSpec(key, self.repeated_blocks(module), encoder="encoder_hidden_states", out_hidden=1,
                         out_encoder=0, indicator=functools.partial(_modulated_image, module.transformer_blocks[0]))

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


def _modulated_image(block, args: dict) -> torch.Tensor:
    """TeaCache's input for Qwen-Image: block 0's image stream, normalised and modulated by the timestep
    (img_norm1(x) * (1 + scale) + shift of its first modulation)."""
    shift, scale, _ = block.img_mod(args["temb"]).chunk(2, dim=-1)[0].chunk(3, dim=-1)
    return block.img_norm1(args["hidden_states"]) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
