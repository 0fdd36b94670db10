"""Logits -> next token for a batch of requests: the processor pipeline of seed 002 §3.

Order (pinned by tests/test_llm_sampling.py; every filter renormalizes before the next runs,
which is why the order matters, seed 002 D02):

  0. screen       a row with NaN or +inf logits, or with no finite logit left after steps 1-3,
                  fails alone (SampleOutput.errors[row], token -1); the other rows are unaffected.
  1. logit_bias   z_i += bias_i; a bias of exactly -100 bans the token (z_i = -inf).
  2. repetition   tokens seen in prompt + generated, each once (HF/CTRL): z/r if z > 0, z*r if z < 0.
  3. presence / frequency   generated tokens only (OpenAI): z_i -= a_f*c_i + a_p*[c_i > 0].
  4. T == 0       greedy: argmax of z, lowest id wins ties; no softmax, never z/0; 5-9 skipped.
  5. temperature  p = softmax((z - z_max) / T).
  6. top_k        keep the k best by (-z_i, id); the set does not depend on T. A k above the
                  number of finite logits keeps them all (the step's mask may shrink the vocabulary).
  7. top_p        smallest descending prefix (ties by id) whose mass reaches top_p (boundary kept).
  8. min_p        keep p_i >= min_p * max p, on probabilities after temperature (moves with T).
  9. draw         one float32 u ~ U[0, 1) from the row's own generator; first i with
                  u < cum_i, falling back to the last positive-probability token. One stream
                  per request, so a seed gives the same tokens alone or batched. Greedy rows
                  draw nothing.

Logprobs are those of the raw model distribution, log_softmax of the logits as given (before
bias, penalties, temperature and filters): vLLM V1's default ("raw_logprobs"). They describe the
model, not the sampling settings, so a token banned by logit_bias still reports its raw logprob.

Numerics: the batch path computes in float32, so a top_p/min_p threshold is compared in float32
(p0 = 0.7 + 5e-13 rounds to 0.7f); the tests pin exact boundaries with dyadic probabilities.
The pure helpers (softmax ... draw) are seed 002's reference functions on one row: they raise
ValueError on bad input and keep float64 input in float64, where its exact examples hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stages.llm.grammar import Constraint
from stages.llm.params import LOGIT_BIAS_BAN, TOP_K_OFF, SamplingParams

Floats = Sequence[float] | torch.Tensor


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A request's own RNG stream; CPU generators keep a seed's draws identical on every device."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


# ---- seed 002 reference helpers: one row, validating ----------------------------------------


def _row(x: Floats, what: str) -> torch.Tensor:
    """1-D float tensor: lists become float64 (exact), float64 stays, other dtypes -> float32."""
    t = torch.as_tensor(x, dtype=torch.float64) if not isinstance(x, torch.Tensor) else x
    t = t if t.dtype == torch.float64 else t.float()
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{what} must be a non-empty 1-D vector, got shape {tuple(t.shape)}")
    if torch.isnan(t).any():
        raise ValueError(f"{what} contains NaN")
    return t


def _logits(z: Floats) -> torch.Tensor:
    t = _row(z, "logits")
    if torch.isposinf(t).any() or not torch.isfinite(t).any():
        raise ValueError("logits must have at least one finite value and no +inf (all masked?)")
    return t


def _probs(p: Floats) -> torch.Tensor:
    t = _row(p, "probs")
    if (t < 0).any() or not torch.isfinite(t).all() or t.sum() <= 0:
        raise ValueError("probs must be finite, >= 0 and not all zero")
    return t


def _fraction(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def softmax(z: Floats) -> torch.Tensor:
    """softmax(z) with the max subtracted first; -inf entries get probability 0."""
    return temperature_probs(z, 1.0)


def greedy(z: Floats) -> int:
    """argmax without a softmax; torch.argmax returns the first maximum, i.e. the lowest id."""
    return int(torch.argmax(_logits(z)))


def temperature_probs(z: Floats, temperature: float) -> torch.Tensor:
    """softmax(z / T), defined for T > 0 only: T = 0 is the greedy branch, never z / 0."""
    if not (isinstance(temperature, (int, float)) and 0 < temperature < math.inf):
        raise ValueError(f"temperature must be finite and > 0 here (T = 0 is greedy()), got {temperature!r}")
    t = _logits(z)
    return torch.softmax((t - t.max()) / temperature, dim=-1)


def top_k_filter(probs: Floats, k: int) -> torch.Tensor:
    """Keep the k most probable (ties to the lower id), renormalized; 1 <= k <= #nonzero."""
    p = _probs(probs)
    finite = int((p > 0).sum())
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= finite:
        raise ValueError(f"k must be an integer in [1, {finite}] (tokens with nonzero probability), got {k!r}")
    return _renormalize(p, _top_k_keep(p[None], torch.tensor([k]))[0])


