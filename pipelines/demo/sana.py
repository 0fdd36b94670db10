"""A tiny, seeded, random-weight Sana checkpoint (SanaPipeline), built offline.

    sana  tiny  vae scale factor 4  transformer sample_size 16 (the 512 px aspect-ratio bins)

Components: a 2-layer SanaTransformer2DModel (linear self-attention, cross-attention to the text), a 3-level
AutoencoderDC (scale factor 4, 4 latent channels, Sana's scaling_factor so the decode's scaling is exercised), the
text encoder a tiny Gemma2Model with an offline Unigram tokenizer (the demo's T5 one: SanaPipeline only needs a
tokenizer that pads right to max_length), and DPMSolverMultistepScheduler with Sana's own scheduler config (flow
sigmas, flow_shift 3.0, flow_prediction). Outputs are noise; the code path is the real one.
"""

from __future__ import annotations

import torch


def build_sana(seed: int = 0, scale: str = "tiny"):
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    from pipelines.demo import _t5_tokenizer

    tokenizer = _t5_tokenizer()
    # the complex human instruction alone is ~1.3k characters (one token each here) before the 300 prompt tokens
    tokenizer.model_max_length = 4096
    torch.manual_seed(seed)
    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, sliding_window=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.pad_token_id,
    ))
    latent_channels = 4
    torch.manual_seed(seed)
    transformer = SanaTransformer2DModel(
        in_channels=latent_channels, out_channels=latent_channels, num_attention_heads=2, attention_head_dim=8,
        num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
        caption_channels=text_encoder.config.hidden_size, sample_size=16, patch_size=1,
    )
    torch.manual_seed(seed)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=latent_channels, attention_head_dim=8,
        encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 16, 16), decoder_block_out_channels=(8, 16, 16),
        encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        encoder_qkv_multiscales=((), (), (5,)), decoder_qkv_multiscales=((), (), (5,)),
        scaling_factor=0.41407,  # Sana's DC-AE f32c32
    )
    # Sana's scheduler_config.json (Sana_1600M_1024px_diffusers)
    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", solver_order=2,
        prediction_type="flow_prediction", algorithm_type="dpmsolver++", solver_type="midpoint",
        lower_order_final=True, final_sigmas_type="zero", use_flow_sigmas=True, flow_shift=3.0,
        timestep_spacing="linspace", steps_offset=0,
    )
    return SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=scheduler)
