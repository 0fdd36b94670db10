"""Whisper decoding for the asr stage: encoder forward, language detection, the token loop.

Free functions over a loaded `WhisperForConditionalGeneration`. For one 30 s window, greedy
decoding here gives the tokens of `model.generate(features, ..., force_unique_generate_call=True)`:
the same decoder prompt, transformers' own logits processors in generate's order (begin-suppress,
suppress, timestamp rules), argmax, and the same stop rule (end of text, or the model's
`max_target_positions`, 448). `force_unique_generate_call` only stops generate from re-decoding
the tail of a window after its last timestamp ("seek"): mmserve cuts long audio into windows up
front, so that every window of every request can share one forward.

Rows that finish (end of text, or their request stopped) leave the batch at the next step: their
KV rows are dropped, the others run on.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

# on_step(rows, tokens, logprobs) -> rows to stop now; rows are indices into the decode's prefixes.
StepFn = Callable[[list[int], list[int], list[float]], Iterable[int]]


@dataclass(frozen=True)
class WhisperTokens:
    """The token ids decoding needs, from the model's generation config."""

    sot: int  # <|startoftranscript|>
    eot: int  # <|endoftext|>: ends a window's text; also the pad id
    no_timestamps: int  # <|notimestamps|>; timestamp tokens start right after it
    no_speech: int  # <|nospeech|> (<|nocaptions|> in older vocabularies), just before <|notimestamps|>
    prev_sot: int  # <|startofprev|>: starts a prompt (previous text)
    languages: dict[str, int]  # "<|de|>" -> id; empty for English-only models
    tasks: dict[str, int]  # "transcribe"/"translate" -> id; empty for English-only models
    max_positions: int  # decoder positions: prompt + generated tokens

    @classmethod
    def of(cls, model) -> "WhisperTokens":
        g = model.generation_config
        return cls(sot=g.decoder_start_token_id, eot=g.eos_token_id, no_timestamps=g.no_timestamps_token_id,
                   no_speech=g.no_timestamps_token_id - 1, prev_sot=g.prev_sot_token_id,
                   languages=dict(getattr(g, "lang_to_id", None) or {}),
                   tasks=dict(getattr(g, "task_to_id", None) or {}),
                   max_positions=model.config.max_target_positions)

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    def init_tokens(self, *, language: int | None, task: str, timestamps: bool) -> list[int]:
        """<|startoftranscript|> [<|lang|> <|task|>] [<|notimestamps|>], as generate builds them."""
        tokens = [self.sot]
        if self.languages:  # multilingual: the language and the task are part of the prompt
            assert language is not None  # given or detected for a multilingual model
            tokens += [language, self.tasks[task]]
        if not timestamps:
            tokens.append(self.no_timestamps)
        return tokens


@torch.inference_mode()
def encode(model, features: torch.Tensor) -> torch.Tensor:
    """Log-mel windows [B, n_mels, 3000] -> encoder states [B, 1500, d_model]."""
    return model.model.encoder(features.to(model.device, model.dtype)).last_hidden_state


@torch.inference_mode()
def detect_languages(model, enc: torch.Tensor, tokens: WhisperTokens) -> list[int]:
    """The most likely language token of each window, from one decoder step on <|startoftranscript|>."""
    start = torch.full((enc.shape[0], 1), tokens.sot, dtype=torch.long, device=enc.device)
    hidden = model.model.decoder(input_ids=start, encoder_hidden_states=enc, use_cache=False).last_hidden_state
    logits = model.proj_out(hidden[:, -1]).float()  # [B, V]
    allowed = torch.full_like(logits, float("-inf"))
    allowed[:, list(tokens.languages.values())] = 0.0
    return (logits + allowed).argmax(-1).tolist()


def logits_processors(model, begin_index: int, timestamps: bool, device) -> list:
    """generate()'s processors for Whisper, in its order (each is prepended to the list there)."""
    from transformers.generation.logits_process import (
        LogitsProcessor,
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    g = model.generation_config
    processors: list[LogitsProcessor] = []
    if g.begin_suppress_tokens:
        processors.append(SuppressTokensAtBeginLogitsProcessor(g.begin_suppress_tokens, begin_index, device=device))
    if g.suppress_tokens:
        processors.append(SuppressTokensLogitsProcessor(g.suppress_tokens, device=device))
    if timestamps:
        processors.append(WhisperTimeStampLogitsProcessor(g, begin_index=begin_index))
    return processors


@torch.inference_mode()
def decode(model, enc: torch.Tensor, prefixes: list[list[int]], *, timestamps: bool, temperature: float,
           max_new_tokens: int, tokens: WhisperTokens, on_step: StepFn | None = None,
           generator: torch.Generator | None = None) -> tuple[list[list[int]], list[list[float]], list[float]]:
    """Decode every window from its prefix (all of one length).

    Returns, per row: its tokens, their log-probabilities, and P(no speech). A row's tokens end with <|endoftext|>
    unless it ran out of positions or was stopped. With
    temperature > 0 tokens are sampled from softmax(scores / temperature) (no top-k / top-p).
    """
    from transformers import DynamicCache, EncoderDecoderCache

    # 1. the batch: every prefix, the processors, an empty KV cache
    length = len(prefixes[0])
    assert all(len(p) == length for p in prefixes), "decode() takes prefixes of one length"
    ids = torch.tensor(prefixes, dtype=torch.long, device=enc.device)  # [B, P], grows by one column a step
    processors = logits_processors(model, length, timestamps, enc.device)
    rows = list(range(len(prefixes)))  # live rows -> their index in `prefixes`
    out: list[list[int]] = [[] for _ in prefixes]
    out_logprobs: list[list[float]] = [[] for _ in prefixes]
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    step_input = ids
    no_speech: list[float] = []
    budget = min(max_new_tokens, tokens.max_positions - length)
    for step in range(budget):
        # 2. one decoder step for the live rows
        hidden = model.model.decoder(input_ids=step_input, encoder_hidden_states=enc, use_cache=True,
                                     **{_cache_argument(model): cache}).last_hidden_state
        if step == 0:  # P(no speech) is read at <|startoftranscript|>, before any processor
            at_sot = model.proj_out(hidden[:, prefixes[0].index(tokens.sot)]).float()
            no_speech = at_sot.softmax(-1)[:, tokens.no_speech].tolist()
        scores = model.proj_out(hidden[:, -1]).float()  # [b, V]
        for processor in processors:
            scores = processor(ids, scores)
        # 3. choose, record, and drop finished or stopped rows
        if temperature > 0:
            probs = torch.softmax(scores / temperature, dim=-1)
            chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            chosen = scores.argmax(-1)
        logprobs = torch.log_softmax(scores, dim=-1).gather(1, chosen[:, None]).squeeze(1).tolist()
        ids = torch.cat([ids, chosen[:, None]], dim=1)
        picked = chosen.tolist()
        for row, token, logprob in zip(rows, picked, logprobs):
            out[row].append(token)
            out_logprobs[row].append(logprob)
        stop = set(on_step(rows, picked, logprobs)) if on_step is not None else set()
        keep = [i for i, (row, token) in enumerate(zip(rows, picked)) if token != tokens.eot and row not in stop]
        if not keep:
            break
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=enc.device)
            cache.batch_select_indices(index)
            enc, ids, chosen = enc[index], ids[index], chosen[index]
            rows = [rows[i] for i in keep]
        step_input = chosen[:, None]
    return out, out_logprobs, no_speech


def _cache_argument(model) -> str:
    """The decoder's name for its KV cache argument: `cache` (transformers >= 5.2x) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.model.decoder.forward).parameters else "past_key_values"
