"""Per-request sampling parameters, validated once at the boundary (OpenAI field names).

Ranges follow seed 002 §3 and the OpenAI API. Every rejection is a ValueError whose message
starts with the field name and states the allowed range, so the HTTP layer can turn it into a
400 as is. "Off" values: temperature 1, top_p 1, top_k -1 (the only top_k below 1 allowed;
0 is rejected because seed 002 rejects k = 0), min_p 0, penalties 0 / 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from stages.llm.grammar import Grammar

TOP_K_OFF = -1  # the one top_k value below 1 that is accepted: consider every token
MAX_STOP = 4  # OpenAI's documented cap on stop strings; each one costs a scan per emitted chunk
MAX_TOP_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_N = 128  # OpenAI's cap on n; the scheduler may still degrade n under pressure
LOGIT_BIAS_BAN = -100.0  # a bias of exactly -100 bans the token (logit -> -inf), as OpenAI documents
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


def _number(name: str, value: object) -> float:
    """A finite real number (bool rejected: True is not a temperature)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _in_range(name: str, value: float, low: float, high: float, rng: str) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {rng}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its next token and when it stops (validated in __post_init__)."""

    temperature: float = 1.0  # >= 0 and finite; 0 selects the greedy branch (argmax, lowest id on ties)
    top_p: float = 1.0  # (0, 1]; smallest sorted prefix whose mass reaches top_p; 1 = off
    top_k: int = TOP_K_OFF  # >= 1, or -1 = off; ties at rank k go to the lower token id
    min_p: float = 0.0  # [0, 1]; keep p_i >= min_p * max p after temperature; 0 = off
    presence_penalty: float = 0.0  # [-2, 2]; subtracted once from every token already generated
    frequency_penalty: float = 0.0  # [-2, 2]; subtracted per occurrence among generated tokens
    repetition_penalty: float = 1.0  # > 0; CTRL rule over prompt + generated tokens; 1 = off
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)  # token id -> [-100, 100]; -100 bans
    seed: int | None = None  # seeds this request's own RNG stream; None = nondeterministic
    max_tokens: int | None = None  # >= 1 new tokens; None = up to the context limit
    stop: tuple[str, ...] = ()  # at most MAX_STOP non-empty strings; matched on detokenized text
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that finish the sequence (like EOS)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks); stop strings/ids still apply
    logprobs: bool = False  # return the chosen token's log-probability (raw model distribution)
    top_logprobs: int = 0  # 0..MAX_TOP_LOGPROBS alternatives per position; needs logprobs=True
    n: int = 1  # 1..MAX_N completions for the prompt (they share its KV blocks)
    response_format: Grammar | None = None  # constrained decoding (stages/llm/grammar.py): every token keeps it

    def __post_init__(self) -> None:
        # 1. sampling distribution
        t = _number("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        p = _number("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        k = _integer("top_k", self.top_k)
        if k < 1 and k != TOP_K_OFF:
            raise ValueError(f"top_k must be >= 1, or {TOP_K_OFF} to disable it, got {k}")
        _in_range("min_p", _number("min_p", self.min_p), 0.0, 1.0, "[0, 1] (0 = off)")
        # 2. penalties and bias
        for name in ("presence_penalty", "frequency_penalty"):
            _in_range(name, _number(name, getattr(self, name)), -2.0, 2.0, "[-2, 2]")
        if _number("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        object.__setattr__(self, "logit_bias", MappingProxyType(self._checked_bias()))
        # 3. randomness, length, stopping
        if self.seed is not None:
            _in_range("seed", _integer("seed", self.seed), *_SEED_RANGE, "[-2**63, 2**64 - 1]")
        if self.max_tokens is not None and _integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1 (or null for the context limit), got {self.max_tokens}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be at most {MAX_STOP} non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = tuple(_integer("stop_token_ids", i) for i in self.stop_token_ids)
        if any(i < 0 for i in ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {list(ids)}")
        object.__setattr__(self, "stop_token_ids", ids)
        # 4. outputs
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        top = _integer("top_logprobs", self.top_logprobs)
        _in_range("top_logprobs", top, 0, MAX_TOP_LOGPROBS, f"[0, {MAX_TOP_LOGPROBS}]")
        if top > 0 and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        _in_range("n", _integer("n", self.n), 1, MAX_N, f"[1, {MAX_N}]")
        if self.response_format is not None and not isinstance(self.response_format, Grammar):
            raise ValueError(f"response_format must be a Grammar, got {type(self.response_format).__name__}")

    def _checked_bias(self) -> dict[int, float]:
        """Token id keys may arrive as JSON strings ("50256"); values must lie in [-100, 100]."""
        if not isinstance(self.logit_bias, Mapping):
            raise ValueError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            token = int(key) if isinstance(key, str) and key.isdigit() else key
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
            _in_range("logit_bias", _number("logit_bias", value), -100.0, 100.0, "[-100, 100]")
            bias[token] = float(value)
        return bias

    @property
    def greedy(self) -> bool:
        """T = 0: argmax branch, consumes no randomness."""
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """Admission-time check against the model: token ids and top_k must fit the vocabulary."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be <= the vocabulary size {vocab_size}, got {self.top_k}")
        for name, ids in (("logit_bias", list(self.logit_bias)), ("stop_token_ids", list(self.stop_token_ids))):
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be < the vocabulary size {vocab_size}, got {bad}")
