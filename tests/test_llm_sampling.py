"""Sampling: seed 002 D01/D02 cases, the spec's float32 boundaries, and the batched sampler."""

from __future__ import annotations

import math

import pytest
import torch

from stages.llm.params import MAX_N, MAX_STOP, SamplingParams
from stages.llm.sampling import (
    apply_frequency_presence,
    apply_hard_mask,
    apply_repetition_penalty,
    draw,
    greedy,
    make_generator,
    min_p_filter,
    min_p_support_from_logits,
    sample,
    sampling_distribution,
    softmax,
    support_of,
    temperature_probs,
    top_k_filter,
    top_p_filter,
    typical_filter,
)

P5 = [0.5, 0.2, 0.15, 0.1, 0.05]


def _sample(logits, params, prompts=None, outputs=None, seeds=None):
    rows = len(params)
    generators = [make_generator(0 if seeds is None else seeds[i]) for i in range(rows)]
    return sample(
        torch.as_tensor(logits, dtype=torch.float32),
        params,
        prompts or [[] for _ in range(rows)],
        outputs or [[] for _ in range(rows)],
        generators,
    )


def _support(logits, **kw):
    z = torch.as_tensor([logits], dtype=torch.float32)
    return support_of(sampling_distribution(z, [SamplingParams(**kw)])[0])


# ---- parameters ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0), ("temperature", math.nan), ("temperature", math.inf), ("temperature", True),
        ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.1), ("top_p", math.nan),
        ("top_k", 0), ("top_k", -2), ("top_k", 1.5),
        ("min_p", -0.1), ("min_p", 1.1),
        ("presence_penalty", 2.1), ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
        ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 0.0}), ("logit_bias", {"x": 1.0}), ("logit_bias", [1]),
        ("seed", 1.5), ("seed", 2**64),
        ("max_tokens", 0), ("max_tokens", 2.0),
        ("stop", ["a"] * (MAX_STOP + 1)), ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", 1), ("logprobs", "yes"),
        ("top_logprobs", 21), ("top_logprobs", -1),
        ("n", 0), ("n", MAX_N + 1),
    ],
)
def test_bad_parameter_names_the_field(field, value):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**{field: value, **extra})


def test_top_logprobs_needs_logprobs():
    with pytest.raises(ValueError, match="^top_logprobs"):
        SamplingParams(top_logprobs=5)


def test_edge_values_are_accepted_and_normalized():
    p = SamplingParams(
        temperature=0, top_p=1, top_k=-1, min_p=1, presence_penalty=-2, frequency_penalty=2,
        logit_bias={"50": -100, 7: 100}, seed=-(2**63), stop="###", stop_token_ids=[2], n=MAX_N,
        logprobs=True, top_logprobs=20,
    )
    assert p.greedy and dict(p.logit_bias) == {50: -100.0, 7: 100.0}
    assert p.stop == ("###",) and p.stop_token_ids == (2,)
    assert hash(p) == hash(SamplingParams(**{**p.__dict__}))  # frozen and hashable
    SamplingParams(top_k=1, min_p=0, max_tokens=1)


def test_check_vocab():
    SamplingParams(top_k=10, logit_bias={9: 1}).check_vocab(10)
    for bad in (SamplingParams(top_k=11), SamplingParams(logit_bias={10: 1}), SamplingParams(stop_token_ids=[10])):
        with pytest.raises(ValueError, match="vocabulary size 10"):
            bad.check_vocab(10)


# ---- D01: greedy and temperature ----------------------------------------------------------------


def test_greedy_lowest_index_wins_ties():
    assert greedy([5, 5, 1]) == 0
    assert greedy([1, 5, 5]) == 1


@pytest.mark.parametrize("t", [0, -1, math.inf, math.nan])
def test_temperature_probs_rejects_non_positive_or_non_finite(t):
    with pytest.raises(ValueError, match="temperature"):
        temperature_probs([1, 2], t)


