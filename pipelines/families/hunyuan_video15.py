"""HunyuanVideo 1.5: a dual-stream 3-D DiT over video tokens and three condition streams (Qwen2.5-VL text, ByT5
glyph text, SigLIP image) + AutoencoderKLHunyuanVideo15, guided by the checkpoint's ClassifierFreeGuidance guider.

Mirrors diffusers' HunyuanVideo15Pipeline (text-to-video) and HunyuanVideo15ImageToVideoPipeline (image-to-video)
step by step: the Qwen2.5-VL hidden state 2 layers before the last, of the prompt in the system-message chat template,
cropped by crop_start (108) to 1000 tokens with its mask; ByT5 embeddings of the prompt's quoted text (zeros and an
empty mask when it quotes none); the flow-matching scheduler on sigmas linspace(1, 0, steps + 1)[:-1]; latents
[B, C, F, H, W] in the transformer's dtype beside the condition latents and their mask on the channel axis (zeros for
text-to-video; image-to-video: the image's VAE latents (argmax) on the first frame, mask 1 there); image embeddings
of zeros (text-to-video: the transformer reads all-zero image embeddings as "no image") or SigLIP's last hidden state
of the image; the decode by 1 / scaling_factor.

Guidance is the guider's (ClassifierFreeGuidance): the request's guidance_scale (default: the guider config's) on a
private copy of the guider per request, which decides, as in diffusers, whether the negative prompt ("" when none) is
encoded (scale not 1, guider enabled) and combines the two predictions each step (its formulation, rescale and
start/stop window). The two rows are one batched forward here; a step outside the guider's start/stop window still
computes the unconditional row (the guider ignores it), so a request keeps one row count for every step.

Image-to-video: the image is resized and centre-cropped to the output size, which is the request's size, else the
configured default size, else (as the pipeline) the bucket of the image's aspect ratio at the transformer's
target_size; the SigLIP encode and the VAE encode run in prepare. The meanflow transformer's `timestep_r` (the next
timestep, 0 at the end) is passed as the image-to-video pipeline passes it.

Not served: other guiders than ClassifierFreeGuidance (refused at load), custom sigmas, text-to-video from an
image-to-video checkpoint or the reverse (each serves its own class's task).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
from diffusers.guiders.classifier_free_guidance import ClassifierFreeGuidance
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts, format_text_input

from encoders.cache import EncoderCache
from pipelines.families.hunyuan_video import decode_hunyuan_latents, dual_stream_cache_spec
from pipelines.families.video_base import VideoFamily
from pipelines.video import VideoConfig, VideoRequest, VideoTask
from stages.diffusion.block_stack import CacheSpec
from stages.stage import WorkItem

TEXT_KEYS = ("embeds", "mask", "embeds_2", "mask_2")  # Qwen2.5-VL embeddings and mask, ByT5's


class HunyuanVideo15Family(VideoFamily):
    family = "hunyuan_video15"
    class_names = ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline")
    pipelines_by_class = {
        "HunyuanVideo15Pipeline": {VideoTask.TEXT_TO_VIDEO: HunyuanVideo15Pipeline},
        "HunyuanVideo15ImageToVideoPipeline": {VideoTask.IMAGE_TO_VIDEO: HunyuanVideo15ImageToVideoPipeline}}
    default_steps = 50  # HunyuanVideo15Pipeline.__call__ defaults (guidance: the guider's config, see __init__)
    default_frames = 121
    default_fps = 24.0  # HunyuanVideo 1.5's clips: 121 frames, 5 s at 24 fps
    cond_keys = TEXT_KEYS

    def __init__(self, name: str, path: str, *, device: str = "cpu", dtype: str = "float32",
                 prompt_cache: EncoderCache | None = None, video: VideoConfig | None = None,
                 quantize: dict[str, str] | None = None):
        super().__init__(name, path, device=device, dtype=dtype, prompt_cache=prompt_cache, video=video,
                         quantize=quantize)
        if type(self.pipe.guider) is not ClassifierFreeGuidance:
            raise ValueError(f"model {self.name}: the {self.family} family runs a ClassifierFreeGuidance guider, this "
                             f"checkpoint's is {type(self.pipe.guider).__name__}; serve it with family = \"diffusers\"")
        self.default_guidance = float(self.pipe.guider.guidance_scale)  # the guider's: __call__ has no guidance_scale

    @property
    def request_default_size(self) -> tuple[int, int]:
        # __call__: the 16:9 bucket at the transformer's target_size
        aspect_w, aspect_h = getattr(self.pipe, "default_aspect_ratio", (16, 9))  # (width, height)
        return self.video.default_size or self._bucket(aspect_h, aspect_w)

    def _bucket(self, height: int, width: int) -> tuple[int, int]:
        """(width, height) of the pipeline's size bucket nearest that aspect ratio at the target size."""
        h, w = self.pipe.video_processor.calculate_default_height_width(height, width, self.pipe.target_size)
        return w, h

    @property
    def size_factor(self) -> int:
        return self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size

    @property
    def frame_factor(self) -> int:
        return self.pipe.vae_scale_factor_temporal

    # -- requests -----------------------------------------------------------------------------
    def validate(self, request: VideoRequest) -> VideoRequest:
        # image-to-video with no size: the configured default, else the bucket of the image (the pipeline's rule)
        if (request.image is not None and hasattr(request.image, "size") and request.width is None
                and request.height is None and self.video.default_size is None):
            width, height = self._bucket(request.image.size[1], request.image.size[0])
            request = replace(request, width=width, height=height)
        return super().validate(request)

    def request_guider(self, request: VideoRequest) -> Any:
        """A private copy of the checkpoint's guider at the request's guidance_scale (its step state is per request;
        the loaded guider itself is never stepped, so every copy starts as a fresh one). A copy, not `guider.new`:
        that builds a guider, which logs diffusers' "experimental feature" warning each time."""
        guider = copy.copy(self.pipe.guider)
        guider.guidance_scale = request.guidance_scale
        return guider

    def uses_negative(self, request: VideoRequest) -> bool:
        # __call__: the negative prompt is encoded when guider._enabled and guider.num_conditions > 1
        return self.request_guider(request).num_conditions > 1

    def request_rows(self, request: VideoRequest) -> int:
        return 2 if self.uses_negative(request) else 1

    # -- 1. text ----------------------------------------------------------------------------
    def text_key(self, text: str) -> Hashable:
        pipe = self.pipe
        chat = pipe.tokenizer.apply_chat_template(
            format_text_input([text], pipe.system_message), add_generation_prompt=True, tokenize=True,
            return_dict=True, max_length=pipe.tokenizer_max_length + pipe.prompt_template_encode_start_idx,
            truncation=True)
        glyphs = extract_glyph_texts(text)
        byt5 = None if glyphs is None else tuple(pipe.tokenizer_2(glyphs, max_length=pipe.tokenizer_2_max_length,
                                                                  truncation=True).input_ids)
        return (tuple(chat["input_ids"][0]), byt5)

    def encode_text(self, text: str) -> dict[str, torch.Tensor]:
        # encode_prompt: [1, 1000, D] Qwen embeddings and mask, [1, 256, D_byt5] ByT5's and mask, in the transformer's
        # dtype as __call__ asks
        tensors = self.pipe.encode_prompt(prompt=text, device=self.device, dtype=self.pipe.transformer.dtype)
        return dict(zip(TEXT_KEYS, tensors, strict=True))

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        h, w, frames = req.height, req.width, req.num_frames
        assert h is not None and w is not None and frames is not None and req.num_inference_steps is not None
        dtype = view.transformer.dtype

        # 2.1 image-to-video: the image cropped to the output size, and its SigLIP embeddings (encode_image)
        image = image_embeds = None
        if req.task is VideoTask.IMAGE_TO_VIDEO:
            image = view.video_processor.resize(req.image, height=h, width=w, resize_mode="crop")
            image_embeds = view.encode_image(image=image, batch_size=1, device=self.device, dtype=dtype)

        # 2.2 timesteps: retrieve_timesteps(scheduler, steps, device, sigmas=linspace(1, 0, steps + 1)[:-1])
        sigmas = np.linspace(1.0, 0.0, req.num_inference_steps + 1)[:-1]
        scheduler.set_timesteps(sigmas=sigmas, device=self.device)
        timesteps = scheduler.timesteps

        # 2.3 latents [1, C, (F - 1) // 4 + 1, H / 16, W / 16] in the transformer's dtype, then the condition latents
        # and mask beside them: zeros for text-to-video, the image's VAE latents on frame 0 for image-to-video
        latents = view.prepare_latents(1, view.num_channels_latents, h, w, frames, dtype, self.device, generator)
        if image is None:
            cond_latents, mask = view.prepare_cond_latents_and_mask(latents, dtype, self.device)
            image_embeds = torch.zeros(1, view.vision_num_semantic_tokens, view.vision_states_dim, dtype=dtype,
                                       device=self.device)
        else:
            with self._vae_lock:
                cond_latents, mask = view.prepare_cond_latents_and_mask(latents, image, 1, h, w, dtype, self.device)
        condition = torch.cat([cond_latents, mask], dim=1)  # [1, C + 1, F, h, w]

        # 2.4 the meanflow transformer's second timestep (the image-to-video pipeline passes it)
        meanflow = image is not None and view.transformer.config.use_meanflow
        item.state.update(scheduler=scheduler, timesteps=timesteps, total=len(timesteps), latents=latents,
                          condition=condition, image_embeds=image_embeds, meanflow=meanflow,
                          guider=self.request_guider(req), decode_extras={})

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        # the rotary grid follows the latents' shape; the token streams their lengths; the transformer tells
        # text-to-video by an all-zero image embedding batch, so the tasks never share a forward
        s, cond, req = item.state, item.inputs["cond"], item.inputs["request"]
        return (tuple(s["latents"].shape[1:]), s["latents"].dtype, req.task, s["meanflow"],
                tuple(s["image_embeds"].shape[1:]), *(tuple(cond[k].shape[1:]) for k in TEXT_KEYS))

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[torch.Tensor]:
        inputs: dict[str, list[torch.Tensor]] = {k: [] for k in ("hidden_states", "timestep", "timestep_r",
                                                                  "image_embeds", *TEXT_KEYS)}
        sizes = []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            i, timesteps = s["i"], s["timesteps"]
            rows = 2 if cond["cfg"] else 1
            x = torch.cat([s["latents"], s["condition"]], dim=1)  # [1, 2C + 1, F, h, w]
            inputs["hidden_states"].append(torch.cat([x] * rows))
            inputs["timestep"].append(timesteps[i].expand(rows).to(x.dtype))
            if s["meanflow"]:
                t_r = timesteps[i + 1] if i + 1 < len(timesteps) else torch.tensor([0.0], device=self.device)
                inputs["timestep_r"].append(t_r.expand(rows).to(x.dtype))
            inputs["image_embeds"].append(torch.cat([s["image_embeds"]] * rows))
            for k in TEXT_KEYS:
                inputs[k].append(cond[k])
            sizes.append(rows)
        names = {"embeds": "encoder_hidden_states", "mask": "encoder_attention_mask",
                 "embeds_2": "encoder_hidden_states_2", "mask_2": "encoder_attention_mask_2"}
        batched = {names.get(k, k): torch.cat(v) for k, v in inputs.items() if v}
        return self.denoise("transformer", items, sizes, batched)

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return tuple(module.transformer_blocks)

    def cache_spec(self, key: str, module) -> CacheSpec:
        # dual-stream blocks -> (video, tokens of the three condition streams), as HunyuanVideo's
        return dual_stream_cache_spec(key, self.repeated_blocks(module))

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: torch.Tensor) -> None:
        s = item.state
        i, guider, t = s["i"], s["guider"], s["timesteps"][s["i"]]
        # the guider's step state decides whether this step guides (its start/stop window), then combines
        guider.set_state(step=i, num_inference_steps=s["total"], timestep=t)
        if item.inputs["cond"]["cfg"]:
            uncond, cond = model_output.chunk(2)
            noise_pred = guider.forward(pred_cond=cond, pred_uncond=uncond).pred
        else:
            noise_pred = guider.forward(pred_cond=model_output).pred
        s["latents"] = s["scheduler"].step(noise_pred, t, s["latents"], return_dict=False)[0]
        s["i"] = i + 1

    # -- 4. decode ---------------------------------------------------------------------------
    def latents_to_video(self, latents: torch.Tensor, items: list[WorkItem]) -> torch.Tensor:
        """[B, C, F, h, w] latents -> [B, 3, frames, H, W], one video at a time: the VAE's mid-block attention
        (diffusers 0.42) broadcasts its [B, L, L] causal mask against [B, 1, L, L] and fails for B > 1."""
        return torch.cat([decode_hunyuan_latents(self.pipe.vae, video) for video in latents.split(1)])
