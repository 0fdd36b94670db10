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
import threading
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


class EncodeStopped(Exception):
    """`encode` gave up between two layers: nobody waits for it any more."""


_stopping = threading.local()  # the calling thread's `should_stop` while it runs `encode`


def _check_stop(module, args) -> None:
    should_stop = getattr(_stopping, "fn", None)
    if should_stop is not None and should_stop():
        raise EncodeStopped


@torch.inference_mode()
def encode(model, features: torch.Tensor, should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
    """Log-mel windows [B, n_mels, 3000] -> encoder states [B, 1500, d_model]. With `should_stop`, it is asked
    before each layer and EncodeStopped raised when it says so (a window's encode is a few hundred ms of CPU:
    a cancelled request must not hold the stage that long). The check is a pre-hook on each layer, installed once
    per model, that reads the calling thread's `should_stop` (threads may share the model)."""
    encoder = model.model.encoder
    if not getattr(encoder, "_stop_hooks", False):
        for layer in encoder.layers:
            layer.register_forward_pre_hook(_check_stop)
        encoder._stop_hooks = True
    _stopping.fn = should_stop
    try:
        return encoder(features.to(model.device, model.dtype)).last_hidden_state
    finally:
        _stopping.fn = None


@torch.inference_mode()
def detect_languages(model, enc: torch.Tensor, tokens: WhisperTokens) -> list[int]:
    """The most likely language token of each window, from one decoder step on <|startoftranscript|>."""
    start = torch.full((enc.shape[0], 1), tokens.sot, dtype=torch.long, device=enc.device)
    hidden = model.model.decoder(input_ids=start, encoder_hidden_states=enc, use_cache=False).last_hidden_state
    logits = model.proj_out(hidden[:, -1]).float()  # [B, V]
    allowed = torch.full_like(logits, float("-inf"))
    allowed[:, list(tokens.languages.values())] = 0.0
    return (logits + allowed).argmax(-1).tolist()


class SuppressTokens:
    """generate()'s SuppressTokensLogitsProcessor (`begin_index` None) or SuppressTokensAtBeginLogitsProcessor (only
    at that length of the ids): the same -inf scores, its mask built once, not at every step (their isin over the
    vocabulary was a tenth of a tiny model's decode on a CPU)."""

    def __init__(self, tokens, begin_index: int | None = None):
        self.tokens = torch.tensor(list(tokens), dtype=torch.long)
        self.begin_index = begin_index
        self._mask: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.begin_index is not None and input_ids.shape[-1] != self.begin_index:
            return scores
        if self._mask is None or self._mask.shape[-1] != scores.shape[-1] or self._mask.device != scores.device:
            mask = torch.zeros(scores.shape[-1], dtype=torch.bool)
            mask[self.tokens[self.tokens < scores.shape[-1]]] = True
            self._mask = mask.to(scores.device)
        return torch.where(self._mask, -float("inf"), scores)


def logits_processors(model, begin_index: int, timestamps: bool) -> list:
    """generate()'s processors for Whisper, in its order (each is prepended to the list there)."""
    from transformers.generation.logits_process import LogitsProcessor, WhisperTimeStampLogitsProcessor

    g = model.generation_config
    processors: list[LogitsProcessor | SuppressTokens] = []
    if g.begin_suppress_tokens:
        processors.append(SuppressTokens(g.begin_suppress_tokens, begin_index))
    if g.suppress_tokens:
        processors.append(SuppressTokens(g.suppress_tokens))
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
    processors = logits_processors(model, length, timestamps)
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
