"""Voice activity detection for `server_vad` turn detection, with OpenAI's parameters.

* `threshold` (0..1, default 0.5): a 32 ms window (512 samples at 16 kHz) is speech when its
  speech probability reaches it. Speech keeps going until the probability falls below
  `threshold - 0.15` (Silero's own hysteresis), so one quiet syllable does not end a turn.
* `prefix_padding_ms` (300): audio before the detected start that belongs to the turn; the
  `speech_started` event's `audio_start_ms` includes it (the caller applies it: it owns the audio).
* `silence_duration_ms` (500): this much silence ends the turn; `speech_stopped`'s `audio_end_ms`
  is where that silence has been seen, so it includes the silence, as OpenAI's does.
* `min_speech_ms` (an extension, server-configured): speech must last this long before it counts,
  a debounce against clicks and breaths. Meanwhile the detector is `suspecting`: the session holds
  back response audio then, so a barge-in costs no more than one speech window of old audio.
* `sentence_silence_ms` (an extension, opt-in; `semantic_vad` sets it): the adaptive end of turn. While
  the transcript of the utterance as it stands ends a sentence (`sentence_ended`, set by the session from
  the early final), this much silence ends the turn; mid-phrase `silence_duration_ms` stays the rule.

The probability comes from the Silero VAD model (the `silero-vad` PyPI package, its TorchScript
file loaded with torch alone: the package's own loader would import torchaudio and change torch's
global thread count) or, when that package is not installed, from the window's energy.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
WINDOW = 512  # samples per decision (32 ms): what Silero takes at 16 kHz
NEG_THRESHOLD_GAP = 0.15


@dataclass(frozen=True)
class VadParams:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    min_speech_ms: int = 64
    sentence_silence_ms: int | None = None  # adaptive: the silence that ends a turn whose transcript ends a sentence

    def __post_init__(self):
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"threshold must be between 0 and 1, got {self.threshold}")
        for key in ("prefix_padding_ms", "silence_duration_ms", "min_speech_ms", "sentence_silence_ms"):
            if (getattr(self, key) or 0) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class VadEvent:
    kind: str  # "start" or "stop"
    sample: int  # start: the first speech sample; stop: where the silence that ended the turn has been seen
    speech_end: int | None = None  # stop: where that silence began (the end of the last speech window)


class SpeechModel(Protocol):
    name: str

    def probability(self, window: np.ndarray) -> float:
        """Speech probability of one window (float32 [512] at 16 kHz); the model may keep state between calls."""

    def reset(self) -> None: ...


class EnergyModel:
    """The fallback: a window's RMS level mapped onto 0..1 (-55 dBFS -> 0, -45 -> 0.5, -35 -> 1)."""

    name = "energy"

    def probability(self, window: np.ndarray) -> float:
        rms = float(np.sqrt(np.mean(np.square(window, dtype=np.float64)))) if len(window) else 0.0
        if rms <= 0:
            return 0.0
        return min(1.0, max(0.0, (20 * math.log10(rms) + 55) / 20))

    def reset(self) -> None:
        pass


class SileroModel:
    """One session's copy of Silero VAD (it keeps a recurrent state and 64 samples of context)."""

    name = "silero"

    def __init__(self, module):
        self._module = module

    def probability(self, window: np.ndarray) -> float:
        import torch

        with torch.inference_mode():
            return float(self._module(torch.from_numpy(np.ascontiguousarray(window, np.float32)), SAMPLE_RATE))

    def reset(self) -> None:
        self._module.reset_states()


