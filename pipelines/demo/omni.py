"""A tiny, seeded, random-weight Qwen2.5-Omni: thinker (audio + vision + text), talker and token2wav.

The model is `Qwen2_5OmniForConditionalGeneration` with audio output enabled, its processor the real
`Qwen2_5OmniProcessor` (Whisper features, Qwen2-VL image and video processors, the demo chat tokenizer
with the Omni special tokens, a chat template that renders audio / image / video parts), and the speakers
file `spk_dict.pt` that `from_pretrained` requires next to the weights. Saved with `save_pretrained`, it
reloads offline through the real `from_pretrained` / `AutoProcessor` path. Outputs are noise (text and
speech); the code path is the real one.

    thinker     audio encoder d32, 2 layers, 128 mel bins (Whisper, 16 kHz, 4 mel frames a token:
                1 s of audio = 25 tokens) + vision depth 2, h32, patch 14, merge 2 (4..16 tokens an image)
                + Qwen2 h64, 2 layers, M-RoPE; text vocab: the demo BPE (~400) + the special tokens below
    talker      h32, 2 layers, head_dim 8, M-RoPE, codec vocab 48 (codes 0..39 + control ids, TALKER_EOS)
    token2wav   DiT h32, 2 layers, block 24, mel 80, ECAPA speaker encoder 32 channels
                + BigVGAN upsample [5, 3, 2, 2, 2, 2] from 64 channels (24 kHz, 240 samples a mel frame,
                2 mel frames a code: 50 codes a second)
    speakers    "Chelsie" (the `generate` default) and "Ethan": seeded random cond / ref_mel, text bos ids

Using it with transformers 5.25's `Qwen2_5OmniForConditionalGeneration.generate`:
  - audio is the default output (there is no `return_audio` argument: `generation_mode="text"` for text only);
  - with an image or video, pass `talker_pixel_values=None` / `talker_pixel_values_videos=None`, or the
    talker's generate rejects the pixel values it is handed ("model_kwargs are not used by the model");
  - pass `talker_eos_token_id=TALKER_EOS`: the signature's default is the real model's [8292, 8294], out of
    this codec vocab. A random talker then stops on its own (2 of 48 ids end it): ~18 codes (0.35 s) an
    answer on average over 30 seeds, at most 67;
  - video: the processor's class default `videos_kwargs` (min 128*28*28 pixels a frame) overrides the video
    processor's budget: a 4-frame 32x32 video is 288 tokens, 8 with
    `videos_kwargs={"size": {"shortest_edge": 3136, "longest_edge": 12544}}`.
The token2wav weights are redrawn so its output is audible, unclipped noise (see `_liven_token2wav`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipelines.demo.llm import Checkpoint, chat_tokenizer

# The processor reads these as tokenizer attributes (tokenizer.audio_token, ...); ids follow the tokenizer.
OMNI_TOKENS = {
    "audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
    "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
}
# Thinker-vocabulary ids the talker reads from the thinker's embedding table: text pad / bos / eos of the
# reply stream, and one text-bos id per speaker. The real checkpoint keeps them in unnamed rows past its
# tokenizer; here they are named special tokens, so a random thinker that emits one still decodes.
TTS_TOKENS = {"tts_text_pad": "<|tts_pad|>", "tts_text_start": "<|tts_bos|>", "tts_text_end": "<|tts_eos|>"}
SPEAKERS = {"Chelsie": "<|spk_chelsie|>", "Ethan": "<|spk_ethan|>"}
# Codec vocabulary of the talker: codes 0..39, then the control ids in the real model's order.
CODEC = dict(tts_codec_pad_token_id=40, tts_codec_start_token_id=41, tts_codec_end_token_id=42,
             tts_codec_mask_token_id=44)
CODEC_VOCAB = 48
TALKER_EOS = [CODEC["tts_codec_pad_token_id"], CODEC["tts_codec_end_token_id"]]  # as generate's [8292, 8294]

# ChatML with string content or a list of parts, matched like the real Qwen2.5-Omni template (by type, or by
# an image / image_url / audio / audio_url / video key): text as it is, one placeholder in its bos / eos pair
# per audio / image / video part (the processor expands it to one token per encoder output). Unlike the real
# template, no default system prompt and no add_vision_id / add_audio_id numbering.
_IS = "part['type'] == '{0}' or '{0}' in part"
_PARTS = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
          "{% if " + _IS.format("image") + " or 'image_url' in part %}<|vision_bos|><|IMAGE|><|vision_eos|>"
          "{% elif " + _IS.format("audio") + " or 'audio_url' in part %}<|audio_bos|><|AUDIO|><|audio_eos|>"
          "{% elif " + _IS.format("video") + " %}<|vision_bos|><|VIDEO|><|vision_eos|>"
          "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}")
OMNI_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n" + _PARTS + "<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPK_FILE = "spk_dict.pt"  # Qwen2_5OmniForConditionalGeneration.from_pretrained loads it (load_speakers)


class OmniCheckpoint(Checkpoint):
    """A Qwen2.5-Omni checkpoint: also writes the speakers (`model.speaker_map`) to spk_dict.pt."""

    def save_pretrained(self, path) -> None:
        super().save_pretrained(path)
        torch.save(self.model.speaker_map, Path(path) / SPK_FILE)


def _tokenizer():
    from transformers import PreTrainedTokenizerFast

    base = chat_tokenizer()
    extra = [*OMNI_TOKENS.values(), *TTS_TOKENS.values(), *SPEAKERS.values()]
    # Named extra special tokens (saved in tokenizer_config.json) give the tokenizer its audio_token, ... attributes.
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token=base.eos_token,
                                  pad_token=base.pad_token, bos_token=None, model_max_length=base.model_max_length,
                                  extra_special_tokens=OMNI_TOKENS)
    tok.add_special_tokens({"additional_special_tokens": extra})
    tok.chat_template = OMNI_TEMPLATE
    return tok


def _liven_token2wav(token2wav) -> None:
    """Re-draw the token2wav weights at std 1/sqrt(fan-in), then scale the vocoder's last conv down.

    At the default init (normal, std 0.02) the DiT's AdaLN-zero gates are ~0, so each mel frame depends
    on its own code only (no attention across blocks: chunked decoding would be trivially exact), and
    BigVGAN's output is ~1e-8 (silence). Redrawn, the DiT mixes frames over its block window and the
    vocoder's pre-clamp output has std ~27 (clipped at +-1): conv_post / 64 makes it ~0.14 rms, peaks ~0.6.
    """
    with torch.no_grad():
        for module in token2wav.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                module.weight.normal_(0.0, module.weight[0].numel() ** -0.5)
        token2wav.code2wav_bigvgan_model.conv_post.weight.mul_(1 / 64)


def build_qwen2_5_omni(seed: int = 0, codec_vocab: int = CODEC_VOCAB) -> OmniCheckpoint:
    """The demo checkpoint. A larger `codec_vocab` makes the random talker's end code rarer in its top-40, so its
    replies run longer (streamed-audio tests and the benchmark use one)."""
    from transformers import (
        Qwen2_5OmniConfig,
        Qwen2_5OmniForConditionalGeneration,
        Qwen2_5OmniProcessor,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = _tokenizer()
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in {**OMNI_TOKENS, **TTS_TOKENS}.items()}
    # The M-RoPE index (get_rope_index, in thinker and talker) finds media by these ids.
    media = dict(audio_token_index=ids["audio_token"], image_token_index=ids["image_token"],
                 video_token_index=ids["video_token"], audio_start_token_id=ids["audio_bos_token"],
                 audio_end_token_id=ids["audio_eos_token"], vision_start_token_id=ids["vision_bos_token"],
                 vision_end_token_id=ids["vision_eos_token"])
    hidden = 64  # thinker width: the audio / vision outputs and the talker's input embeddings match it
    audio: dict[str, Any] = dict(num_mel_bins=128, d_model=32, encoder_layers=2, encoder_attention_heads=4,
                                 encoder_ffn_dim=64, output_dim=hidden, n_window=100, max_source_positions=1500)
    vision: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=14,
                                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden,
                                  window_size=56, fullatt_block_indexes=[1])
    # sum(mrope_section) = head_dim / 2: 8 for the thinker (64 / 4 heads), 4 for the talker (head_dim 8)
    text: dict[str, Any] = dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048,
                                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                 "rope_theta": 1000000.0},
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                                tie_word_embeddings=False)
    thinker = dict(audio_config=audio, vision_config=vision, text_config=text, **media)
    talker = dict(vocab_size=codec_vocab, embedding_size=hidden, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                  max_position_embeddings=4096,
                  rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1000000.0},
                  spatial_merge_size=2, **{f"{k}_token_id": ids[k] for k in TTS_TOKENS}, **CODEC, **media)
    # ECAPA: enc_channels[-1] = sum(enc_channels[1:-1]) (the aggregated SE-Res2Net outputs)
    dit = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=32,
               block_size=24, look_ahead_layers=[1], look_backward_layers=[0], repeats=2, num_embeds=codec_vocab,
               mel_dim=80, enc_emb_dim=32, enc_dim=32, enc_channels=[32, 32, 32, 64], enc_kernel_sizes=[5, 3, 3, 1],
               enc_dilations=[1, 2, 3, 1], enc_attention_channels=16, enc_res2net_scale=2, enc_se_channels=16)
    bigvgan = dict(mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3, 7],
                   resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
                   upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])
    config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                               token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan), enable_audio_output=True)
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    _liven_token2wav(model.token2wav)
    # A speaker: the text-bos id the talker starts its reply stream with, an x-vector-like `cond`
    # (enc_emb_dim) and a reference mel (1, frames, mel_dim) for the DiT's speaker encoder.
    model.speaker_map = {name: {"bos_token": tok.convert_tokens_to_ids(token), "cond": torch.randn(1, 32),
                                "ref_mel": torch.randn(1, 48, 80)} for name, token in SPEAKERS.items()}
    for gen in (model.generation_config, model.thinker.generation_config):
        gen.eos_token_id = tok.eos_token_id
        gen.pad_token_id = tok.pad_token_id
    budget: dict[str, Any] = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16)  # 4..16 tokens an image or frame pair
    processor = Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(**budget),
        video_processor=Qwen2VLVideoProcessor(**budget, cap_pixels_per_frame=False),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160,
                                                  chunk_length=30, n_fft=400, return_attention_mask=True),
        tokenizer=tok, chat_template=OMNI_TEMPLATE)
    return OmniCheckpoint(model, processor)
