"""A realtime voice session (OpenAI Realtime protocol), independent of the transport.

The transport hands client events to `receive` (one inbound mailbox per session, applied in order
by one worker) and attaches a sender to the session's Outbox (the one writer: numbered, journalled
events). The cascade: input audio -> VAD (input.py) -> streaming ASR (asr.py) ->
the language model on the final transcript -> phrase-level TTS -> paced audio deltas
(response.py). An omni voice: input audio -> VAD -> the user's audio kept on its item (heard_audio.py) ->
the omni model hears it and speaks (thinker -> talker -> token2wav) -> paced audio deltas.
VoiceSession is the coordinator: its state, the mailbox and its worker, the outbound side
and the idle timer. The client's events are applied by one part per idea, each a mixin over that state:
the input audio buffer (input_buffer.py), conversation items and transcripts (item_control.py),
responses (turns.py) and the session's own configuration and control events (session_control.py).

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
from dataclasses import dataclass
from typing import Any

from pipelines.config import VoiceSessionConfig, VoiceSpec
from realtime.sessions import Outbox, error_event
from realtime.voice.asr import AsrLane
from realtime.voice.audio_codec import b64encode, encode
from realtime.voice.heard_audio import HeardAudioLane
from realtime.voice.input import VoiceInput
from realtime.voice.input_buffer import InputBufferControl
from realtime.voice.item_control import ItemControl
from realtime.voice.items import Conversation, PlaybackClock, new_id
from realtime.voice.metrics import VoiceMetrics
from realtime.voice.protocol import FORCED_CHOICES, ProtocolError, SessionConfig, event_name, parse_client_event
from realtime.voice.response import OutputChunk, Response
from realtime.voice.session_control import SessionControl
from realtime.voice.speculation import Speculation, SpeculationControl, StableTranscript
from realtime.voice.turns import ResponseControl
from realtime.voice.vad import VadLoader

log = logging.getLogger(__name__)


IDLE_TIMEOUT = object()  # the mailbox entry of a due server_vad idle timeout (applied in order with client events)


@dataclass
class Inbound:
    message: str | bytes | object  # one client frame, IDLE_TIMEOUT or a StableTranscript
    received_at: float  # session clock when it arrived (input audio older than max_input_age_ms is dropped)


class VoiceSession(SessionControl, InputBufferControl, ItemControl, ResponseControl, SpeculationControl):
    def __init__(self, engine, spec: VoiceSpec, limits: VoiceSessionConfig, *, session_id: str, resume_token: str,
                 outbox: Outbox, vad: VadLoader, tenant: str = "default", beta: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.engine, self.spec, self.limits = engine, spec, limits
        self.id, self.resume_token, self.outbox = session_id, resume_token, outbox
        self.tenant, self.clock, self.metrics = tenant, clock, engine.metrics.part(VoiceMetrics)
        self.voices = tuple(engine.models[spec.omni or spec.tts].voices)
        self.config = SessionConfig(voice=spec.voice or self.voices[0], instructions=spec.instructions,
                                    max_output_tokens=spec.max_output_tokens, beta=beta)
        self.epoch = 0  # the fence: bumped by every interruption
        self.response: Response | None = None  # the active response
        self.speculation: Speculation | None = None  # a response started while the speaker pauses (speculation.py)
        self.audio_gate = asyncio.Event()  # cleared while speech that may be a barge-in is being confirmed
        self.audio_gate.set()
        self.conversation = Conversation(limits.max_items)
        self.playback = PlaybackClock()
        self.asr: AsrLane | HeardAudioLane
        # the tool choices its chat model serves: auto only when its template's tool calls can be read back
        self.tool_choices = frozenset() if spec.omni else \
            FORCED_CHOICES | ({"auto"} if engine.chat_model(spec.chat).tool_format is not None else set())
        if spec.omni:  # the model hears the audio itself: kept, not transcribed
            omni = engine.chat_model(spec.omni)
            self.asr, self.max_heard = HeardAudioLane(omni.max_audio_s(engine.config.media)), omni.vlm.max_audios
        else:
            count = lambda source: self.metrics.finals.labels(model=spec.name, source=source).inc()  # noqa: E731
            self.asr, self.max_heard = AsrLane(self._transcriber, self, count), 0
        self.input = VoiceInput(self.asr, vad, min_speech_ms=limits.min_speech_ms,
                                early_final_ms=limits.early_final_ms)
        self.input.configure(self.config.input_format, self.config.turn_detection)
        self.stale_chunks_dropped = 0  # audio of an old epoch stopped at the fence
        self.input_chunks_dropped = 0  # appends older than max_input_age_ms
        self.on_close: list[Callable[[str], Awaitable[None]]] = []  # the transport's hooks (close the socket)
        self._mailbox: asyncio.Queue[Inbound] = asyncio.Queue(limits.mailbox_events)
        self._worker: asyncio.Task | None = None
        self._updated = False  # a session.update has been applied (the first one may pick the beta dialect)
        self._announced: dict[str, asyncio.Event] = {}  # user item -> set once conversation.item.created is out
        self._acks: dict[str, tuple[float, float]] = {}  # item -> (played ms, clock) from playback.ack
        self._voice_used = False  # a response has spoken: the voice may no longer change
        self._idle_timer: asyncio.TimerHandle | None = None  # server_vad idle_timeout_ms, armed after a response
        self.closed = False
        self._handlers = {  # client event -> the part that applies it
            # session_control.py
            "session.update": self._session_update, "session.heartbeat": self._heartbeat,
            "session.event_ack": self._event_ack, "session.resume": self._resume,
            # input_buffer.py
            "input_audio_buffer.append": self._append, "input_audio_buffer.commit": self._commit_buffer,
            "input_audio_buffer.clear": self._clear_buffer,
            # item_control.py
            "conversation.item.create": self._item_create, "conversation.item.truncate": self._item_truncate,
            "conversation.item.delete": self._item_delete, "conversation.item.retrieve": self._item_retrieve,
            "playback.ack": self._playback_ack,
            # turns.py
            "response.create": self._response_create, "response.cancel": self._response_cancel,
            "output_audio_buffer.clear": self._output_clear,
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
        if self.speculation is not None:
            self._discard_speculation(self.speculation)
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

    # -- the inbound side ---------------------------------------------------------------------------------
    async def _work(self) -> None:
        while True:
            inbound = await self._mailbox.get()
            event_id = None
            try:
                if inbound.message is IDLE_TIMEOUT:
                    await self._idle_timeout()
                    continue
                if isinstance(inbound.message, StableTranscript):
                    await self._stable(inbound.message)
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
                self.check_speculation()
                self._mailbox.task_done()

    def post(self, message: object) -> bool:
        """Queue a server-side entry (IDLE_TIMEOUT, StableTranscript), applied in order with the client's events;
        False when the mailbox is full."""
        try:
            self._mailbox.put_nowait(Inbound(message, self.clock()))
            return True
        except asyncio.QueueFull:
            return False

    # -- server_vad idle timeout: armed here, applied by input_buffer.py ----------------------------------
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
        self.post(IDLE_TIMEOUT)  # a full mailbox: the client is busy sending, it is not idle


def _event_id_of(message: str | bytes) -> str | None:
    """The event_id of an event that failed to parse, when it has one."""
    try:
        event = json.loads(message)
    except (ValueError, TypeError, RecursionError):
        return None
    value = event.get("event_id") if isinstance(event, dict) else None
    return value if isinstance(value, str) else None
