"""Qwen2.5-Omni's speech half: the talker (codec tokens from the thinker's states) and token2wav (a flow-matching
DiT to mel, BigVGAN to 24 kHz audio), as the `talker`, `token2wav` (the DiT) and `vocoder` (BigVGAN) stages after
the thinker's llm node.

The thinker (the llm stage over the paged runner) keeps its last hidden state at every prompt and fed reply token
(GenerationRequest.keep_hidden). The talker reads, per position, that state plus the token's input embedding
(zero at media placeholders), as `Qwen2_5OmniForConditionalGeneration.generate` builds it; it samples codes
with a generator stream seeded from the request's seed, then token2wav draws its noise from the same stream, so
one seed gives transformers' `generate()` audio after `torch.manual_seed(seed)` (docs/omni.md).

The talker runs its items one after another inside a batch (each request's talker prompt and code count are its
own, and its sampling holds the global generator); token2wav's DiT runs a batch's jobs in one call; the vocoder
one job a call, its replicas side by side. The talker starts once the thinker's reply is complete (no streaming
edge yet).
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from stages.events import EventKind
from stages.stage import Stage, WorkItem

SAMPLE_RATE = 24000  # token2wav's output
NOISE_STREAM = 1 << 32  # a streamed reply's token2wav noise is drawn from seed + this (OmniVoice.chunk_noise)
VOCODER_MARGIN = 16  # mel frames BigVGAN reads past a streamed chunk on either side (its chunks then match to 3e-6)
# The talker samples and token2wav draws its noise from torch's global generator (transformers passes no
# generator): each request sets the global state to its own stream, draws, and restores it, holding this lock,
# so the talker and token2wav workers of different requests never interleave their draws.
_GLOBAL_RNG = threading.Lock()


@contextmanager
def seeded_stream(device: torch.device, state: tuple | int):
    """torch's global generators (the CPU's and, on a GPU, the device's) set to `state` (or seeded with an int, as
    torch.manual_seed does) for the block, then restored; yields a callable returning the state reached, for the
    next block of the same stream. Holds the lock that keeps other requests' draws out."""
    cuda = device.type == "cuda"
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[device] if cuda else []):
        if isinstance(state, int):
            torch.manual_seed(state)
        else:
            torch.set_rng_state(state[0])
            if cuda:
                torch.cuda.set_rng_state(state[1], device)
        yield lambda: (torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None)


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


@dataclass(frozen=True)
class TalkerJob:
    """One reply for the talker: the thinker's prompt and reply token ids, its kept hidden states [prompt + fed
    reply, H], the speaker, the seed, and `stop()` (true once cancelled)."""

    prompt_ids: list[int]
    reply_ids: list[int]
    hidden: torch.Tensor
    speaker: str
    seed: int
    stop: Callable[[], bool] = lambda: False
    on_code: Callable[[int], None] | None = None  # told each code as it is drawn (a streamed reply's token2wav)


@dataclass(frozen=True)
class TalkerPrompt:
    input_ids: list[int]  # codec ids of the prompt (mask per thinker position, then pad and bos): penalized ids
    inputs_embeds: torch.Tensor  # [1, positions, H]
    reply_part: torch.Tensor  # [steps, H]: what each later step adds to its code's embedding (the last repeats)


class _TalkerRow:
    """A reply being spoken: its own cache (unpadded), codes, sequence (for the repetition penalty) and generator
    state."""

    def __init__(self, index: int, job: TalkerJob, input_ids: list[int], reply_part: torch.Tensor, cache,
                 logits: torch.Tensor, seed: int):
        self.index, self.job, self.cache, self.logits = index, job, cache, logits
        self.sequence = list(input_ids)  # the talker's whole sequence so far (prompt ids, then codes)
        self.reply_part = reply_part
        self.codes: list[int] = []
        self.state: tuple | int = seed

    @property
    def length(self) -> int:  # positions in its cache
        return self.cache.layers[0].keys.shape[2]

    def next_reply(self) -> torch.Tensor:
        return self.reply_part[min(len(self.codes) - 1, len(self.reply_part) - 1)]

    def draw(self, probs: torch.Tensor, device: torch.device) -> int:
        """A code drawn from `probs` [1, V] with this row's stream, as generate()'s multinomial draws alone."""
        with seeded_stream(device, self.state) as reached:
            code = int(torch.multinomial(probs, num_samples=1)[0, 0])
            self.state = reached()
        self.sequence.append(code)
        return code


