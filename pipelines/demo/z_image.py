"""A tiny, seeded, random-weight Z-Image checkpoint (ZImagePipeline), built offline.

    z_image  tiny  vae scale factor 4  default size 1024 x 1024  latents [16, 256, 256]

Components: a ZImageTransformer2DModel of 2 main layers and 1 noise / context refiner each (16 latent channels,
2x2 patches), an AutoencoderKL with FLUX's latent space (16 channels, scaling and shift factors, so the decode's
mapping is exercised), the text encoder a tiny Qwen3Model with the demo's ChatML byte-level BPE tokenizer
(pipelines/demo/llm.py: ZImagePipeline wraps every prompt in the tokenizer's chat template and reads the
second-to-last hidden state), and FlowMatchEulerDiscreteScheduler with Z-Image's own scheduler config (shift 3.0, no
dynamic shifting). Outputs are noise; the code path is the real one.
"""

from __future__ import annotations

import torch


def build_z_image(seed: int = 0, scale: str = "tiny"):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from pipelines.demo.llm import chat_tokenizer

    tokenizer = chat_tokenizer()
    torch.manual_seed(seed)
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    ))
    latent_channels = 16
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=latent_channels, dim=32, n_layers=2,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=text_encoder.config.hidden_size,
        axes_dims=[4, 6, 6],  # sums to the head dim (dim / n_heads)
        axes_lens=[1024, 512, 512],
    )
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        block_out_channels=(16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, latent_channels=latent_channels, layers_per_block=1,
        norm_num_groups=16, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
        scaling_factor=0.3611, shift_factor=0.1159,  # FLUX's VAE, which Z-Image uses
    )
    # Z-Image-Turbo's scheduler_config.json
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
