"""Incremental speech recognition for realtime sessions: partial hypotheses as audio arrives,
a final one at an endpoint.

The method is the simplest that is correct: the utterance so far is kept in a buffer and
re-decoded from scratch, through the same engine call (and so the same asr stage, batching
and limits) as REST requests, every `partial_every_s` seconds of new audio; `endpoint()` (called
by the session's VAD, or forced at `max_utterance_s`) decodes it once more as the final
hypothesis and starts a new utterance.

Cost: Whisper's encoder always runs a full 30 s window, so every partial costs one window
encode (~0.1-0.3 s of CPU for tiny.en) plus a decode of the text so far. An utterance of L
seconds therefore costs about L / partial_every_s window encodes and O(L^2 / partial_every_s)
decoded tokens, against one encode for a single final decode: raise `partial_every_s` when
partials are too expensive. Partials are not guaranteed to be prefixes of each other or of
the final text (a re-decode may revise earlier words).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from pipelines.asr import SAMPLE_RATE, TRANSCRIBE, TranscriptionRequest
from stages.events import StageError


@dataclass(frozen=True)
class Hypothesis:
    text: str  # the transcript of the utterance so far (final: of the whole utterance)
    final: bool  # True at an endpoint: the utterance is over and a new one starts
    start_s: float  # where the utterance starts in the session's audio
    audio_s: float  # seconds of audio the hypothesis covers


@dataclass(frozen=True)
class Utterance:
    request: TranscriptionRequest | None  # its audio to decode (None: there was none)
    start_s: float
    audio_s: float


class IncrementalTranscriber:
    """One session's speech recognition state. Feed 16 kHz mono float32 audio as it arrives."""

    task = TRANSCRIBE  # with language, prompt and temperature: the fields TranscriptionModel.check reads
    temperature = 0.0

    def __init__(self, engine, model: str, *, language: str | None = None, prompt: str | None = None,
                 partial_every_s: float = 1.0, max_utterance_s: float = 28.0):
        if partial_every_s <= 0 or not 0 < max_utterance_s <= 30:
            raise ValueError("partial_every_s must be > 0 and max_utterance_s in (0, 30] (one Whisper window)")
        self.engine = engine
        self.model = model
        self.language = language
        self.prompt = prompt
        engine.transcription_model(model).check(self)  # the session's fields, before any audio
        self.partial_every_s = partial_every_s
        self.max_utterance_s = max_utterance_s
        self._chunks: list[np.ndarray] = []  # the utterance's audio
        self._samples = 0  # its length
        self._decoded_at = 0  # buffer length at the last partial
        self._start_s = 0.0  # where the utterance starts in the session
        self._handle = None  # the decode in flight (abort() cancels it)
        self._abort = False

    @property
    def buffered_s(self) -> float:
        return self._samples / SAMPLE_RATE

    @property
    def samples(self) -> int:
        """The utterance's length so far (16 kHz samples)."""
        return self._samples

    def request(self) -> TranscriptionRequest | None:
        """The utterance so far as a request (None without audio); the utterance goes on."""
        return self._request() if self._samples else None

    async def feed(self, samples: np.ndarray, partial: bool = True) -> list[Hypothesis]:
        """Add audio; returns the hypotheses it made due: a partial, and a final one if the utterance grew too long.
        `partial=False` decodes no partial now (the caller knows more audio or the endpoint follows at once)."""
        out: list[Hypothesis] = []
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        limit = int(self.max_utterance_s * SAMPLE_RATE)
        while len(samples):
            take = samples[: limit - self._samples]
            samples = samples[len(take):]
            self._chunks.append(take)
            self._samples += len(take)
            if self._samples >= limit:
                out.append(await self.endpoint())
        if partial and self._samples - self._decoded_at >= self.partial_every_s * SAMPLE_RATE:
            self._decoded_at = self._samples
            try:
                text = await self._partial()
            except StageError as exc:
                if exc.code != "cancelled" or not self._abort:
                    raise
                return out  # abort(): no partial this time
            out.append(Hypothesis(text, False, self._start_s, self.buffered_s))
        return out

    async def endpoint(self) -> Hypothesis:
        """The final hypothesis of the utterance so far (empty text without audio); then a new utterance starts."""
        utterance = self.take_utterance()
        text = await self.decode(utterance.request) if utterance.request is not None else ""
        return Hypothesis(text, True, utterance.start_s, utterance.audio_s)

    def take_utterance(self) -> Utterance:
        """The utterance so far as a request for its final decode (None without audio), which the caller runs
        (`decode`, or a graph's asr node); a new utterance starts."""
        request = self._request() if self._samples else None
        utterance = Utterance(request, self._start_s, self.buffered_s)
        self._start_s += self.buffered_s
        self._chunks, self._samples, self._decoded_at = [], 0, 0
        return utterance

    async def decode(self, request: TranscriptionRequest) -> str:
        """The transcript of one utterance's request, through the engine's asr stage."""
        handle = await asyncio.to_thread(self.engine.submit_transcription, self.model, request)
        return (await handle.aresult())["text"]

    def abort(self) -> None:
        """Cancel the partial decode in flight (nobody needs it any more, e.g. because the endpoint has come):
        the `feed` awaiting it returns without that partial; the audio stays in the utterance."""
        self._abort = True
        if self._handle is not None:
            self._handle.cancel()

    def _request(self) -> TranscriptionRequest:
        return TranscriptionRequest(np.concatenate(self._chunks), language=self.language, prompt=self.prompt)

    async def _partial(self) -> str:
        """Decode the utterance so far, abortably (`abort`)."""
        self._abort = False
        handle = await asyncio.to_thread(self.engine.submit_transcription, self.model, self._request())
        if self._abort:  # abort() came while the request was being submitted
            handle.cancel()
        self._handle = handle
        try:
            return (await handle.aresult())["text"]
        finally:
            self._handle = None