@pytest.mark.parametrize("bad", [[], [math.nan, 1.0], [-math.inf, -math.inf]])
@pytest.mark.parametrize(
    "fn",
    [softmax, greedy, lambda x: top_k_filter(x, 1), lambda x: top_p_filter(x, 0.5), lambda x: min_p_filter(x, 0.5),
     lambda x: typical_filter(x, 0.5), lambda x: draw(x, 0.5)],
)
def test_empty_nan_or_all_masked_input_raises(fn, bad):
    with pytest.raises(ValueError):
        fn(bad)


def test_all_zero_probabilities_raise():
    for fn in (lambda x: top_k_filter(x, 1), lambda x: top_p_filter(x, 0.5), lambda x: draw(x, 0.0)):
        with pytest.raises(ValueError):
            fn([0.0, 0.0])


def test_temperature_limits():
    assert temperature_probs([5, 3, 1], 1e-4)[0] > 0.999999
    split = temperature_probs([5, 5, 1], 1e-4)
    assert split[:2].tolist() == pytest.approx([0.5, 0.5], abs=1e-4) and split[2] < 1e-6
    sharp, flat = temperature_probs([5, 3, 1], 0.5).max(), temperature_probs([5, 3, 1], 2).max()
    assert float(sharp) == pytest.approx(0.9817, abs=1e-4) and float(flat) == pytest.approx(0.6652, abs=1e-4)
    assert support_of(temperature_probs([5, 3, 1, -30], 0.05)) == {0, 1, 2, 3}  # T > 0: full support


# ---- D01: top-k, top-p, min-p, typical ----------------------------------------------------------


def test_top_k():
    probs = softmax([4, 3, 2, 1, 0])
    for k in (1, 2, 3):
        q = top_k_filter(probs, k)
        assert support_of(q) == set(range(k)) and float(q.sum()) == pytest.approx(1.0)
        if k > 1:
            assert float(q[0] / q[1]) == pytest.approx(float(probs[0] / probs[1]))
    assert support_of(top_k_filter(softmax([3, 3, 1]), 1)) == {0}
    for k in (0, -1, 6):
        with pytest.raises(ValueError, match="k must be"):
            top_k_filter(probs, k)
    assert support_of(top_k_filter(probs, 5)) == set(range(5))
    for t in (0.3, 1.0, 4.0):  # S_k does not depend on T > 0
        assert support_of(top_k_filter(temperature_probs([4, 3, 2, 1, 0], t), 2)) == {0, 1}


def test_top_p_keeps_the_boundary_token():
    p = [0.4, 0.3, 0.2, 0.1]
    q = top_p_filter(p, 0.65)
    assert support_of(q) == {0, 1}
    assert q[:2].tolist() == pytest.approx([0.4 / 0.7, 0.3 / 0.7])
    assert support_of(top_p_filter(p, 0.7)) == {0, 1}  # exact boundary (float64): ">=" not ">"
    assert support_of(top_p_filter(p, 0.7 + 5e-13)) == {0, 1, 2}
    assert support_of(top_p_filter(p, 1.0)) == {0, 1, 2, 3}
    assert support_of(top_p_filter([0.0, 0.6, 0.4], 1.0)) == {1, 2}  # p0 = 1 keeps every nonzero token
    for bad in (0, -0.1, 1.1):
        with pytest.raises(ValueError, match="top_p"):
            top_p_filter(p, bad)
    # the two wrong definitions the spec names would give {} / {0} here
    assert {i for i, x in enumerate(p) if x >= 0.65} != {0, 1}
    assert {i for i in range(4) if sum(p[: i + 1]) < 0.65} != {0, 1}


def test_top_p_float32_dyadic_boundaries():
    """notes §6: the 0.7 boundary is float64 luck; dyadic masses are exact in float32 too."""
    p32 = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float32)
    assert support_of(top_p_filter(p32, 0.75)) == {0, 1}
    assert support_of(top_p_filter(p32, 0.75 + 1e-6)) == {0, 1, 2}
    z = torch.log(p32).tolist()  # the batched path, end to end from logits
    assert _support(z, top_p=0.75) == {0, 1}
    assert _support(z, top_p=0.75 + 1e-6) == {0, 1, 2}
    assert _support(z, top_p=0.5) == {0}  # boundary exactly at the first token
    assert _support(z, min_p=0.25) == {0, 1, 2, 3} and _support(z, min_p=0.25 + 1e-6) == {0, 1}


