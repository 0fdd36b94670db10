"""The response side of a voice session: start a response (`response.create`, or a turn's end), gate it on
final transcripts, finish it, or cut it short at the epoch fence (`response.cancel`, `output_audio_buffer.clear`,
barge-in) and truncate the assistant item to what was heard.

A mixin of VoiceSession (realtime/voice/session.py), split off to keep each file readable; it uses the session's
state (epoch, response, conversation, playback clock, outbox) and owns none of its own.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pipelines.voice_turn import HeardSpeech
from realtime.voice.audio_codec import b64encode
from realtime.voice.heard_audio import SAMPLE_RATE as HEARD_RATE
from realtime.voice.items import Item, new_id
from realtime.voice.protocol import ProtocolError, ResponseParams, event_name, parse_response_params
from realtime.voice.response import Response, ResponseRunner, Timings, response_object
from stages.media.audio_encode import encode_audio

if TYPE_CHECKING:
    from realtime.voice.asr import Claim, Handover
    from realtime.voice.session import Inbound


class ResponseControl:
    # -- the client's events ------------------------------------------------------------------------------
    async def _response_create(self, event: dict, inbound: Inbound) -> None:
        if self.response is not None:
            raise ProtocolError("conversation_already_has_active_response", "the conversation already has an active "
                                f"response ({self.response.id}); wait for its response.done or cancel it")
        params = parse_response_params(event.get("response"), self.config, self.spec.max_output_tokens,
                                       self.tool_choices)
        await self._start_response(params, inbound.received_at)

    async def _response_cancel(self, event: dict, inbound: Inbound) -> None:
        r, wanted = self.response, event.get("response_id")
        if r is None or (wanted is not None and wanted != r.id):
            raise ProtocolError("response_cancel_not_active", "there is no active response" +
                                (f" with id {wanted!r}" if wanted is not None else "") + " to cancel",
                                param="response_id" if wanted is not None else None)
        now = self.clock()
        self._bump(r, now)
        await self._end_cancelled(r, "client_cancelled", now)

    async def _output_clear(self, event: dict, inbound: Inbound) -> None:
        """The client cut the reply off (dropped what it had buffered): cancel it and keep what was heard."""
        now, r = self.clock(), self.response
        if r is not None:
            self._bump(r, now)
            await self._end_cancelled(r, "client_cancelled", now)
        else:
            playing = self._playing_item(now)
            if playing is not None:
                await self._truncate_heard(playing, now)
            self.playback.stop(now)
        await self.emit({"type": "output_audio_buffer.cleared", "response_id": r.id if r is not None else ""})

    # -- a response's course ------------------------------------------------------------------------------
    def _default_params(self) -> ResponseParams:
        c = self.config
        return ResponseParams(c.output_modalities, c.instructions, c.max_output_tokens, c.temperature, tools=c.tools)

    async def _start_response(self, params: ResponseParams, start: float, claim: Claim | None = None) -> None:
        """`claim`: the response runs the final decode of the utterance that ended the turn as its graph's asr node
        (realtime/voice/asr.py)."""
        self.disarm_idle()
        c = self.config
        audio = "audio" in params.output_modalities
        item = Item(new_id("item"), "assistant", "audio" if audio else "text", status="in_progress")
        r = Response(new_id("resp"), self.epoch, params, item, c.voice, c.speed, c.output_format, Timings(start),
                     holding=params.calls and not self.spec.omni)
        if claim is not None and params.input_items is None:
            r.claim = claim
        elif claim is not None:
            claim.release()
        self.response = r
        self._voice_used = self._voice_used or audio
        await self.emit({"type": "response.created", "response": self._response_body(r, "in_progress")})
        r.task = asyncio.create_task(ResponseRunner(self, r).run(), name=f"response-{r.id}")

    async def context_for(self, r: Response) -> list[dict[str, Any]]:
        """The chat messages of a response, once every user transcript in them is final (the LLM gate)."""
        return (await self._context(r.params, None))[0]

    async def turn_context(self, r: Response) -> tuple[list[dict[str, Any]], HeardSpeech | None]:
        """context_for, except when the response took over the final decode of the utterance that ended the turn:
        then that item's message is a placeholder its graph's asr node fills (the HeardSpeech), and only the
        other transcripts are waited for."""
        if r.claim is None or r.params.input_items is not None:
            return await self._context(r.params, None)
        claim = r.claim
        handover = await asyncio.shield(claim.handover)
        pending = [item for item in self.conversation if item.id != claim.item_id
                   and item.transcript is not None and not item.transcript.done()]
        if handover is None or pending:  # a later item waits for the lane, which would wait for this response
            claim.release()
            return await self._context(r.params, None)
        return await self._context(r.params, (claim.item_id, handover))

    async def _context(self, params: ResponseParams, heard: tuple[str, Handover] | None):
        system = [{"role": "system", "content": params.instructions}]
        if params.input_items is not None:
            turns = [(spec["role"], spec["text"]) for spec in params.input_items]
            return system + [{"role": role, "content": text} for role, text in turns if text.strip()], None
        items = list(self.conversation)
        for item in items:
            if (heard is None or item.id != heard[0]) and item.transcript is not None and not item.transcript.done():
                await asyncio.shield(item.transcript)
        messages: list[dict[str, Any]] = list(system)
        speech = None
        calls_message: dict[str, Any] | None = None  # the assistant message the latest call items went into
        for item in items:
            if heard is not None and item.id == heard[0]:
                speech = HeardSpeech(heard[1].request, len(messages), heard[1].earlier)
                messages.append({"role": item.role, "content": ""})
            elif item.kind == "function_call":  # consecutive calls: one assistant message with its tool_calls
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages[-1].get("tool_calls") is not None and messages[-1] is calls_message:
                    messages[-1]["tool_calls"].append(call)
                else:
                    calls_message = {"role": "assistant", "content": "", "tool_calls": [call]}
                    messages.append(calls_message)
            elif item.kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
            elif item.audio is not None:  # an omni voice hears the user's audio itself
                wav = b64encode(encode_audio(item.audio, HEARD_RATE, "wav"))
                messages.append({"role": item.role, "content": [
                    {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]})
            elif item.history_text.strip():
                messages.append({"role": item.role, "content": item.history_text})
        return messages, speech

    async def open_output_item(self, r: Response) -> None:
        """The assistant item enters the conversation and the client hears of it (after the LLM gate)."""
        guard = lambda: r.epoch == self.epoch and not r.stopped  # noqa: E731
        previous = self.conversation.add(r.item) if r.params.conversation == "auto" else None
        r.item_opened = True
        wire = r.item.wire(self.config.beta)
        await self.emit({"type": "response.output_item.added", "response_id": r.id, "output_index": 0, "item": wire},
                        guard=guard)
        if r.params.conversation == "auto":
            await self.emit({"type": "conversation.item.created", "previous_item_id": previous, "item": wire},
                            guard=guard)
        part = {"type": "audio", "transcript": ""} if r.audio else {"type": "text", "text": ""}
        await self.emit({"type": "response.content_part.added", "response_id": r.id, "item_id": r.item.id,
                         "output_index": 0, "content_index": 0, "part": part}, guard=guard)

    async def open_calls(self, r: Response, calls: list[dict[str, Any]], guard) -> None:
        """The reply is function calls (OpenAI's chat shape): each becomes a function_call output item, with its
        arguments in one delta (the reply was held whole), then done; no audio goes with it. The client runs the
        function and sends a function_call_output item, then response.create."""
        beta, auto = self.config.beta, r.params.conversation == "auto"
        for call in calls:
            index = len(r.calls) + (1 if r.item_opened else 0)
            item = Item(new_id("item"), "assistant", "function_call", status="in_progress", call_id=call["id"],
                        name=call["function"]["name"])
            r.calls.append(item)
            previous = self.conversation.add(item) if auto else None
            await self.emit({"type": "response.output_item.added", "response_id": r.id, "output_index": index,
                             "item": item.wire(beta)}, guard=guard)
            if auto:
                await self.emit({"type": "conversation.item.created" if beta else "conversation.item.added",
                                 "previous_item_id": previous, "item": item.wire(beta)}, guard=guard)
            item.arguments = call["function"]["arguments"]
            ids = {"response_id": r.id, "item_id": item.id, "output_index": index, "call_id": item.call_id}
            await self.emit({"type": "response.function_call_arguments.delta", **ids, "delta": item.arguments},
                            guard=guard)
            await self.emit({"type": "response.function_call_arguments.done", **ids, "name": item.name,
                             "arguments": item.arguments}, guard=guard)
            item.status = "completed"
            await self.emit({"type": "response.output_item.done", "response_id": r.id, "output_index": index,
                             "item": item.wire(beta)}, guard=guard)
            if auto and not beta:
                await self.emit({"type": "conversation.item.done", "previous_item_id": previous,
                                 "item": item.wire(beta)}, guard=guard)

    async def complete_response(self, r: Response, status: str, reason: str | None, error: dict | None) -> None:
        """The runner finished (completed, incomplete or failed): the done events, metrics and rate limits."""
        self.response, r.finished = None, True
        r.item.status = "completed" if status == "completed" else "incomplete"
        beta, ids = self.config.beta, {"response_id": r.id, "item_id": r.item.id, "output_index": 0, "content_index": 0}
        if r.item_opened:
            if r.audio:
                await self.emit({"type": event_name("response.output_audio.done", beta), **ids})
                await self.emit({"type": event_name("response.output_audio_transcript.done", beta), **ids,
                                 "transcript": r.item.text})
                part = {"type": "audio", "transcript": r.item.text}
            else:
                await self.emit({"type": event_name("response.output_text.done", beta), **ids, "text": r.item.text})
                part = {"type": "text", "text": r.item.text}
            await self.emit({"type": "response.content_part.done", **ids, "part": part})
            await self.emit({"type": "response.output_item.done", "response_id": r.id, "output_index": 0,
                             "item": r.item.wire(beta)})
        await self._done_events(r, status, reason, error)
        if status in ("completed", "incomplete"):
            self.arm_idle()

    def _bump(self, r: Response, now: float) -> None:
        """The fence goes up first; everything else follows from producers seeing it."""
        self.epoch += 1
        r.timings.interrupt = now
        r.stop()
        self.response, r.finished = None, True

    async def _end_cancelled(self, r: Response, reason: str, now: float, truncate: bool = True) -> None:
        if r.timings.silent is None:
            r.timings.silent = self.clock()
        r.item.status = "incomplete"
        heard = self._heard_ms(r.item, now) if r.audio else None
        self.playback.stop(now)
        if heard is not None and truncate:
            r.item.heard_ms = heard
        if r.item_opened:
            await self.emit({"type": "response.output_item.done", "response_id": r.id, "output_index": 0,
                             "item": r.item.wire(self.config.beta)})
        await self._done_events(r, "cancelled", reason, None)
        if heard is not None and truncate and r.item_opened and r.params.conversation == "auto":
            await self.emit({"type": "conversation.item.truncated", "item_id": r.item.id, "content_index": 0,
                             "audio_end_ms": int(heard)})

    async def _truncate_heard(self, item: Item, now: float) -> None:
        """New speech while a finished response still plays: the rest of it was not heard."""
        heard = self._heard_ms(item, now)
        self.playback.stop(now)
        item.heard_ms = heard
        await self.emit({"type": "conversation.item.truncated", "item_id": item.id, "content_index": 0,
                         "audio_end_ms": int(heard)})

    def _playing_item(self, now: float) -> Item | None:
        """The assistant item the client is still playing (by the playback clock), if any."""
        return next((i for i in reversed(list(self.conversation)) if i.role == "assistant"
                     and self.playback.playing(i.id, now)), None)

    def _heard_ms(self, item: Item, now: float) -> float:
        """playback.ack (extrapolated since it came), else the playback clock; never past the audio sent."""
        ack = self._acks.get(item.id)
        heard = ack[0] + max(0.0, now - ack[1]) * 1000 if ack else self.playback.played_ms(item.id, now)
        return max(0.0, min(heard, item.audio_ms))

    async def _done_events(self, r: Response, status: str, reason: str | None, error: dict | None) -> None:
        output = [r.item.wire(self.config.beta)] if r.item_opened else []
        output += [call.wire(self.config.beta) for call in r.calls]
        await self.emit({"type": "response.done", "response": self._response_body(r, status, reason, error, output)})
        report = r.timings.report()
        if status != "cancelled" or r.timings.interrupt is None:
            report["interrupt_to_silence_ms"] = None
        await self.emit({"type": "response.metrics", "response_id": r.id, "status": status, "epoch": r.epoch,
                         "audio_sent_ms": round(r.item.audio_ms, 1), "speculated": r.speculated, **report})
        if r.timings.first_audio is not None:
            self.metrics.ttfa.labels(model=self.spec.name).observe(r.timings.first_audio - r.timings.start)
        if status == "cancelled" and r.timings.interrupt is not None:
            self.metrics.interrupt.labels(model=self.spec.name).observe(r.timings.silent - r.timings.interrupt)
        await self.emit({"type": "rate_limits.updated", "rate_limits": [
            {"name": "tokens", "limit": self.spec.max_output_tokens, "remaining": self.spec.max_output_tokens,
             "reset_seconds": 0.0}]})

    def _response_body(self, r: Response, status: str, reason=None, error=None, output=None) -> dict[str, Any]:
        return response_object(r, status=status, reason=reason, error=error, beta=self.config.beta,
                               output_format=r.output_format, output=output)
