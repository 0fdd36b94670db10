"""Qwen2.5-Omni's BigVGAN vocoder with a faster upsampler: what transformers computes, up to float summation order.

Every anti-aliased activation of the vocoder upsamples its input 2x with a fixed windowed-sinc filter, run by
transformers as a depthwise `conv_transpose1d`. On a CPU a grouped transposed convolution takes torch's slow generic
path: 42 % of a reply's vocoding (the demo checkpoint, 480 mel frames, one thread: 111 of 265 ms). The same
upsampling is a depthwise `conv1d` of the input with zeros stuffed between its samples, under the flipped filter,
which runs on oneDNN: the reply's vocoding then takes 218 ms instead of 276 (measured side by side), and its waveform
differs from transformers' by float rounding (7e-6 on a full-scale waveform).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class StuffedUpSample1d(torch.nn.Module):
    """transformers' `Qwen2_5OmniUpSample1d` (replicate-pad, transposed convolution by the filter at stride `ratio`,
    times `ratio`, edges cut) as one depthwise convolution of the zero-stuffed input: y = x * w in full, which
    `conv1d` computes on the stuffed signal padded by K - 1 with the filter flipped; the edges are cut by the
    padding (a negative pad crops)."""

    def __init__(self, upsample: Any):
        super().__init__()
        self.ratio: int = upsample.ratio
        self.pad: int = upsample.pad
        kernel: int = upsample.kernel_size
        self.left: int = kernel - 1 - upsample.pad_left
        self.right: int = kernel - 1 - upsample.pad_right
        self.filter = torch.nn.Buffer(upsample.filter.flip(-1), persistent=False)  # [1, 1, K]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        rows, channels, _ = hidden_states.shape
        padded = F.pad(hidden_states, (self.pad, self.pad), mode="replicate")
        stuffed = padded.new_zeros(rows, channels, (padded.shape[-1] - 1) * self.ratio + 1)
        stuffed[..., ::self.ratio] = padded
        out = F.conv1d(F.pad(stuffed, (self.left, self.right)), self.filter.expand(channels, -1, -1),
                       groups=channels)
        return self.ratio * out


def register(bigvgan: torch.nn.Module) -> int:
    """Swap every upsampler of `bigvgan` (token2wav's `code2wav_bigvgan_model`) for a `StuffedUpSample1d`; the
    number swapped."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniUpSample1d

    swapped = 0
    for module in list(bigvgan.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Qwen2_5OmniUpSample1d):
                setattr(module, name, StuffedUpSample1d(child).to(child.filter.device))
                swapped += 1
    return swapped
