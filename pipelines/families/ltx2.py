"""LTX-2: one audio-video DiT (LTX2VideoTransformer3DModel) over packed video and audio latents + a Gemma 3 text
encoder and its text connectors + AutoencoderKLLTX2Video, and the audio VAE and vocoder for the soundtrack.

Its own family, not LTX-Video's: the text stack (Gemma's stacked hidden states through per-modality connectors),
the transformer (two streams, video and audio, cross-attending each other), the VAEs and the guidance all differ.

Mirrors diffusers' LTX2Pipeline (text-to-video) step by step, at its __call__ defaults: the prompt embedded once per
text (the connectors work row by row, so their output is cached with Gemma's); float32 video and audio latents drawn
from the request's generator in that order; flow-matching sigmas linspace(1, 1 / steps, steps) shifted by mu from the
video's token count, one scheduler per stream. Each step runs up to three batched forwards over every request in the
batch: the [negative, prompt] CFG rows, the spatio-temporal-guidance rows (self-attention skipped in `stg_blocks`)
and the modality-isolation rows (no audio<->video cross-attention); their x0 deltas add, are rescaled
(guidance_rescale) and turn back into a velocity for the Euler step. The request's guidance_scale is the video's CFG
scale; the audio's is audio_guidance_scale (7). The soundtrack is decoded with the video and returned as
outputs["audio"] (float32 [samples, channels]) at outputs["sample_rate"]; /v1/videos muxes it into the MP4 (AAC).

Not served: image-to-video and the conditioned/two-stage/DFR pipelines, prompt enhancement, the duration head
(num_frames comes from the request), motion_speed, decode noise (decode_timestep 0), step caching.
"""

from __future__ import annotations

import copy
from typing import Any, Hashable

import numpy as np
import torch
from diffusers import LTX2Pipeline
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg, retrieve_timesteps
from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

from pipelines.families.video_base import VideoFamily
from pipelines.video import VideoRequest, VideoTask
from stages.stage import WorkItem


