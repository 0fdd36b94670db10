"""From decoded window tokens to a transcript: segments with times, text, and streamed text deltas.

Times: a window's timestamp tokens (<|t|>, 0.02 s steps from the window's start) are shifted
by the window's offset in the request's audio and clamped to the audio the window holds, so
segments are monotonic across windows. A window decoded without timestamps is one segment
spanning the window.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

TIME_PRECISION_S = 0.02  # one timestamp token step


@dataclass(frozen=True)
class AudioWindow:
    """Up to 30 s of a request's audio, ready for the encoder."""

    samples: object  # float32 [n] (numpy) at 16 kHz, n <= 30 s; the stage computes its log-mel features
    offset_s: float  # where the window starts in the request's audio
    duration_s: float  # audio in the window; the rest of the 30 s is padding


@dataclass(frozen=True)
class DecodedWindow:
    """What the decoder produced for one window."""

    tokens: tuple[int, ...]  # generated tokens (text, timestamps, the closing <|endoftext|> if reached)
    logprobs: tuple[float, ...]  # log-probability of each token under the processed scores
    no_speech_prob: float  # P(<|nospeech|>) at <|startoftranscript|>
    language: str  # language code the window was decoded in ("en", "de", ...)


@dataclass(frozen=True)
class Segment:
    """A stretch of transcript with times in the request's audio (OpenAI's verbose_json segment)."""

    id: int
    seek: int  # start of its window, in 10 ms mel frames (openai-whisper's meaning)
    start: float  # seconds
    end: float
    text: str
    tokens: tuple[int, ...]  # text tokens only
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def window_spans(tokens: tuple[int, ...], timestamp_begin: int,
                 eot: int) -> list[tuple[float | None, float | None, list[int]]]:
    """A window's tokens -> (start, end, text token positions) spans in window time; None where no timestamp says."""
    spans: list[tuple[float | None, float | None, list[int]]] = []
    start: float | None = None
    last_end: float | None = None
    text: list[int] = []
    for i, token in enumerate(tokens):
        if token == eot:
            break
        if token < timestamp_begin:
            text.append(i)
            continue
        time = (token - timestamp_begin) * TIME_PRECISION_S
        if start is None and not text:  # an opening timestamp
            start = time
        else:  # a closing one (a text run after a closing timestamp starts where that one ended)
            spans.append((start if start is not None else last_end, time, text))
            start, last_end, text = None, time, []
    if text:  # unclosed: runs to the end of the window
        spans.append((start if start is not None else last_end, None, text))
    return spans


def window_segments(decoded: DecodedWindow, window: AudioWindow, *, timestamps: bool, timestamp_begin: int, eot: int,
                    temperature: float, text_of: Callable[[list[int]], str], first_id: int) -> list[Segment]:
    """Segments of one window, in the request's time, clamped to the window's audio; empty text dropped.

    Without timestamps the window is one segment (any timestamp token in it is not text, and ignored).
    """
    if timestamps:
        spans = window_spans(decoded.tokens, timestamp_begin, eot)
    else:
        kept = [i for i, t in enumerate(decoded.tokens) if t < timestamp_begin and t != eot]
        spans = [(0.0, None, kept)] if kept else []
    segments: list[Segment] = []
    for start, end, positions in spans:
        ids = [decoded.tokens[i] for i in positions]
        text = text_of(ids)
        if not text.strip():
            continue
        start = min(max(start or 0.0, 0.0), window.duration_s)
        end = min(max(end if end is not None else window.duration_s, start), window.duration_s)
        logprob = sum(decoded.logprobs[i] for i in positions) / len(positions)
        segments.append(Segment(
            id=first_id + len(segments), seek=round(window.offset_s * 100), start=round(window.offset_s + start, 3),
            end=round(window.offset_s + end, 3), text=text, tokens=tuple(ids), temperature=temperature,
            avg_logprob=logprob, compression_ratio=compression_ratio(text), no_speech_prob=decoded.no_speech_prob))
    return segments


class TranscriptStream:
    """Text deltas of one request, in window order, while its windows decode in parallel.

    Window k's text is released once windows 0..k-1 have finished. The deltas concatenate to the
    final transcript text (leading space stripped; trailing whitespace and an incomplete UTF-8
    character are held back until more text follows or the transcript ends).
    """

    def __init__(self, num_windows: int, text_of: Callable[[list[int]], str], eot: int, emit: Callable[[str], None]):
        self._tokens: list[list[int]] = [[] for _ in range(num_windows)]
        self._done = [False] * num_windows
        self._texts: list[str | None] = [None] * num_windows  # text of each finished window
        self._text_of = text_of
        self._eot = eot
        self._emit = emit
        self.sent = ""  # the text emitted so far

    def add(self, window: int, token: int) -> None:
        if self._done[window]:
            return
        if token == self._eot:
            self.finish(window)
            return
        self._tokens[window].append(token)
        self._flush(final=False)

    def finish(self, window: int) -> None:
        if not self._done[window]:
            self._done[window] = True
            self._texts[window] = self._text_of(self._tokens[window])
            self._flush(final=all(self._done))

    def _visible(self) -> str:
        parts = []
        for k, done in enumerate(self._done):
            if not done:
                parts.append(self._text_of(self._tokens[k]))
                break
            text = self._texts[k]
            assert text is not None  # set when the window finished
            parts.append(text)
        return "".join(parts).lstrip()

    def _flush(self, *, final: bool) -> None:
        text = self._visible()
        text = text.rstrip() if final else text.rstrip().rstrip("\ufffd")
        if len(text) > len(self.sent) and text.startswith(self.sent):
            delta, self.sent = text[len(self.sent):], text
            self._emit(delta)
