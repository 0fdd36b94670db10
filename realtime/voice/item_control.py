"""The conversation items of a voice session: `conversation.item.create`, `.truncate`, `.delete` and
`.retrieve`, `playback.ack` (what of an item the client has played), and the ASR lane's sink, which turns a
user audio item's transcript into `conversation.item.input_audio_transcription.*` events.

A mixin of VoiceSession (realtime/voice/session.py), as turns.py is: it uses the session's state
(conversation, playback clock, acks, announced items, ASR lane, response) and owns none of its own.
The items themselves are items.py's.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from realtime.voice.audio_codec import AudioDecodeError, b64decode, decode
from realtime.voice.items import Item, new_id
from realtime.voice.protocol import ProtocolError, parse_function_item, parse_item
from realtime.voice.vad import SAMPLE_RATE
from stages.speech.audio_dsp import resample

if TYPE_CHECKING:
    from realtime.voice.session import Inbound


class ItemControl:
    async def _item_create(self, event: dict, inbound: Inbound) -> None:
        self.disarm_idle()
        raw = event.get("item")
        previous_id = event.get("previous_item_id")
        if previous_id is not None and not isinstance(previous_id, str):
            raise ProtocolError("invalid_value", "previous_item_id must be a string", param="previous_item_id")
        if isinstance(raw, dict) and raw.get("type") in ("function_call", "function_call_output"):
            await self._function_item_create(parse_function_item(raw, "item"), previous_id)
            return
        spec = parse_item(raw, "item")
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
            self.hear(item)
        await self.emit({"type": "conversation.item.created", "previous_item_id": previous,
                         "item": item.wire(self.config.beta)})
        if item.id in self._announced:
            self._announced[item.id].set()

    async def _function_item_create(self, spec: dict, previous_id: str | None) -> None:
        """A function call (the client may replay one) or, usually, the output of one the model made: it must answer
        a call in the conversation, which the next response's prompt then holds with its result."""
        if spec["type"] == "function_call":
            item = Item(spec["id"] or new_id("item"), "assistant", "function_call", call_id=spec["call_id"],
                        name=spec["name"], arguments=spec["arguments"])
        else:
            if self.conversation.call(spec["call_id"]) is None:
                raise ProtocolError("invalid_value", f"item.call_id {spec['call_id']!r} answers no function_call "
                                    "in the conversation", param="item.call_id")
            item = Item(spec["id"] or new_id("item"), "tool", "function_call_output", call_id=spec["call_id"],
                        text=spec["output"])
        previous = self.conversation.add(item, previous_id)
        await self.emit({"type": "conversation.item.created", "previous_item_id": previous,
                         "item": item.wire(self.config.beta)})

    def hear(self, item: Item) -> None:
        """An omni voice keeps a user item's audio for its model to hear (the ASR lane keeps none); only the latest
        `max_heard` items (the model's audio parts per request) keep theirs."""
        item.audio = self.asr.take_audio(item.id)
        if item.audio is None:
            return
        heard = [i for i in self.conversation if i.audio is not None]
        for older in heard[:-self.max_heard] if self.max_heard else heard:
            older.audio = None

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

    # -- the ASR lane's sink ------------------------------------------------------------------------------
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