class LTX2Family(VideoFamily):
    family = "ltx2"
    class_names = ("LTX2Pipeline",)
    pipelines_by_class = {"LTX2Pipeline": {VideoTask.TEXT_TO_VIDEO: LTX2Pipeline}}
    default_steps = 30  # LTX2Pipeline.__call__ defaults
    default_guidance = 3.0
    default_size = (768, 512)  # (width, height)
    default_frames = 121
    default_fps = 24.0
    max_sequence_length = 1024
    cond_keys = ("video", "audio", "mask")  # the connectors' outputs, [negative, prompt] as __call__ orders them
    # the rest of __call__'s guidance, fixed per model (requests set guidance_scale only)
    audio_guidance_scale = 7.0
    stg_scale, audio_stg_scale = 1.0, 1.0
    modality_scale, audio_modality_scale = 3.0, 3.0
    guidance_rescale, audio_guidance_rescale = 0.7, 0.7
    stg_blocks: tuple[int, ...] = (28,)  # spatio_temporal_guidance_blocks: LTX-2's 48-block transformer
    use_cross_timestep = True
    motion_speed = 1.0

    @property
    def size_factor(self) -> int:
        return 32  # LTX2Pipeline.check_inputs: height and width divisible by 32

    @property
    def frame_factor(self) -> int:
        return self.pipe.vae_temporal_compression_ratio

    # -- requests -----------------------------------------------------------------------------
    def audio_scale(self, request: VideoRequest) -> float:
        assert request.guidance_scale is not None  # validate() filled it
        return self.audio_guidance_scale or request.guidance_scale  # __call__: audio_guidance_scale or guidance_scale

    @property
    def stg(self) -> bool:
        return self.stg_scale > 0.0 or self.audio_stg_scale > 0.0

    @property
    def isolation(self) -> bool:
        return self.modality_scale > 1.0 or self.audio_modality_scale > 1.0

    def uses_negative(self, request: VideoRequest) -> bool:
        assert request.guidance_scale is not None
        return request.guidance_scale > 1.0 or self.audio_scale(request) > 1.0  # do_classifier_free_guidance

    def request_rows(self, request: VideoRequest) -> int:
        return (2 if self.uses_negative(request) else 1) + int(self.stg) + int(self.isolation)  # rows a step runs

    # -- 1. text ----------------------------------------------------------------------------
    def text_key(self, text: str) -> Hashable:
        return tuple(self.pipe.tokenizer(text.strip(), max_length=self.max_sequence_length, truncation=True).input_ids)

    def encode_text(self, text: str) -> dict[str, torch.Tensor]:
        pipe = self.pipe
        embeds, mask = pipe._get_gemma_prompt_embeds(text, 1, self.max_sequence_length, device=self.device)
        video, audio, mask = pipe.connectors(embeds, mask, padding_side=getattr(pipe.tokenizer, "padding_side", "left"))
        return {"video": video, "audio": audio, "mask": mask}  # [1, L, D_video], [1, L, D_audio], [1, L]

    # -- 2. prepare ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, item: WorkItem) -> None:
        req, cond, scheduler, view, generator = self.begin(item)
        h, w, frames, steps = req.height, req.width, req.num_frames, req.num_inference_steps
        assert h is not None and w is not None and frames is not None and steps is not None and req.fps is not None

        # 2.1 video then audio latents, packed [1, tokens, C], from the one generator (the order __call__ draws them)
        grid = ((frames - 1) // view.vae_temporal_compression_ratio + 1, h // view.vae_spatial_compression_ratio,
                w // view.vae_spatial_compression_ratio)  # latent frames, height, width
        latents = view.prepare_latents(1, view.transformer.config.in_channels, h, w, frames, 0.0, torch.float32,
                                       self.device, generator)
        audio_per_second = view.audio_sampling_rate / view.audio_hop_length / float(
            view.audio_vae_temporal_compression_ratio)
        audio_frames = round(frames / req.fps * audio_per_second)
        audio_vae = view.audio_vae.config
        audio_latents = view.prepare_audio_latents(1, num_channels_latents=audio_vae.latent_channels,
                                                   audio_latent_length=audio_frames, num_mel_bins=audio_vae.mel_bins,
                                                   noise_scale=0.0, dtype=torch.float32, device=self.device,
                                                   generator=generator)

        # 2.2 timesteps: sigmas shifted by mu from the video's token count; the audio steps on a copy
        config = scheduler.config
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 1024),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.95),
                             config.get("max_shift", 2.05))
        sigmas = np.linspace(1.0, 1 / steps, steps)
        audio_scheduler = copy.deepcopy(scheduler)
        for sched in (audio_scheduler, scheduler):  # diffusers annotates sigmas as list[float]; it passes an array
            timesteps, _ = retrieve_timesteps(sched, steps, self.device, None, sigmas=sigmas, mu=mu)  # type: ignore
            sched.set_begin_index(0)

        # 2.3 positions: the video's RoPE follows the conditioning frame rate
        fps = conditioning_frame_rate(req.fps, self.motion_speed)
        video_coords = view.transformer.rope.prepare_video_coords(1, *grid, self.device, fps=fps)
        audio_coords = view.transformer.audio_rope.prepare_audio_coords(1, audio_frames, self.device)
        item.state.update(scheduler=scheduler, audio_scheduler=audio_scheduler, timesteps=timesteps,
                          total=len(timesteps), latents=latents, audio_latents=audio_latents, grid=grid,
                          audio_frames=audio_frames, fps=fps, video_coords=video_coords, audio_coords=audio_coords,
                          decode_extras={"grid": grid, "audio_frames": audio_frames})

    # -- 3. denoise ------------------------------------------------------------------------
    def denoise_key(self, item: WorkItem) -> Hashable:
        s, cond = item.state, item.inputs["cond"]
        return (s["grid"], s["audio_frames"], s["fps"], tuple(s["latents"].shape[1:]),
                tuple(s["audio_latents"].shape[1:]), tuple(cond["video"].shape[1:]), tuple(cond["audio"].shape[1:]))

    def call_denoiser(self, key: str, *args: Any, **inputs: Any) -> torch.Tensor:
        """The transformer's (video, audio) outputs as one [rows, video + audio features] tensor (what the speed-ups
        split by rows and graphs capture)."""
        video, audio = self.pipe.transformer(*args, **inputs, return_dict=False)
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def _pass(self, items: list[WorkItem], positive_only: bool,
              **flags: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One batched transformer forward over every item: its CFG rows, or (positive_only) the prompt's row
        alone; -> per item (video, audio) outputs in float32, [rows, tokens, C] each."""
        dtype = self.pipe.text_encoder.dtype
        inputs: dict[str, list[torch.Tensor]] = {k: [] for k in (
            "hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
            "timestep", "encoder_attention_mask", "video_coords", "audio_coords")}
        sizes = []
        for item in items:
            s, cond = item.state, item.inputs["cond"]
            rows = 1 if positive_only or not cond["cfg"] else 2
            inputs["hidden_states"].append(torch.cat([s["latents"]] * rows).to(dtype))
            inputs["audio_hidden_states"].append(torch.cat([s["audio_latents"]] * rows).to(dtype))
            inputs["encoder_hidden_states"].append(cond["video"][-rows:])
            inputs["audio_encoder_hidden_states"].append(cond["audio"][-rows:])
            inputs["encoder_attention_mask"].append(cond["mask"][-rows:])
            inputs["timestep"].append(s["timesteps"][s["i"]].expand(rows))
            inputs["video_coords"].append(torch.cat([s["video_coords"]] * rows))
            inputs["audio_coords"].append(torch.cat([s["audio_coords"]] * rows))
            sizes.append(rows)
        batched = {k: torch.cat(v) for k, v in inputs.items()}
        batched["sigma"] = batched["timestep"]  # used by LTX-2.3
        batched["audio_encoder_attention_mask"] = batched["encoder_attention_mask"]
        s = items[0].state
        frames, height, width = s["grid"]
        shared = {"num_frames": frames, "height": height, "width": width, "fps": s["fps"],
                  "audio_num_frames": s["audio_frames"], "use_cross_timestep": self.use_cross_timestep, **flags}
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        video_shape, audio_shape = s["latents"].shape[1:], s["audio_latents"].shape[1:]
        split = video_shape.numel()
        for packed in self.denoise("transformer", items, sizes, batched, shared):
            packed = packed.float()
            out.append((packed[:, :split].reshape(-1, *video_shape), packed[:, split:].reshape(-1, *audio_shape)))
        return out

    @torch.inference_mode()
    def forward(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        main = self._pass(items, False, isolate_modalities=False, spatio_temporal_guidance_blocks=None)
        stg = self._pass(items, True, isolate_modalities=False, spatio_temporal_guidance_blocks=self.stg_blocks) \
            if self.stg else [None] * len(items)
        isolated = self._pass(items, True, isolate_modalities=True, spatio_temporal_guidance_blocks=None) \
            if self.isolation else [None] * len(items)
        return [{"main": m, "stg": g, "isolated": i} for m, g, i in zip(main, stg, isolated, strict=True)]

    # -- speed-ups ----------------------------------------------------------------------------
    denoiser_keys = ("transformer",)

    def repeated_blocks(self, module) -> tuple:
        return tuple(module.transformer_blocks)

    @torch.inference_mode()
    def commit(self, item: WorkItem, model_output: dict[str, Any]) -> None:
        s, req, cfg = item.state, item.inputs["request"], item.inputs["cond"]["cfg"]
        i, t = s["i"], s["timesteps"][s["i"]]
        streams = (  # (latents, scheduler, CFG scale, STG scale, modality scale, rescale, which output)
            ("latents", s["scheduler"], req.guidance_scale, self.stg_scale, self.modality_scale,
             self.guidance_rescale, 0),
            ("audio_latents", s["audio_scheduler"], self.audio_scale(req), self.audio_stg_scale,
             self.audio_modality_scale, self.audio_guidance_rescale, 1))
        for name, scheduler, scale, stg_scale, modality_scale, rescale, k in streams:
            latents, sigma = s[name], scheduler.sigmas[i]

            def x0(velocity: torch.Tensor) -> torch.Tensor:
                return latents - velocity * sigma  # convert_velocity_to_x0

            main = model_output["main"][k]
            cfg_delta: torch.Tensor | int = 0
            if cfg:
                uncond, main = main.chunk(2)
                cfg_delta = (scale - 1) * (x0(main) - x0(uncond))
            pred = x0(main)
            stg_delta: torch.Tensor | int = 0
            if model_output["stg"] is not None:
                stg_delta = stg_scale * (pred - x0(model_output["stg"][k]))
            modality_delta: torch.Tensor | int = 0
            if model_output["isolated"] is not None:
                modality_delta = (modality_scale - 1) * (pred - x0(model_output["isolated"][k]))
            guided = pred + cfg_delta + stg_delta + modality_delta
            if rescale > 0:
                guided = rescale_noise_cfg(guided, pred, guidance_rescale=rescale)
            velocity = (latents - guided) / sigma  # convert_x0_to_velocity
            s[name] = scheduler.step(velocity, t, latents, return_dict=False)[0]
        s["decode_extras"]["audio_latents"] = s["audio_latents"]
        s["i"] = i + 1

    # -- 4. decode ---------------------------------------------------------------------------
    def decode_key(self, item: WorkItem) -> Hashable:
        extras = item.inputs["decode_extras"]
        lat = item.inputs["latents"]
        return (tuple(lat.shape[1:]), lat.dtype, extras["grid"], extras["audio_frames"])

    def latents_to_video(self, latents: torch.Tensor, items: list[WorkItem]) -> torch.Tensor:
        pipe, vae = self.pipe, self.pipe.vae
        grid = items[0].inputs["decode_extras"]["grid"]
        latents = pipe._unpack_latents(latents, *grid, pipe.transformer_spatial_patch_size,
                                       pipe.transformer_temporal_patch_size).to(pipe.text_encoder.dtype)
        timestep = None  # decode_timestep 0 and decode_noise_scale 0 (the defaults): the latents decode as they are
        if vae.config.timestep_conditioning:
            timestep = torch.zeros(latents.shape[0], device=latents.device, dtype=latents.dtype)
        latents = pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        return vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]

    def latents_to_audio(self, items: list[WorkItem]) -> torch.Tensor:
        """The items' audio latents -> waveforms [B, channels, samples] through the audio VAE and the vocoder."""
        pipe, audio_vae = self.pipe, self.pipe.audio_vae
        latents = torch.cat([it.inputs["decode_extras"]["audio_latents"] for it in items])
        latents = pipe._denormalize_audio_latents(latents, audio_vae.latents_mean, audio_vae.latents_std)
        mel_bins = audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        latents = pipe._unpack_audio_latents(latents, items[0].inputs["decode_extras"]["audio_frames"],
                                             num_mel_bins=mel_bins)
        mel = audio_vae.decode(latents.to(audio_vae.dtype), return_dict=False)[0]
        return pipe.vocoder(mel)

    @torch.inference_mode()
    def decode(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        out = super().decode(items)
        with self._vae_lock:
            audio = self.latents_to_audio(items).float().cpu().numpy()
        rate = int(getattr(self.pipe.vocoder.config, "output_sampling_rate", self.pipe.audio_sampling_rate))
        for result, wave in zip(out, audio, strict=True):
            result.update(audio=np.ascontiguousarray(wave.T), sample_rate=rate)  # [samples, channels]
        return out
