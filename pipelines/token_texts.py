"""Token id -> its text and exact UTF-8 bytes, for logprobs (OpenAI's `token` and `bytes` fields)."""

from __future__ import annotations

import re

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte-fallback tokens


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable stand-in character -> the byte it encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_decoder()


class TokenTexts:
    """Token id -> (text, exact UTF-8 bytes) for logprobs, with the model's tokenizer; memoized per reply.

    The text is the token decoded alone; a token holding part of a UTF-8 character decodes to U+FFFD,
    so its bytes come from the token's own piece (byte-level BPE or sentencepiece byte fallback).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._memo:
            self._memo[token_id] = self._render(token_id)
        return self._memo[token_id]

    def _render(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode())
        piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        byte = _BYTE_PIECE.match(piece)
        if byte:
            return text, [int(byte.group(1), 16)]
        if piece and all(c in _BYTE_LEVEL for c in piece):
            return text, [_BYTE_LEVEL[c] for c in piece]
        return text, list(text.encode())
