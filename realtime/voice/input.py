"""A voice session's input audio: wire bytes -> 16 kHz samples -> turn detection -> the ASR lane.

With `server_vad`, audio outside speech only waits in a short ring (for the prefix padding);
a detected start opens a user item whose audio (from `prefix_padding_ms` before the start) goes
to the ASR lane as it arrives, and a detected stop ends it. With `turn_detection: null` every
appended sample belongs to the pending item until the client commits or clears it.

An utterance's audio ends `early_final_ms` after its last speech window: the rest of the endpointing
silence is not transcribed. So once a pause has lasted that long, the utterance as it would end there
is known, and the lane decodes it at once (`AsrLane.pause`: the early final); audio past that point is
held back until the speaker goes on (it joins the utterance) or the turn ends (it is dropped).

Positions are absolute sample counts at 16 kHz since the session began (`ms = sample // 16`).
"""

from __future__ import annotations

import asyncio
import math

import numpy as np

from realtime.voice.asr import AsrLane
from realtime.voice.audio_codec import PCM16, AudioFormat, StreamResampler
from realtime.voice.heard_audio import HeardAudioLane
from realtime.voice.items import new_id
from realtime.voice.protocol import ProtocolError
from realtime.voice.turn_detection import TurnDetection
from realtime.voice.vad import SAMPLE_RATE, WINDOW, TurnDetector, VadEvent, VadLoader, VadParams

MIN_COMMIT_MS = 100  # OpenAI refuses to commit less


class RingAudio:
    """The recent input, addressed by absolute sample position."""

    def __init__(self):
        self._data = np.zeros(0, np.float32)
        self.start = 0  # absolute position of _data[0]

    @property
    def end(self) -> int:
        return self.start + len(self._data)

    def append(self, samples: np.ndarray) -> None:
        self._data = np.concatenate([self._data, samples])

    def slice(self, a: int, b: int) -> np.ndarray:
        return self._data[max(a, self.start) - self.start: max(b, self.start) - self.start]

    def trim(self, keep_from: int) -> None:
        if keep_from > self.start:
            self._data = self._data[keep_from - self.start:]
            self.start = keep_from