def test_min_p():
    z = [3.1, 1.0, 0.4, -2.0]
    probs = softmax(z)
    assert probs.tolist() == pytest.approx([0.8363, 0.1024, 0.0562, 0.0051], abs=1e-4)
    supports = {a: support_of(min_p_filter(probs, a)) for a in (1.0, 0.9, 0.5, 0.2, 0.05)}
    assert supports[1.0] == supports[0.9] == supports[0.5] == supports[0.2] == {0}
    assert supports[0.05] == {0, 1, 2}
    alphas = sorted(supports, reverse=True)
    assert all(supports[a] <= supports[b] for a, b in zip(alphas, alphas[1:]))  # nested, grows as alpha falls
    tied = min_p_filter(softmax([3, 3, 1]), 1.0)
    assert support_of(tied) == {0, 1} and tied[:2].tolist() == pytest.approx([0.5, 0.5])
    for bad in (0, -0.1, 1.1):
        with pytest.raises(ValueError, match="min_p"):
            min_p_filter(probs, bad)


def test_min_p_support_moves_with_temperature():
    z = [4.0, 2.0, 1.0, -1.0]
    temps = (0.2, 0.5, 1.0, 2.0, 5.0)
    sizes = [len(min_p_support_from_logits(z, t, 0.3)) for t in temps]
    assert sizes == [1, 1, 1, 2, 4]
    assert 4 + 2.0 * math.log(0.3) == pytest.approx(1.592, abs=1e-3)
    for t in temps:  # logit form, probability form and the batched sampler agree
        prob_form = support_of(min_p_filter(temperature_probs(z, t), 0.3))
        assert prob_form == min_p_support_from_logits(z, t, 0.3) == _support(z, temperature=t, min_p=0.3)


def test_shift_invariance():
    z = torch.tensor([3.1, 1.0, 0.4, -2.0], dtype=torch.float64)
    a, b = min_p_filter(softmax(z), 0.05), min_p_filter(softmax(z + 7), 0.05)
    assert support_of(a) == support_of(b) and torch.allclose(a, b)
    w = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0], dtype=torch.float64)
    assert support_of(top_k_filter(softmax(w), 2)) == support_of(top_k_filter(softmax(w + 5), 2)) == {0, 1}
    assert support_of(top_p_filter(softmax(w), 0.7)) == support_of(top_p_filter(softmax(w + 5), 0.7))
    for kw in ({"top_k": 2}, {"top_p": 0.7}, {"min_p": 0.05}):
        assert _support(w.tolist(), **kw) == _support((w + 5).tolist(), **kw)


def test_typical_excludes_the_argmax():
    p = torch.tensor([0.02, 0.35, 0.33, 0.30], dtype=torch.float64)
    entropy = float(-(p * p.log()).sum())
    assert entropy == pytest.approx(1.1727, abs=1e-4)
    assert (-p.log() - entropy).abs().tolist() == pytest.approx([2.739, 0.123, 0.064, 0.031], abs=1e-3)
    support = support_of(typical_filter(p, 0.63))
    assert support == {2, 3} and 1 not in support
    assert all(support != set(range(m)) for m in range(1, 5))  # no top-m prefix
    for bad in (0, -0.1, 1.1):
        with pytest.raises(ValueError, match="typical_p"):
            typical_filter(p, bad)


# ---- D01: penalties, masking, draw; D02: order --------------------------------------------------


def test_penalty_formulas():
    z = torch.tensor([2.0, -1.0, 0.5])
    out = apply_frequency_presence(z, torch.tensor([3.0, 0.0, 1.0]), 0.2, 0.5)
    assert out.tolist() == pytest.approx([0.9, -1.0, -0.2], abs=1e-6)  # 2 - 0.6 - 0.5 is not exact
    rep = apply_repetition_penalty(torch.tensor([2.0, -2.0, 1.0]), torch.tensor([True, True, False]), 2.0)
    assert rep.tolist() == [1.0, -4.0, 1.0]  # sign-aware scaling, not a constant shift


