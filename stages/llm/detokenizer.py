"""Streaming text for the language stage: token ids in, text that is safe to send out.

Two stages, applied in this order (seed 002 §3, "apply stop strings to detokenized text"):

1. `IncrementalDetokenizer` turns one token id at a time into a text delta. Byte-level BPE
   splits one character over several tokens and SentencePiece drops a leading space when a
   token is decoded alone, so a token cannot be decoded by itself. Like HF TGI and vLLM, we
   decode a small window, `ids[prefix_offset:]`, subtract the decoding of its already
   emitted head, `ids[prefix_offset:read_offset]`, and hold everything back while the window
   ends in U+FFFD (an unfinished UTF-8 sequence).
2. `StopStringMatcher` holds back the longest tail that could still grow into a stop string
   and cuts the text before the earliest stop string (excluded from the output, as OpenAI does).

`OutputText` chains both for the engine: `push(token_id)` per sampled token (or `push_ids` for the
tokens of one streamed delta), `finish()` when the request ends for any reason other than a stop string.

Contract (tested): the concatenation of every delta, flush included, equals
`tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`,
cut before the earliest stop string. Cleanup is off because it rewrites text across token
boundaries (" ." -> "."), which no stream can take back; transformers 5 skips it for BPE anyway.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode shows for an unfinished sequence
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens that prime the window with `continue_prompt` (vLLM's choice)


class IncrementalDetokenizer:
    """Decodes one request's output ids incrementally, never emitting half a character.

    `prompt_ids` matter only with `continue_prompt=True`: the last few prompt tokens then
    prime the window, so the first output token keeps the leading space a SentencePiece
    decoder (Llama-2, Mistral v1) strips at the start of a string: " Paris" after
    "The capital of France is", the `/v1/completions` reading. By default the text is that of
    the output ids alone ("Paris"), as a chat message reads and as `tokenizer.decode` gives.
    Byte-level tokenizers (GPT-2, Llama-3, Qwen) give the same text either way.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        continue_prompt: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # A fast tokenizer's Rust decoder, called directly: what `tokenizer.decode` does without cleanup, less
        # its Python wrapping (twice per token per sequence: it showed in the step profile).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        # Window of ids still needed for decoding; ids before `_prefix_offset` are dropped.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if continue_prompt else []
        # Start of the context that is decoded again with every new token (already emitted).
        self._prefix_offset = 0
        # End of what has been emitted; ids from here on are pending.
        self._read_offset = len(self._ids)
        # Every delta emitted so far, joined lazily.
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (every `push` delta plus the `flush` remainder)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, token_id: int) -> str:
        """Add one sampled id; return the new text that is final, possibly "" (held back)."""
        return self.push_ids((token_id,))

    def push_ids(self, token_ids: Sequence[int]) -> str:
        """Add sampled ids, in order (the tokens of one streamed delta): the same text as pushing them one by one,
        joined, from two decodes however many they are."""
        for token_id in token_ids:
            token_id = operator.index(token_id)
            if token_id < 0:
                raise ValueError(f"token_id must be >= 0 (a vocabulary index), got {token_id}")
            self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        # Hold while the tail is an unfinished character, while nothing new appeared (a
        # skipped special token, a SentencePiece space that may still lead a word), or if
        # the decoder rewrote the emitted head (then only `flush` can settle it).
        if (
            len(new_text) <= len(prefix_text)
            or new_text.endswith(REPLACEMENT_CHAR)
            or not new_text.startswith(prefix_text)
        ):
            return ""
        delta = new_text[len(prefix_text) :]
        # The new tokens become the context of the next window; older ids are no longer read.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of the request, release what is held (an unfinished sequence shows as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        common = 0  # normally all of prefix_text; shorter only if the decoder rewrote the head
        for a, b in zip(prefix_text, new_text):
            if a != b:
                break
            common += 1
        delta = new_text[common:]
        del self._ids[:]
        self._prefix_offset = self._read_offset = 0
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(  # type: ignore[return-value]  # transformers: str | list[str]; str for one list
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )


