"""How many characters one token can stand for: a prompt's length in characters can prove, before
tokenizing, that it cannot fit the context (a 10 MB prompt is refused at once, not after seconds).

The bound is the longest vocabulary entry (added and special tokens included), in characters: a byte-level
piece has one character per byte, a sentencepiece piece one per character, so no token covers more input
characters than its piece has. That holds only while the tokenizer keeps every input character, so the
bound is None (no early refusal) for a tokenizer that can drop or merge text: a normalizer that strips,
removes accents or maps through a table, a pre-tokenizer that removes whitespace, a model that fuses a run
of unknown characters into one token. Canonical composition (NFC, NFKC) merges at most 4 characters into
one (the longest canonical decomposition in Unicode), so it multiplies the bound by 4.
"""

from __future__ import annotations

import json
from typing import Any

MAX_COMPOSED = 4  # the longest canonical decomposition of one Unicode character (U+1F82 and others)
_KEEPS = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "ByteLevel": 1,  # never shorten the text
          "NFC": MAX_COMPOSED, "NFKC": MAX_COMPOSED}
_SPLITS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}  # keep every character


def max_chars_per_token(tokenizer) -> int | None:
    """Characters of input text one token covers at most, or None when this tokenizer gives no such bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast (Rust) tokenizers only
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not _keeps_text(spec.get("pre_tokenizer")) or not _model_keeps_text(spec.get("model") or {}):
        return None
    return factor * max(len(piece) for piece in tokenizer.get_vocab())


def _normalizer_factor(spec: dict[str, Any] | None) -> int | None:
    """How many input characters end up as one normalized character at most (None: unbounded)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", ()):
            f = _normalizer_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # Llama's " " -> "▁"; a pattern longer than its replacement shortens the text
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content", "")
        if pattern is None or not content:
            return None  # a regex, or a deletion
        return max(1, -(-len(pattern) // len(content)))
    return _KEEPS.get(kind) if kind is not None else None


def _keeps_text(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(part) for part in spec.get("pretokenizers", ()))
    return kind in _SPLITS and spec.get("behavior") != "Removed"


def _model_keeps_text(spec: dict[str, Any]) -> bool:
    kind = spec.get("type")
    if kind == "BPE":  # without byte fallback, fuse_unk turns a run of unknown characters into one token
        return bool(spec.get("byte_fallback")) or not spec.get("fuse_unk") or spec.get("unk_token") is None
    if kind == "Unigram":
        return bool(spec.get("byte_fallback"))
    return False  # WordPiece and WordLevel: a long or unknown word becomes one [UNK]
