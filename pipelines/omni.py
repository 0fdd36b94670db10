"""Qwen2.5-Omni's speech half: the talker (codec tokens from the thinker's states) and token2wav (a flow-matching
DiT to mel, BigVGAN to 24 kHz audio), as the `talker` and `token2wav` stages after the thinker's llm node.

The thinker (the llm stage over the paged runner) keeps its last hidden state at every prompt and fed reply token
(GenerationRequest.keep_hidden). The talker reads, per position, that state plus the token's input embedding
(zero at media placeholders), as `Qwen2_5OmniForConditionalGeneration.generate` builds it; it samples codes
with a generator stream seeded from the request's seed, then token2wav draws its noise from the same stream, so
one seed gives transformers' `generate()` audio after `torch.manual_seed(seed)` (docs/omni.md).

Both stages run their items one after another inside a batch (each request's talker prompt and code count are its
own); the talker starts once the thinker's reply is complete (no streaming edge yet).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from stages.stage import Stage, WorkItem

SAMPLE_RATE = 24000  # token2wav's output
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
        del full
        self.thinker = thinker
        self.config = thinker.config
        self.device = torch.device(device)

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(self.speakers)

    @torch.inference_mode()
    def codes(self, prompt_ids: list[int], reply_ids: list[int], hidden: torch.Tensor, geometries: list,
              speaker: str, seed: int, max_codes: int,
              stop: Callable[[], bool] = lambda: False) -> tuple[list[int], tuple]:
        """The talker's codes for one reply (its sampling seeded with `seed`), and the RNG state after them
        (token2wav continues the stream).
        `stop()` is asked after every code: true (the request was cancelled or timed out) ends the talker there."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Stop(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), stop(), dtype=torch.bool, device=input_ids.device)

        embed = self.thinker.get_input_embeddings()
        talker = self.talker
        ids = torch.tensor(prompt_ids + reply_ids[:-1], dtype=torch.long, device=embed.weight.device)
        tokens = embed(ids).float()
        media = {self.config.audio_token_id, self.config.image_token_id, self.config.video_token_id}
        tokens[:len(prompt_ids)][torch.tensor([t in media for t in prompt_ids])] = 0  # media rows: zeroed
        states = hidden.to(tokens) + tokens  # [prompt + fed reply, H]
        n = len(prompt_ids)
        spk = self.speakers[speaker]

        def embedded(token: int) -> torch.Tensor:
            return embed(torch.tensor([token], device=embed.weight.device)).float()

        reply = states[n:]
        if len(reply) == 0:  # one sampled token: nothing was fed back, nothing to say
            return [], ()
        inputs_embeds = torch.cat([states[:n], embedded(spk["bos_token"]), reply[:1]])[None].to(self.device)
        reply_part = torch.cat([reply[1:], embedded(talker.text_eos_token), embedded(talker.text_pad_token)])
        input_ids = torch.tensor([[talker.codec_mask_token] * n + [talker.codec_pad_token, talker.codec_bos_token]],
                                 device=self.device)
        text_ids = torch.tensor([prompt_ids + [spk["bos_token"], reply_ids[0]]], device=self.device)
        images = [g.grid_thw for g in geometries if g.kind == "image"]
        videos = [g for g in geometries if g.kind == "video"]
        audios = [g.audio_frames for g in geometries if g.kind == "audio"]
        eos = [talker.codec_pad_token, talker.codec_eos_token]
        with seeded_stream(self.device, seed) as reached:
            out = talker.generate(
                input_ids=input_ids, input_text_ids=text_ids,
                thinker_reply_part=reply_part[None].to(self.device, talker.dtype),
                inputs_embeds=inputs_embeds.to(talker.dtype), attention_mask=torch.ones_like(input_ids),
                suppress_tokens=[talker.codec_bos_token], image_grid_thw=torch.tensor(images) if images else None,
                video_grid_thw=torch.tensor([g.grid_thw for g in videos]) if videos else None,
                video_second_per_grid=torch.tensor([g.second_per_grid for g in videos]) if videos else None,
                audio_feature_lengths=torch.tensor(audios) if audios else None, use_audio_in_video=False,
                max_new_tokens=max_codes, do_sample=True, top_k=40, top_p=0.8, temperature=0.9, eos_token_id=eos,
                pad_token_id=talker.codec_pad_token, repetition_penalty=1.05,
                stopping_criteria=StoppingCriteriaList([Stop()]))
            state = reached()
        codes = out[0, input_ids.shape[1]:].tolist()
        for i, code in enumerate(codes):
            if code in eos:
                return codes[:i], state
        return codes, state

    @torch.inference_mode()
    def waveform(self, codes: list[int], speaker: str, generator_state: tuple) -> torch.Tensor:
        """float32 [samples] at 24 kHz (empty for no codes)."""
        if not codes:
            return torch.zeros(0)
        spk = self.speakers[speaker]
        with seeded_stream(self.device, generator_state):
            wav = self.token2wav(torch.tensor([codes], device=self.device), conditioning=spk["cond"].to(
                self.device).float(), reference_mel=spk["ref_mel"].to(self.device).float())
        return wav.reshape(-1).float().cpu()


class TalkerStage(Stage):
    """The thinker's reply (its tokens and kept hidden states) -> codec codes; the llm's outputs pass on."""

    kind = "talker"

    def __init__(self, model: str, voice: OmniVoice, max_codes: int = 4096):
        self.model = model
        self.voice = voice
        self.max_codes = max_codes

    def batch_key(self, item: WorkItem) -> Hashable:
        return self.model

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        outputs = []
        for item in items:
            speech: SpeechOutput = item.inputs["speech"]
            choice = item.inputs["choices"][0]
            generation = item.inputs["request"]
            tasks = (*item.inputs.get("media", ()), *item.inputs.get("audio_media", ()))  # each kind in prompt order
            geometries = [task.geometry for task in tasks]
            codes, state = self.voice.codes(list(generation.prompt_ids), choice["token_ids"], choice.pop("hidden"),
                                            geometries, speech.voice, speech.seed, self.max_codes,
                                            stop=item.request.should_stop)
            outputs.append({"codes": codes, "rng": state})
        return outputs


class Token2WavStage(Stage):
    """Codes -> a 24 kHz waveform, with the talker's generator stream continued for the noise."""

    kind = "token2wav"

    def __init__(self, model: str, voice: OmniVoice):
        self.model = model
        self.voice = voice

    def batch_key(self, item: WorkItem) -> Hashable:
        return self.model

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        return [{"choices": item.inputs["choices"], "usage": item.inputs["usage"],
                 "audio": self.voice.waveform(item.inputs["codes"], item.inputs["speech"].voice, item.inputs["rng"]),
                 "sample_rate": SAMPLE_RATE} for item in items]