def top_p_filter(probs: Floats, top_p: float) -> torch.Tensor:
    """Smallest descending prefix (ties by id) with mass >= top_p, boundary kept; probs sum to 1."""
    _fraction("top_p", top_p)
    p = _probs(probs)
    return _renormalize(p, _top_p_keep(p[None], torch.tensor([top_p], dtype=p.dtype))[0])


def min_p_filter(probs: Floats, min_p: float) -> torch.Tensor:
    """Keep p_i >= min_p * max p (every tied maximum survives), renormalized."""
    _fraction("min_p", min_p)
    p = _probs(probs)
    return _renormalize(p, _min_p_keep(p[None], torch.tensor([min_p], dtype=p.dtype))[0])


def min_p_support_from_logits(z: Floats, temperature: float, min_p: float) -> set[int]:
    """The same min-p set in logit form: z_i >= z_max + T ln(min_p)."""
    _fraction("min_p", min_p)
    t = _logits(z)
    return support_of(t >= t.max() + temperature * math.log(min_p))


def typical_filter(probs: Floats, typical_p: float) -> torch.Tensor:
    """Sort by |-ln p_i - H| (ties by id), keep the smallest prefix with mass >= typical_p.

    A seed 002 reference only: SamplingParams has no typical_p (OpenAI has none).
    """
    _fraction("typical_p", typical_p)
    p = _probs(probs)
    p = p / p.sum()
    logp = torch.log(p)  # -inf where p == 0: those sort last (distance inf)
    entropy = -(p * torch.where(p > 0, logp, 0)).sum()
    order = torch.sort((-logp - entropy).abs(), stable=True).indices
    cum = p[order].cumsum(-1)
    keep_sorted = torch.cat([cum.new_zeros(1), cum[:-1]]) < typical_p
    return _renormalize(p, torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted))


def apply_hard_mask(z: Floats, allowed: Sequence[bool] | torch.Tensor) -> torch.Tensor:
    """Constrained decoding's primitive: illegal tokens get -inf, nothing else changes."""
    t = _row(z, "logits")
    return t.masked_fill(~torch.as_tensor(allowed, dtype=torch.bool), -math.inf)


