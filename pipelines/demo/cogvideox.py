"""A tiny, seeded, random-weight CogVideoX checkpoint (CogVideoXPipeline, CogVideoX-5b's layout), and its
image-to-video variant (CogVideoXImageToVideoPipeline, CogVideoX-5b-I2V's layout).

    family         pipeline                        latents [T, C, H, W] for 9 frames at 32 x 32
    cogvideox      CogVideoXPipeline               3 x 4 x 4 x 4   (VAE: 8x spatial, 4x temporal; patch 2, rotary)
    cogvideox-i2v  CogVideoXImageToVideoPipeline   the same, the transformer reading 8 channels (latents + image's)

The transformer keeps CogVideoX's sample size (60 x 90 latents, 49 frames), so a request that names no size or
frames gets the pipeline's 480 x 720 x 49; its scheduler is CogVideoX-2b's DDIM (zero-SNR, v-prediction).
The T5 tokenizer is built in memory (pipelines/demo/__init__.py) and saved with the checkpoint.
"""

from __future__ import annotations

from pipelines.demo.video import _seeded, _t5_config


def build_cogvideox(seed: int, scale: str, *, image_to_video: bool = False):
    """`image_to_video`: the transformer takes the image's latents beside the noisy ones (in_channels 2 x 4), saved
    as a CogVideoXImageToVideoPipeline."""
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXImageToVideoPipeline,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    from pipelines.demo import _t5_tokenizer

    tokenizer = _t5_tokenizer()
    text_encoder = _seeded(seed, lambda: T5EncoderModel(_t5_config(T5Config, tokenizer)))
    vae = _seeded(seed, lambda: AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4))
    transformer = _seeded(seed, lambda: CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=8 if image_to_video else 4, out_channels=4,
        time_embed_dim=8, text_embed_dim=32, num_layers=2, sample_width=90, sample_height=60, sample_frames=49,
        patch_size=2, temporal_compression_ratio=4, max_text_seq_length=226, use_rotary_positional_embeddings=True))
    # CogVideoX-2b's scheduler config (the 5b checkpoints use CogVideoXDPMScheduler with the same settings)
    scheduler = CogVideoXDDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                       clip_sample=False, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                       set_alpha_to_one=True, snr_shift_scale=3.0, timestep_spacing="trailing")
    pipeline = CogVideoXImageToVideoPipeline if image_to_video else CogVideoXPipeline
    return pipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                    scheduler=scheduler)
