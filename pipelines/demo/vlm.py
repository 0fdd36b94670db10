"""Tiny, seeded, random-weight vision-language checkpoints: LLaVA and Qwen2.5-VL.

Each is a model plus its processor (image processor, video processor for Qwen, the demo chat
tokenizer with the media special tokens added, a chat template that renders image and video
parts), saved with `save_pretrained` so it reloads through the real `from_pretrained` /
`AutoProcessor` path offline. Outputs are noise; the code path is the real one.

    llava       CLIP vision 32 px / patch 8 (16 tokens an image) + projector + Llama h64, 2 layers
    qwen2_5_vl  vision depth 2, h32, patch 14, merge 2 (4..16 tokens an image) + Qwen2 h64, 2 layers, M-RoPE
    qwen2_vl    the same shapes as Qwen2-VL (built on request, not served by default)
"""

from __future__ import annotations

from typing import Any

import torch

from pipelines.demo.llm import Checkpoint, chat_tokenizer

# ChatML, with string content or a list of parts: text, and one placeholder per image / video part.
_PARTS = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
          "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}IMAGE"
          "{% elif part['type'] == 'video' %}VIDEO{% endif %}{% endfor %}{% endif %}")
_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n" + _PARTS + "<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAVA_TEMPLATE = _TEMPLATE.replace("IMAGE", "<image>").replace("VIDEO", "")
QWEN_TEMPLATE = (_TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
                 .replace("VIDEO", "<|vision_start|><|video_pad|><|vision_end|>"))
QWEN_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_TEXT: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, max_position_embeddings=2048, bos_token_id=None)


def _tokenizer(special: list[str]):
    tok = chat_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": special})
    return tok


def _seeded_model(cls, config, seed: int, tok):
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def build_llava(seed: int = 0) -> Checkpoint:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = _tokenizer(["<image>"])
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **_TEXT)
    # image_token_id: LlavaConfig's attribute_map alias of image_token_index, unknown to its typed __init__
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_id=tok.convert_tokens_to_ids("<image>"),  # type: ignore[call-arg]
                         vision_feature_layer=-2, vision_feature_select_strategy="default", tie_word_embeddings=False)
    model = _seeded_model(LlavaForConditionalGeneration, config, seed, tok)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    # patch_size / num_additional_image_tokens (CLS) must match the tower, or tokens and features disagree.
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8, num_additional_image_tokens=1,
                               vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE)
    return Checkpoint(model, processor)


def build_qwen2_5_vl(seed: int = 0, *, v2: bool = False) -> Checkpoint:
    """Qwen2.5-VL; `v2=True`: the same shape as a Qwen2-VL checkpoint (no window attention, no video timing)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    prefix = "Qwen2VL" if v2 else "Qwen2_5_VL"
    config_cls, model_cls, processor_cls = (getattr(transformers, f"{prefix}{suffix}") for suffix in
                                            ("Config", "ForConditionalGeneration", "Processor"))
    tok = _tokenizer(QWEN_SPECIAL)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    vision: dict[str, Any]
    if v2:
        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
    else:
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1],
                      tokens_per_second=2)
    # sum(mrope_section) = head_dim / 2 = 8
    text = dict(vocab_size=len(tok), rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                       "rope_theta": 10000.0},
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **_TEXT)
    config = config_cls(vision_config=vision, text_config=text, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    model = _seeded_model(model_cls, config, seed, tok)
    budget: dict[str, Any] = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16)  # 4..16 tokens an image or frame pair
    processor = processor_cls(image_processor=Qwen2VLImageProcessor(**budget), tokenizer=tok,
                                    video_processor=Qwen2VLVideoProcessor(**budget, cap_pixels_per_frame=False),
                                    chat_template=QWEN_TEMPLATE)
    return Checkpoint(model, processor)
