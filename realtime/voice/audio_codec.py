"""Audio on the realtime voice wire: base64 pcm16 (24 kHz mono) and G.711 μ-law / A-law (8 kHz), to and
from float32 waveforms, and streaming resampling between the wire rate and the models' rates.

Formats are named as OpenAI names them: beta "pcm16" / "g711_ulaw" / "g711_alaw", GA `{"type":
"audio/pcm", "rate": 24000}` / `{"type": "audio/pcmu"}` / `{"type": "audio/pcma"}`. The G.711 code is
the ITU reference algorithm (as in Sun's g711.c and CPython's former audioop), tabulated once.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from stages.speech.audio_dsp import resample


@dataclass(frozen=True)
class AudioFormat:
    name: str  # beta name: "pcm16", "g711_ulaw", "g711_alaw"
    ga_type: str  # GA type: "audio/pcm", "audio/pcmu", "audio/pcma"
    rate: int  # samples per second on the wire
    bytes_per_sample: int

    def ga(self) -> dict:
        return {"type": self.ga_type, "rate": self.rate}

    def duration_ms(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_sample * 1000 / self.rate


PCM16 = AudioFormat("pcm16", "audio/pcm", 24_000, 2)
ULAW = AudioFormat("g711_ulaw", "audio/pcmu", 8_000, 1)
ALAW = AudioFormat("g711_alaw", "audio/pcma", 8_000, 1)
FORMATS = {f.name: f for f in (PCM16, ULAW, ALAW)}
GA_FORMATS = {f.ga_type: f for f in (PCM16, ULAW, ALAW)}


class AudioDecodeError(ValueError):
    """Audio bytes that are not what the format says; the message names the problem."""


def b64decode(text: str) -> bytes:
    """Strict base64 (the standard alphabet, padding required), or AudioDecodeError."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise AudioDecodeError(f"audio is not valid base64: {e}") from None


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode(data: bytes, fmt: AudioFormat) -> np.ndarray:
    """Wire bytes -> float32 [n] in [-1, 1] at `fmt.rate`."""
    if fmt is PCM16:
        if len(data) % 2:
            raise AudioDecodeError(f"pcm16 audio must be an even number of bytes (16-bit samples); got {len(data)}")
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    table = _ulaw_decode_table() if fmt is ULAW else _alaw_decode_table()
    return table[np.frombuffer(data, dtype=np.uint8)].astype(np.float32) / 32768.0


def encode(samples: np.ndarray, fmt: AudioFormat) -> bytes:
    """float32 [n] at `fmt.rate` -> wire bytes (clipped to [-1, 1])."""
    pcm = np.clip(np.round(np.asarray(samples, dtype=np.float32) * 32767.0), -32768, 32767).astype(np.int16)
    if fmt is PCM16:
        return pcm.astype("<i2").tobytes()
    table = _ulaw_encode_table() if fmt is ULAW else _alaw_encode_table()
    return table[pcm.astype(np.int32) + 32768].tobytes()


# -- G.711 --------------------------------------------------------------------------------------------------

_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])  # 14-bit magnitudes
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])  # 13-bit magnitudes


@lru_cache(maxsize=1)
def _ulaw_encode_table() -> np.ndarray:
    """uint8 [65536]: μ-law code of every int16 sample (index = sample + 32768)."""
    pcm = (np.arange(65536, dtype=np.int32) - 32768) >> 2  # 14-bit
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(pcm), 8159) + (0x84 >> 2)
    seg = np.searchsorted(_ULAW_SEG_END, mag)  # first segment whose end >= mag
    code = np.where(seg >= 8, 0x7F, (np.minimum(seg, 7) << 4) | ((mag >> (np.minimum(seg, 7) + 1)) & 0xF))
    return (code ^ mask).astype(np.uint8)


@lru_cache(maxsize=1)
def _ulaw_decode_table() -> np.ndarray:
    """int16 [256]: the sample of every μ-law code."""
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


@lru_cache(maxsize=1)
def _alaw_encode_table() -> np.ndarray:
    """uint8 [65536]: A-law code of every int16 sample (index = sample + 32768)."""
    pcm = (np.arange(65536, dtype=np.int32) - 32768) >> 3  # 13-bit
    mask = np.where(pcm >= 0, 0xD5, 0x55)
    mag = np.where(pcm >= 0, pcm, -pcm - 1)
    seg = np.searchsorted(_ALAW_SEG_END, mag)
    s = np.minimum(seg, 7)
    quant = np.where(s < 2, mag >> 1, mag >> np.maximum(s, 1)) & 0x0F
    code = np.where(seg >= 8, 0x7F, (s << 4) | quant)
    return (code ^ mask).astype(np.uint8)


@lru_cache(maxsize=1)
def _alaw_decode_table() -> np.ndarray:
    """int16 [256]: the sample of every A-law code."""
    a = np.arange(256, dtype=np.int32) ^ 0x55
    t = (a & 0x0F) << 4
    seg = (a & 0x70) >> 4
    t = np.where(seg == 0, t + 8, np.where(seg == 1, t + 0x108, (t + 0x108) << np.maximum(seg - 1, 0)))
    return np.where(a & 0x80, t, -t).astype(np.int16)


# -- streaming resampling -----------------------------------------------------------------------------------


class StreamResampler:
    """Resamples a stream that arrives in pieces, with the same result as resampling it whole (away from
    the ends): each piece is resampled with `margin` input samples of context on both sides, so the
    output lags the input by `margin` samples (2 ms at 24 kHz)."""

    def __init__(self, orig_rate: int, new_rate: int, margin_ms: float = 2.0):
        g = math.gcd(orig_rate, new_rate)
        self.orig_rate, self.new_rate = orig_rate, new_rate
        self._o, self._n = orig_rate // g, new_rate // g  # `o` input samples make exactly `n` output samples
        self._margin = max(1, math.ceil(margin_ms * orig_rate / 1000 / self._o)) * self._o
        self._buffer = np.zeros(self._margin, np.float32)  # left context (silence before the stream) + pending

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """The output samples that `samples` (and what came before) settle."""
        if self.orig_rate == self.new_rate:
            return np.asarray(samples, np.float32)
        self._buffer = np.concatenate([self._buffer, np.asarray(samples, np.float32)])
        m = self._margin
        usable = (len(self._buffer) - 2 * m) // self._o * self._o  # whole groups with context on both sides
        if usable <= 0:
            return np.zeros(0, np.float32)
        window = self._buffer[: m + usable + m]
        out = resample(window, self.orig_rate, self.new_rate)
        first = m // self._o * self._n
        settled = out[first: first + usable // self._o * self._n]
        self._buffer = self._buffer[usable:]  # keeps `m` samples of left context
        return settled
