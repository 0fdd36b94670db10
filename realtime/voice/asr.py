"""A voice session's speech-recognition lane: user audio in, transcription deltas and final transcripts out.

The lane runs beside the session's mailbox so that a decode (a few hundred ms of CPU for Whisper
tiny) never holds up voice activity detection: barge-in must not wait for ASR. Work is applied in
order; audio that queued up behind a decode is fed at once, and no partial is decoded for audio
whose utterance is already over (the final decode covers it): the endpoint is not kept waiting.

Partials become `...input_audio_transcription.delta` events only while they agree with what was
sent: a delta is the words past the text already sent, the last word of a partial held back (it
may be cut mid-word), and nothing when a re-decode revised earlier words. `...completed` carries
the final transcript, which is what the response is built from (the LLM starts on a stable
transcript, book ch.21).

When the speaker pauses (`pause`), the utterance as it would end there is decoded at once: the early final.
If the endpoint comes with no audio added since, that text is the final transcript (the same audio, the same
greedy decode: nothing is decoded again); the sink hears of it (`transcript_stable`) so that the session may
start a response on it speculatively. Audio that comes instead makes it a partial.

A response that starts at the endpoint may take the final decode over (`endpoint(..., claim=True)`): the lane
hands it the utterance's request (`Claim.handover`) instead of decoding it, the response's turn graph runs it
as its asr node, ahead of the LLM in the same graph, and hands the transcript back (`Handover.transcript`);
the lane then announces it as it would its own. A response that lets go first (cancelled, failed, or never
run the node) hands back None, and the lane decodes the utterance itself: the item's transcript never
depends on a response that went away.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipelines.asr import TranscriptionRequest
from pipelines.asr_incremental import IncrementalTranscriber
from stages.events import StageError

log = logging.getLogger(__name__)


@dataclass
class _Op:
    kind: str  # "audio" (samples), "pause" (it may end here), "endpoint" (the utterance is over), "oneshot" (a whole
    #            item's audio)
    generation: int  # the lane's generation when queued; ops of an older one are dropped
    item_id: str
    samples: np.ndarray | None = None
    partials: bool = True  # audio: partial hypotheses may be decoded for it
    upto: int = 0  # pause: where the utterance would end (the session's sample position)


@dataclass
class _EarlyFinal:
    """The decode of an utterance as it stood when its speaker paused."""

    item_id: str
    transcriber: IncrementalTranscriber
    samples: int  # the utterance's length then
    text: str


@dataclass
class Handover:
    """An utterance's final decode, handed to a response: it sets `transcript` (None: the lane decodes it)."""

    request: TranscriptionRequest
    earlier: tuple[str, ...]  # the item's transcripts of its earlier utterances
    transcript: asyncio.Future  # -> str | None

    def give_back(self, text: str | None) -> None:
        if not self.transcript.done():
            self.transcript.set_result(text)


class Claim:
    """A response's claim on an item's final decode; `handover` resolves when the lane reaches the endpoint: a
    Handover, or None when the lane decodes it itself (nothing to decode, the audio cleared, the claim let go)."""

    def __init__(self, item_id: str) -> None:
        self.item_id = item_id
        self.handover: asyncio.Future = asyncio.get_running_loop().create_future()
        self.released = False

    def resolve(self, handover: Handover | None) -> bool:
        if self.released or self.handover.done():
            return False
        self.handover.set_result(handover)
        return True

    def release(self) -> None:
        """The response is done with it (whatever happened): a decode it holds goes back to the lane."""
        self.released = True
        if not self.handover.done():
            self.handover.set_result(None)
        elif (handover := self.handover.result()) is not None:
            handover.give_back(None)


class TranscriptSink:
    """What the lane calls back into (the session's events)."""

    async def transcript_delta(self, item_id: str, delta: str) -> None: ...

    async def transcript_done(self, item_id: str, text: str, audio_s: float) -> None: ...

    async def transcript_failed(self, item_id: str, code: str, message: str) -> None: ...

    async def transcript_stable(self, item_id: str, transcript: str, upto: int) -> None:
        """The early final: the item's transcript if its utterance ends at `upto` (where the speaker paused)."""


