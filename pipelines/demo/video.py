"""Tiny, seeded, random-weight text/image-to-video checkpoints (Wan 2.1/2.2 and LTX-Video).

    family    pipeline                   latents [C, T, H, W] for 9 frames at 32 x 32
    wan       WanPipeline                16 x 3 x 4 x 4    (VAE: 8x spatial, 4x temporal; patch 1x2x2)
    wan-i2v   WanImageToVideoPipeline    16 x 3 x 4 x 4    (Wan 2.2 style: no CLIP image encoder;
                                                            the transformer reads latents + mask + condition)
    ltx       LTXPipeline                8 x 3 x 8 x 8     (VAE: 4x spatial, 4x temporal; patch 1)

The LTX checkpoint also serves image-to-video (LTXImageToVideoPipeline shares its components).
The T5 / UMT5 tokenizers are built in memory (pipelines/demo/__init__.py) and saved with the checkpoint.
"""

from __future__ import annotations

import torch


def _seeded(seed: int, make):
    torch.manual_seed(seed)
    return make()


def _t5_config(cls, tokenizer):
    return cls(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
               relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)


def build_wan(seed: int, scale: str, *, image_to_video: bool = False, clip_image_encoder: bool = False):
    """WanPipeline; image_to_video: WanImageToVideoPipeline (Wan 2.2 style, or Wan 2.1 with clip_image_encoder)."""
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    from pipelines.demo import _t5_tokenizer

    tokenizer = _t5_tokenizer()
    text_encoder = _seeded(seed, lambda: UMT5EncoderModel(_t5_config(UMT5Config, tokenizer)))
    vae = _seeded(seed, lambda: AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                                 temperal_downsample=[False, True, True]))
    transformer = _seeded(seed, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
        in_channels=16 * 2 + 4 if image_to_video else 16,  # i2v: latents + (4 mask + 16 condition) channels
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        image_dim=32 if clip_image_encoder else None))  # Wan 2.1 I2V: CLIP's penultimate hidden states
    # Wan 2.1's scheduler: UniPC on flow-matching sigmas, shifted.
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    parts = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler)
    if image_to_video:
        if not clip_image_encoder:
            return WanImageToVideoPipeline(**parts, image_encoder=None, image_processor=None)
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=32, patch_size=8)
        image_encoder = _seeded(seed, lambda: CLIPVisionModel(vision))
        processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        return WanImageToVideoPipeline(**parts, image_encoder=image_encoder, image_processor=processor)
    return WanPipeline(**parts)


def build_ltx(seed: int, scale: str):
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    from pipelines.demo import _t5_tokenizer

    tokenizer = _t5_tokenizer()
    text_encoder = _seeded(seed, lambda: T5EncoderModel(_t5_config(T5Config, tokenizer)))
    vae = _seeded(seed, lambda: AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False,
        patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False))
    transformer = _seeded(seed, lambda: LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=12,
        cross_attention_dim=24, num_layers=2, caption_channels=32))
    scheduler = FlowMatchEulerDiscreteScheduler(  # LTX-Video's: the shift grows with the token count
        shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1)
    return LTXPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                       transformer=transformer)
