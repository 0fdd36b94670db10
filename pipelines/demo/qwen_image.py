"""A tiny, seeded, random-weight Qwen-Image checkpoint (QwenImagePipeline), built offline.

    qwen_image       tiny  vae scale factor 4  default size 512 x 512  latents [4, 1, 128, 128]
    qwen_image_edit  the same components with the Qwen2.5-VL processor, saved as a QwenImageEditPipeline
    qwen_image_edit_plus  the same, saved as a QwenImageEditPlusPipeline (one or several input images)

Components: a 2-block QwenImageTransformer2DModel (4 latent channels packed 2x2: in_channels 16), a 3-D
AutoencoderKLQwenImage (z_dim 4, two spatial downsamples, non-trivial latents_mean / latents_std so the decode's
de-normalisation is exercised), the text encoder a tiny Qwen2.5-VL (pipelines/demo/vlm.py's shapes and its chat
tokenizer), and FlowMatchEulerDiscreteScheduler with Qwen-Image's own scheduler config (exponential time shift,
dynamic shifting by token count, shift_terminal). Outputs are noise; the code path is the real one.
"""

from __future__ import annotations

import torch

from pipelines.demo.vlm import build_qwen2_5_vl


def build_qwen_image(seed: int = 0, scale: str = "tiny"):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**_components(seed))


def build_qwen_image_edit(seed: int = 0, scale: str = "tiny"):
    """Qwen-Image-Edit: qwen_image's components, and the tiny Qwen2.5-VL processor (its image processor makes 4..16
    vision tokens of an image) that the edit pipeline's text encoder reads the input image through."""
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline(**_components(seed, processor=True))


def build_qwen_image_edit_plus(seed: int = 0, scale: str = "tiny"):
    """Qwen-Image-Edit-Plus (2509): qwen_image_edit's components, saved as a QwenImageEditPlusPipeline."""
    from diffusers import QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline(**_components(seed, processor=True))


def _components(seed: int, *, processor: bool = False) -> dict:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )

    vlm = build_qwen2_5_vl(seed)  # model and processor; the pipeline takes the model and its tokenizer
    text_encoder, tokenizer = vlm.model, vlm.processor.tokenizer
    z_dim = 4
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * z_dim,  # latents packed 2x2
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_encoder.config.text_config.hidden_size,
        guidance_embeds=False,  # Qwen-Image: true CFG, no embedded guidance
        axes_dims_rope=(8, 4, 4),  # sums to attention_head_dim
    )
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    vae = AutoencoderKLQwenImage(
        base_dim=24, z_dim=z_dim, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=(torch.randn(z_dim, generator=generator) * 0.5).tolist(),
        latents_std=(torch.rand(z_dim, generator=generator) + 0.5).tolist(),
    )
    # Qwen-Image's scheduler_config.json
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    components = dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                      transformer=transformer)
    if processor:  # Qwen-Image-Edit saves a Qwen2VLProcessor beside its Qwen2.5-VL encoder: the same image processor
        from transformers import Qwen2VLProcessor

        components["processor"] = Qwen2VLProcessor(image_processor=vlm.processor.image_processor, tokenizer=tokenizer,
                                                   video_processor=vlm.processor.video_processor,
                                                   chat_template=vlm.processor.chat_template)
    return components
