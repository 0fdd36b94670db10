"""The input lane of an omni voice (a `[[voices]]` entry with `omni = "MODEL"`): the model hears the user's audio
itself, so nothing is transcribed. The lane stands where the ASR lane (asr.py) stands and answers the same calls:
it gathers each user item's 16 kHz audio as it arrives, and when the utterance ends (the VAD's stop, a commit, a
whole item created with audio) the item's `final` resolves to "" (no transcript) and its audio waits in
`take_audio` for the session, which keeps it on the item. A response's context then carries that audio as an
`input_audio` part (turns.py).

An utterance longer than the model takes (`max_s`: the media limit, the model's `max_audio_s`, its encoder's
window) keeps its last `max_s` seconds: the end of a turn is what asks for the answer.
"""

from __future__ import annotations

import asyncio

import numpy as np

SAMPLE_RATE = 16_000  # what VoiceInput hands on (realtime/voice/vad.py)


class HeardAudioLane:
    def __init__(self, max_s: float):
        self.max_samples = int(max_s * SAMPLE_RATE)
        self._pieces: dict[str, list[np.ndarray]] = {}  # item -> its audio so far
        self._done: dict[str, np.ndarray] = {}  # item -> its whole audio, until the session takes it
        self._finals: dict[str, asyncio.Future] = {}

    def start(self) -> None:
        pass

    async def close(self) -> None:
        for future in self._finals.values():
            if not future.done():
                future.set_result("")
        self._pieces.clear()
        self._done.clear()

    async def idle(self) -> None:
        """Nothing runs in the background: every call has been applied when it returns."""

    def final(self, item_id: str) -> asyncio.Future:
        """Resolves to "" once the item's audio is complete (there is no transcript)."""
        if item_id not in self._finals:
            self._finals[item_id] = asyncio.get_running_loop().create_future()
        return self._finals[item_id]

    def audio(self, item_id: str, samples: np.ndarray, partials: bool = True) -> None:
        if len(samples):
            self._pieces.setdefault(item_id, []).append(np.asarray(samples, np.float32))

    def pause(self, item_id: str, upto: int) -> None:
        """The model hears the audio itself: nothing to decode early."""

    def endpoint(self, item_id: str, claim: bool = False) -> None:
        """The item's utterance is over. No response claims a decode here (returns None, as an unclaimed ASR lane)."""
        pieces = self._pieces.pop(item_id, [])
        self._finish(item_id, np.concatenate(pieces) if pieces else np.zeros(0, np.float32))

    def oneshot(self, item_id: str, samples: np.ndarray) -> None:
        self._finish(item_id, np.asarray(samples, np.float32))

    def clear(self, item_id: str | None) -> None:
        if item_id is not None:
            self._pieces.pop(item_id, None)
            self._done.pop(item_id, None)
            future = self._finals.pop(item_id, None)
            if future is not None and not future.done():
                future.set_result("")

    def take_audio(self, item_id: str) -> np.ndarray | None:
        """The item's whole audio (16 kHz), once; None when it had none."""
        self._finals.pop(item_id, None)  # resolved: the item holds it
        samples = self._done.pop(item_id, None)
        return samples if samples is not None and len(samples) else None

    def _finish(self, item_id: str, samples: np.ndarray) -> None:
        self._done[item_id] = samples[-self.max_samples:] if self.max_samples else samples[:0]
        future = self.final(item_id)
        if not future.done():
            future.set_result("")