def test_hard_mask():
    z = apply_hard_mask([1, 2, 0.5, 9], [True, True, False, False])
    assert softmax(z).tolist() == pytest.approx([0.2689, 0.7311, 0, 0], abs=1e-4)  # the masked 9 is gone


def test_draw_with_stub_uniforms():
    assert [draw(P5, u) for u in (0.0, 0.5, 0.999999999, 1.0)] == [0, 1, 4, 4]
    assert draw([0.0, 0.6, 0.4], 0.0) == 1  # zero-probability tokens are never drawn
    assert draw([0.1] * 10 + [0.0], 1.0) == 9  # fallback is the last positive token, not 10
    with pytest.raises(ValueError):
        draw([0.0, 0.0, 0.0], 0.5)


def test_draw_empirical_frequency():
    logits = torch.log(torch.tensor([[0.7, 0.3]])).expand(4000, 2)
    stream = make_generator(42)  # one request's stream, drawn 4000 times
    out = sample(logits, [SamplingParams()] * 4000, [[]] * 4000, [[]] * 4000, [stream] * 4000)
    assert 0.65 <= out.token_ids.count(0) / 4000 <= 0.75


def test_d02_filter_order_is_not_commutative():
    a = support_of(top_p_filter(top_k_filter(P5, 3), 0.8))
    b = support_of(top_k_filter(top_p_filter(P5, 0.8), 3))
    assert (a, b) == ({0, 1}, {0, 1, 2})
    renormalized = top_k_filter(P5, 3)
    assert float(renormalized[0]) == pytest.approx(0.588, abs=1e-3)
    assert float(renormalized[:2].sum()) == pytest.approx(0.824, abs=1e-3)
    z = torch.log(torch.tensor(P5)).tolist()  # the sampler's pinned order: top_k -> top_p -> min_p
    assert _support(z, top_k=3, top_p=0.8) == {0, 1}
    assert _support(z, top_p=0.8, min_p=0.25) == {0, 1, 2}  # min_p first would renormalize to {0, 1}
    assert support_of(top_p_filter(min_p_filter(P5, 0.25), 0.8)) == {0, 1}


# ---- the batched sampler ------------------------------------------------------------------------


def test_pipeline_order_bias_then_repetition_then_presence():
    # token 0 was seen; bias +3 then /2 gives 2.0 < 2.5; the reverse order would give 3.5 > 2.5
    out = _sample([[1.0, 2.5]], [SamplingParams(temperature=0, logit_bias={0: 3}, repetition_penalty=2)], [[0]])
    assert out.token_ids == [1]
    # token 0 generated once: 2/2 - 0.5 = 0.5 < 0.6; presence first would give (2-0.5)/2 = 0.75
    params = SamplingParams(temperature=0, repetition_penalty=2, presence_penalty=0.5)
    assert _sample([[2.0, 0.6]], [params], outputs=[[0]]).token_ids == [1]


def test_penalty_scopes():
    # presence/frequency count generated tokens only; repetition counts the prompt, once per token
    z = [[2.0, 1.9]]
    assert _sample(z, [SamplingParams(temperature=0, presence_penalty=2)], prompts=[[0, 0]]).token_ids == [0]
    assert _sample(z, [SamplingParams(temperature=0, presence_penalty=2)], outputs=[[0]]).token_ids == [1]
    freq = SamplingParams(temperature=0, frequency_penalty=0.1)
    assert _sample([[2.0, 1.85]], [freq], outputs=[[0]]).token_ids == [0]  # 1.9 > 1.85
    assert _sample([[2.0, 1.85]], [freq], outputs=[[0, 0]]).token_ids == [1]  # 1.8 < 1.85
    rep = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert _sample([[3.0, 1.9]], [rep], prompts=[[0, 0, 0]]).token_ids == [0]  # 3/1.5 = 2, not 3/1.5**3