def apply_repetition_penalty(z: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """CTRL rule on seen tokens only: positive logits divided, negative multiplied (not a shift)."""
    return torch.where(seen, torch.where(z > 0, z / penalty, z * penalty), z)


def apply_frequency_presence(
    z: torch.Tensor, counts: torch.Tensor, frequency: float | torch.Tensor, presence: float | torch.Tensor
) -> torch.Tensor:
    """OpenAI: z_i - frequency * c_i - presence * [c_i > 0]."""
    return z - frequency * counts - presence * (counts > 0).to(z.dtype)


def support_of(x: torch.Tensor) -> set[int]:
    """Indices of nonzero entries: a filter's support, or a boolean mask's members."""
    return set(torch.nonzero(x).flatten().tolist())


def draw(probs: Floats, u: float) -> int:
    """First i with u < cum_i (zero-probability tokens never win); u past the end -> last positive."""
    if not 0 <= u <= 1:
        raise ValueError(f"u must be in [0, 1], got {u!r}")
    p = _probs(probs)
    return int(_draw(p[None], torch.tensor([u], dtype=p.dtype))[0])


# ---- batched kernels: [B, V], no validation (sample() screens rows first) --------------------


def _renormalize(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def _top_k_keep(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Rank by (-score, id): everything above the k-th score, then tied ones by increasing id."""
    k = k.to(scores.device)[:, None]  # [B, 1]
    kth = scores.topk(int(k.max()), dim=-1).values.gather(-1, k - 1)  # [B, 1]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


def _top_p_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sorted position r is kept iff the mass before it is < top_p: the boundary token stays."""
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
    cum = ordered.cumsum(-1)
    before = torch.cat([cum.new_zeros(cum.shape[0], 1), cum[:, :-1]], dim=-1)
    keep_sorted = before < top_p.to(probs)[:, None]
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _min_p_keep(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    return probs >= min_p.to(probs)[:, None] * probs.max(-1, keepdim=True).values


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cum = probs.cumsum(-1)  # [B, V]
    index = torch.searchsorted(cum, u.to(cum)[:, None], right=True)[:, 0]  # first cum_i > u
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(-1)
    return torch.where(index < probs.shape[-1], index, last_positive)


# ---- the engine's entry point -----------------------------------------------------------------


@dataclass
class SampleOutput:
    """One step's result, row-aligned with the logits it came from."""

    token_ids: list[int]  # [B] chosen token per row; -1 where the row failed
    logprobs: list[float | None]  # raw-model logprob of the chosen token; None unless asked (or failed)
    top_logprobs: list[list[tuple[int, float]] | None]  # best (token id, logprob) first, ties by id
    errors: dict[int, str]  # row -> why it failed: fail that request only, the other rows are valid


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator],
    constraint: Constraint | None = None,
) -> SampleOutput:
    """Pick one token per row of logits [B, V] (any float dtype; computed in float32); a `constraint` masks its
    rows to the tokens their grammars accept, after the penalties.

    Row r belongs to params[r], prompt_ids[r], output_ids[r] (generated so far) and
    generators[r], the request's own stream (see make_generator); each non-greedy row draws
    exactly one uniform from it per call. The pipeline order is the module docstring's.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if not len(params) == len(prompt_ids) == len(output_ids) == len(generators) == batch:
        raise ValueError(f"params, prompt_ids, output_ids and generators must each have {batch} rows")
    raw = logits.float()  # [B, V]
    if all(_plain_greedy(p) for p in params) and math.isfinite(raw.sum().item()):  # a NaN or an inf spoils the sum
        # the common decode step: every row greedy with nothing to apply but its grammar, no bad logit: one argmax
        # (4.) over the masked logits (a grammar always leaves a token: at the least its end)
        z = raw
        if constraint is not None:
            z = raw.clone()
            constraint.apply(z)
        return SampleOutput(z.argmax(-1).tolist(), [None] * batch, [None] * batch, {})
    errors: dict[int, str] = {}
    for row in (torch.isnan(raw) | torch.isposinf(raw)).any(-1).nonzero()[:, 0].tolist():
        errors[row] = "the model produced NaN or +inf logits"
    z = raw.clone()  # [B, V], processed in place below; the caller's tensor is untouched
    _apply_bias(z, params, errors)  # 1.
    _apply_penalties(z, params, prompt_ids, output_ids, errors)  # 2. and 3.
    if constraint is not None:  # grammar rows: only the tokens their matchers accept
        constraint.apply(z)
    for row in (~torch.isfinite(z).any(-1)).nonzero()[:, 0].tolist():
        errors.setdefault(row, "every token is masked (-inf or banned by logit_bias): nothing to sample")
    tokens = torch.full((batch,), -1, dtype=torch.long, device=z.device)
    ok = [r for r in range(batch) if r not in errors]
    greedy_rows = [r for r in ok if params[r].greedy]
    if greedy_rows:  # 4.
        rows = torch.tensor(greedy_rows, device=z.device)
        tokens[rows] = z[rows].argmax(-1)  # first maximum = lowest id
    sampled_rows = [r for r in ok if not params[r].greedy]
    if sampled_rows:  # 5. - 9.
        rows = torch.tensor(sampled_rows, device=z.device)
        probs = sampling_distribution(z[rows], [params[r] for r in sampled_rows])
        u = torch.stack([torch.rand((), generator=generators[r], device=generators[r].device) for r in sampled_rows])
        tokens[rows] = _draw(probs, u.to(z.device))  # 9. one uniform per row from its own stream
    chosen, top = _raw_logprobs(raw, tokens, params, errors)
    return SampleOutput(tokens.tolist(), chosen, top, errors)


def _plain_greedy(p: SamplingParams) -> bool:
    """Greedy with no logit bias, no penalty and no logprobs: its token is the first argmax of its raw logits."""
    return (p.greedy and not p.logit_bias and not p.logprobs and p.repetition_penalty == 1
            and p.frequency_penalty == 0 and p.presence_penalty == 0)


def _column(values: list, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=like.device)


def _apply_bias(z: torch.Tensor, params: Sequence[SamplingParams], errors: dict[int, str]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for r, p in enumerate(params):
        if not p.logit_bias or r in errors:
            continue
        if max(p.logit_bias) >= z.shape[-1]:
            errors[r] = f"logit_bias token id {max(p.logit_bias)} is outside the vocabulary [0, {z.shape[-1]})"
            continue
        rows += [r] * len(p.logit_bias)
        cols += list(p.logit_bias)
        values += list(p.logit_bias.values())
    if rows:
        ri, ci, v = _column(rows, z, torch.long), _column(cols, z, torch.long), _column(values, z)
        z.index_put_((ri, ci), v, accumulate=True)
        ban = v == LOGIT_BIAS_BAN
        z[ri[ban], ci[ban]] = -math.inf


def _apply_penalties(
    z: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    errors: dict[int, str],
) -> None:
    vocab = z.shape[-1]
    for r, p in enumerate(params):  # ids come from our tokenizer; a mismatch fails the row, not the batch
        used = p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0
        ids = [*prompt_ids[r], *output_ids[r]] if used and r not in errors else []
        if ids and not 0 <= min(ids) <= max(ids) < vocab:
            errors[r] = f"token ids must lie in [0, {vocab}) for penalties, got {min(ids)}..{max(ids)}"
    live = [r for r in range(len(params)) if r not in errors]
    rep = [r for r in live if params[r].repetition_penalty != 1]
    if rep:  # 2. prompt + generated, each token once
        rows = _column(rep, z, torch.long)
        seen = _count_table([[*prompt_ids[r], *output_ids[r]] for r in rep], z) > 0
        penalty = _column([params[r].repetition_penalty for r in rep], z)[:, None]
        z[rows] = apply_repetition_penalty(z[rows], seen, penalty)
    freq = [r for r in live if params[r].frequency_penalty != 0 or params[r].presence_penalty != 0]
    if freq:  # 3. generated only
        rows = _column(freq, z, torch.long)
        counts = _count_table([output_ids[r] for r in freq], z)
        frequency = _column([params[r].frequency_penalty for r in freq], z)[:, None]
        presence = _column([params[r].presence_penalty for r in freq], z)[:, None]
        z[rows] = apply_frequency_presence(z[rows], counts, frequency, presence)


def _count_table(ids_per_row: list[Sequence[int]], like: torch.Tensor) -> torch.Tensor:
    """[len(ids_per_row), V] float32 occurrence counts."""
    lengths = _column([len(ids) for ids in ids_per_row], like, torch.long)
    rows = torch.repeat_interleave(torch.arange(len(ids_per_row), device=like.device), lengths)
    cols = _column([t for ids in ids_per_row for t in ids], like, torch.long)
    table = torch.zeros(len(ids_per_row), like.shape[-1], device=like.device)
    return table.index_put_((rows, cols), torch.ones_like(cols, dtype=table.dtype), accumulate=True)


def sampling_distribution(z: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Steps 5-8: the distribution step 9 draws from, for processed logits z [B, V] with T > 0.

    Rows must hold at least one finite logit (sample() screens them); exposed so tests and
    callers can read a request's exact support.
    """
    z = z.float()
    temperature = _column([p.temperature for p in params], z)[:, None]
    probs = torch.softmax((z - z.max(-1, keepdim=True).values) / temperature, dim=-1)  # 5. [B, V]
    vocab = z.shape[-1]
    rows = [i for i, p in enumerate(params) if p.top_k != TOP_K_OFF and p.top_k < vocab]
    if rows:  # 6. ranked on logits, so T cannot reorder it
        sel = _column(rows, z, torch.long)
        keep = _top_k_keep(z[sel], _column([params[i].top_k for i in rows], z, torch.long))
        probs[sel] = _renormalize(probs[sel], keep)
    rows = [i for i, p in enumerate(params) if p.top_p < 1]
    if rows:  # 7.
        sel = _column(rows, z, torch.long)
        probs[sel] = _renormalize(probs[sel], _top_p_keep(probs[sel], _column([params[i].top_p for i in rows], z)))
    rows = [i for i, p in enumerate(params) if p.min_p > 0]
    if rows:  # 8.
        sel = _column(rows, z, torch.long)
        probs[sel] = _renormalize(probs[sel], _min_p_keep(probs[sel], _column([params[i].min_p for i in rows], z)))
    return probs


def _raw_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams], errors: dict[int, str]
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    chosen: list[float | None] = [None] * len(params)
    top: list[list[tuple[int, float]] | None] = [None] * len(params)
    wanted = [r for r, p in enumerate(params) if p.logprobs and r not in errors]
    if not wanted:
        return chosen, top
    rows = _column(wanted, raw, torch.long)
    logprobs = torch.log_softmax(raw[rows], dim=-1)  # [W, V]
    picked = logprobs.gather(-1, tokens[rows][:, None])[:, 0].tolist()
    width = max(params[r].top_logprobs for r in wanted)
    values, ids = logprobs.sort(dim=-1, descending=True, stable=True) if width else (logprobs, logprobs)
    top_values, top_ids = values[:, :width].tolist(), ids[:, :width].tolist()
    for i, r in enumerate(wanted):
        n = params[r].top_logprobs
        chosen[r] = picked[i]
        top[r] = list(zip(top_ids[i][:n], top_values[i][:n]))
    return chosen, top
