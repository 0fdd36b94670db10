"""Small, exact audio operations on float32 waveforms: band-limited resampling and edge fades.

Used by the tts stage, phrase by phrase: every phrase starts and ends in silence after
`fade_edges`, so phrases resampled (or synthesised) apart join without a click, and a stream
of phrases equals the whole output sample for sample.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

_LOWPASS_ROLLOFF = 0.99  # cut-off as a fraction of the lower Nyquist frequency (as torchaudio)
_ZEROS = 6  # sinc zero crossings on each side of a tap: the kernel's width


def resample(samples: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """Windowed-sinc (Hann) resampling of float32 [n] -> [ceil(n * new / orig)].

    The same polyphase method as torchaudio's `resample` (sinc_interp_hann, 6 zero crossings,
    rolloff 0.99), written here so that no extra package is needed. Edges see zeros beyond
    the ends, which the callers fade to anyway.
    """
    samples = np.asarray(samples, dtype=np.float32)
    if orig_rate == new_rate or len(samples) == 0:
        return samples
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernel, width = _sinc_kernel(orig, new)  # [new, 1, 2 * width + orig]
    x = torch.from_numpy(samples)[None, None]  # [1, 1, n]
    x = torch.nn.functional.pad(x, (width, width + orig))
    y = torch.nn.functional.conv1d(x, kernel, stride=orig)  # [1, new, frames]
    y = y.transpose(1, 2).reshape(-1)  # interleave the phases
    target = math.ceil(new * len(samples) / orig)
    return y[:target].numpy().astype(np.float32, copy=False)


@lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    base = min(orig, new) * _LOWPASS_ROLLOFF  # cut-off, in units of the reduced rates
    width = math.ceil(_ZEROS * orig / base)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig  # [1, 1, taps]
    t = torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx  # [new, 1, taps]
    t = (t * base).clamp(-_ZEROS, _ZEROS)
    window = torch.cos(t * math.pi / _ZEROS / 2) ** 2
    t = t * math.pi
    scale = base / orig
    kernels = torch.where(t == 0, torch.tensor(1.0, dtype=torch.float64), t.sin() / t) * window * scale
    return kernels.to(torch.float32), width


def fade_edges(samples: np.ndarray, fade: int) -> np.ndarray:
    """Raised-cosine fade-in over the first `fade` samples and fade-out over the last (a copy).

    The first and last samples become exactly 0, so any two faded pieces join continuously.
    A piece shorter than two fades is faded over half its length each way.
    """
    out = np.array(samples, dtype=np.float32, copy=True)
    n = min(fade, len(out) // 2)
    if n > 0:
        ramp = _ramp(n)
        out[:n] *= ramp
        out[len(out) - n:] *= ramp[::-1]
    if len(out):
        out[0] = out[-1] = 0.0
    return out


@lru_cache(maxsize=16)
def _ramp(n: int) -> np.ndarray:
    # 0 at the edge, 1 at the inside: sin^2 over a quarter period, sampled at 0..n-1.
    return (np.sin(np.arange(n) / n * (np.pi / 2)) ** 2).astype(np.float32)


def stretch_frames(frames: torch.Tensor, speed: float) -> torch.Tensor:
    """Time-stretch a spectrogram [T, bins] to round(T / speed) frames by linear interpolation.

    Stretching frames before the vocoder changes duration, not pitch (the vocoder sets pitch
    per frame). Used where a model has no speaking-rate control of its own.
    """
    if speed == 1.0 or frames.shape[0] < 2:
        return frames
    target = max(1, round(frames.shape[0] / speed))
    x = frames.T[None]  # [1, bins, T]
    y = torch.nn.functional.interpolate(x, size=target, mode="linear", align_corners=True)
    return y[0].T.contiguous()
