"""A tiny, seeded, random-weight HunyuanVideo text-to-video checkpoint (HunyuanVideoPipeline, HunyuanVideo's layout).

    family          pipeline               latents [C, T, H, W] for 9 frames at 32 x 32
    hunyuan_video   HunyuanVideoPipeline   4 x 3 x 4 x 4   (VAE: 8x spatial, 4x temporal; patch 1, guidance embeds)

Two text encoders, as the real checkpoint: a Llama (LlamaModel, 3 layers, so hidden_states[-3] is a layer's output)
whose byte-level BPE tokenizer knows Llama 3's header tokens, and a CLIP text model for the pooled embedding. The
BPE is trained in-process on a fixed corpus that holds the pipeline's prompt template, with its vocabulary sized so
the template's system part tokenizes to exactly the template's crop_start (95) tokens, as Llama 3's tokenizer does:
the crop leaves the user's prompt, as in the real model. The scheduler is HunyuanVideo's (flow matching, shift 7).
"""

from __future__ import annotations

import re

from pipelines.demo.llm import _CORPUS
from pipelines.demo.video import _seeded

# Llama 3's specials the prompt template uses; <|begin_of_text|> opens every encoding (as Llama 3's post-processor)
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA_VOCAB = 572  # the BPE size at which the template's system part is crop_start (95) tokens (checked below)


def prefix_bpe(system_text: str, specials: list[str], vocab_size: int):
    """A byte-level BPE (a `tokenizers.Tokenizer`) trained on the demo corpus and a prompt template's system text, so
    that at the right `vocab_size` the template's prefix is exactly the pipeline's crop_start tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # no regex split: merges may cross words, which lets the template's prefix shrink to crop_start tokens
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([*_CORPUS, system_text], trainer)
    return tok


def llama_tokenizer():
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    template = DEFAULT_PROMPT_TEMPLATE["template"]
    system_text = re.sub(r"<\|[a-z_]+\|>", " ", template.replace("{}", ""))
    tok = prefix_bpe(system_text, LLAMA_SPECIALS, LLAMA_VOCAB)
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   pad_token="<|end_of_text|>", padding_side="right", model_max_length=2048)
    prefix = len(fast(template.split("{}")[0]).input_ids)
    if prefix != DEFAULT_PROMPT_TEMPLATE["crop_start"]:
        raise RuntimeError(f"the demo Llama tokenizer's template prefix is {prefix} tokens, not crop_start "
                           f"{DEFAULT_PROMPT_TEMPLATE['crop_start']}: re-size LLAMA_VOCAB")
    return fast


def build_hunyuan_video(seed: int, scale: str):
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import CLIPTextModel, LlamaConfig, LlamaModel

    from pipelines.demo import _clip_config, _clip_tokenizer

    tokenizer = llama_tokenizer()
    text_encoder = _seeded(seed, lambda: LlamaModel(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval())
    tokenizer_2 = _clip_tokenizer()
    text_encoder_2 = _seeded(seed, lambda: CLIPTextModel(_clip_config(tokenizer_2, hidden=8, layers=2)).eval())
    vae = _seeded(seed, lambda: AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4,
        mid_block_add_attention=True))
    transformer = _seeded(seed, lambda: HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4)))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)  # HunyuanVideo's scheduler_config
    return HunyuanVideoPipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                                scheduler=scheduler, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)