class AsrLane:
    def __init__(self, make_transcriber: Callable[[], IncrementalTranscriber], sink: TranscriptSink,
                 count_final: Callable[[str], None] = lambda source: None):
        self.make_transcriber = make_transcriber
        self.count_final = count_final  # where an endpoint's final came from: "early", "graph" or "lane"
        self.transcriber = make_transcriber()  # the utterance in progress
        self.sink = sink
        self.generation = 0
        self._applied_generation = 0  # the generation whose audio the transcriber holds
        self._ops: asyncio.Queue[_Op] = asyncio.Queue()
        self._finals: dict[str, asyncio.Future] = {}  # item id -> final transcript
        self._claims: dict[str, Claim] = {}  # item id -> the response that takes over its final decode
        self._parts: dict[str, list[str]] = {}  # item id -> finals of its earlier utterances (forced at 28 s)
        self._sent: dict[str, list[str]] = {}  # item id -> words sent as deltas
        self._audio_s: dict[str, float] = {}
        self._early: _EarlyFinal | None = None
        self._urgent_queued = 0  # endpoint and pause ops queued
        self._urgent_waiting = asyncio.Event()  # set while one is: a partial in flight is aborted
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="voice-asr")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for claim in self._claims.values():
            claim.resolve(None)
        for future in self._finals.values():
            if not future.done():
                future.set_result("")

    def final(self, item_id: str) -> asyncio.Future:
        """Resolves to the item's final transcript ("" when it failed or the audio was cleared)."""
        if item_id not in self._finals:
            self._finals[item_id] = asyncio.get_running_loop().create_future()
        return self._finals[item_id]

    def audio(self, item_id: str, samples: np.ndarray, partials: bool = True) -> None:
        if len(samples):
            self._ops.put_nowait(_Op("audio", self.generation, item_id, samples, partials))

    def pause(self, item_id: str, upto: int) -> None:
        """The speaker paused: decode the utterance as it stands, which ends at `upto` if the turn ends here."""
        self._urgent(_Op("pause", self.generation, item_id, upto=upto))

    def endpoint(self, item_id: str, claim: bool = False) -> Claim | None:
        """The item's utterance is over; with `claim`, the response about to start takes over its final decode."""
        self.final(item_id)
        self._urgent(_Op("endpoint", self.generation, item_id))
        if not claim:
            return None
        self._claims[item_id] = Claim(item_id)
        return self._claims[item_id]

    def _urgent(self, op: _Op) -> None:
        self._ops.put_nowait(op)
        self._urgent_queued += 1
        self._urgent_waiting.set()

    def oneshot(self, item_id: str, samples: np.ndarray) -> None:
        """Transcribe a whole item (conversation.item.create with input audio): its own utterance."""
        self.final(item_id)
        self._ops.put_nowait(_Op("oneshot", self.generation, item_id, samples))

    def clear(self, item_id: str | None) -> None:
        """Forget queued audio (input_audio_buffer.clear); the item, if any, resolves to ""."""
        self.generation += 1
        if item_id is not None:
            if (claim := self._claims.pop(item_id, None)) is not None:
                claim.resolve(None)
            future = self.final(item_id)
            if not future.done():
                future.set_result("")

    def take_audio(self, item_id: str) -> None:
        """The lane keeps no audio for the session: its items are heard through their transcripts."""
        return None

    async def idle(self) -> None:
        """Wait until every queued op has been applied (tests, benchmarks)."""
        await self._ops.join()

    async def _run(self) -> None:
        while True:
            op = await self._ops.get()
            ops = [op]
            while not self._ops.empty():  # what queued up behind the last decode
                ops.append(self._ops.get_nowait())
            try:
                await self._apply(ops)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a failed decode fails the item, not the session
                log.warning("voice asr failed: %s", exc)
                self.transcriber = self.make_transcriber()  # whatever it held is lost with the item
                for item_id in {o.item_id for o in ops if o.kind in ("endpoint", "oneshot")}:
                    await self._fail(item_id, exc)
            finally:
                for _ in ops:
                    self._ops.task_done()

    async def _apply(self, ops: list[_Op]) -> None:
        for i, op in enumerate(ops):
            if op.kind in ("endpoint", "pause"):
                self._urgent_queued -= 1
                if not self._urgent_queued:
                    self._urgent_waiting.clear()
            if op.generation != self.generation:
                if op.kind == "endpoint" and (claim := self._claims.pop(op.item_id, None)) is not None:
                    claim.resolve(None)
                continue
            if op.generation != self._applied_generation:  # the input buffer was cleared: drop what it held
                self.transcriber, self._applied_generation = self.make_transcriber(), op.generation
            later_audio = any(o.kind == "audio" and o.item_id == op.item_id for o in ops[i + 1:])
            if op.kind == "audio":
                self._early = None
                ends_soon = any(o.kind in ("endpoint", "pause") and o.item_id == op.item_id for o in ops[i + 1:])
                if op.partials and not (ends_soon or later_audio):
                    hypotheses = await self._feed_partial(op.samples)
                else:
                    hypotheses = await self.transcriber.feed(op.samples, partial=False)
                self._audio_s[op.item_id] = self._audio_s.get(op.item_id, 0.0) + len(op.samples) / 16000
                for h in hypotheses:
                    if h.final:  # the utterance grew past one window: keep its text, go on
                        self._parts.setdefault(op.item_id, []).append(h.text.strip())
                    else:
                        await self._partial(op.item_id, h.text)
            elif op.kind == "pause":
                if not later_audio:  # else the speaker went on already
                    await self._early_final(op.item_id, op.upto)
            elif op.kind == "endpoint":
                transcriber, early, self._early = self.transcriber, self._early, None
                decoded = early is not None and early.item_id == op.item_id and early.transcriber is transcriber \
                    and early.samples == transcriber.samples  # the early final's audio is the whole utterance
                utterance = transcriber.take_utterance()
                self.transcriber = self.make_transcriber()  # the next utterance: the session's current settings
                if decoded:
                    if (claim := self._claims.pop(op.item_id, None)) is not None:
                        claim.resolve(None)  # decoded already: nothing to hand over
                    self.count_final("early")
                    await self._finish(op.item_id, early.text)
                else:
                    await self._finish(op.item_id, await self._final_text(op.item_id, transcriber, utterance.request))
            else:  # oneshot: its own transcriber, so an utterance in progress is not disturbed
                transcriber = self.make_transcriber()
                hypotheses = await transcriber.feed(op.samples, partial=False)
                self._parts.setdefault(op.item_id, []).extend(h.text.strip() for h in hypotheses if h.final)
                self._audio_s[op.item_id] = len(op.samples) / 16000
                await self._finish(op.item_id, (await transcriber.endpoint()).text)

    async def _final_text(self, item_id: str, transcriber: IncrementalTranscriber,
                          request: TranscriptionRequest | None) -> str:
        """The utterance's final transcript: decoded by the response that claimed it, else here."""
        claim = self._claims.pop(item_id, None)
        if request is None:
            if claim is not None:
                claim.resolve(None)
            return ""
        if claim is not None:
            earlier = tuple(self._parts.get(item_id, []))
            handover = Handover(request, earlier, asyncio.get_running_loop().create_future())
            if claim.resolve(handover):
                try:
                    text = await handover.transcript
                except asyncio.CancelledError:  # the lane is closing
                    handover.give_back(None)
                    raise
                if text is not None:
                    self.count_final("graph")
                    return text
        self.count_final("lane")
        return await transcriber.decode(request)

    async def _early_final(self, item_id: str, upto: int) -> None:
        transcriber = self.transcriber
        request = transcriber.request()
        if request is None:
            return
        try:
            text = await transcriber.decode(request)
        except StageError as exc:  # the endpoint decodes it again; the utterance is not lost
            log.warning("voice asr: early final failed: %s", exc)
            return
        self._early = _EarlyFinal(item_id, transcriber, transcriber.samples, text)
        await self._partial(item_id, text)
        await self.sink.transcript_stable(item_id, self._transcript(item_id, text), upto)

    async def _feed_partial(self, samples: np.ndarray) -> list:
        """Feed with a partial decode, aborted when an endpoint or a pause is queued meanwhile: the final decode
        (what the response waits for) must not wait behind a partial nobody will read."""
        feed = asyncio.create_task(self.transcriber.feed(samples, partial=True))
        ending = asyncio.create_task(self._urgent_waiting.wait())
        try:
            await asyncio.wait({feed, ending}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the lane is closing
            self.transcriber.abort()
            feed.cancel()
            raise
        finally:
            ending.cancel()
        if not feed.done():
            self.transcriber.abort()
        return await feed

    async def _partial(self, item_id: str, text: str) -> None:
        words = self._transcript(item_id, text).split()[:-1]  # the last word may be cut
        sent = self._sent.setdefault(item_id, [])
        if len(words) <= len(sent) or [_norm(w) for w in words[:len(sent)]] != [_norm(w) for w in sent]:
            return
        new = words[len(sent):]
        sent.extend(new)
        await self.sink.transcript_delta(item_id, (" " if len(sent) > len(new) else "") + " ".join(new))

    async def _finish(self, item_id: str, text: str) -> None:
        transcript = self._transcript(item_id, text)
        self._parts.pop(item_id, None)
        sent = self._sent.pop(item_id, [])
        words = transcript.split()
        if len(words) > len(sent) and [_norm(w) for w in words[:len(sent)]] == [_norm(w) for w in sent]:
            rest = words[len(sent):]
            await self.sink.transcript_delta(item_id, (" " if sent else "") + " ".join(rest))
        future = self.final(item_id)
        if not future.done():
            future.set_result(transcript)
        await self.sink.transcript_done(item_id, transcript, self._audio_s.pop(item_id, 0.0))

    def _transcript(self, item_id: str, text: str) -> str:
        """The item's transcript with `text` as its last utterance (after those cut at the window's end)."""
        return " ".join(p for p in self._parts.get(item_id, []) + [text.strip()] if p)

    async def _fail(self, item_id: str, exc: Exception) -> None:
        if (claim := self._claims.pop(item_id, None)) is not None:
            claim.resolve(None)
        self._parts.pop(item_id, None)
        self._sent.pop(item_id, None)
        self._audio_s.pop(item_id, None)
        future = self.final(item_id)
        if not future.done():
            future.set_result("")
        await self.sink.transcript_failed(item_id, getattr(exc, "code", "transcription_failed"), str(exc))


def _norm(word: str) -> str:
    return re.sub(r"[^\w']", "", word.lower())