def _sample(rows: list[_TalkerRow], processors: tuple, device: torch.device) -> list[int]:
    """generate()'s sampling of each row's next code: its processors and warpers over all rows at once (each row's
    sequence padded with its own first id, which the repetition penalty then counts no more than once), then one
    draw per row from the row's own stream."""
    longest = max(len(row.sequence) for row in rows)
    ids = torch.tensor([row.sequence + row.sequence[:1] * (longest - len(row.sequence)) for row in rows],
                       device=device)
    scores = torch.cat([row.logits for row in rows])
    for process in processors:
        scores = process(ids, scores)
    probs = torch.softmax(scores, dim=-1)
    return [row.draw(probs[b:b + 1], device) for b, row in enumerate(rows)]


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
        del full
        self.thinker = thinker
        self.config = thinker.config
        self.device = torch.device(device)

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(self.speakers)

    def talker_prompt(self, job: TalkerJob) -> TalkerPrompt:
        """What `generate()` hands the talker for one reply: per prompt position the thinker's input embedding (zero
        at media placeholders) plus its last hidden state, the speaker's bos embedding and the first reply token's
        sum; the rest of the reply (then text-end, then text-pad for ever) is added to the codes step by step."""
        embed = self.thinker.get_input_embeddings()
        talker = self.talker
        ids = torch.tensor(job.prompt_ids + job.reply_ids[:-1], dtype=torch.long, device=embed.weight.device)
        tokens = embed(ids).float()
        media = {self.config.audio_token_id, self.config.image_token_id, self.config.video_token_id}
        tokens[:len(job.prompt_ids)][torch.tensor([t in media for t in job.prompt_ids])] = 0  # media rows: zeroed
        states = job.hidden.to(tokens) + tokens  # [prompt + fed reply, H]
        n = len(job.prompt_ids)
        spk = self.speakers[job.speaker]

        def embedded(token: int) -> torch.Tensor:
            return embed(torch.tensor([token], device=embed.weight.device)).float()

        reply = states[n:]
        inputs_embeds = torch.cat([states[:n], embedded(spk["bos_token"]), reply[:1]])[None].to(self.device)
        reply_part = torch.cat([reply[1:], embedded(talker.text_eos_token), embedded(talker.text_pad_token)])
        input_ids = [talker.codec_mask_token] * n + [talker.codec_pad_token, talker.codec_bos_token]
        return TalkerPrompt(input_ids, inputs_embeds.to(talker.dtype), reply_part.to(self.device, talker.dtype))

    @torch.inference_mode()
    def codes(self, jobs: list[TalkerJob], max_codes: int) -> list[tuple[list[int], tuple | int]]:
        """Each reply's codes and the generator state after them (token2wav continues the stream), the talker's
        steps batched across the replies.

        Sampling is `generate()`'s (repetition penalty 1.05 over the whole sequence, the start token suppressed,
        temperature 0.9, top-k 40, top-p 0.8), each reply drawing from its own stream seeded with its seed, as
        `generate()` after `torch.manual_seed(seed)` draws alone. The talker sees what `generate()` hands its
        forward: no attention mask, so plain 1-D positions (its 3-D rope index is never computed) and no codec
        pad / bos embeddings added to the prompt (docs/omni.md). Each reply's prompt is prefilled alone; then one
        forward a step serves every reply still talking: their caches left-padded to one length under an
        attention mask, each row at its own position. A reply ends at the codec's end or pad code, at
        `max_codes`, or when its `stop()` says so (cancelled or timed out)."""
        from transformers import DynamicCache
        from transformers.generation.logits_process import (
            RepetitionPenaltyLogitsProcessor,
            SuppressTokensLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        talker, device = self.talker, self.device
        eos = (talker.codec_pad_token, talker.codec_eos_token)
        processors = (RepetitionPenaltyLogitsProcessor(1.05),
                      SuppressTokensLogitsProcessor([talker.codec_bos_token], device=str(device)),
                      TemperatureLogitsWarper(0.9), TopKLogitsWarper(40), TopPLogitsWarper(0.8))  # generate()'s order
        results: list[tuple[list[int], tuple | int]] = [([], ()) for _ in jobs]
        rows: list[_TalkerRow] = []
        for i, job in enumerate(jobs):
            if len(job.reply_ids) < 2:  # one sampled token: nothing was fed back, nothing to say
                continue
            prompt = self.talker_prompt(job)
            out = talker(inputs_embeds=prompt.inputs_embeds, cache=DynamicCache(), use_cache=True)
            rows.append(_TalkerRow(i, job, prompt.input_ids, prompt.reply_part, out.cache, out.logits[:, -1].float(),
                                   job.seed))
        while rows:
            talking = []
            for row, code in zip(rows, _sample(rows, processors, device)):
                if code in eos or row.job.stop():
                    results[row.index] = (row.codes, row.state)
                    continue
                row.codes.append(code)
                if row.job.on_code is not None:
                    row.job.on_code(code)
                if len(row.codes) >= max_codes:
                    results[row.index] = (row.codes, row.state)
                else:
                    talking.append(row)
            rows = talking
            if rows:
                self._talker_step(rows)
        return results

    def _talker_step(self, rows: list[_TalkerRow]) -> None:
        """One forward for every row still talking: its last code (plus its next reply embedding) at its own
        position, over the rows' caches left-padded to one length."""
        from transformers import DynamicCache

        talker, device = self.talker, self.device
        longest = max(row.length for row in rows)
        cache = DynamicCache()
        for layer in range(len(rows[0].cache.layers)):
            keys, values = [], []
            for row in rows:
                k, v = row.cache.layers[layer].keys, row.cache.layers[layer].values
                pad = longest - row.length
                keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            cache.update(torch.cat(keys), torch.cat(values), layer)
        mask = torch.zeros(len(rows), longest + 1, dtype=torch.long, device=device)
        for b, row in enumerate(rows):
            mask[b, longest - row.length:] = 1
        codes = torch.tensor([[row.codes[-1]] for row in rows], device=device)
        embeds = talker.get_input_embeddings()(codes) + torch.stack([row.next_reply() for row in rows])[:, None]
        positions = torch.tensor([[row.length] for row in rows], device=device)
        out = talker(inputs_embeds=embeds, attention_mask=mask, position_ids=positions[None].expand(3, -1, -1),
                     cache=cache, use_cache=True)
        for b, row in enumerate(rows):
            pad = longest - row.length
            for layer, kept in zip(row.cache.layers, out.cache.layers):
                kept_keys, kept_values = kept.keys[b:b + 1, :, pad:], kept.values[b:b + 1, :, pad:]
                layer.keys, layer.values = kept_keys, kept_values
            row.logits = out.logits[b:b + 1, -1].float()

    def reply_noise(self, codes: list[int], state: tuple | int) -> torch.Tensor:
        """A whole reply's token2wav noise [frames, mel_dim]: its `torch.randn`, drawn where generate() draws it (the
        talker's stream, continued from `state`)."""
        with seeded_stream(self.device, state):
            return torch.randn([1, len(codes) * self.repeats, self.mel_dim], device=self.device)[0]

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

        The jobs' frames are padded to the longest and the DiT's block attention never reaches a padding frame
        (which sees only itself, so no attention row is empty). A job's mel is then the one it gets alone, up to
        float rounding (measured 3e-6 on the waveform; alone, equal)."""
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
        reach = real[:, None, None, :] | torch.eye(longest, dtype=torch.bool, device=device)  # [jobs, 1, q, k]
        blocks: dict[tuple, torch.Tensor] = {}

        def block_diff(hidden_states: torch.Tensor) -> torch.Tensor:
            """The DiT's block distances, with padding frames out of reach (a huge distance); made once a call.
            Under CFG the rows are [conditioned jobs, unconditioned jobs]."""
            if hidden_states.shape[:2] not in blocks:
                diff = type(dit)._create_block_diff(dit, hidden_states)
                rows = reach.repeat(hidden_states.shape[0] // len(jobs), 1, 1, 1)
                blocks[hidden_states.shape[:2]] = torch.where(rows, diff, torch.full_like(diff, 1 << 20))
            return blocks[hidden_states.shape[:2]]

        def velocity(t, x):
            out = dit(hidden_states=x, quantized_code=code, speaker_embedding=cond, condition_vector=ref_mel,
                      time_step=t, apply_cfg=True)
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * guidance_scale

        t = torch.linspace(0, 1, num_steps, device=device, dtype=cond.dtype)
        t += sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
        embed = dit.input_embed
        speaker_encoder = embed.spk_encoder
        with _BLOCK_DIFF:
            dit._create_block_diff = block_diff  # this call's padding (an instance attribute over the method)
            # the speaker encoder reads the reference mels, the same at every evaluation: run it once a call
            embed.spk_encoder = _Once(speaker_encoder)
            try:
                mel = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(t)[-1]
            finally:
                del dit._create_block_diff
                embed.spk_encoder = speaker_encoder
        return [mel[b, :n].T for b, n in enumerate(frames)]


# token2wav's DiT reads its attention blocks from `_create_block_diff`; a batched call sets its own for the call
_BLOCK_DIFF = threading.Lock()


class _Once(torch.nn.Module):
    """A module whose first output is the output of every later call: for an input that does not change."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.output: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.output is None:
            self.output = self.inner(x)
        return self.output


class _SpeechStage(Stage):
    """A stage of one model's speech half: every item of the model batches with every other."""

    def __init__(self, model: str, voice: OmniVoice):
        self.model = model
        self.voice = voice

    def batch_key(self, item: WorkItem) -> Hashable:
        return self.model


class TalkerStage(_SpeechStage):
    """The thinker's reply (its tokens and kept hidden states) -> codec codes, each told as a DELTA {"codes"} for a
    streamed reply; the llm's choices and usage pass on."""

    kind = "talker"

    def __init__(self, model: str, voice: OmniVoice, max_codes: int = 4096):
        super().__init__(model, voice)
        self.max_codes = max_codes

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        jobs = []
        for item in items:
            speech: SpeechOutput = item.inputs["speech"]
            choice = item.inputs["choices"][0]
            told = (lambda code, item=item: item.emit(EventKind.DELTA, codes=[code])) if speech.stream else None
            jobs.append(TalkerJob(list(item.inputs["request"].prompt_ids), choice["token_ids"], choice.pop("hidden"),
                                  speech.voice, speech.seed, stop=item.request.should_stop, on_code=told))
        return [{"codes": codes, "rng": state, "choices": item.inputs["choices"], "usage": item.inputs["usage"]}
                for item, (codes, state) in zip(items, self.voice.codes(jobs, self.max_codes))]


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
        self.codes = list(outputs["codes"])
        return self._cut(done=True)

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
    talker = outputs["token2wav"]["talker"]
    audio = torch.cat([torch.zeros(0), *(piece["audio"] for piece in outputs["pieces"])])
    return {"choices": talker["choices"], "usage": talker["usage"], "audio": audio, "sample_rate": SAMPLE_RATE}
