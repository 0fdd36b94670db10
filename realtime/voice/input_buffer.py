"""The input audio buffer of a voice session: `input_audio_buffer.append`, `.commit` and `.clear`, the turns
server_vad detects in the appended audio (speech started / stopped, barge-in), the committed user audio item,
and server_vad's idle timeout (`input_audio_buffer.timeout_triggered`).

A mixin of VoiceSession (realtime/voice/session.py), as turns.py is: it uses the session's state (input,
ASR lane, conversation, response, limits, outbox) and owns none of its own. The audio itself (resampling,
VAD, the ring of recent samples) is input.py's VoiceInput.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from realtime.voice.audio_codec import AudioDecodeError, b64decode, decode
from realtime.voice.items import Item, new_id
from realtime.voice.protocol import ProtocolError
from realtime.voice.vad import SAMPLE_RATE

if TYPE_CHECKING:
    from realtime.voice.asr import Claim
    from realtime.voice.session import Inbound


class InputBufferControl:
    async def _append(self, event: dict, inbound: Inbound) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise ProtocolError("invalid_value", "audio must be a base64 string", param="audio")
        limit = self.limits.max_append_bytes
        if len(audio) * 3 // 4 > limit:
            raise ProtocolError("audio_too_large", f"one append may carry {limit} bytes of audio; this one carries "
                                                   f"{len(audio) * 3 // 4}", param="audio")
        try:
            samples = decode(b64decode(audio), self.config.input_format)
        except AudioDecodeError as exc:
            raise ProtocolError("invalid_audio", str(exc), param="audio") from None
        if (self.clock() - inbound.received_at) * 1000 > self.limits.max_input_age_ms:
            self.input_chunks_dropped += 1  # stale: processing it would delay what is current (book ch.21)
            self.metrics.input_dropped.inc()
            return
        for vad_event in await self.input.feed(self.input.to_model_rate(samples)):
            if vad_event.kind == "start":
                await self._speech_started(vad_event)
            else:
                await self._speech_stopped(vad_event)
        self.input.flush()
        # speech that may be a barge-in: response audio waits until it is one (cancelled) or is not (it goes on)
        detector, td = self.input.detector, self.config.turn_detection
        if detector is not None and detector.suspecting and td is not None and td.interrupt_response:
            self.audio_gate.clear()
        else:
            self.audio_gate.set()

    async def _speech_started(self, vad_event) -> None:
        self.disarm_idle()
        now = self.clock()
        item_id, first = self.input.begin(vad_event)
        self._announced[item_id] = asyncio.Event()
        td = self.config.turn_detection
        r = self.response if td.interrupt_response else None
        # a finished response whose audio the client still plays is interrupted too
        playing = self._playing_item(now) if r is None and td.interrupt_response else None
        if r is not None:
            self._bump(r, now)

        def mark_silent() -> bool:  # under the outbox lock: every earlier frame has been sent or dropped
            if r is not None:
                r.timings.silent = self.clock()
            return True

        await self.emit({"type": "input_audio_buffer.speech_started", "audio_start_ms": first * 1000 // SAMPLE_RATE,
                         "item_id": item_id}, guard=mark_silent)
        if r is not None:
            await self._end_cancelled(r, "turn_detected", now)
        elif playing is not None:
            await self._truncate_heard(playing, now)

    async def _speech_stopped(self, vad_event) -> None:
        now = self.clock()
        item_id = self.input.end(vad_event)
        if item_id is None:
            return
        await self.emit({"type": "input_audio_buffer.speech_stopped",
                         "audio_end_ms": vad_event.sample * 1000 // SAMPLE_RATE, "item_id": item_id})
        respond = self.config.turn_detection.create_response and self.response is None
        self.turn_ended(item_id, respond)  # a speculation on this utterance may be adopted (speculation.py)
        claim = await self._commit_item(item_id, respond)  # the response takes the final decode into its graph
        if respond and self.response is None:
            await self._start_response(self._default_params(), now, claim)
        elif claim is not None:
            claim.release()

    async def _commit_buffer(self, event: dict, inbound: Inbound) -> None:
        self.disarm_idle()
        item_id = self.input.commit()
        self._announced.setdefault(item_id, asyncio.Event())
        await self._commit_item(item_id)

    async def _commit_item(self, item_id: str, respond: bool = False) -> Claim | None:
        """The pending audio is a user item now; its transcript follows when the ASR lane finishes it (or, with
        `respond`, the response about to start, whose claim on the final decode this returns)."""
        item = Item(item_id, "user", "audio", transcript=self.asr.final(item_id))
        claim = self.asr.endpoint(item_id, claim=respond)
        await self._add_user_audio(item)
        return claim

    async def _add_user_audio(self, item: Item) -> None:
        item_id = item.id
        previous = self.conversation.add(item)
        self.hear(item)
        await self.emit({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
        await self.emit({"type": "conversation.item.created", "previous_item_id": previous,
                         "item": item.wire(self.config.beta)})
        self._announced.setdefault(item_id, asyncio.Event()).set()

    async def _idle_timeout(self) -> None:
        """server_vad's idle timeout came due (session.py arms it after a response): an empty user audio item is
        committed and a response starts by itself."""
        td = self.config.turn_detection
        if td is None or td.idle_timeout_ms is None or self.response is not None or self.input.pending_item is not None:
            return  # something happened since the timer was set
        end_ms = self.input.ring.end * 1000 // SAMPLE_RATE
        item = Item(new_id("item"), "user", "audio", transcript=asyncio.get_running_loop().create_future())
        item.transcript.set_result("")
        await self.emit({"type": "input_audio_buffer.timeout_triggered", "item_id": item.id,
                         "audio_start_ms": max(0, end_ms - td.idle_timeout_ms), "audio_end_ms": end_ms})
        await self._add_user_audio(item)
        await self._start_response(self._default_params(), self.clock())

    async def _clear_buffer(self, event: dict, inbound: Inbound) -> None:
        if self.input.pending_item is not None:
            self._announced.pop(self.input.pending_item, None)
        self.input.clear()
        await self.emit({"type": "input_audio_buffer.cleared"})
