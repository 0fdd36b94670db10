"""A tiny, seeded, random-weight FLUX.2 checkpoint (Flux2Pipeline), built offline.

    flux2  tiny  vae scale factor 4  default size 512 x 512  latents [32 * 4, 64, 64] (patchified 2x2)

Components as FLUX.2-dev lays them out: a Flux2Transformer2DModel of 1 double-stream and 2 single-stream blocks
(32 latent channels patchified 2x2: in_channels 128, guidance embeds, 4 rope axes), an AutoencoderKLFlux2 (three
blocks, its batch-norm statistics made non-trivial so the decode's de-normalisation is exercised), the text encoder
a tiny Mistral3ForConditionalGeneration (Pixtral vision tower and a 30-layer Mistral: the pipeline stacks hidden
states 10, 20 and 30) with a PixtralProcessor over the demo's byte-level BPE tokenizer (pipelines/demo/llm.py) and
a chat template that reads the pipeline's system + user messages, and FLUX.2's FlowMatchEulerDiscreteScheduler
config (dynamic shifting: the pipeline passes its empirical mu). Outputs are noise; the code path is the real one.

    flux2_klein  tiny  the same sizes (Flux2KleinPipeline)

FLUX.2 [klein]'s layout: the same transformer (no guidance embedder), VAE and scheduler, the text encoder a tiny
Qwen3ForCausalLM of 27 layers (the pipeline stacks hidden states 9, 18 and 27) over the demo's byte-level BPE chat
tokenizer (its chat template ignores `enable_thinking`), `is_distilled` False: true CFG with a negative prompt.
"""

from __future__ import annotations

from typing import Any

import torch

# Mistral-style turns; content is a list of typed parts (the pipeline's format_input), text parts read.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_flux2(seed: int = 0, scale: str = "tiny"):
    from diffusers import Flux2Pipeline
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessor,
        PixtralProcessor,
        PixtralVisionConfig,
    )

    from pipelines.demo.llm import chat_tokenizer

    tokenizer = chat_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    image_processor = PixtralImageProcessor(patch_size=8, size={"longest_edge": 32})
    processor = PixtralProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                 chat_template=CHAT_TEMPLATE)
    hidden = 16
    config = Mistral3Config(
        vision_config=PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=32, patch_size=8),
        text_config=MistralConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=32,
                                  num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                  max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None, sliding_window=None),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1,
    )
    torch.manual_seed(seed)
    text_encoder = Mistral3ForConditionalGeneration(config).eval()
    return Flux2Pipeline(tokenizer=processor, text_encoder=text_encoder,
                         **_image_components(seed, text_hidden=hidden, guidance_embeds=True))


def build_flux2_klein(seed: int = 0, scale: str = "tiny"):
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipelines.demo.llm import chat_tokenizer

    tokenizer = chat_tokenizer()
    hidden = 16
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=32, num_hidden_layers=27,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    text_encoder = Qwen3ForCausalLM(config).eval()
    return Flux2KleinPipeline(tokenizer=tokenizer, text_encoder=text_encoder, is_distilled=False,
                              **_image_components(seed, text_hidden=hidden, guidance_embeds=False))


def _image_components(seed: int, *, text_hidden: int, guidance_embeds: bool) -> dict[str, Any]:
    """The transformer, VAE and scheduler both layouts share; the transformer reads three stacked hidden states of
    a `text_hidden`-wide encoder and embeds the guidance or not."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    latent_channels = 32
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=latent_channels * 4, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * text_hidden,  # three stacked hidden states of the encoder
        timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
        guidance_embeds=guidance_embeds,
    )
    torch.manual_seed(seed)
    vae: Any = AutoencoderKLFlux2(  # Any: mypy sees diffusers' lazy exports as dummies (no `bn`)
        block_out_channels=(16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, latent_channels=latent_channels, layers_per_block=1,
        norm_num_groups=16, mid_block_add_attention=False,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a trained VAE's running statistics, not the identity
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=generator) * 0.2)
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=generator) + 0.5)
    # FLUX.2-dev's scheduler_config.json
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096, time_shift_type="exponential")
    return {"scheduler": scheduler, "vae": vae, "transformer": transformer}
