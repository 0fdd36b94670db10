"""The tts stage: phrases -> audio, one phrase per request per step, each phrase streamed as it is made.

A loop stage: a request joins at a phrase boundary and advances one phrase per step, so a
long text never holds back the first audio of a request that arrives after it, and a cancelled
request leaves at the next phrase boundary. A step serves requests that have not sent any
audio yet first.

Every phrase is synthesised on its own (noise from the request's generator), resampled to the
requested rate if it differs from the model's, and faded in and out over a few milliseconds:
phrases start and end at zero, so joins are click-free, and the final audio is exactly the
concatenation of the streamed chunks.

Events: DELTA {"index", "audio": float32 [n], "sample_rate"} per phrase; FINAL outputs
{"audio": float32 [N], "sample_rate", "phrases", "input_tokens"}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Protocol, Sequence

import numpy as np
import torch

from stages.events import EventKind
from stages.speech.audio_dsp import fade_edges, resample
from stages.stage import LoopStage, WorkItem

FADE_S = 0.005  # fade in and out at each phrase edge


class Speaker(Protocol):
    """What a TTS family adapter provides (pipelines/tts_vits.py, pipelines/tts_speecht5.py)."""

    sample_rate: int  # of the waveforms `synthesize` returns
    voices: dict[str, Any]  # voice name -> the handle `synthesize` takes (speaker id, x-vector)

    def tokenize(self, text: str) -> list[int]:
        """One phrase -> token ids ([] when it holds nothing the model can say)."""

    def synthesize(self, token_ids: Sequence[int], voice: Any, speed: float,
                   generator: torch.Generator) -> np.ndarray:
        """One phrase -> float32 waveform [n]; every random draw comes from `generator`."""


@dataclass(frozen=True)
class Phrase:
    text: str  # as cut from the input (normalised spaces)
    token_ids: tuple[int, ...]  # the model's tokens for it


@dataclass(frozen=True)
class SpeechJob:
    """What one speech request runs (the ExecutionRequest of the tts graph)."""

    phrases: tuple[Phrase, ...]  # at least one, in order
    voice: Any  # the speaker's voice handle (speaker id, x-vector)
    voice_name: str  # the voice the caller chose (for logs)
    speed: float  # 0.25..4.0; the speaker applies it
    seed: int  # seeds the request's generator
    sample_rate: int  # output rate; phrases are resampled to it when the model's differs

    @property
    def num_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.phrases)


class TtsStage(LoopStage):
    kind = "tts"

    def __init__(self, name: str, speaker: Speaker):
        self.model = name
        self.speaker = speaker

    def batch_key(self, item: WorkItem) -> Hashable:
        return "tts"  # phrases of any request share a step (each is its own forward)

    def start(self, item: WorkItem) -> None:
        job: SpeechJob = item.inputs["request"]
        item.state["generator"] = torch.Generator("cpu").manual_seed(job.seed)
        item.state["next"] = 0  # index of the next phrase to synthesise
        item.state["chunks"] = []  # faded phrase waveforms at job.sample_rate

    def step(self, items: list[WorkItem]) -> None:
        # Requests still waiting for their first audio go first.
        for item in sorted(items, key=lambda i: i.state["next"] > 0):
            job: SpeechJob = item.inputs["request"]
            index = item.state["next"]
            audio = self.render(job, job.phrases[index], item.state["generator"])
            item.state["chunks"].append(audio)
            item.state["next"] = index + 1
            item.emit(EventKind.DELTA, index=index, audio=audio, sample_rate=job.sample_rate)

    def render(self, job: SpeechJob, phrase: Phrase, generator: torch.Generator) -> np.ndarray:
        """One phrase, synthesised, at the job's rate, faded at both ends. float32 [n]."""
        audio = self.speaker.synthesize(phrase.token_ids, job.voice, job.speed, generator)
        audio = resample(audio, self.speaker.sample_rate, job.sample_rate)
        return fade_edges(audio, round(FADE_S * job.sample_rate))

    def is_done(self, item: WorkItem) -> bool:
        return item.state["next"] >= len(item.inputs["request"].phrases)

    def finish(self, item: WorkItem) -> dict[str, Any]:
        job: SpeechJob = item.inputs["request"]
        chunks = item.state["chunks"]
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return {"audio": audio, "sample_rate": job.sample_rate, "phrases": len(chunks),
                "input_tokens": job.num_tokens}
