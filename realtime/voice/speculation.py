"""Speculative responses: a voice turn's answer starts before the turn has ended.

When the speaker pauses, the ASR lane decodes the utterance as it would end there (the early final,
realtime/voice/asr.py) and tells the session (`transcript_stable`). If the pause still holds when that
transcript comes, the session submits the turn graph (llm ⇢ tts) that the end of the turn would submit,
on the conversation as it stands plus that transcript: a speculation. Nothing of it is sent: its events
wait in its request's stream. When the turn ends, the response that starts builds its own request as
always and adopts the speculation only if the two requests are equal (same messages, sampling, voice,
tools), reading the stream from its first event; it then sends what the speculation made at once. Any
other outcome discards it (the request is cancelled, its events never read): the speaker went on, the
buffer was cleared, the final transcript or the context differs, the session changed or closed.

The speculation's fence is its own until a response adopts it, then that response's: a barge-in stops it
like any response. `mmserve_realtime_voice_speculations_total{outcome}` counts started, kept and
discarded ones. The same transcript also drives the adaptive end of turn (vad.py): a transcript that ends a
sentence shortens the silence that ends the turn when the session asked for it (`sentence_silence_ms`,
`semantic_vad`).

A mixin of VoiceSession (realtime/voice/session.py), as turns.py is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pipelines.phrases import ends_sentence
from pipelines.voice_turn import VoiceTurnRequest
from realtime.voice.response import voice_turn_request
from stages.events import StageError
from stages.request_state import RequestHandle

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class StableTranscript:
    """The mailbox entry of an early final (applied in order with the client's events)."""

    item_id: str
    transcript: str
    upto: int  # where the utterance ends if the turn ends at this pause


@dataclass
class Speculation:
    item_id: str
    upto: int
    epoch: int
    request: VoiceTurnRequest  # what was submitted
    session_epoch: Callable[[], int]
    handle: RequestHandle | None = None
    owner: Callable[[], bool] | None = None  # the fence of the response that adopted it
    alive: bool = True
    turn_ended: bool = False  # its turn has ended: a response is about to adopt it or not

    def current(self) -> bool:
        """The fence of its request: the adopting response's, else alive within its epoch."""
        if self.owner is not None:
            return self.owner()
        return self.alive and self.epoch == self.session_epoch()


class SpeculationControl:
    # -- the ASR lane's sink ------------------------------------------------------------------------------
    async def transcript_stable(self, item_id: str, transcript: str, upto: int) -> None:
        self.post(StableTranscript(item_id, transcript, upto))  # a full mailbox: no speculation this time

    async def _stable(self, stable: StableTranscript) -> None:
        """Applied from the mailbox: the pause may still hold (then speculate), or the speaker went on."""
        inp = self.input
        if inp.pending_item != stable.item_id or inp.paused_upto != stable.upto:
            return  # the speaker went on, or the turn has ended already
        if inp.detector is not None and ends_sentence(stable.transcript):
            inp.detector.sentence_ended = True  # the adaptive end of turn, when the session asked for it
        if self._may_speculate():
            await self._speculate(stable)

    def _may_speculate(self) -> bool:
        td = self.config.turn_detection
        if not self.limits.speculate or self.spec.omni or td is None or not td.create_response:
            return False
        if self.response is not None or self.speculation is not None:
            return False
        # the context must be complete now: a speculation never waits for another item's transcript
        return all(item.transcript is None or item.transcript.done() for item in self.conversation)

    async def _speculate(self, stable: StableTranscript) -> None:
        params, c = self._default_params(), self.config
        messages, _ = await self._context(params, None)
        if stable.transcript.strip():
            messages.append({"role": "user", "content": stable.transcript})
        request = voice_turn_request(self, params, messages, voice=c.voice, speed=c.speed,
                                     rate=c.output_format.rate)
        spec = Speculation(stable.item_id, stable.upto, self.epoch, request, lambda: self.epoch)
        try:
            spec.handle = await asyncio.to_thread(self.engine.submit_voice_turn, self.spec.name, request,
                                                  fence=spec.current)
        except StageError as exc:  # e.g. the engine is full: the turn's end submits as always
            log.info("voice session %s: no speculation: %s", self.id, exc)
            return
        self.speculation = spec
        self._count_speculation("started")
        if self.closed:  # closed while it was being submitted
            self._discard_speculation(spec)

    # -- its end --------------------------------------------------------------------------------------------
    def check_speculation(self) -> None:
        """After each applied event: a speculation whose pause no longer holds is discarded."""
        spec = self.speculation
        if spec is not None and not spec.turn_ended and (self.input.pending_item != spec.item_id
                                                          or self.input.paused_upto != spec.upto):
            self._discard_speculation(spec)

    def turn_ended(self, item_id: str, respond: bool) -> None:
        """speech_stopped for `item_id`: the response about to start (`respond`) may adopt its speculation."""
        spec = self.speculation
        if spec is not None:
            if respond and spec.item_id == item_id and spec.epoch == self.epoch:
                spec.turn_ended = True
            else:
                self._discard_speculation(spec)

    def adopt_speculation(self, request: VoiceTurnRequest, owner: Callable[[], bool]) -> RequestHandle | None:
        """The handle of the speculation that submitted exactly `request` (then fenced by `owner`), else None (any
        speculation is discarded)."""
        spec, self.speculation = self.speculation, None
        if spec is None:
            return None
        if not (spec.alive and spec.turn_ended and spec.handle is not None and spec.epoch == self.epoch
                and spec.request == request):
            self._discard_speculation(spec)
            return None
        spec.owner = owner
        self._count_speculation("kept")
        return spec.handle

    def drop_speculation(self) -> None:
        """A response that ended without adopting its turn's speculation (failed or cancelled before its graph)."""
        if self.speculation is not None and self.speculation.turn_ended:
            self._discard_speculation(self.speculation)

    def _discard_speculation(self, spec: Speculation) -> None:
        if self.speculation is spec:
            self.speculation = None
        if not spec.alive:
            return
        spec.alive = False
        if spec.handle is not None:
            spec.handle.cancel()
        self._count_speculation("discarded")

    def _count_speculation(self, outcome: str) -> None:
        self.metrics.speculations.labels(model=self.spec.name, outcome=outcome).inc()
