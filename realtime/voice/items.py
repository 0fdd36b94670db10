"""A voice session's conversation: its items, what of the assistant's audio the user has heard, and the
clock that tells how far the client has played.

History keeps only what was heard (book ch.21): an assistant audio item remembers where each
phrase's audio lies in it, so truncating it to `heard_ms` keeps the phrases heard whole plus the
heard share of the words of the phrase that was playing. The full generated text stays on the
item as diagnostic state (`text`), never in the history the language model sees.

Function calling adds two kinds of item: a `function_call` (the assistant's call: `call_id`, `name`, `arguments`)
and a `function_call_output` (the tool's result the client sends back, as `text`). They have no audio.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from realtime.voice.protocol import ProtocolError, content_type


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


@dataclass
class Phrase:
    text: str  # what the phrase says
    start_ms: float  # where its audio starts in the item's audio
    duration_ms: float


@dataclass
class Item:
    id: str
    role: str  # "system", "user", "assistant" ("tool" for a function_call_output)
    kind: str  # "text", "audio", "function_call" or "function_call_output"
    text: str = ""  # the text, or the (full) transcript of the audio
    status: str = "completed"  # "in_progress" while a response writes it, "incomplete" when cut short
    transcript: asyncio.Future | None = None  # user audio: resolves to the ASR's final text (gates the response)
    audio_ms: float = 0.0  # assistant audio: milliseconds sent to the client
    phrases: list[Phrase] = field(default_factory=list)  # assistant audio: the phrases laid out on its audio
    heard_ms: float | None = None  # truncated here (None: all of it was heard, or it has no audio)
    audio: np.ndarray | None = None  # user audio an omni voice hears (16 kHz); the cascade keeps transcripts only
    call_id: str = ""  # a function_call and its function_call_output share it
    name: str = ""  # a function_call's function
    arguments: str = ""  # a function_call's arguments (JSON text)

    @property
    def history_text(self) -> str:
        """What enters the language model's context: for a truncated audio item, only what was heard."""
        if self.heard_ms is None or not self.phrases:
            return self.text if self.heard_ms is None else ""
        heard = []
        for phrase in self.phrases:
            if phrase.start_ms >= self.heard_ms:
                break
            words = phrase.text.split()
            share = min(1.0, (self.heard_ms - phrase.start_ms) / max(phrase.duration_ms, 1e-6))
            heard.extend(words[: int(len(words) * share + 1e-9)])
        return " ".join(heard)

    def wire(self, beta: bool) -> dict[str, Any]:
        """The item as events carry it (GA or beta content types)."""
        if self.kind == "function_call":
            return {"id": self.id, "object": "realtime.item", "type": "function_call", "status": self.status,
                    "call_id": self.call_id, "name": self.name, "arguments": self.arguments}
        if self.kind == "function_call_output":
            return {"id": self.id, "object": "realtime.item", "type": "function_call_output", "status": self.status,
                    "call_id": self.call_id, "output": self.text}
        if self.role == "assistant":
            if self.kind == "audio":
                part = {"type": content_type("output_audio", beta), "transcript": self.history_text}
            else:
                part = {"type": content_type("output_text", beta), "text": self.text}
        elif self.kind == "audio":
            done = self.transcript is None or self.transcript.done()
            part = {"type": "input_audio", "transcript": self.text if done else None}
        else:
            part = {"type": "input_text", "text": self.text}
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role, "status": self.status,
                "content": [part]}


class Conversation:
    """The ordered items of one session."""

    def __init__(self, max_items: int = 1024):
        self.max_items = max_items
        self._items: list[Item] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items))

    @property
    def last_id(self) -> str | None:
        return self._items[-1].id if self._items else None

    def get(self, item_id: Any, param: str = "item_id") -> Item:
        for item in self._items:
            if item.id == item_id:
                return item
        raise ProtocolError("item_not_found", f"no item with id {item_id!r} in the conversation", param=param)

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` ("root": first; None: last). Returns the id of the item before it."""
        if any(i.id == item.id for i in self._items):
            raise ProtocolError("duplicate_item_id", f"an item with id {item.id!r} exists already", param="item.id")
        after = None if previous_item_id in (None, "root") else self.get(previous_item_id, "previous_item_id")
        if len(self._items) >= self.max_items:  # forget the oldest: a session must not grow without bound
            self._items.pop(0)
        if previous_item_id is None:
            index = len(self._items)
        elif after is None or after not in self._items:  # "root" (or the item just forgotten)
            index = 0
        else:
            index = self._items.index(after) + 1
        self._items.insert(index, item)
        return self._items[index - 1].id if index > 0 else None

    def call(self, call_id: str) -> Item | None:
        """The function_call item of `call_id`, if the conversation holds it."""
        return next((i for i in self._items if i.kind == "function_call" and i.call_id == call_id), None)

    def delete(self, item_id: Any) -> Item:
        item = self.get(item_id)
        self._items.remove(item)
        return item


class PlaybackClock:
    """Where the client's playback is, assuming it plays each audio delta as soon as it arrives after the one
    before (pipecat's simulated clock). Drives pacing (the lead over real time) and the played-time fallback
    of truncation when the client sends neither `playback.ack` nor `conversation.item.truncate`."""

    MAX_ITEMS = 16  # items whose playback is remembered

    def __init__(self):
        self.play_end = 0.0  # when everything sent so far has been played (clock seconds)
        self._segments: dict[str, list[tuple[float, float, float]]] = {}  # item -> [(start time, offset ms, ms)]
        self._stopped: dict[str, float] = {}  # item -> played ms when playback was cut

    def lead_ms(self, now: float) -> float:
        return max(0.0, self.play_end - now) * 1000

    def schedule(self, item_id: str, offset_ms: float, duration_ms: float, now: float) -> None:
        start = max(self.play_end, now)
        segments = self._segments.setdefault(item_id, [])
        if segments and abs(segments[-1][0] + segments[-1][2] / 1000 - start) < 1e-6 \
                and abs(segments[-1][1] + segments[-1][2] - offset_ms) < 1e-3:  # plays right on: one longer segment
            segments[-1] = (segments[-1][0], segments[-1][1], segments[-1][2] + duration_ms)
        else:
            segments.append((start, offset_ms, duration_ms))
        self.play_end = start + duration_ms / 1000
        while len(self._segments) > self.MAX_ITEMS:  # only the latest items can still be playing
            self.forget(next(iter(self._segments)))

    def played_ms(self, item_id: str, now: float) -> float:
        if item_id in self._stopped:
            return self._stopped[item_id]
        played = 0.0
        for start, offset, duration in self._segments.get(item_id, ()):
            if now > start:
                played = max(played, offset + min(duration, (now - start) * 1000))
        return played

    def playing(self, item_id: str, now: float) -> bool:
        segments = self._segments.get(item_id)
        return bool(segments) and item_id not in self._stopped and now < segments[-1][0] + segments[-1][2] / 1000

    def stop(self, now: float) -> None:
        """The client stops playback (an interruption): nothing sent so far plays any further."""
        for item_id in self._segments:
            if item_id not in self._stopped:
                self._stopped[item_id] = self.played_ms(item_id, now)
        self.play_end = min(self.play_end, now)

    def forget(self, item_id: str) -> None:
        self._segments.pop(item_id, None)
        self._stopped.pop(item_id, None)
