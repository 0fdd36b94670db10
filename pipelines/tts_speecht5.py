"""The SpeechT5 family (`SpeechT5ForTextToSpeech` + `SpeechT5HifiGan`) for the tts stage.

A checkpoint directory holds the model and its tokenizer (as microsoft/speecht5_tts), plus:

    vocoder/                  a SpeechT5HifiGan checkpoint (as microsoft/speecht5_hifigan) — required
    voices.safetensors        optional: named speaker x-vectors, one float tensor [512] per voice
    generate_speech.json      optional: {"threshold", "minlenratio", "maxlenratio"} for generation

Without voices.safetensors the model gets a deterministic set of random x-vectors (logged): any
checkpoint serves, but real voices come from real x-vectors (e.g. the CMU ARCTIC set).

SpeechT5's decoder prenet applies dropout at inference too (Tacotron 2's trick), drawing from
torch's global RNG. `synthesize` runs `generate_speech`'s loop with those draws taken from the
request's own generator, so on the CPU it equals `torch.manual_seed(seed); generate_speech(...)`.
`speed` time-stretches the mel spectrogram before the vocoder (duration changes, pitch does not).
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from pipelines.tts import checkpoint_dir
from stages.speech.audio_dsp import stretch_frames

log = logging.getLogger(__name__)

VOICES_FILE = "voices.safetensors"
VOCODER_DIR = "vocoder"
GENERATION_FILE = "generate_speech.json"
FALLBACK_VOICES = ("alloy", "echo", "fable", "nova", "onyx", "shimmer")  # names of the seeded random x-vectors
_GENERATION_DEFAULTS = {"threshold": 0.5, "minlenratio": 0.0, "maxlenratio": 20.0}  # as generate_speech


class SpeechT5Speaker:
    """A loaded SpeechT5 TTS model, its HiFi-GAN vocoder and voices; synthesises one phrase at a time."""

    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "float32"):
        from transformers import SpeechT5ForTextToSpeech, SpeechT5HifiGan, SpeechT5Tokenizer

        root = checkpoint_dir(path)
        if not (root / VOCODER_DIR / "config.json").is_file():
            raise ValueError(f"{path}: no {VOCODER_DIR}/ folder with a SpeechT5HifiGan checkpoint; put one there "
                             "(e.g. the files of microsoft/speecht5_hifigan)")
        self.device = torch.device(device)
        torch_dtype = getattr(torch, dtype)
        # transformers' PreTrainedModel.to is @wraps-decorated: to mypy its first argument is `self`
        self.model = SpeechT5ForTextToSpeech.from_pretrained(root, dtype=torch_dtype).to(
            self.device).eval()  # type: ignore[arg-type]
        self.vocoder = SpeechT5HifiGan.from_pretrained(root / VOCODER_DIR, dtype=torch_dtype).to(
            self.device).eval()  # type: ignore[arg-type]
        self.tokenizer = SpeechT5Tokenizer.from_pretrained(root)
        self.sample_rate: int = int(self.vocoder.config.sampling_rate)
        self.generation = _read_generation(root)
        self.voices: dict[str, torch.Tensor] = _read_voices(root, self.model.config.speaker_embedding_dim, path)
        # transformers renamed the decoder's `past_key_values` to `cache` within 5.x: use what this version takes.
        decoder_args = inspect.signature(self.model.speecht5.decoder.wrapped_decoder.forward).parameters
        self._cache_arg = "cache" if "cache" in decoder_args else "past_key_values"

    def tokenize(self, text: str) -> list[int]:
        """Token ids of one phrase, end-of-sentence included ([] when nothing but unknown characters)."""
        ids = self.tokenizer(text)["input_ids"]
        unk, eos = self.tokenizer.unk_token_id, self.tokenizer.eos_token_id
        return ids if any(i not in (unk, eos) for i in ids) else []

    @torch.inference_mode()
    def synthesize(self, token_ids: Sequence[int], voice: torch.Tensor, speed: float,
                   generator: torch.Generator) -> np.ndarray:
        """One phrase -> float32 waveform [n] at `sample_rate`; prenet dropout masks come from `generator`."""
        model, config = self.model, self.model.config
        r, bins = config.reduction_factor, config.num_mel_bins
        speaker = voice.to(self.device, model.dtype)[None]  # [1, 512]
        # 1. encode the text
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, T]
        mask = torch.ones_like(input_ids)
        encoded = model.speecht5.encoder(input_values=input_ids, attention_mask=mask, return_dict=True)
        memory = encoded.last_hidden_state  # [1, T, H]
        maxlen = int(memory.size(1) * self.generation["maxlenratio"] / r)
        minlen = int(memory.size(1) * self.generation["minlenratio"] / r)
        # 2. decode mel frames autoregressively (r per step) until the stop probability crosses the threshold
        sequence = memory.new_zeros(1, 1, bins)
        steps: list[torch.Tensor] = []
        cache, idx = None, 0
        while True:
            idx += 1
            prenet = _decoder_prenet(model.speecht5.decoder.prenet, sequence, speaker, generator)
            out = model.speecht5.decoder.wrapped_decoder(
                hidden_states=prenet[:, -1:], attention_mask=None, encoder_hidden_states=memory,
                encoder_attention_mask=mask, use_cache=True, return_dict=True, **{self._cache_arg: cache})
            last = out.last_hidden_state.squeeze(1)  # [1, H]
            cache = out[self._cache_arg]
            spectrum = model.speech_decoder_postnet.feat_out(last).view(1, r, bins)
            steps.append(spectrum)
            sequence = torch.cat((sequence, spectrum[:, -1:, :]), dim=1)
            stop = torch.sigmoid(model.speech_decoder_postnet.prob_out(last)).sum(-1) >= self.generation["threshold"]
            if idx >= minlen and (idx >= maxlen or bool(stop[0])):
                break
        spectrogram = model.speech_decoder_postnet.postnet(torch.cat(steps, dim=1))[0]  # [frames, bins]
        # 3. speed, then the vocoder
        spectrogram = stretch_frames(spectrogram, speed)
        return self.vocoder(spectrogram).float().cpu().numpy()


def _decoder_prenet(prenet, sequence: torch.Tensor, speaker: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """SpeechT5SpeechDecoderPrenet.forward with its always-on dropout drawn from `generator`."""
    p = prenet.config.speech_decoder_prenet_dropout
    x = sequence
    for layer in prenet.layers:
        x = torch.nn.functional.relu(layer(x))
        # One mask shared by the batch, as _consistent_dropout: keep where bernoulli(p) == 1.
        keep = torch.bernoulli(torch.empty(x.shape[1:]), p, generator=generator).to(x.device)  # [T, units]
        x = torch.where(keep[None] == 1, x, 0) * (1 / (1 - p))
    x = prenet.encode_positions(prenet.final_layer(x))
    speaker = torch.nn.functional.normalize(speaker).unsqueeze(1).expand(-1, x.size(1), -1)
    return torch.nn.functional.relu(prenet.speaker_embeds_layer(torch.cat([x, speaker], dim=-1)))


def _read_generation(root: Path) -> dict[str, float]:
    file = root / GENERATION_FILE
    values = dict(_GENERATION_DEFAULTS)
    if file.is_file():
        given = json.loads(file.read_text())
        unknown = set(given) - set(values)
        if unknown:
            raise ValueError(f"{file}: unknown keys {sorted(unknown)}; known: {sorted(values)}")
        values.update({k: float(v) for k, v in given.items()})
    if values["maxlenratio"] <= 0:
        raise ValueError(f"{file}: maxlenratio must be > 0")
    return values


def _read_voices(root: Path, dim: int, path: str) -> dict[str, torch.Tensor]:
    file = root / VOICES_FILE
    if file.is_file():
        from safetensors.torch import load_file

        voices = {name: t.float().reshape(-1) for name, t in sorted(load_file(str(file)).items())}
        bad = [name for name, t in voices.items() if t.numel() != dim]
        if not voices or bad:
            raise ValueError(f"{file}: every voice must be a tensor of {dim} values (bad: {bad})")
        return voices
    log.warning("%s: no %s; serving seeded random x-vectors as voices %s (not real speakers)", path, VOICES_FILE,
                list(FALLBACK_VOICES))
    return fallback_voices(dim)


def fallback_voices(dim: int = 512) -> dict[str, torch.Tensor]:
    """Deterministic stand-in x-vectors: seeded Gaussian vectors, scaled like real x-vectors (norm ~ 1.3)."""
    out = {}
    for i, name in enumerate(FALLBACK_VOICES):
        g = torch.Generator().manual_seed(1000 + i)
        out[name] = torch.randn(dim, generator=g) * 0.06
    return out
