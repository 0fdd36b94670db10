"""Text-to-speech models: the request checks, phrase splitting and tokenizing, and the tts stage behind them.

Two families, each loaded from a standard checkpoint (config.json `architectures`):
* "vits" — `VitsModel` + `VitsTokenizer` (MMS-TTS): pipelines/tts_vits.py
* "speecht5" — `SpeechT5ForTextToSpeech` + `SpeechT5HifiGan` vocoder, x-vectors as voices: pipelines/tts_speecht5.py

A request's text is cut into phrases (pipelines/phrases.py); the tts stage synthesises them in
order and streams each as it is ready. `seed` (an extension; default 0) seeds the request's
generator: the same text, voice, speed and seed give the same audio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipelines.image_request import RequestError
from pipelines.phrases import PhraseLimits, split_phrases
from stages.pool import PoolConfig
from stages.speech.tts import Phrase, Speaker, SpeechJob, TtsStage

VITS_FAMILY = "vits"
SPEECHT5_FAMILY = "speecht5"
TTS_FAMILIES = (VITS_FAMILY, SPEECHT5_FAMILY)
SPEECH_TASK = "text-to-speech"  # ModelInfo.tasks of a TTS model
# A step synthesises one phrase for each of up to 8 requests; 32 stay in the loop at once.
TTS_POOL = PoolConfig(max_batch_size=8, max_delay_ms=0.0, max_queue=256)


@dataclass(frozen=True)
class SpeechLimits:
    max_input_chars: int = 4096  # OpenAI's limit for /v1/audio/speech
    min_speed: float = 0.25
    max_speed: float = 4.0
    phrases: PhraseLimits = PhraseLimits()  # phrase lengths (characters)

    def __post_init__(self):
        if self.max_input_chars < 1:
            raise ValueError(f"max_input_chars must be >= 1, got {self.max_input_chars}")
        if not 0 < self.min_speed <= 1.0 <= self.max_speed:
            raise ValueError(f"speed limits must satisfy 0 < min_speed <= 1 <= max_speed, got "
                             f"{self.min_speed}..{self.max_speed}")


@dataclass
class SpeechRequest:
    """What the caller asked to hear, parsed but not yet split or tokenized."""

    input: str  # the text to speak
    voice: str | None = None  # None: the model's first voice
    speed: float = 1.0  # 0.25..4.0
    seed: int = 0  # seeds the noise of sampling models (VITS) and SpeechT5's prenet dropout
    sample_rate: int | None = None  # output rate; None: the model's own
    tenant: str = "default"


def checkpoint_dir(path: str) -> Path:
    """A local directory, or the local snapshot of a cached hub id (the server is offline)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, local_files_only=True))


class SpeakerLoader(Protocol):
    """A TTS family's speaker class (VitsSpeaker, SpeechT5Speaker): a checkpoint -> its Speaker."""

    def __call__(self, path: str, *, device: str = ..., dtype: str = ...) -> Speaker: ...


class SpeechModel:
    """A loaded TTS model: its speaker (family adapter), voices, limits and the tts stage that runs it."""

    def __init__(self, name: str, path: str, family: str, *, device: str = "cpu", dtype: str = "float32",
                 limits: SpeechLimits = SpeechLimits()):
        speaker_cls: SpeakerLoader
        if family == VITS_FAMILY:
            from pipelines.tts_vits import VitsSpeaker as speaker_cls
        elif family == SPEECHT5_FAMILY:
            from pipelines.tts_speecht5 import SpeechT5Speaker as speaker_cls
        else:
            raise ValueError(f"family {family!r} is not a text-to-speech family; use one of {TTS_FAMILIES}")
        self.name = name
        self.family = family
        self.limits = limits
        self.speaker = speaker_cls(path, device=device, dtype=dtype)
        self.stage = TtsStage(name, self.speaker)

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(self.speaker.voices)

    @property
    def sample_rate(self) -> int:
        return self.speaker.sample_rate

    def check(self, request: SpeechRequest) -> None:
        """The cheap checks, before anything is split or tokenized. Raises RequestError naming the field."""
        text, limits = request.input, self.limits
        if not isinstance(text, str) or not text.strip():
            raise RequestError("input", "input must be a non-empty string: the text to speak")
        if len(text) > limits.max_input_chars:
            raise RequestError("input", f"input is {len(text)} characters; the limit is {limits.max_input_chars}",
                               code="input_too_long")
        if request.voice is not None and request.voice not in self.speaker.voices:
            raise RequestError("voice", f"voice {request.voice!r} is not a voice of model {self.name}; its voices: "
                               f"{list(self.voices)}", code="unknown_voice")
        speed = request.speed
        if not (isinstance(speed, (int, float)) and math.isfinite(speed)
                and limits.min_speed <= speed <= limits.max_speed):
            raise RequestError("speed", f"speed must be between {limits.min_speed} and {limits.max_speed}; got {speed}")
        if not 0 <= request.seed < 2**63:
            raise RequestError("seed", f"seed must be between 0 and 2**63-1; got {request.seed}")
        if request.sample_rate is not None and not 8000 <= request.sample_rate <= 48000:
            raise RequestError("sample_rate", f"sample_rate must be between 8000 and 48000; got {request.sample_rate}")

    def job(self, request: SpeechRequest) -> SpeechJob:
        """Check, split into phrases and tokenize: what the tts stage runs."""
        self.check(request)
        phrases = []
        for text in split_phrases(request.input, self.limits.phrases):
            ids = self.speaker.tokenize(text)
            if ids:  # a phrase of only unspeakable characters (for this vocabulary) makes no sound
                phrases.append(Phrase(text, tuple(ids)))
        if not phrases:
            raise RequestError("input", f"input holds no characters model {self.name} can speak (its tokenizer "
                                        "knows none of them)", code="unspeakable_input")
        voice = request.voice if request.voice is not None else self.voices[0]
        return SpeechJob(phrases=tuple(phrases), voice=self.speaker.voices[voice], voice_name=voice,
                         speed=float(request.speed), seed=request.seed,
                         sample_rate=request.sample_rate or self.sample_rate)
