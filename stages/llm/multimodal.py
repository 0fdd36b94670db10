"""Multimodal inputs of a generation: encoded media spliced into the prompt, and M-RoPE positions.

A prompt holds one placeholder token per feature row of each media item (image, video). The
runner embeds the prompt's tokens and overwrites the rows of every placeholder span covered by
a chunk with the span's features; chunked prefill may cut a span, so each chunk takes its
slice. Qwen2-VL-style models also need 3-D (temporal, height, width) positions for the prompt,
computed once by the model's own `get_rope_index`; tokens after the prompt use `p + delta` on
all three axes, as `generate()` does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from stages.events import ErrorKind, StageError


@dataclass(frozen=True)
class MediaSpan:
    """One media item's placeholder span in prompt_ids and, once encoded, its features."""

    offset: int  # position of the first placeholder token in prompt_ids
    length: int  # placeholder tokens = feature rows
    identity: str  # encoder weights id | processor config hash | dtype | media content hash
    features: torch.Tensor | None = None  # [length, hidden], on the runner's device; None until encoded
    audio: bool = False  # an audio clip's span: its features come from audio_encode, not vision_encode

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MRoPE:
    """3-D rotary positions of a prompt (Qwen2-VL / Qwen2.5-VL)."""

    positions: torch.Tensor  # long [3, len(prompt_ids)]: temporal, height, width position of each prompt token
    delta: int  # a token at index p >= len(prompt_ids) has position p + delta on every axis


def in_span_order(spans: Sequence[MediaSpan], vision: Sequence[torch.Tensor] | None,
                  audio: Sequence[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """The two encoders' features (each in its spans' order) interleaved in prompt order; a count that does not
    match its spans is left for attach_features to refuse."""
    vision, audio = list(vision or ()), list(audio or ())
    if not audio:
        return vision or None
    wanted = [s.audio for s in spans]
    if wanted.count(True) != len(audio) or wanted.count(False) != len(vision):
        return vision + audio
    streams = {False: iter(vision), True: iter(audio)}
    return [next(streams[a]) for a in wanted]


def attach_features(spans: Sequence[MediaSpan], features: Sequence[torch.Tensor] | None, *, num_tokens: int,
                    hidden_size: int) -> tuple[MediaSpan, ...]:
    """The spans with their encoded features; any mismatch is a 400, never silent garbage."""
    if not spans:
        if features:
            raise StageError("media_mismatch", f"{len(features)} encoded media items arrived for a prompt without "
                             "media placeholders", param="messages", kind=ErrorKind.INVALID)
        return ()
    features = list(features or ())
    if len(features) != len(spans):
        raise StageError("media_mismatch", f"the prompt has {len(spans)} media placeholder spans but "
                         f"{len(features)} encoded media items arrived", param="messages", kind=ErrorKind.INVALID)
    out = []
    for i, (span, feats) in enumerate(zip(spans, features)):
        if span.offset < 0 or span.end > num_tokens:
            raise StageError("media_mismatch", f"media item {i} spans tokens [{span.offset}, {span.end}) outside "
                             f"the {num_tokens}-token prompt", param="messages", kind=ErrorKind.INVALID)
        if feats.ndim != 2 or feats.shape[0] != span.length or feats.shape[1] != hidden_size:
            raise StageError("media_mismatch", f"media item {i} has {span.length} placeholder tokens but features "
                             f"of shape {tuple(feats.shape)}; expected ({span.length}, {hidden_size})",
                             param="messages", kind=ErrorKind.INVALID)
        out.append(replace(span, features=feats))
    return tuple(out)


def splice(embeds: torch.Tensor, row: int, start: int, end: int, spans: Sequence[MediaSpan]) -> None:
    """Overwrite embeds[row : row + end - start] (prompt positions [start, end)) with the spans' features there."""
    for span in spans:
        lo, hi = max(span.offset, start), min(span.end, end)
        if lo < hi:
            assert span.features is not None  # attach_features ran before the prompt's prefill
            embeds[row + lo - start:row + hi - start] = span.features[lo - span.offset:hi - span.offset].to(embeds)


def mrope_positions(mrope: MRoPE | None, start: int, end: int) -> torch.Tensor:
    """Long [3, end - start]: the 3-D positions of token indices [start, end) (text positions when None)."""
    if mrope is None:
        return torch.arange(start, end, dtype=torch.long).expand(3, -1)
    prompt_len = mrope.positions.shape[1]
    parts = []
    if start < prompt_len:
        parts.append(mrope.positions[:, start:min(end, prompt_len)])
    if end > prompt_len:
        parts.append(torch.arange(max(start, prompt_len), end, dtype=torch.long).expand(3, -1) + mrope.delta)
    return torch.cat(parts, dim=1)
