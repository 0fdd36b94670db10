"""A tiny, seeded, random-weight Qwen3-Omni (MoE): thinker (audio + vision + text), talker with its code predictor,
and code2wav.

The model is `Qwen3OmniMoeForConditionalGeneration` with audio output enabled, its processor the real
`Qwen3OmniMoeProcessor` (Whisper features, Qwen2-VL image and video processors at patch 16, the Qwen2.5-Omni demo's
tokenizer and chat template: the same special tokens, plus "system" and "assistant" as single tokens as in the real
vocabulary, where generate() finds the turns by them). Unlike Qwen2.5-Omni, the speakers live in the config
(`talker_config.speaker_id`), so the checkpoint is self-contained. Saved with `save_pretrained`, it reloads offline
through the real `from_pretrained` / `AutoProcessor` path. Outputs are noise; the code path is the real one.

    thinker     audio encoder d32, 2 layers, 128 mel bins (16 kHz, n_window 50: a 100-frame chunk of 1 s is 13
                tokens) + vision depth 2, h32, patch 16, merge 2 (4..16 tokens an image)
                + a MoE text model h64, 2 layers, 4 experts (top 2), interleaved M-RoPE [2, 3, 3]
    talker      h32, 1 layer, MoE 4 experts; codec vocabulary 1040 (codes 0..15, control ids above 1024: generate
                suppresses its top 1024 ids but the eos), 4 code groups; code predictor h32, 1 layer
    code2wav    h32, 1 layer, codebook 16 x 4 quantizers, upsampling 2*2 then 8*5*4*3 (1920 samples a code)
    speakers    "ethan" and "chelsie" (codec ids in the config)

`deepstack=True` gives the vision tower deepstack mergers (the released model injects its layers 8, 16 and 24 into
the first three text layers); the default has none, because mmserve's llm runner does not inject deepstack features
yet: a checkpoint with them is served without image input (docs/omni.md).
"""

from __future__ import annotations

from typing import Any

import torch

from pipelines.demo.llm import Checkpoint
from pipelines.demo.omni import OMNI_TEMPLATE, OMNI_TOKENS, TTS_TOKENS, _tokenizer

CODEBOOK = 16  # codes of each code group: a random talker's eos is 1 of the 17 ids it may draw (short replies)
CODEC_VOCAB = 1024 + CODEBOOK  # the talker's vocabulary: generate() suppresses [vocab - 1024, vocab) but its eos
CODEC = dict(codec_pad_id=1024 + 4, codec_bos_id=1024 + 5, codec_eos_token_id=1024 + 6, codec_nothink_id=1024 + 11,
             codec_think_bos_id=1024 + 12, codec_think_eos_id=1024 + 13)
SPEAKER_IDS = {"ethan": 1024 + 14, "chelsie": 1024 + 15}
LAST_CONV_SCALE = 1 / 128  # code2wav's output convolution, redrawn: ~0.11 rms, peaks ~0.6 (_liven_code2wav)


def _liven_code2wav(code2wav) -> None:
    """Re-draw code2wav's linear and convolution weights at std 1/sqrt(fan-in), then scale its last convolution so
    the waveform is audible, unclipped noise rather than ~1e-7 (the default init, std 0.02, makes silence)."""
    with torch.no_grad():
        for module in code2wav.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                module.weight.normal_(0.0, module.weight[0].numel() ** -0.5)
        code2wav.decoder[-1].conv.weight.mul_(LAST_CONV_SCALE)


def build_qwen3_omni(seed: int = 0, deepstack: bool = False) -> Checkpoint:
    from transformers import (
        Qwen3OmniMoeConfig,
        Qwen3OmniMoeForConditionalGeneration,
        Qwen3OmniMoeProcessor,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = _tokenizer()
    # Each role one token, as in the real vocabulary: generate() finds the user turns and the reply's start by them.
    tok.add_tokens(["system", "assistant"])
    roles = {f"{role}_token_id": tok.convert_tokens_to_ids(role) for role in ("system", "user", "assistant")}
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in {**OMNI_TOKENS, **TTS_TOKENS}.items()}
    hidden = 64  # thinker width: the audio / vision outputs match it
    # get_rope_index finds media by these ids (thinker and talker)
    media = dict(audio_token_id=ids["audio_token"], image_token_id=ids["image_token"],
                 video_token_id=ids["video_token"], audio_start_token_id=ids["audio_bos_token"],
                 vision_start_token_id=ids["vision_bos_token"], position_id_per_seconds=13)
    audio: dict[str, Any] = dict(num_mel_bins=128, d_model=32, encoder_layers=2, encoder_attention_heads=4,
                                 encoder_ffn_dim=64, output_dim=hidden, n_window=50, n_window_infer=800,
                                 downsample_hidden_size=16, max_source_positions=1500)
    vision: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=16,
                                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden,
                                  num_position_embeddings=256, deepstack_visual_indexes=[0, 1] if deepstack else [])
    # sum(mrope_section) = head_dim / 2
    text: dict[str, Any] = dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                num_experts=4, num_experts_per_tok=2, max_position_embeddings=2048,
                                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                 "rope_theta": 1000000.0},
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    thinker = dict(audio_config=audio, vision_config=vision, text_config=text, user_token_id=roles["user_token_id"],
                   **media)
    talker_text = dict(vocab_size=CODEC_VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                       shared_expert_intermediate_size=32,
                       num_experts=4, num_experts_per_tok=2, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                        "rope_theta": 1000000.0})
    predictor = dict(vocab_size=CODEBOOK, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=4)
    talker = dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=4,
                  thinker_hidden_size=hidden, accept_hidden_layer=1, speaker_id=SPEAKER_IDS, spatial_merge_size=2,
                  **CODEC, **media)
    code2wav = dict(codebook_size=CODEBOOK, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                    intermediate_size=64, num_hidden_layers=1, num_quantizers=4, decoder_dim=32, sliding_window=8)
    special = {name: tok.convert_tokens_to_ids(t) for name, t in (("im_start_token_id", "<|im_start|>"),
                                                                  ("im_end_token_id", "<|im_end|>"))}
    config = Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
                                enable_audio_output=True, tts_pad_token_id=ids["tts_text_pad"],
                                tts_bos_token_id=ids["tts_text_start"], tts_eos_token_id=ids["tts_text_end"],
                                **special, **roles)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    # transformers 5.25 leaves the talker's MoE expert weights (3-D parameters) as allocated: whatever the memory
    # held (seen: 2e8, and NaN logits in a long test run). Every expert weight is drawn here, from the seed.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.normal_(0.0, 0.02)
    _liven_code2wav(model.code2wav)
    for gen in (model.generation_config, model.thinker.generation_config):
        gen.eos_token_id = tok.eos_token_id
        gen.pad_token_id = tok.pad_token_id
    budget: dict[str, Any] = dict(min_pixels=64 * 64, max_pixels=32 * 32 * 16, patch_size=16)  # 4..16 tokens
    processor = Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessor(**budget),
        video_processor=Qwen2VLVideoProcessor(**budget, cap_pixels_per_frame=False),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160,
                                                  chunk_length=30, n_fft=400, return_attention_mask=True),
        tokenizer=tok, chat_template=OMNI_TEMPLATE)
    return Checkpoint(model, processor)
