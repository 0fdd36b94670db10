"""A tiny, seeded, random-weight Qwen2-Audio checkpoint (audio + text in, text out).

Qwen2AudioForConditionalGeneration + Qwen2AudioProcessor (WhisperFeatureExtractor, the demo chat
tokenizer with the three audio special tokens added, a ChatML template that renders each audio part
as the real checkpoint does: "Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>\\n"), saved with
`save_pretrained` so it reloads through the real `from_pretrained` / `AutoProcessor` path offline.
Outputs are noise; the code path is the real one.

    encoder   Whisper-style, d32, 2 layers, 4 heads, 80 mel bins; a 10 s window instead of 30 s:
              the feature extractor pads / truncates every clip to CHUNK_SECONDS (1000 mel frames) and
              the encoder's max_source_positions is 1000 // 2 = 500, the length it insists on
    tokens    the processor expands one <|AUDIO|> into ((L - 1) // 2 + 1 - 2) // 2 + 1 tokens for a clip
              of L valid mel frames (100 a second): 25 a second, at most 250 a clip (mmserve refuses longer)
    text      Qwen2 h64, 2 layers, 4 heads, 2 kv heads; the projector maps d32 -> h64
"""

from __future__ import annotations

from typing import Any

import torch

from pipelines.demo.llm import Checkpoint, chat_tokenizer

AUDIO_SPECIAL = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]  # the processor's defaults (audio_token & co.)
SAMPLING_RATE = 16000
HOP_LENGTH = 160  # samples per mel frame (10 ms)
CHUNK_SECONDS = 10  # every clip is padded / truncated to this; the real checkpoint uses 30
MEL_BINS = 80

# ChatML with string content or a list of parts: text, and one numbered placeholder per audio part.
AUDIO_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TEXT: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, max_position_embeddings=2048, bos_token_id=None)


def build_qwen2_audio(seed: int = 0) -> Checkpoint:
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    tok = chat_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": AUDIO_SPECIAL})
    frames = CHUNK_SECONDS * SAMPLING_RATE // HOP_LENGTH
    # The encoder checks input_features.shape[-1] == max_source_positions * 2 (conv2 has stride 2).
    audio = dict(model_type="qwen2_audio_encoder", num_mel_bins=MEL_BINS, d_model=32, encoder_layers=2,
                 encoder_attention_heads=4, encoder_ffn_dim=64, max_source_positions=frames // 2)
    text = dict(model_type="qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, **_TEXT)
    config = Qwen2AudioConfig(audio_config=audio, text_config=text,
                              audio_token_id=tok.convert_tokens_to_ids("<|AUDIO|>"),  # type: ignore[call-arg]
                              tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    features = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE, hop_length=HOP_LENGTH,
                                       chunk_length=CHUNK_SECONDS)
    processor = Qwen2AudioProcessor(feature_extractor=features, tokenizer=tok, chat_template=AUDIO_TEMPLATE)
    return Checkpoint(model, processor)
