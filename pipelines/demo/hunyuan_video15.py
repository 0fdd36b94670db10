"""Tiny, seeded, random-weight HunyuanVideo 1.5 checkpoints: text-to-video (HunyuanVideo15Pipeline) and
image-to-video (HunyuanVideo15ImageToVideoPipeline), HunyuanVideo 1.5's layout.

    family              pipeline                            latents [C, T, H, W] for 9 frames at 32 x 48
    hunyuan_video15     HunyuanVideo15Pipeline              4 x 3 x 2 x 3   (VAE: 16x spatial, 4x temporal; patch 1)
    hunyuan_video15-i2v HunyuanVideo15ImageToVideoPipeline  the same, + a SigLIP vision encoder for the image

The transformer reads 2 x 4 + 1 channels (the latents, the condition latents and their mask) and target_size 64, so a
request that names no size gets the pipeline's 16:9 bucket at 64 px (64 x 48 here), an image-to-video one its image's
bucket. Two text encoders, as the real checkpoint: a Qwen2.5-VL text model (3 layers, so hidden_states[-3] is a
layer's output) whose ChatML byte-level BPE is sized so the system message's chat prefix is exactly the pipeline's
crop_start (108) tokens, and a ByT5 encoder (T5EncoderModel + the byte-level ByT5Tokenizer) for the quoted text of a
prompt. The guider is ClassifierFreeGuidance at 6 (the checkpoints' guider config), the scheduler flow matching with
shift 5 (the 480p checkpoints'). The image-to-video checkpoint adds a SiglipVisionModel (32 px, patch 8: 16 tokens)
and its SiglipImageProcessor.
"""

from __future__ import annotations

import inspect

from pipelines.demo.video import _seeded

QWEN_VOCAB = 567  # the BPE size at which the chat prefix of the system message is crop_start (108) tokens


def qwen_tokenizer():
    """The demo ChatML tokenizer retrained so the pipeline's system prompt prefix is crop_start tokens."""
    from diffusers import HunyuanVideo15Pipeline
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input
    from transformers import PreTrainedTokenizerFast

    from pipelines.demo.hunyuan_video import prefix_bpe
    from pipelines.demo.llm import CHAT_TEMPLATE, SPECIAL_TOKENS

    params = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
    system, crop_start = params["system_message"].default, params["crop_start"].default
    fast = PreTrainedTokenizerFast(tokenizer_object=prefix_bpe(system, SPECIAL_TOKENS, QWEN_VOCAB),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
                                   padding_side="right", model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    chat = fast.apply_chat_template(format_text_input(["{}"], system), add_generation_prompt=True, tokenize=False)
    prefix = len(fast(chat[0].split("{}")[0]).input_ids)
    if prefix != crop_start:
        raise RuntimeError(f"the demo Qwen tokenizer's chat prefix is {prefix} tokens, not crop_start {crop_start}: "
                           "re-size QWEN_VOCAB")
    return fast


def build_hunyuan_video15(seed: int, scale: str, *, image_to_video: bool = False):
    """`image_to_video`: saved as a HunyuanVideo15ImageToVideoPipeline, with a tiny SigLIP for the image."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15ImageToVideoPipeline,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    tokenizer = qwen_tokenizer()
    text_encoder = _seeded(seed, lambda: Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0})).eval())
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = _seeded(seed, lambda: T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id)).eval())
    vae = _seeded(seed, lambda: AutoencoderKLHunyuanVideo15(
        latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1, spatial_compression_ratio=16,
        temporal_compression_ratio=4))
    transformer = _seeded(seed, lambda: HunyuanVideo15Transformer3DModel(
        in_channels=2 * 4 + 1, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=16, rope_axes_dim=(2, 2, 4),
        target_size=64, task_type="i2v" if image_to_video else "t2v"))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)  # HunyuanVideo 1.5 480p's scheduler_config
    parts = dict(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae, scheduler=scheduler,
                 text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                 guider=ClassifierFreeGuidance(guidance_scale=6.0))
    if not image_to_video:
        return HunyuanVideo15Pipeline(**parts)
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    image_encoder = _seeded(seed, lambda: SiglipVisionModel(vision).eval())
    processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    return HunyuanVideo15ImageToVideoPipeline(**parts, image_encoder=image_encoder, feature_extractor=processor)
