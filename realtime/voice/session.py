"""A realtime voice session (OpenAI Realtime protocol), independent of the transport.

The transport hands client events to `receive` (one inbound mailbox per session, applied in order
by one worker) and attaches a sender to the session's Outbox (the one writer: numbered, journalled
events). The cascade: input audio -> VAD (input.py) -> streaming ASR (asr.py) ->
the language model on the final transcript -> phrase-level TTS -> paced audio deltas
(response.py); starting, finishing and cancelling responses is turns.py.

The epoch is the fence (book ch.21). Speech during a response (barge-in), `response.cancel` or a
truncate of the playing item bump it first; then the response's engine requests and tasks are
cancelled, `response.done` says cancelled (turn_detected / client_cancelled) and the assistant
item is truncated to what was heard: the client's `playback.ack`, else the playback clock
(elapsed time since the first delta, clamped to the audio sent). Every producer checks the epoch
before it emits and the audio sink checks it again under the outbox lock, so no audio of an old
epoch is sent after the bump; a late chunk of an old epoch (`sink_audio`) is dropped and counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from pipelines.asr_incremental import IncrementalTranscriber
from pipelines.config import VoiceSessionConfig, VoiceSpec
from pipelines.image_request import RequestError
from realtime.sessions import Outbox, error_event
from realtime.voice.asr import AsrLane
from realtime.voice.audio_codec import AudioDecodeError, b64decode, b64encode, decode, encode
from realtime.voice.input import VoiceInput
from realtime.voice.items import Conversation, Item, PlaybackClock, new_id
from realtime.voice.metrics import VoiceMetrics
from realtime.voice.protocol import (
    ProtocolError,
    SessionConfig,
    apply_session_update,
    event_name,
    is_beta_session,
    parse_client_event,
    parse_item,
    parse_response_params,
    session_object,
)
from realtime.voice.response import OutputChunk, Response
from realtime.voice.turns import ResponseControl
from realtime.voice.vad import SAMPLE_RATE, VadLoader
from stages.speech.audio_dsp import resample

log = logging.getLogger(__name__)


IDLE_TIMEOUT = object()  # the mailbox entry of a due server_vad idle timeout (applied in order with client events)


@dataclass
class Inbound:
    message: str | bytes | object  # one client frame, or IDLE_TIMEOUT
    received_at: float  # session clock when it arrived (input audio older than max_input_age_ms is dropped)


class VoiceSession(ResponseControl):
    def __init__(self, engine, spec: VoiceSpec, limits: VoiceSessionConfig, *, session_id: str, resume_token: str,
                 outbox: Outbox, vad: VadLoader, tenant: str = "default", beta: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.engine, self.spec, self.limits = engine, spec, limits
        self.id, self.resume_token, self.outbox = session_id, resume_token, outbox
        self.tenant, self.clock, self.metrics = tenant, clock, engine.metrics.part(VoiceMetrics)
        self.voices = tuple(engine.models[spec.tts].voices)
        self.config = SessionConfig(voice=spec.voice or self.voices[0], instructions=spec.instructions,
                                    max_output_tokens=spec.max_output_tokens, beta=beta)
        self.epoch = 0  # the fence: bumped by every interruption
        self.response: Response | None = None  # the active response
        self.conversation = Conversation(limits.max_items)
        self.playback = PlaybackClock()
        self.asr = AsrLane(self._transcriber, self)
        self.input = VoiceInput(self.asr, vad, min_speech_ms=limits.min_speech_ms)
        self.input.configure(self.config.input_format, self.config.turn_detection)
        self.stale_chunks_dropped = 0  # audio of an old epoch stopped at the fence
        self.input_chunks_dropped = 0  # appends older than max_input_age_ms
        self.on_close: list[Callable[[str], Awaitable[None]]] = []  # the transport's hooks (close the socket)
        self._mailbox: asyncio.Queue[Inbound] = asyncio.Queue(limits.mailbox_events)
        self._worker: asyncio.Task | None = None
        self._updated = False  # a session.update has been applied (the first one may pick the beta dialect)
        self._announced: dict[str, asyncio.Event] = {}  # user item -> set once conversation.item.created is out
        self._acks: dict[str, tuple[float, float]] = {}  # item -> (played ms, clock) from playback.ack
        self._voice_used = False
        self._idle_timer: asyncio.TimerHandle | None = None  # server_vad idle_timeout_ms, armed after a response
        self.closed = False
        self._handlers = {
            "session.update": self._session_update, "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit_buffer, "input_audio_buffer.clear": self._clear_buffer,
            "conversation.item.create": self._item_create, "conversation.item.truncate": self._item_truncate,
            "conversation.item.delete": self._item_delete, "conversation.item.retrieve": self._item_retrieve,
            "response.create": self._response_create, "response.cancel": self._response_cancel,
            "output_audio_buffer.clear": self._output_clear, "session.heartbeat": self._heartbeat,
            "session.event_ack": self._event_ack, "playback.ack": self._playback_ack, "session.resume": self._resume,
        }

    # -- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.asr.start()
        self._worker = asyncio.create_task(self._work(), name=f"voice-{self.id}")
        await self.emit({"type": "session.created", "session": self._session(), "resume_token": self.resume_token,
                         "capabilities": {"supports_resume": True, "supports_playback_ack": True,
                                          "max_lead_ms": self.limits.max_lead_ms, "vad": self.input.vad.kind}})

    async def receive(self, message: str | bytes, received_at: float | None = None) -> None:
        """Queue one client frame (waits while the mailbox is full: backpressure on the socket)."""
        await self._mailbox.put(Inbound(message, self.clock() if received_at is None else received_at))

    async def drain(self) -> None:
        """Wait until every queued client event has been applied and the ASR lane is idle."""
        await self._mailbox.join()
        await self.asr.idle()

    async def close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.disarm_idle()
        r = self.response
        if r is not None:
            self.epoch += 1
            r.stop()
            self.response = None
        if self.outbox.attached and reason not in ("client_closed",):
            await self.emit({"type": "session.expired", "reason": reason})
        tasks = [t for t in (self._worker, r.task if r else None) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.asr.close()
        for hook in self.on_close:
            await hook(reason)

    # -- the outbound side --------------------------------------------------------------------------------
    async def emit(self, event: dict[str, Any], guard: Callable[[], bool] | None = None) -> int | None:
        """Send a server event (it gets an `event_id` and a `server_event_seq`); `guard` is the epoch fence."""
        kind = event.pop("type")
        return await self.outbox.emit({"type": kind, "event_id": new_id("event"), **event}, guard=guard)

    async def sink_audio(self, epoch: int, chunk: OutputChunk) -> bool:
        """Send one piece of response audio, unless its epoch (or response) has passed: then it is dropped and
        counted. The check and the playback bookkeeping run under the outbox lock, right before the send."""
        r = self.response
        fmt = self.config.output_format if r is None else r.output_format
        ms = len(chunk.samples) * 1000 / fmt.rate
        event = {"type": event_name("response.output_audio.delta", self.config.beta), "response_id": chunk.response_id,
                 "item_id": chunk.item_id, "output_index": 0, "content_index": 0,
                 "delta": b64encode(encode(chunk.samples, fmt)), "epoch": epoch, "sample_rate_hz": fmt.rate}

        def current() -> bool:
            r = self.response
            if epoch != self.epoch or r is None or r.id != chunk.response_id or r.stopped:
                return False
            now = self.clock()
            event["audio_start_ms"] = round(r.item.audio_ms)
            self.playback.schedule(r.item.id, r.item.audio_ms, ms, now)
            r.item.audio_ms += ms
            r.timings.first_audio = r.timings.first_audio or now
            r.timings.last_audio = now
            return True

        event = {"type": event.pop("type"), "event_id": new_id("event"), **event}  # `current` edits this dict
        if await self.outbox.emit(event, guard=current) is None:
            self.stale_chunks_dropped += 1
            self.metrics.stale_dropped.inc()
            return False
        return True

    async def _error(self, exc: ProtocolError, event_id: str | None) -> None:
        await self.emit(error_event(exc.code, exc.message, param=exc.param, event_id=event_id,
                                    error_type=exc.error_type))

    def _session(self) -> dict[str, Any]:
        return session_object(self.config, session_id=self.id, model=self.spec.name)

    # -- the inbound side ---------------------------------------------------------------------------------
    async def _work(self) -> None:
        while True:
            inbound = await self._mailbox.get()
            event_id = None
            try:
                if inbound.message is IDLE_TIMEOUT:
                    await self._idle_timeout()
                    continue
                event = parse_client_event(inbound.message, self.limits.max_event_bytes)
                event_id = event.get("event_id")
                await self._handlers[event["type"]](event, inbound)
            except ProtocolError as exc:
                await self._error(exc, event_id if event_id is not None else _event_id_of(inbound.message))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not end the session: say so, go on
                log.exception("voice session %s: event failed", self.id)
                await self._error(ProtocolError("internal_error", f"the server failed to apply the event: {exc}",
                                                error_type="server_error"), event_id)
            finally:
                self._mailbox.task_done()

    async def _session_update(self, event: dict, inbound: Inbound) -> None:
        session = event.get("session")
        beta = self.config.beta or (not self._updated and isinstance(session, dict) and is_beta_session(session))
        config = apply_session_update(self.config, session, model=self.spec.name, voices=self.voices,
                                      max_tokens_cap=self.spec.max_output_tokens, voice_locked=self._voice_used)
        if (config.transcription_language, config.transcription_prompt) != \
                (self.config.transcription_language, self.config.transcription_prompt):
            try:
                self._transcriber(config)
            except RequestError as exc:
                raise ProtocolError(exc.code, f"transcription: {exc.message}",
                                    param=f"session.audio.input.transcription.{exc.param}") from None
        self.config, self._updated = _with_beta(config, beta), True
        self.disarm_idle()
        self.input.configure(config.input_format, config.turn_detection)
        await self.emit({"type": "session.updated", "session": self._session()})

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
        await self._commit_item(item_id)
        if self.config.turn_detection.create_response and self.response is None:
            await self._start_response(self._default_params(), now)

    async def _commit_buffer(self, event: dict, inbound: Inbound) -> None:
        self.disarm_idle()
        item_id = self.input.commit()
        self._announced.setdefault(item_id, asyncio.Event())
        await self._commit_item(item_id)

    async def _commit_item(self, item_id: str) -> None:
        """The pending audio is a user item now; its transcript follows when the ASR lane finishes it."""
        item = Item(item_id, "user", "audio", transcript=self.asr.final(item_id))
        self.asr.endpoint(item_id)
        await self._add_user_audio(item)

    async def _add_user_audio(self, item: Item) -> None:
        item_id = item.id
        previous = self.conversation.add(item)
        await self.emit({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
        await self.emit({"type": "conversation.item.created", "previous_item_id": previous,
                         "item": item.wire(self.config.beta)})
        self._announced.setdefault(item_id, asyncio.Event()).set()

    # -- server_vad idle timeout: OpenAI's input_audio_buffer.timeout_triggered --------------------------------
    def arm_idle(self) -> None:
        """After a response: when the user stays silent `idle_timeout_ms` past the end of its audio's playback, an
        empty user audio item is committed and a response starts by itself (a phone agent's "are you there?")."""
        self.disarm_idle()
        td = self.config.turn_detection
        if td is None or td.idle_timeout_ms is None or self.closed:
            return
        delay_s = self.playback.lead_ms(self.clock()) / 1000 + td.idle_timeout_ms / 1000
        self._idle_timer = asyncio.get_running_loop().call_later(delay_s, self._idle_due)

    def disarm_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_due(self) -> None:
        self._idle_timer = None
        try:
            self._mailbox.put_nowait(Inbound(IDLE_TIMEOUT, self.clock()))
        except asyncio.QueueFull:  # the client is busy sending: it is not idle
            pass

    async def _idle_timeout(self) -> None:
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

    async def _item_create(self, event: dict, inbound: Inbound) -> None:
        self.disarm_idle()
        spec = parse_item(event.get("item"), "item")
        previous_id = event.get("previous_item_id")
        if previous_id is not None and not isinstance(previous_id, str):
            raise ProtocolError("invalid_value", "previous_item_id must be a string", param="previous_item_id")
        item = Item(spec["id"] or new_id("item"), spec["role"], "text", text=spec["text"])
        samples = None
        if spec["audio"] is not None:
            try:
                samples = decode(b64decode(spec["audio"]), self.config.input_format)
            except AudioDecodeError as exc:
                raise ProtocolError("invalid_audio", str(exc), param="item.content.audio") from None
            item.kind, item.transcript = "audio", self.asr.final(item.id)
        previous = self.conversation.add(item, previous_id)
        if samples is not None:
            self._announced[item.id] = asyncio.Event()
            self.asr.oneshot(item.id, resample(samples, self.config.input_format.rate, SAMPLE_RATE))
        await self.emit({"type": "conversation.item.created", "previous_item_id": previous,
                         "item": item.wire(self.config.beta)})
        if item.id in self._announced:
            self._announced[item.id].set()

    async def _item_truncate(self, event: dict, inbound: Inbound) -> None:
        item = self.conversation.get(event.get("item_id"))
        if event.get("content_index", 0) != 0:
            raise ProtocolError("invalid_value", "content_index must be 0 (an item has one content part)",
                                param="content_index")
        end = event.get("audio_end_ms")
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise ProtocolError("invalid_value", "audio_end_ms must be an integer >= 0", param="audio_end_ms")
        if item.role != "assistant" or item.kind != "audio":
            raise ProtocolError("invalid_value", f"item {item.id} is not an assistant audio item", param="item_id")
        now = self.clock()
        if self.response is not None and self.response.item is item:  # the client stopped playing it: cancel
            r = self.response
            self._bump(r, now)
            await self._end_cancelled(r, "client_cancelled", now, truncate=False)
        if end > item.audio_ms + 0.5:
            raise ProtocolError("invalid_value", f"audio_end_ms {end} is past the end of the item's audio "
                                                 f"({item.audio_ms:.0f} ms were sent)", param="audio_end_ms")
        self.playback.stop(now)
        item.heard_ms = float(end)
        await self.emit({"type": "conversation.item.truncated", "item_id": item.id, "content_index": 0,
                         "audio_end_ms": end})

    async def _item_delete(self, event: dict, inbound: Inbound) -> None:
        item = self.conversation.get(event.get("item_id"))
        if self.response is not None and self.response.item is item:
            raise ProtocolError("item_in_use", f"item {item.id} is being written by the active response; cancel it "
                                               "first", param="item_id")
        self.conversation.delete(item.id)
        self.playback.forget(item.id)
        self._acks.pop(item.id, None)
        await self.emit({"type": "conversation.item.deleted", "item_id": item.id})

    async def _item_retrieve(self, event: dict, inbound: Inbound) -> None:
        item = self.conversation.get(event.get("item_id"))
        await self.emit({"type": "conversation.item.retrieved", "item": item.wire(self.config.beta)})

    async def _response_create(self, event: dict, inbound: Inbound) -> None:
        if self.response is not None:
            raise ProtocolError("conversation_already_has_active_response", "the conversation already has an active "
                                f"response ({self.response.id}); wait for its response.done or cancel it")
        params = parse_response_params(event.get("response"), self.config, self.spec.max_output_tokens)
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

    async def _heartbeat(self, event: dict, inbound: Inbound) -> None:
        await self.emit({"type": "session.heartbeat_ack", "server_event_seq_last": self.outbox.journal.last_seq})

    async def _event_ack(self, event: dict, inbound: Inbound) -> None:
        seq = event.get("server_event_seq")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ProtocolError("invalid_value", "server_event_seq must be an integer >= 0", param="server_event_seq")
        self.outbox.journal.ack(seq)

    async def _playback_ack(self, event: dict, inbound: Inbound) -> None:
        played = event.get("played_ms")
        if isinstance(played, bool) or not isinstance(played, (int, float)) or played < 0:
            raise ProtocolError("invalid_value", "played_ms must be a number >= 0", param="played_ms")
        item_id = event.get("item_id")
        if item_id is None and event.get("response_id") is not None:
            r = self.response
            if r is None or r.id != event["response_id"]:
                raise ProtocolError("response_not_found", "response_id is not the active response; send item_id",
                                    param="response_id")
            item_id = r.item.id
        item = self.conversation.get(item_id)
        self._acks[item.id] = (float(played), self.clock())

    async def _resume(self, event: dict, inbound: Inbound) -> None:
        raise ProtocolError("invalid_event", "session.resume must be the first event on a new connection",
                            param="type")

    # -- the ASR lane's sink ------------------------------------------------------------------------------
    def _transcriber(self, config: SessionConfig | None = None) -> IncrementalTranscriber:
        c = config or self.config
        return IncrementalTranscriber(self.engine, self.spec.asr, language=c.transcription_language,
                                      prompt=c.transcription_prompt, partial_every_s=self.limits.partial_every_s)

    async def transcript_delta(self, item_id: str, delta: str) -> None:
        await self.emit({"type": "conversation.item.input_audio_transcription.delta", "item_id": item_id,
                         "content_index": 0, "delta": delta})

    async def transcript_done(self, item_id: str, text: str, audio_s: float) -> None:
        await self._wait_announced(item_id)
        for item in self.conversation:
            if item.id == item_id:
                item.text = text
        await self.emit({"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                         "content_index": 0, "transcript": text,
                         "usage": {"type": "duration", "seconds": round(audio_s, 3)}})

    async def transcript_failed(self, item_id: str, code: str, message: str) -> None:
        await self._wait_announced(item_id)
        await self.emit({"type": "conversation.item.input_audio_transcription.failed", "item_id": item_id,
                         "content_index": 0, "error": {"type": "transcription_error", "code": code,
                                                       "message": message, "param": None}})

    async def _wait_announced(self, item_id: str) -> None:
        """Transcription events of an item follow its conversation.item.created."""
        announced = self._announced.get(item_id)
        if announced is not None:
            await announced.wait()
            del self._announced[item_id]


def _with_beta(config: SessionConfig, beta: bool) -> SessionConfig:
    return config if config.beta == beta else replace(config, beta=beta)


def _event_id_of(message: str | bytes) -> str | None:
    """The event_id of an event that failed to parse, when it has one."""
    try:
        event = json.loads(message)
    except (ValueError, TypeError, RecursionError):
        return None
    value = event.get("event_id") if isinstance(event, dict) else None
    return value if isinstance(value, str) else None