def test_logit_bias_adds_and_minus_100_bans():
    assert _sample([[1.0, 0.0]], [SamplingParams(temperature=0, logit_bias={1: 1.5})]).token_ids == [1]
    assert _sample([[50.0, 0.0]], [SamplingParams(temperature=0, logit_bias={0: -100})]).token_ids == [1]
    banned = SamplingParams(logit_bias={0: -100}, seed=1)
    assert _support([50.0, 0.0, -1.0], logit_bias={}) == {0, 1, 2}
    assert all(_sample([[50.0, 0.0, -1.0]], [banned], seeds=[s]).token_ids != [0] for s in range(20))


def test_greedy_in_a_batch():
    z = [[1.0, 7.0, 7.0, -math.inf], [-math.inf, 3.0, 3.0, 3.0]]
    stream = make_generator(3)
    state = stream.get_state()
    out = sample(torch.tensor(z), [SamplingParams(temperature=0)] * 2, [[], []], [[], []], [stream, stream])
    assert out.token_ids == [1, 1] and not out.errors
    assert torch.equal(stream.get_state(), state)  # greedy draws no randomness


def test_temperature_concentrates_in_the_sampler():
    z = [[5.0, 5.0, 1.0]]
    draws = {_sample(z, [SamplingParams(temperature=1e-4)], seeds=[s]).token_ids[0] for s in range(40)}
    assert draws == {0, 1}  # the T -> 0+ limit splits over the tie; it never reaches 2
    for t in (0.05, 1.0, 20.0):  # top_k's set is the same at every T > 0
        assert _support([4.0, 3.0, 2.0, 1.0, 0.0], top_k=2, temperature=t) == {0, 1}


def test_tiny_temperature_does_not_overflow():
    """z_max is subtracted before dividing by T, so z / T never reaches inf - inf = NaN."""
    z = torch.tensor([[100.0, 100.0, 0.0, -math.inf]])
    probs = sampling_distribution(z, [SamplingParams(temperature=1e-37)])
    assert probs[0].tolist() == [0.5, 0.5, 0.0, 0.0]
    assert temperature_probs([100.0, 100.0, 0.0], 1e-300).tolist() == [0.5, 0.5, 0.0]


def _steps(params, seed, other_rows, steps=12):
    """One request generating `steps` tokens from fixed per-step logits, in row 0, alone or batched."""
    vocab, tokens = 50, []
    mine, theirs = make_generator(1234), make_generator(4321)  # logits sources, not samplers
    rows = [(params, make_generator(seed))] + [(p, make_generator(None)) for p in other_rows]
    for _ in range(steps):
        own, rest = torch.randn(1, vocab, generator=mine), torch.randn(len(other_rows), vocab, generator=theirs)
        logits = torch.cat([own, rest])
        prompts, outputs = [[1, 2, 3]] * len(rows), [list(tokens)] * len(rows)
        out = sample(logits * 3, [p for p, _ in rows], prompts, outputs, [g for _, g in rows])
        tokens.append(out.token_ids[0])
    return tokens


def test_same_seed_same_tokens_alone_or_batched():
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, frequency_penalty=0.3, seed=7)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, top_p=0.5),
        SamplingParams(top_k=3, repetition_penalty=1.3, logit_bias={4: 5}),
        SamplingParams(logit_bias={i: -100 for i in range(50)}),  # fails every step, alone
    ]
    alone = _steps(params, 7, [])
    assert _steps(params, 7, others) == alone
    assert _steps(params, 8, []) != alone  # and the seed matters


def test_seeded_row_is_independent_of_its_neighbours_and_position():
    z = torch.randn(1, 100, generator=make_generator(0)) * 2
    params = SamplingParams(temperature=1.2, seed=5)
    alone = [sample(z, [params], [[]], [[]], [make_generator(s)]).token_ids[0] for s in range(30)]
    for position in (0, 2):
        batch = torch.cat([torch.randn(2, 100), torch.randn(1, 100)])
        batch[position] = z[0]
        neighbours = [SamplingParams(temperature=0), SamplingParams(top_p=0.3, min_p=0.2, top_k=4)]
        got = []
        for s in range(30):
            rows = list(neighbours)
            rows.insert(position, params)
            gens = [make_generator(99), make_generator(98)]
            gens.insert(position, make_generator(s))
            got.append(sample(batch, rows, [[]] * 3, [[]] * 3, gens).token_ids[position])
        assert got == alone


