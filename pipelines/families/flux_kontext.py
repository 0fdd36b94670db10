"""FLUX.1 Kontext: in-context image editing on FLUX.1's components (MMDiT on packed latents, CLIP + T5, AutoencoderKL).

Mirrors diffusers' FluxKontextPipeline step by step. What differs from FluxFamily (pipelines/families/flux.py):

* an edit's input image is *context*, not a starting point: it is resized (to the preferred Kontext resolution of
  its aspect ratio unless request.extra['auto_resize'] is False), VAE-encoded (the distribution's mode: no draw
  from the generator), packed, and concatenated to the noise tokens of every step; its position ids carry 1 in
  the first channel. The transformer's output is cut back to the noise tokens. The denoising starts from pure
  noise at the first timestep (no strength: an edit's `strength` is ignored);
* the output size is fitted to an area (request.extra['max_area']) keeping the requested aspect ratio, as the
  pipeline's `max_area` does. Its default here is the requested width x height (the size a request names, or the
  input image's for edits, is the size it gets); diffusers' own default is 1024**2, so with max_area = 1024**2 a
  request reproduces a pipeline call that passes no max_area;
* the flow-matching sigmas are always the pipeline's linspace (FluxPipeline drops them for `use_flow_sigmas`).

Text-to-image (no image) is FluxPipeline's loop with those two differences. Guidance embeds, true CFG with a
negative prompt (request.extra['true_cfg_scale'] > 1), max_sequence_length and the prompt cache are FluxFamily's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux.pipeline_flux_kontext import (
    PREFERRED_KONTEXT_RESOLUTIONS,
    retrieve_timesteps,
)

from pipelines.families.flux import FluxFamily
from pipelines.image_request import ImageLimits, ImageRequest, RequestError, Task
from stages.diffusion.memory import Size
from stages.stage import WorkItem


class FluxKontextFamily(FluxFamily):
    family = "flux_kontext"
    class_names = ("FluxKontextPipeline",)  # type: ignore[assignment]  # FluxFamily's is inferred as a 3-tuple
    # One pipeline does both: with an image it edits in context, without one it generates.
    pipeline_classes = {Task.TEXT_TO_IMAGE: FluxKontextPipeline, Task.IMAGE_TO_IMAGE: FluxKontextPipeline}
    request_knobs = FluxFamily.request_knobs | {"max_area", "auto_resize"}

    # -- request knobs (request.extra) --------------------------------------------------------
    @staticmethod
    def auto_resize(request: ImageRequest) -> bool:
        return bool(request.extra.get("auto_resize", True))  # the pipeline's `_auto_resize`

    def validate(self, request: ImageRequest, limits: ImageLimits) -> ImageRequest:
        request = super().validate(request, limits)
        assert request.width is not None and request.height is not None  # validate() filled them
        factor = self.size_factor
        max_area = request.extra.get("max_area", request.width * request.height)
        if isinstance(max_area, bool) or not isinstance(max_area, int) or \
                not factor * factor <= max_area <= limits.max_pixels:
            raise RequestError("max_area", f"max_area must be an integer between {factor * factor} and "
                                           f"{limits.max_pixels}; got {max_area!r}")
        if not isinstance(request.extra.get("auto_resize", True), bool):
            raise RequestError("auto_resize", f"auto_resize must be true or false; got "
                                              f"{request.extra['auto_resize']!r}")
        width, height = fit_area(request.width, request.height, max_area, factor)
        if width < factor or height < factor or width * height > limits.max_pixels:
            raise RequestError("max_area", f"max_area {max_area} at the aspect ratio of {request.width}x"
                                           f"{request.height} makes {width}x{height}; this model needs at least "
                                           f"{factor}x{factor} and at most {limits.max_pixels} pixels",
                               code="unsupported_size")
        # the fitted size says it all now: without max_area a second validate keeps it
        extra = {k: v for k, v in request.extra.items() if k != "max_area"}
        request = dataclasses.replace(request, width=width, height=height, extra=extra)
        context = self.context_size(request)
        if context is not None and min(context) < factor:
            raise RequestError("image", f"image is {request.image.size[0]}x{request.image.size[1]}; this model "
                                        f"needs at least {factor}x{factor}", code="image_too_small")
        return request

    def context_size(self, request: ImageRequest) -> tuple[int, int] | None:
        """(width, height) the context image is encoded at, as the pipeline's step 3 resizes it; None: no image."""
        if request.task is not Task.IMAGE_TO_IMAGE or request.image is None:
            return None
        height, width = self.pipe.image_processor.get_default_height_width(request.image)  # down to the VAE factor
        if min(height, width) < 1:
            return (0, 0)
        if self.auto_resize(request):  # Kontext is trained on these resolutions
            aspect_ratio = width / height
            _, width, height = min((abs(aspect_ratio - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        factor = self.size_factor
        return width // factor * factor, height // factor * factor

    def request_size(self, request: ImageRequest) -> Size:
        """The context image's tokens ride along as extra 'frames' of the output's size (rounded up), so that memory
        estimates (stages/diffusion/memory.py) grow with all the tokens one forward holds."""
        width, height = request.width or 0, request.height or 0
        context = self.context_size(request)
        if context is None or not width * height:
            return (width, height, 1)
        return (width, height, 1 + math.ceil(context[0] * context[1] / (width * height)))

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        dtype = cond["embeds"].dtype
        channels = view.transformer.config.in_channels // 4
        h, w = req.height, req.width
        assert h is not None and w is not None  # validate() filled them
        state: dict[str, Any] = {"scheduler": scheduler, "decode_extras": {"height": h, "width": w}}

        # 2.1 the context image, resized and preprocessed as the pipeline's step 3 does
        image, context = None, self.context_size(req)
        if context is not None:
            image = view.image_processor.resize(req.image, context[1], context[0])
            image = view.image_processor.preprocess(image, context[1], context[0])

        # 2.2 latents: packed noise, and the context's packed latents (ids with 1 in their first channel)
        with self._vae_lock:
            latents, image_latents, latent_ids, image_ids = view.prepare_latents(
                image, req.n, channels, h, w, dtype, self.device, generator)
        if image_ids is not None:
            latent_ids = torch.cat([latent_ids, image_ids], dim=0)  # dim 0: the token axis

        # 2.3 timesteps: flow-matching sigmas, shifted by mu from the noise's token count
        steps = req.num_inference_steps
        assert steps is not None  # validate() filled it
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = self.shift(scheduler, latents.shape[1])
        # diffusers annotates sigmas as list[float]; its own pipeline passes this numpy array
        timesteps, steps = retrieve_timesteps(scheduler, steps, self.device,
                                              sigmas=sigmas, mu=mu)  # type: ignore[arg-type]
        scheduler.set_begin_index(0)

        # 2.4 the embedded guidance of guidance-distilled transformers: one value per sample
        state["guidance"] = None
        if view.transformer.config.guidance_embeds:
            rows = latents.shape[0] * (2 if cond["cfg"] else 1)
            assert req.guidance_scale is not None  # validate() filled it
            state["guidance"] = torch.full([1], req.guidance_scale, device=self.device,
                                           dtype=torch.float32).expand(rows)
        state.update(timesteps=timesteps, total=len(timesteps), latents=latents, image_latents=image_latents,
                     image_ids=latent_ids, context=context)
        item.state.update(state)

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        # The context's size sets its token count and its ids (None: text-to-image, no context tokens).
        return (super().denoise_key(item), item.state["context"])

    def model_input(self, item: WorkItem) -> torch.Tensor:
        """The noise tokens, then the context image's ([n, L + L_image, 64]; without a context, the noise's)."""
        s = item.state
        return s["latents"] if s["image_latents"] is None else torch.cat([s["latents"], s["image_latents"]], dim=1)

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        # the predictions of the noise tokens only (the context's come first to nothing); the ids of one key are
        # equal for all its items (the latent grid, the context's size and the T5 length are in it)
        out = super().forward(items)
        return [o[:, :item.state["latents"].shape[1]] for o, item in zip(out, items, strict=True)]

def fit_area(width: int, height: int, max_area: int, multiple_of: int) -> tuple[int, int]:
    """(width, height) of about max_area pixels at width:height's aspect ratio, rounded down to multiple_of: the
    pipeline's own adjustment of the size it is asked for."""
    aspect_ratio = width / height
    width = round((max_area * aspect_ratio) ** 0.5) // multiple_of * multiple_of
    height = round((max_area / aspect_ratio) ** 0.5) // multiple_of * multiple_of
    return width, height