class VoiceInput:
    def __init__(self, asr: AsrLane | HeardAudioLane, vad: VadLoader, *, min_speech_ms: int, early_final_ms: int):
        self.asr = asr
        self.vad = vad
        self.min_speech_ms = min_speech_ms
        self.end_pad = early_final_ms * SAMPLE_RATE // 1000  # an utterance's audio past its last speech window
        self.format: AudioFormat = PCM16
        self.turn_detection: TurnDetection | None = None
        self.detector: TurnDetector | None = None
        self.ring = RingAudio()
        self.pending_item: str | None = None  # the user item being spoken (server_vad) or buffered (manual)
        self._resampler = StreamResampler(PCM16.rate, SAMPLE_RATE)
        self._forwarded = 0  # the pending item's audio has gone to the ASR lane up to here
        self._buffered = 0  # manual mode: samples in the pending item
        self.paused_upto: int | None = None  # the pending item's early final covers its audio up to here

    @property
    def speaking(self) -> bool:
        return self.detector is not None and self.detector.speaking

    def configure(self, fmt: AudioFormat, turn_detection: TurnDetection | None) -> None:
        """Apply the session's input format and turn detection; a change of either drops an unfinished turn."""
        if fmt.rate != self.format.rate:
            self._resampler = StreamResampler(fmt.rate, SAMPLE_RATE)
        if turn_detection != self.turn_detection or fmt != self.format:
            if self.pending_item is not None and (self.turn_detection is None) != (turn_detection is None):
                self.clear()
            if turn_detection is None:
                self.detector = None
            else:
                params = VadParams(turn_detection.threshold, turn_detection.prefix_padding_ms,
                                   turn_detection.silence_duration_ms, self.min_speech_ms,
                                   turn_detection.sentence_silence_ms)
                if self.detector is None:
                    self.detector = TurnDetector(self.vad.new(), params)
                else:
                    self.detector.params = params
        self.format, self.turn_detection = fmt, turn_detection

    def to_model_rate(self, samples: np.ndarray) -> np.ndarray:
        """Wire-rate samples -> 16 kHz (streaming: continuous across appends)."""
        return self._resampler.feed(samples)

    async def feed(self, samples: np.ndarray) -> list[VadEvent]:
        """Add 16 kHz audio. Manual mode: it joins the pending item. server_vad: returns the detector's decisions;
        the caller applies each (`begin` / `end`) in order, then calls `flush`."""
        self.ring.append(samples)
        if self.detector is None:
            if self.pending_item is None:
                self.pending_item = new_id("item")
            self.asr.audio(self.pending_item, samples, partials=False)  # the item exists only once committed
            self._buffered += len(samples)
            self._forwarded = self.ring.end
            self.ring.trim(self.ring.end)
            return []
        return await asyncio.to_thread(self.detector.feed, samples) if len(samples) else []

    def begin(self, event: VadEvent) -> tuple[str, int]:
        """Speech started: a new pending item, its audio from the prefix padding on. Returns (item id, first sample)."""
        padding = self.turn_detection.prefix_padding_ms * SAMPLE_RATE // 1000
        first = max(self.ring.start, event.sample - padding)
        self.pending_item, self._forwarded, self.paused_upto = new_id("item"), first, None
        return self.pending_item, first

    def end(self, event: VadEvent) -> str | None:
        """Speech stopped: the pending item's audio up to `early_final_ms` past its speech goes to the ASR lane;
        returns the item."""
        item_id = self.pending_item
        if item_id is not None:
            upto = event.sample if event.speech_end is None else min(event.sample, event.speech_end + self.end_pad)
            self._forward(item_id, upto, partials=False)
        self.pending_item = self.paused_upto = None
        return item_id

    def flush(self) -> None:
        """After a feed's decisions: audio of an ongoing turn goes to the lane (while the speaker pauses, only up to
        `early_final_ms` into the pause, which starts the early final); the ring keeps what a start may need."""
        if self.pending_item is not None and self.speaking:
            pause = self.detector.pause_start
            if pause is None:
                self._forward(self.pending_item, self.ring.end)
                self.paused_upto = None
            else:  # no partial decode while the speaker pauses: the early final or the endpoint comes next
                upto = pause + self.end_pad
                self._forward(self.pending_item, min(self.ring.end, upto), partials=False)
                if self.ring.end >= upto and self.paused_upto != upto:
                    self.paused_upto = upto
                    self.asr.pause(self.pending_item, upto)
            self.ring.trim(self._forwarded)
        elif self.turn_detection is not None:
            td = self.turn_detection
            keep = math.ceil((td.prefix_padding_ms + self.min_speech_ms) * SAMPLE_RATE / 1000) + 2 * WINDOW
            self.ring.trim(self.ring.end - keep)

    def commit(self) -> str:
        """The client commits: the pending item's audio is complete. Raises ProtocolError when there is none."""
        if self.pending_item is None or (self.detector is None
                                         and self._buffered < MIN_COMMIT_MS * SAMPLE_RATE // 1000):
            have = self._buffered * 1000 // SAMPLE_RATE if self.detector is None else 0
            raise ProtocolError("input_audio_buffer_commit_empty", f"buffer too small: expected at least "
                                f"{MIN_COMMIT_MS} ms of audio, but the buffer holds {have} ms")
        item_id = self.pending_item
        if self.detector is not None:  # mid-speech: the turn ends here
            self._forward(item_id, self.ring.end, partials=False)
            self.detector.reset()
        self.pending_item, self._buffered, self.paused_upto = None, 0, None
        return item_id

    def clear(self) -> None:
        """Drop the pending item's audio (the ASR lane forgets it too)."""
        self.asr.clear(self.pending_item)
        self.pending_item, self._buffered, self.paused_upto = None, 0, None
        if self.detector is not None:
            self.detector.reset()

    def _forward(self, item_id: str, upto: int, partials: bool = True) -> None:
        if upto > self._forwarded:
            self.asr.audio(item_id, self.ring.slice(self._forwarded, upto), partials=partials)
            self._forwarded = upto
