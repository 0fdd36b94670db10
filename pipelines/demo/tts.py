"""Demo text-to-speech checkpoints: tiny seeded random VITS and SpeechT5 (+ HiFi-GAN), built offline.

Each is a complete directory that reloads through the real `from_pretrained` path of its
family (pipelines/tts_vits.py, pipelines/tts_speecht5.py). The audio is shaped noise; the code
path is the real one. Random weights are nudged where a random model would otherwise be
useless: VITS durations start near 3 frames a token (so `speed` has room to act), the last
vocoder layers are scaled down (no full-scale clipping), and SpeechT5 never asks to stop, so a
phrase lasts `maxlenratio` (here 2) spectrogram frames per token.

    vits-demo      VitsModel h32 x 2 layers, upsample [8, 8, 4] (16 kHz, 256 samples a frame),
                   2 speakers named in voices.json ("alloy", "echo")
    speecht5-demo  SpeechT5ForTextToSpeech h32 x 2+2 layers + SpeechT5HifiGan (16 kHz) in vocoder/,
                   a SentencePiece character tokenizer trained here, six seeded x-vectors in voices.safetensors
"""

from __future__ import annotations

import io
import json
import math
import tempfile
from pathlib import Path
from typing import Any, Protocol

import torch

from pipelines.demo.llm import Checkpoint

VITS_CHARS = ["_", " ", "'", "-", *map(chr, range(ord("a"), ord("z") + 1)), *"0123456789"]  # "_" (id 0): the blank
VITS_VOICES = {"alloy": 0, "echo": 1}
# "small": a heavier VITS for benchmarks, so that compute (not overhead) dominates as in a real one
_VITS_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, ffn_dim=64, upsample_initial_channel=32,
                 resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]]),
    "small": dict(hidden_size=96, num_hidden_layers=4, ffn_dim=192, upsample_initial_channel=128,
                  resblock_kernel_sizes=[3, 7], resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]]),
}
# SentencePiece needs text to learn its characters from: every character a demo phrase may hold.
_SPM_TEXT = ["The quick brown fox jumps over the lazy dog.", "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG!",
             "0123456789, 'quoted' - (parens); colon: question? exclamation! \"double\""]


class SavesPretrained(Protocol):
    """A part of a bundle: a Checkpoint, a transformers model or tokenizer."""

    def save_pretrained(self, save_directory: Path, /) -> object: ...


class TtsBundle:
    """Components saved together like a hub checkpoint: sub-folders and extra files."""

    def __init__(self, parts: dict[str, SavesPretrained], files: dict[str, bytes]):
        self.parts = parts  # relative folder ("" = the root) -> object with save_pretrained
        self.files = files  # relative file name -> contents

    def save_pretrained(self, path) -> None:
        for sub, part in self.parts.items():
            part.save_pretrained(Path(path) / sub if sub else Path(path))
        for name, data in self.files.items():
            (Path(path) / name).write_bytes(data)


def build_vits_model(seed: int, scale: str) -> TtsBundle:
    from transformers import VitsConfig, VitsModel, VitsTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        vocab = Path(tmp) / "vocab.json"
        vocab.write_text(json.dumps({c: i for i, c in enumerate(VITS_CHARS)}))
        tokenizer = VitsTokenizer(str(vocab), phonemize=False)
    config = VitsConfig(
        vocab_size=len(tokenizer), **_VITS_SIZES[scale], num_attention_heads=2, flow_size=16, spectrogram_bins=17,
        upsample_rates=[8, 8, 4], upsample_kernel_sizes=[16, 16, 8], prior_encoder_num_flows=2,
        prior_encoder_num_wavenet_layers=2, posterior_encoder_num_wavenet_layers=2,
        duration_predictor_num_flows=2, duration_predictor_filter_channels=32, depth_separable_num_layers=2,
        num_speakers=len(VITS_VOICES), speaker_embedding_size=8, sampling_rate=16000)
    torch.manual_seed(seed)
    model = VitsModel(config).eval()
    with torch.no_grad():
        # The last duration flow (applied last in reverse) shifts log-durations: ~3 frames a token.
        model.duration_predictor.flows[0].translate[0] = -math.log(3.0)
        model.decoder.conv_post.weight.mul_(0.02)  # rms ~0.1, not clipped noise
    files = {"voices.json": json.dumps(VITS_VOICES).encode()}
    return TtsBundle({"": Checkpoint(model, tokenizer)}, files)


def build_speecht5_model(seed: int, scale: str) -> TtsBundle:
    from safetensors.torch import save
    from transformers import SpeechT5Config, SpeechT5ForTextToSpeech, SpeechT5HifiGan, SpeechT5HifiGanConfig

    from pipelines.tts_speecht5 import fallback_voices

    tokenizer = _speecht5_tokenizer()
    config = SpeechT5Config(
        vocab_size=len(tokenizer), hidden_size=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, speech_decoder_prenet_units=32,
        speech_decoder_postnet_units=32, speech_decoder_postnet_layers=2, num_mel_bins=80, reduction_factor=2,
        max_speech_positions=1024, max_text_positions=450, encoder_max_relative_position=32,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.eos_token_id)
    vocoder_config = SpeechT5HifiGanConfig(
        model_in_dim=80, upsample_initial_channel=32, upsample_rates=[4, 4, 4, 4], upsample_kernel_sizes=[8, 8, 8, 8],
        resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]], sampling_rate=16000,
        initializer_range=0.1)  # the default 0.01 makes a random vocoder all but silent
    torch.manual_seed(seed)
    model = SpeechT5ForTextToSpeech(config).eval()
    vocoder = SpeechT5HifiGan(vocoder_config).eval()
    with torch.no_grad():
        model.speech_decoder_postnet.prob_out.weight.zero_()  # never stop early: maxlenratio sets the length
        model.speech_decoder_postnet.prob_out.bias.fill_(-10.0)
        vocoder.conv_post.weight.mul_(10.0)
    voices = save({name: v.contiguous() for name, v in fallback_voices(config.speaker_embedding_dim).items()})
    files = {"voices.safetensors": voices, "generate_speech.json": json.dumps({"maxlenratio": 2.0}).encode()}
    return TtsBundle({"": Checkpoint(model, tokenizer), "vocoder": vocoder}, files)


def _speecht5_tokenizer():
    """A SentencePiece character model (ids as SpeechT5's: <s> 0, <pad> 1, </s> 2, <unk> 3), trained here."""
    import sentencepiece as spm
    from transformers import SpeechT5Tokenizer

    model = io.BytesIO()
    chars = sorted(set("".join(_SPM_TEXT)))
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_SPM_TEXT * 4), model_writer=model, model_type="char", vocab_size=len(chars) + 4,
        bos_id=0, pad_id=1, eos_id=2, unk_id=3, character_coverage=1.0, add_dummy_prefix=True,
        minloglevel=2)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spm_char.model"
        path.write_bytes(model.getvalue())
        return SpeechT5Tokenizer(str(path))