class VadLoader:
    """Makes one SpeechModel per session: Silero when the package is installed (loaded once, copied per
    session), else the energy model. `prefer="energy"` skips Silero."""

    def __init__(self, prefer: str = "silero"):
        if prefer not in ("silero", "energy"):
            raise ValueError(f"prefer must be 'silero' or 'energy', got {prefer!r}")
        self.prefer = prefer
        self._template = None
        self._lock = threading.Lock()
        self._missing = prefer == "energy"

    @property
    def kind(self) -> str:
        return "energy" if self._missing or self._load() is None else "silero"

    def new(self) -> SpeechModel:
        template = None if self._missing else self._load()
        if template is None:
            return EnergyModel()
        with self._lock:
            return SileroModel(copy.deepcopy(template))

    def _load(self):
        with self._lock:
            if self._template is None and not self._missing:
                path = silero_file()
                if path is None:
                    log.info("silero-vad is not installed (pip install --no-deps silero-vad): server_vad uses the "
                             "energy fallback")
                    self._missing = True
                    return None
                import torch

                with warnings.catch_warnings():  # torch.jit.load is deprecated; the package ships TorchScript
                    warnings.simplefilter("ignore")
                    module = torch.jit.load(str(path), map_location="cpu")
                module.eval()
                self._template = module
            return self._template


def silero_file() -> Path | None:
    """The TorchScript model inside the installed `silero-vad` package (found without importing it)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.jit"
    return path if path.is_file() else None


class TurnDetector:
    """Speech start / stop decisions over a stream of 16 kHz audio, window by window."""

    def __init__(self, model: SpeechModel, params: VadParams):
        self.model = model
        self.params = params
        self.speaking = False
        self._pending = np.zeros(0, np.float32)  # samples not yet in a full window
        self._position = 0  # absolute index of the first pending sample
        self._run_start: int | None = None  # idle: where the current run of speech windows began
        self._silence_start: int | None = None  # speaking: where the current run of silent windows began
        self.sentence_ended = False  # the utterance's transcript so far ends a sentence (adaptive end of turn)
        self.last_probability = 0.0

    @property
    def pausing(self) -> bool:
        """Speaking, but the latest windows were silent: the turn may be about to end."""
        return self.speaking and self._silence_start is not None

    @property
    def pause_start(self) -> int | None:
        """While pausing: where the silence began (the end of the last speech window); else None."""
        return self._silence_start if self.speaking else None

    @property
    def suspecting(self) -> bool:
        """Not speaking, but the latest windows were speech: a start is due unless they stop within min_speech_ms."""
        return not self.speaking and self._run_start is not None

    @property
    def samples_seen(self) -> int:
        return self._position + len(self._pending)

    def reset(self, speaking: bool = False) -> None:
        """Forget the run in progress (the model state too); e.g. after the client commits mid-speech."""
        self.speaking = speaking
        self._run_start = self._silence_start = None
        self.sentence_ended = False
        self.model.reset()

    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        """Decisions that the new audio completes, in order (absolute sample positions)."""
        p = self.params
        min_speech = math.ceil(p.min_speech_ms * SAMPLE_RATE / 1000)
        min_silence = math.ceil(p.silence_duration_ms * SAMPLE_RATE / 1000)
        if p.sentence_silence_ms is not None and self.sentence_ended:
            min_silence = min(min_silence, math.ceil(p.sentence_silence_ms * SAMPLE_RATE / 1000))
        negative = max(0.01, p.threshold - NEG_THRESHOLD_GAP)
        self._pending = np.concatenate([self._pending, np.asarray(samples, np.float32)])
        events: list[VadEvent] = []
        while len(self._pending) >= WINDOW:
            window, start = self._pending[:WINDOW], self._position
            self._pending, self._position = self._pending[WINDOW:], start + WINDOW
            prob = self.last_probability = self.model.probability(window)
            end = start + WINDOW
            if not self.speaking:
                if prob >= p.threshold:
                    self._run_start = start if self._run_start is None else self._run_start
                    if end - self._run_start >= max(min_speech, 1):
                        events.append(VadEvent("start", self._run_start))
                        self.speaking, self._run_start, self._silence_start = True, None, None
                else:
                    self._run_start = None
            elif prob < negative:
                self._silence_start = start if self._silence_start is None else self._silence_start
                if end - self._silence_start >= min_silence:
                    events.append(VadEvent("stop", end, self._silence_start))
                    self.speaking, self._silence_start, self.sentence_ended = False, None, False
            else:
                self._silence_start = None
                self.sentence_ended = False  # more speech: the transcript that ended a sentence is out of date
        return events