@pytest.mark.parametrize(
    "bad_row",
    [
        [-math.inf] * 6,
        [0.0, math.nan, 1.0, 2.0, 3.0, 4.0],
        [0.0, math.inf, 1.0, 2.0, 3.0, 4.0],
    ],
)
def test_broken_row_fails_alone(bad_row):
    good = [[0.5, 2.0, 1.0, 0.0, -1.0, 3.0], [1.0, 1.0, 1.0, 9.0, 1.0, 1.0]]
    params = [SamplingParams(seed=1, logprobs=True), SamplingParams(temperature=0), SamplingParams(top_k=2)]
    batched = _sample([good[0], bad_row, good[1]], params, seeds=[1, 2, 3])
    reference = _sample(good, [params[0], params[2]], seeds=[1, 3])
    assert list(batched.errors) == [1] and batched.token_ids[1] == -1
    assert [batched.token_ids[0], batched.token_ids[2]] == reference.token_ids
    assert batched.logprobs[1] is None and batched.logprobs[0] == reference.logprobs[0]


def test_everything_banned_fails_alone():
    ban_all = SamplingParams(logit_bias={i: -100 for i in range(4)}, seed=0)
    out = _sample([[1.0, 2.0, 3.0, 4.0]] * 2, [ban_all, SamplingParams(temperature=0)])
    assert out.token_ids == [-1, 3] and "masked" in out.errors[0] and 1 not in out.errors
    out = _sample([[1.0, 2.0]] * 2, [SamplingParams(logit_bias={5: 1.0}), SamplingParams(temperature=0)])
    assert "vocabulary" in out.errors[0] and out.token_ids[1] == 1
    out = _sample([[1.0, 2.0]] * 2, [SamplingParams(repetition_penalty=2.0), SamplingParams()], prompts=[[7], [0]])
    assert list(out.errors) == [0]


def test_logprobs_are_raw_and_ties_sorted_by_id():
    z = torch.tensor([[2.0, 1.0, 1.0, 0.0, -math.inf]])
    raw = torch.log_softmax(z, -1)[0]
    params = SamplingParams(temperature=0.3, top_k=1, logit_bias={0: -100}, logprobs=True, top_logprobs=3)
    out = sample(z, [params], [[]], [[]], [make_generator(0)])
    assert out.token_ids == [1]  # token 0 banned, top_k=1 keeps the lower id of the tie
    assert out.logprobs[0] == pytest.approx(float(raw[1]))
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1, 2]  # raw distribution, banned token included
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(raw[:3].tolist())
    plain = _sample(z.expand(2, -1), [SamplingParams(logprobs=True), SamplingParams()])
    assert plain.top_logprobs == [[], None] and plain.logprobs[1] is None


def test_low_precision_logits_and_input_untouched():
    z = torch.tensor([[0.0, 3.0, 1.0, 3.0]], dtype=torch.bfloat16)
    before = z.clone()
    for params in (SamplingParams(temperature=0), SamplingParams(top_p=0.9, logit_bias={1: 2})):
        assert sample(z, [params], [[]], [[1]], [make_generator(0)]).token_ids[0] in (1, 3)
    assert torch.equal(z, before)


def test_top_k_larger_than_the_live_vocabulary_is_clamped():
    z = [[1.0, -math.inf, 0.0, -math.inf]]
    assert _support(z[0], top_k=3) == {0, 2}
    assert _sample(z, [SamplingParams(top_k=50, seed=1)]).errors == {}


def test_row_count_mismatch_raises():
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(2, 3), [SamplingParams()], [[]], [[]], [make_generator(0)])
    with pytest.raises(ValueError, match="batch, vocab"):
        sample(torch.zeros(3), [SamplingParams()], [[]], [[]], [make_generator(0)])