class StopStringMatcher:
    """Cuts streamed text before the earliest stop string, emitting nothing that could still be one.

    The result equals `text[:min(text.find(s) for s in stops if s in text)]` on the full text,
    however the text is split into deltas. With overlapping stops ("abc" and "b"), a stop that
    has completed waits while an earlier-starting stop may still complete ("ab" seen), because
    that one would win on the full text.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise ValueError("stops must be a list of strings, not one string")
        for i, stop in enumerate(stops):
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stops[{i}] must be a non-empty string, got {stop!r}")
        # Distinct stop strings, in the caller's order.
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        # Longest stop string: no held tail is ever longer than this minus one.
        self._max_len = max((len(s) for s in self._stops), default=0)
        # Text received but not yet emitted.
        self._buffer = ""
        # A stop string has been found; everything after it is dropped.
        self.matched = False

    def push(self, delta: str) -> tuple[str, bool]:
        """Add streamed text; return (text safe to emit now, whether a stop string matched)."""
        if self.matched:
            return "", True  # tokens sampled after the stop (in flight) are dropped
        self._buffer += delta
        buf = self._buffer
        live = self._earliest_live_start(buf)
        match = self._earliest_match(buf)
        if match is not None and match <= live:
            return self._stop(match), True
        self._buffer = buf[live:]
        return buf[:live], False

    def flush(self) -> str:
        """At the end of the text, release what was held, cut before a stop string if one matched.

        Only a stop that was waiting on a longer, earlier-starting one can still match here;
        read `matched` afterwards for the finish reason.
        """
        if self.matched:
            return ""
        match = self._earliest_match(self._buffer)
        if match is not None:
            return self._stop(match)
        out, self._buffer = self._buffer, ""
        return out

    def _stop(self, at: int) -> str:
        out = self._buffer[:at]
        self._buffer = ""
        self.matched = True
        return out

    def _earliest_match(self, buf: str) -> int | None:
        found = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _earliest_live_start(self, buf: str) -> int:
        """Smallest i whose tail buf[i:] is a proper prefix of a stop string (len(buf) if none)."""
        for i in range(max(0, len(buf) - self._max_len + 1), len(buf)):
            tail = buf[i:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                return i
        return len(buf)


@dataclass(frozen=True)
class OutputDelta:
    """What one step adds to a request's streamed text."""

    text: str  # new text to send to the client; "" while held back
    stopped: bool  # a stop string matched: finish the request with finish_reason "stop"


class OutputText:
    """One request's output text: ids -> incremental detokenizer -> stop-string matcher.

    The engine calls `push(token_id)` for every sampled token that belongs in the text and
    `finish()` once when the request ends for another reason (EOS, a stop token id, length);
    a cancelled request publishes nothing more and needs neither. Do not push the EOS or a stop
    token id: as with OpenAI, their text is not part of the output. Once the text is final (a
    stop string matched, or `finish()` ran), `push` and `finish` return empty deltas, so tokens
    already in flight are dropped.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        stops: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        continue_prompt: bool = False,
    ) -> None:
        # Token ids -> UTF-8-safe text deltas.
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens, continue_prompt=continue_prompt
        )
        # Text deltas -> text that cannot be part of a stop string.
        self.matcher = StopStringMatcher(stops)
        # Everything handed to the client so far, joined on read.
        self._chunks: list[str] = []
        # The text is final: a stop string matched or `finish()` ran; later pushes are dropped.
        self.finished = False

    @property
    def text(self) -> str:
        """All text streamed so far; after `finish()`, the request's final output text."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the text (finish_reason "stop")."""
        return self.matcher.matched

    def push(self, token_id: int) -> OutputDelta:
        """Add one sampled token; return the text to stream now and whether a stop string matched."""
        return self.push_ids((token_id,))

    def push_ids(self, token_ids: Sequence[int]) -> OutputDelta:
        """Add sampled tokens, in order (one streamed delta's): the same text as pushing them one by one, joined."""
        if self.finished:
            return OutputDelta("", self.stopped)
        text, stopped = self.matcher.push(self.detokenizer.push_ids(token_ids))
        return self._emit(text, stopped)

    def finish(self) -> OutputDelta:
        """End of the request: release held characters and held stop-string prefixes."""
        if self.finished:
            return OutputDelta("", self.stopped)
        text, stopped = self.matcher.push(self.detokenizer.flush())
        if not stopped:
            text += self.matcher.flush()
        self.finished = True
        return self._emit(text, self.matcher.matched)

    def _emit(self, text: str, stopped: bool) -> OutputDelta:
        if text:
            self._chunks.append(text)
        self.finished = self.finished or stopped
        return OutputDelta(text, stopped)
