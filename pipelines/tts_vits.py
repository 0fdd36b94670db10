"""The VITS family (MMS-TTS and other `VitsModel` checkpoints) for the tts stage.

VITS samples noise twice per forward: the stochastic duration predictor's latents and the
prior latents. `VitsModel.forward` draws both from torch's global RNG, which threads share;
`synthesize` runs the same computation with both draws taken from the request's own
`torch.Generator` (on the CPU, then moved), so a seed gives the same waveform whatever else
runs, and on the CPU exactly what `torch.manual_seed(seed); model(input_ids)` gives.

Voices: `voices.json` in the checkpoint ({"name": speaker_id}) when present; otherwise a
single-speaker model has the voice "default" and a multi-speaker one "speaker_0", "speaker_1", ...
`speed` is the model's speaking rate (durations scaled by 1 / speed; pitch unchanged).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from pipelines.tts import checkpoint_dir

VOICES_FILE = "voices.json"


class VitsSpeaker:
    """A loaded VitsModel + VitsTokenizer: tokenizes phrases and synthesises them one at a time."""

    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "float32"):
        from transformers import VitsModel, VitsTokenizer

        root = checkpoint_dir(path)
        self.device = torch.device(device)
        # transformers' PreTrainedModel.to is @wraps-decorated: to mypy its first argument is `self`
        self.model = VitsModel.from_pretrained(root, dtype=getattr(torch, dtype)).to(
            self.device).eval()  # type: ignore[arg-type]
        self.tokenizer = VitsTokenizer.from_pretrained(root)
        if getattr(self.tokenizer, "phonemize", False):
            raise ValueError(f"{path}: its VitsTokenizer phonemizes with espeak (phonemize=True); mmserve serves "
                             "character-level VITS checkpoints (MMS-TTS) only")
        config = self.model.config
        self.sample_rate: int = int(config.sampling_rate)
        self.voices: dict[str, int | None] = _read_voices(root, config.num_speakers)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of one phrase ([] when none of its characters is in the vocabulary)."""
        ids = self.tokenizer(text)["input_ids"]  # characters outside the vocabulary are dropped
        if self.tokenizer.add_blank:
            return ids if len(ids) > 1 else []  # an empty text still yields one blank
        return ids

    @torch.inference_mode()
    def synthesize(self, token_ids: Sequence[int], voice: int | None, speed: float,
                   generator: torch.Generator) -> np.ndarray:
        """One phrase -> float32 waveform [n] at `sample_rate`; noise comes from `generator` only."""
        model, config = self.model, self.model.config
        dtype = model.text_encoder.embed_tokens.weight.dtype
        # 1. text encoder (batch of one: no padding)
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, T]
        in_mask = torch.ones_like(input_ids).unsqueeze(-1).to(dtype)  # [1, T, 1]
        speaker = None
        if config.num_speakers > 1 and voice is not None:
            speaker = model.embed_speaker(torch.tensor([voice], device=self.device)).unsqueeze(-1)  # [1, E, 1]
        encoded = model.text_encoder(input_ids=input_ids, padding_mask=in_mask, attention_mask=None, return_dict=True)
        hidden = encoded.last_hidden_state.transpose(1, 2)  # [1, H, T]
        in_mask = in_mask.transpose(1, 2)  # [1, 1, T]
        # 2. durations (stochastic: the first noise draw), scaled by the speaking rate
        if config.use_stochastic_duration_prediction:
            noise = torch.randn(1, 2, hidden.size(2), generator=generator).to(self.device, dtype)
            log_duration = _stochastic_durations(model.duration_predictor, hidden, in_mask, speaker,
                                                 noise * model.noise_scale_duration)
        else:
            log_duration = model.duration_predictor(hidden, in_mask, speaker)
        length_scale = 1.0 / (model.speaking_rate * speed)
        duration = torch.ceil(torch.exp(log_duration) * in_mask * length_scale)  # [1, 1, T] frames per token
        frames = int(torch.clamp_min(duration.sum(), 1).item())
        # 3. expand the prior to frames, sample it (the second noise draw), invert the flow, vocode
        attn = _alignment(duration, frames)  # [1, frames, T]
        means = torch.matmul(attn, encoded.prior_means).transpose(1, 2)  # [1, C, frames]
        log_vars = torch.matmul(attn, encoded.prior_log_variances).transpose(1, 2)
        # transformers draws randn_like(means) on a transposed view, which torch fills element by element
        # (not its vectorised contiguous path): draw on the same layout to get the same numbers.
        noise = torch.empty(1, frames, means.size(1)).transpose(1, 2).normal_(generator=generator)
        noise = noise.to(self.device, dtype)
        prior = means + noise * torch.exp(log_vars) * model.noise_scale
        out_mask = torch.ones(1, 1, frames, device=self.device, dtype=dtype)
        latents = model.flow(prior, out_mask, speaker, reverse=True)
        waveform = model.decoder(latents * out_mask, speaker)  # [1, 1, frames * hop]
        return waveform[0, 0].float().cpu().numpy()


def _stochastic_durations(predictor, hidden: torch.Tensor, mask: torch.Tensor, speaker: torch.Tensor | None,
                          latents: torch.Tensor) -> torch.Tensor:
    """VitsStochasticDurationPredictor.forward(reverse=True) with its noise passed in. -> log durations [1, 1, T]."""
    x = predictor.conv_pre(hidden)
    if speaker is not None:
        x = x + predictor.cond(speaker)
    x = predictor.conv_dds(x, mask)
    x = predictor.conv_proj(x) * mask
    flows = list(reversed(predictor.flows))
    flows = flows[:-2] + [flows[-1]]  # transformers drops one unused flow here too
    for flow in flows:
        latents = torch.flip(latents, [1])
        latents, _ = flow(latents, mask, global_conditioning=x, reverse=True)
    return latents[:, :1]


def _alignment(duration: torch.Tensor, frames: int) -> torch.Tensor:
    """Hard monotonic alignment from per-token frame counts [1, 1, T] -> [1, frames, T] (one-hot rows)."""
    ends = torch.cumsum(duration[0, 0], 0)  # [T]
    starts = ends - duration[0, 0]
    t = torch.arange(frames, device=duration.device, dtype=duration.dtype)[:, None]  # [frames, 1]
    return ((t >= starts) & (t < ends)).to(duration.dtype)[None]


def _read_voices(root: Path, num_speakers: int) -> dict[str, int | None]:
    file = root / VOICES_FILE
    if file.is_file():
        voices = json.loads(file.read_text())
        if not isinstance(voices, dict) or not voices:
            raise ValueError(f"{file}: expected a JSON object {{voice name: speaker id}}")
        for name, sid in voices.items():
            if not isinstance(sid, int) or not 0 <= sid < max(num_speakers, 1):
                raise ValueError(f"{file}: voice {name!r} names speaker {sid!r}; the model has speakers "
                                 f"0..{max(num_speakers, 1) - 1}")
        return {str(k): (v if num_speakers > 1 else None) for k, v in voices.items()}
    if num_speakers <= 1:
        return {"default": None}
    return {f"speaker_{i}": i for i in range(num_speakers)}
