"""Qwen3-Omni's code2wav stage: the talker's codes to 24 kHz audio, a whole reply at once or streamed.

code2wav decodes a whole reply as `generate()` does (chunks of 300 codes, 25 of left context), or, streamed
(`CodeChunks`), chunks of the codes as the talker makes them: each inside one of those 300-code spans, with up to
`CONTEXT_CODES` codes of left context; the chunks' samples concatenate to the whole reply's waveform.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

from pipelines.omni3 import DECODE_CONTEXT, DECODE_SPAN, SAMPLE_RATE, Omni3Voice
from stages.events import EventKind, StageError
from stages.pool import PoolConfig
from stages.stage import Stage, WorkItem

# A call decodes one whole reply, or several replies' streamed chunks (ModelSpec.pools rules)
CODE2WAV_POOL = PoolConfig(max_batch_size=8, max_queue=256)
# A streamed reply's chunks: the first of FIRST_CHUNK codes (the first audio comes early), each later one twice the
# one before up to MAX_CHUNK, each decoded with CONTEXT_CODES codes of left context (docs/omni.md: measured error)
FIRST_CHUNK, MAX_CHUNK, CONTEXT_CODES = 4, 64, 25


def talked3(inputs: dict[str, Any]) -> dict[str, Any]:
    """A whole reply's code2wav inputs: the codes (the talker's one piece), the thinker's choices and usage."""
    thinker = inputs["llm"]
    if not inputs["pieces"]:
        raise StageError("internal_error", "the talker ended without its reply")
    return {**inputs, "codes": inputs["pieces"][0]["codes"], "choices": thinker["choices"], "usage": thinker["usage"]}


class CodeChunks:
    """A streamed reply's cut of its talker's frames into code2wav chunks: a first of `chunk` codes, each later one
    twice the one before up to `max_chunk`, none across generate()'s 300-code decode spans. A chunk that opens a span
    is decoded with that span's own left context (as generate() decodes it); a later one with up to `context` codes
    before it in its span. A chunk is cut as soon as its last frame is drawn (code2wav is causal)."""

    def __init__(self, chunk: int = FIRST_CHUNK, max_chunk: int = MAX_CHUNK, context: int = CONTEXT_CODES):
        self.chunk, self.max_chunk, self.context = chunk, max(chunk, max_chunk), max(1, context)
        self.frames: list[list[int]] = []
        self.start = 0  # the next chunk's first code

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        self.frames += delta["codes"]
        return self._cut(done=False)

    def flush(self, outputs: dict[str, Any]) -> list[dict[str, Any]]:
        return self._cut(done=True)  # every frame came as a delta

    def _cut(self, done: bool) -> list[dict[str, Any]]:
        pieces, n = [], len(self.frames)
        while self.start < n:
            span = self.start - self.start % DECODE_SPAN
            end = min(self.start + self.chunk, span + DECODE_SPAN)
            if end > n and not done:
                break
            end = min(end, n)
            opens = self.start == span
            lowest = span - (DECODE_CONTEXT if span - DECODE_CONTEXT > 0 else span)  # generate()'s context
            first = lowest if opens else max(lowest, self.start - self.context)
            pieces.append({"window": torch.tensor(self.frames[first:end], dtype=torch.long).T,
                           "context": self.start - first, "opens_span": opens})
            self.start, self.chunk = end, min(2 * self.chunk, self.max_chunk)
        return pieces


class Code2WavStage(Stage):
    """Codes -> a 24 kHz waveform: a whole reply alone (generate()'s span decode), streamed replies' chunks (pieces:
    `CodeChunks`) together in one forward, each told as a DELTA {"audio", "sample_rate"}, as Qwen2.5-Omni's vocoder
    tells its chunks."""

    kind = "code2wav"

    def __init__(self, model: str, voice: Omni3Voice):
        self.model = model
        self.voice = voice

    def batch_key(self, item: WorkItem) -> Hashable:
        return self.model, item.piece is None  # whole replies apart from chunks

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        if items[0].piece is None:
            return [{"choices": item.inputs["choices"], "usage": item.inputs["usage"],
                     "audio": self.voice.waveform(item.inputs["codes"]), "sample_rate": SAMPLE_RATE}
                    for item in items]
        chunks = self.voice.chunks([(item.inputs["window"], item.inputs["context"], item.inputs["opens_span"])
                                    for item in items])
        for item, audio in zip(items, chunks):
            item.emit(EventKind.DELTA, audio=audio, sample_rate=SAMPLE_RATE)
        return [{"audio": audio} for audio in chunks]


def streamed_reply3(outputs: dict[str, Any]) -> dict[str, Any]:
    """A streamed spoken request's outputs (its chunks' pieces, the talker's) as a whole one's: choices, usage, the
    chunks' audio joined, the sample rate."""
    thinker = outputs["talker"]["llm"]
    audio = torch.cat([torch.zeros(0), *(piece["audio"] for piece in outputs["pieces"])])
    return {"choices": thinker["choices"], "usage": thinker["usage"], "audio": audio, "sample_rate": SAMPLE_RATE}
