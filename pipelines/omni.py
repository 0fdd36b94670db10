"""Qwen2.5-Omni's speech half after the thinker's llm node: the talker (codec codes from the thinker's states,
pipelines/omni_talker.py), token2wav's DiT (codes to mel, the `token2wav` stage) and its BigVGAN (mel to 24 kHz
audio, the `vocoder` stage).

The talker samples codes with a generator stream seeded from the request's seed. For a whole reply token2wav then
draws its noise from the same stream, so one seed gives transformers' `generate()` audio after
`torch.manual_seed(seed)` (docs/omni.md). A streamed reply's token2wav decodes windows of codes while the talker
still speaks (`CodeWindows`), its noise sliced from a stream of its own (`OmniVoice.chunk_noise`), and the vocoder
makes each chunk's audio as its mel comes.

token2wav's DiT runs a batch's jobs (whole replies and windows of any replies) in one call, its replicas side by side
on the one DiT; the vocoder one job a call, its replicas side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable

import torch

from pipelines.omni_bigvgan import register as register_upsamplers
from pipelines.omni_dit import dit_call
from pipelines.omni_dit import register as register_block_attention
from stages.events import EventKind
from stages.stage import Stage, WorkItem

SAMPLE_RATE = 24000  # token2wav's output
NOISE_STREAM = 1 << 32  # a streamed reply's token2wav noise is drawn from seed + this (OmniVoice.chunk_noise)
VOCODER_MARGIN = 16  # mel frames BigVGAN reads past a streamed chunk on either side (its chunks then match to 3e-6)


def reply_generator(device: torch.device, state: torch.Tensor | int) -> torch.Generator:
    """A generator on `device` in `state` (a generator's state, or an int seed): a reply's own stream. transformers
    samples the talker's codes and draws token2wav's noise from torch's global generator of the device after
    `torch.manual_seed(seed)`; a generator of the device seeded with `seed` gives the same numbers, and each
    request keeps its own (no global state shared between the workers of different requests)."""
    generator = torch.Generator(device)
    if isinstance(state, int):
        generator.manual_seed(state)
    else:
        generator.set_state(state)
    return generator


def not_speaking(model: str):
    """The refusal of audio output by a model without a speech decoder (names `modalities`)."""
    from pipelines.image_request import RequestError

    return RequestError("modalities", f"model {model} does not speak: audio output needs a model with a speech "
                        "decoder (a Qwen2.5-Omni with its talker); ask for [\"text\"]", code="unsupported_modality")


@dataclass(frozen=True)
class SpeechOutput:
    """What a request asks of the speech half: the speaker and the seed of its sampling and noise."""

    voice: str
    seed: int
    # True: the audio goes out in chunks while the talker still speaks (chunked token2wav, its noise from a stream of
    # its own: `chunk_noise`); False: token2wav runs once on the whole reply, as generate() does (equal to it)
    stream: bool = False


class OmniVoice:
    """The talker, token2wav and speakers of a Qwen2.5-Omni checkpoint, beside a thinker loaded elsewhere (whose
    input embeddings the talker reads)."""

    def __init__(self, path: str, thinker, *, device: str, dtype: torch.dtype = torch.float32):
        from transformers import Qwen2_5OmniForConditionalGeneration

        # The whole checkpoint loads once more (its thinker copy is dropped below: a transient second thinker).
        full = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=dtype)
        if not full.has_talker:
            raise ValueError(f"{path}: this Qwen2.5-Omni checkpoint has no talker (enable_audio_output is off)")
        self.talker = full.talker.to(device).eval()
        self.token2wav = full.token2wav.to(device).float().eval()  # float32 only (bf16 inputs fail)
        self.speakers: dict[str, dict[str, Any]] = dict(full.speaker_map)
        dit = self.token2wav.code2wav_dit_model
        # mel frames a code makes and a DiT block holds; mel channels
        self.repeats, self.block, self.mel_dim = dit.repeats, dit.block_size, dit.mel_dim
        self.hop = math.prod(self.token2wav.code2wav_bigvgan_model.config.upsample_rates)  # samples a mel frame
        register_block_attention(dit)
        register_upsamplers(self.token2wav.code2wav_bigvgan_model)
        del full
        self.thinker = thinker
        self.config = thinker.config
        self.device = torch.device(device)

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(self.speakers)

    def reply_noise(self, codes: list[int], state: torch.Tensor | int) -> torch.Tensor:
        """A whole reply's token2wav noise [frames, mel_dim]: its `torch.randn`, drawn where generate() draws it (the
        talker's stream, continued from `state`)."""
        generator = reply_generator(self.device, state)
        return torch.randn([1, len(codes) * self.repeats, self.mel_dim], device=self.device, generator=generator)[0]

    def chunk_noise(self, seed: int, start: int, end: int) -> torch.Tensor:
        """Mel frames [start, end) of a streamed reply's token2wav noise [frames, mel_dim], from a CPU stream of its
        own (seed + NOISE_STREAM): its first chunks are made before the talker's last draw, so they cannot continue
        the talker's stream. A CPU normal draw whose size is a multiple of 16 is a prefix of any longer one, so
        every chunk slices one noise: the one `torch.randn([1, frames, mel_dim])` draws after
        `torch.manual_seed(seed + NOISE_STREAM)`."""
        generator = torch.Generator().manual_seed((seed + NOISE_STREAM) % (1 << 64))
        size = end * self.mel_dim
        flat = torch.randn(size + -size % 16, generator=generator)
        return flat[:size].view(end, self.mel_dim)[start:].to(self.device)

    @torch.inference_mode()
    def mels(self, jobs: list[tuple[list[int], str, torch.Tensor]]) -> list[torch.Tensor | None]:
        """Each (codes, speaker, initial noise [frames, mel_dim]) job's mel [mel_dim, frames] (None for no codes):
        the DiT's flow matching once for all the jobs whose speakers' reference mels have one shape (`_mels`)."""
        out: list[torch.Tensor | None] = [None] * len(jobs)
        groups: dict[tuple, list[int]] = {}
        for i, (codes, speaker, _) in enumerate(jobs):
            if codes:
                groups.setdefault(tuple(self.speakers[speaker]["ref_mel"].shape), []).append(i)
        for members in groups.values():
            for i, mel in zip(members, self._mels([jobs[i] for i in members])):
                out[i] = mel
        return out

    @torch.inference_mode()
    def vocode(self, mel: torch.Tensor | None) -> torch.Tensor:
        """BigVGAN: one job's mel -> float32 [samples] at 24 kHz (empty for None). One job a call: its convolutions
        would reach from one job into another's padding."""
        if mel is None:
            return torch.zeros(0)
        return self.token2wav.code2wav_bigvgan_model(mel[None]).reshape(-1).float().cpu()

    def _mels(self, jobs: list[tuple[list[int], str, torch.Tensor]], num_steps: int = 10, guidance_scale: float = 0.5,
              sway_coefficient: float = -1.0) -> list[torch.Tensor]:
        """token2wav's DiT `sample()` (its defaults) for a batch of (codes, speaker, initial noise [frames, mel_dim])
        jobs: each job's mel [mel_dim, frames].

        The jobs' frames are padded to the longest; the DiT attends block-locally and never reaches a padding
        frame (pipelines/omni_dit.py). A job's mel is then the one it gets alone, and the dense DiT's, up to float
        rounding (measured 1.5e-6 on the mel, 3e-6 on the waveform)."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        dit, device = self.token2wav.code2wav_dit_model, self.device
        frames = [len(codes) * dit.repeats for codes, _, _ in jobs]
        longest = max(frames)
        if longest > dit.config.max_position_embeddings:
            raise ValueError(f"{longest} mel frames exceed token2wav's max_position_embeddings "
                             f"({dit.config.max_position_embeddings})")
        noise = torch.zeros(len(jobs), longest, dit.mel_dim, device=device)
        code = torch.zeros(len(jobs), longest // dit.repeats, dtype=torch.long, device=device)
        for b, ((codes, _, initial), n) in enumerate(zip(jobs, frames)):
            noise[b, :n] = initial
            code[b, :len(codes)] = torch.tensor(codes, device=device)
        cond = torch.cat([self.speakers[s]["cond"] for _, s, _ in jobs]).to(device).float()
        cond = cond.unsqueeze(1).repeat(1, longest, 1)
        ref_mel = torch.cat([self.speakers[s]["ref_mel"] for _, s, _ in jobs]).to(device).float()
        real = torch.arange(longest, device=device)[None] < torch.tensor(frames, device=device)[:, None]

        def velocity(t, x):
            out = dit(hidden_states=x, quantized_code=code, speaker_embedding=cond, condition_vector=ref_mel,
                      time_step=t, apply_cfg=True)
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * guidance_scale

        t = torch.linspace(0, 1, num_steps, device=device, dtype=cond.dtype)
        t += sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
        with dit_call(real):  # block-local attention over the real frames; the speaker encoder once
            mel = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(t)[-1]
        return [mel[b, :n].T for b, n in enumerate(frames)]


class _SpeechStage(Stage):
    """A stage of one model's speech half: every item of the model batches with every other."""

    def __init__(self, model: str, voice: OmniVoice):
        self.model = model
        self.voice = voice

    def batch_key(self, item: WorkItem) -> Hashable:
        return self.model


class CodeWindows:
    """A streamed reply's cut of its talker's codes into token2wav windows: a first chunk of `chunk` codes, each
    later one twice the one before up to `max_chunk` (the first comes early; the later ones spend less of the DiT on
    context), each with up to `context` codes of context on either side (whole DiT blocks, so a window's blocks
    line up with the whole reply's). A chunk is cut once its right context is drawn, or when the talker is done."""

    def __init__(self, chunk: int, context: int, max_chunk: int):
        self.chunk, self.context, self.max_chunk = chunk, context, max(chunk, max_chunk)
        self.codes: list[int] = []
        self.start = 0  # the next chunk's first code

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        self.codes += delta["codes"]
        return self._cut(done=False)

    def flush(self, outputs: dict[str, Any]) -> list[dict[str, Any]]:
        return self._cut(done=True)  # every code came as a delta

    def _cut(self, done: bool) -> list[dict[str, Any]]:
        pieces, n = [], len(self.codes)
        while self.start < n and (done or self.start + self.chunk + self.context <= n):
            end = min(n, self.start + self.chunk)
            first, last = max(0, self.start - self.context), min(n, end + self.context)
            pieces.append({"window": self.codes[first:last], "offset": first, "core": (self.start, end)})
            self.start, self.chunk = end, min(2 * self.chunk, self.max_chunk)
        return pieces


class Token2WavStage(_SpeechStage):
    """Codes -> mel, token2wav's DiT for a batch's jobs in one flow-matching call. A whole reply (after its talker)
    continues the talker's generator stream for its noise; a streamed reply's window (a piece: `CodeWindows`) slices
    its noise from a stream of its own and hands on the mel of its chunk plus the vocoder's margin, as a DELTA."""

    kind = "token2wav"

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        voice, jobs = self.voice, []
        for item in items:
            speech: SpeechOutput = item.inputs["speech"]
            if item.piece is None:
                codes = item.inputs["codes"]
                jobs.append((codes, speech.voice, voice.reply_noise(codes, item.inputs["rng"])))
            else:
                codes, first = item.inputs["window"], item.inputs["offset"] * voice.repeats
                jobs.append((codes, speech.voice, voice.chunk_noise(speech.seed, first, first + len(codes) *
                                                                    voice.repeats)))
        outputs = []
        for item, mel in zip(items, voice.mels(jobs)):
            if item.piece is None:
                outputs.append({"choices": item.inputs["choices"], "usage": item.inputs["usage"], "mel": mel})
                continue
            assert mel is not None  # a window has codes
            first = item.inputs["offset"] * voice.repeats
            start, end = (code * voice.repeats for code in item.inputs["core"])
            lo, hi = max(start - VOCODER_MARGIN, first), min(end + VOCODER_MARGIN, first + mel.shape[1])
            piece = {"mel": mel[:, lo - first:hi - first], "cut": (start - lo, end - lo)}
            item.emit(EventKind.DELTA, **piece)
            outputs.append(piece)
        return outputs


class VocoderStage(_SpeechStage):
    """Mel -> a 24 kHz waveform (token2wav's BigVGAN), one job a call; on a CPU two replicas work side by side. A
    streamed reply's piece vocodes its chunk with the margin and keeps the chunk's samples, told as a DELTA
    {"audio", "sample_rate"}."""

    kind = "vocoder"

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        outputs = []
        for item in items:
            audio = self.voice.vocode(item.inputs["mel"])
            if item.piece is None:
                outputs.append({"choices": item.inputs["choices"], "usage": item.inputs["usage"], "audio": audio,
                                "sample_rate": SAMPLE_RATE})
                continue
            start, end = (frame * self.voice.hop for frame in item.inputs["cut"])
            item.emit(EventKind.DELTA, audio=audio[start:end], sample_rate=SAMPLE_RATE)
            outputs.append({"audio": audio[start:end]})
        return outputs


class OneEach:
    """A streaming edge's splitter that makes each delta of its source one piece (the vocoder's, from token2wav)."""

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        return [delta]

    def flush(self, outputs: dict[str, Any]) -> list[dict[str, Any]]:
        return []


def streamed_reply(outputs: dict[str, Any]) -> dict[str, Any]:
    """A streamed spoken request's outputs (its vocoder's pieces, token2wav's, the talker's) as a whole one's:
    choices, usage, the chunks' audio joined, the sample rate."""
    thinker = outputs["token2wav"]["talker"]["llm"]
    audio = torch.cat([torch.zeros(0), *(piece["audio"] for piece in outputs["pieces"])])
    return {"choices": thinker["choices"], "usage": thinker["usage"], "audio": audio, "sample_rate": SAMPLE_RATE}
