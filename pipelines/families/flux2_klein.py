"""FLUX.2 [klein]: FLUX.2's transformer, latents and VAE (pipelines/families/flux2.py), a Qwen3 encoder, true CFG.

Mirrors diffusers' Flux2KleinPipeline, text-to-image and multi-reference editing. What differs from FLUX.2:

* the text encoder is a Qwen3 causal LM: the prompt as one user message through the tokenizer's chat template
  (generation prompt, thinking off), padded to request.extra['max_sequence_length'] (512), and hidden states 9, 18
  and 27 stacked per token ([1, L, 3D]);
* no embedded guidance (the transformer has no guidance embedder): guidance_scale is the scale of a true CFG whose
  negative half is the request's negative_prompt ("" when it gives none, as __call__ encodes ""). It runs when
  guidance_scale > 1 (default 4.0, 50 steps: __call__'s defaults); the negative and the prompt rows of a request
  go through one forward ([negative x n, prompt x n]), not two, and requests at different steps share it;
* a step-distilled checkpoint (`is_distilled` in model_index.json) runs no CFG whatever the scale (its
  __call__ ignores guidance_scale) and refuses a negative prompt.

The references of an edit, the timesteps (the empirical mu), the step caching and the decode are FLUX.2's.
"""

from __future__ import annotations

from typing import Hashable

import numpy as np
from diffusers import Flux2KleinPipeline

from pipelines.families.flux2 import MAX_SEQUENCE_LENGTH, Flux2Family
from pipelines.image_request import ImageRequest, Task


class Flux2KleinFamily(Flux2Family):
    family = "flux2_klein"
    class_names = ("Flux2KleinPipeline",)
    pipeline_classes = {Task.TEXT_TO_IMAGE: Flux2KleinPipeline, Task.IMAGE_TO_IMAGE: Flux2KleinPipeline}
    default_steps = 50  # Flux2KleinPipeline.__call__ num_inference_steps
    default_guidance = 4.0  # its guidance_scale: the true CFG's scale
    embeds_guidance = False  # __call__ passes guidance=None

    @property
    def distilled(self) -> bool:
        return bool(self.pipe.config.is_distilled)

    def no_cfg_reason(self) -> str | None:
        if self.distilled:
            return "a step-distilled FLUX.2 [klein] (is_distilled) runs no CFG"
        return None

    def uses_negative(self, request: ImageRequest) -> bool:
        # diffusers: do_classifier_free_guidance = guidance_scale > 1 and not is_distilled
        assert request.guidance_scale is not None  # validate() filled it
        return request.guidance_scale > 1.0 and not self.distilled

    # -- 1. text ----------------------------------------------------------------------------
    def text_key(self, text: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> Hashable:
        tokenizer = self.pipe.tokenizer  # the tokens _get_qwen3_prompt_embeds feeds the encoder
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
        inputs = tokenizer(chat, padding="max_length", truncation=True, max_length=max_sequence_length)
        ids, mask = (np.asarray(inputs[k]).tolist() for k in ("input_ids", "attention_mask"))
        return tuple(ids), tuple(mask)
