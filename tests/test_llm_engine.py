"""The llm stage end to end: greedy output equals transformers generate(), alone and batched, with
prefix hits, chunked prefill and preemption; seeded sampling is batch-invariant; cancellation
returns every KV block and publishes nothing after the cancel."""

from __future__ import annotations

import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelines.chat import ChatRequest, LLMConfig
from pipelines.config import EngineConfig, ModelSpec
from pipelines.demo import build_demo_model
from pipelines.engine import Engine
from serve.errors import http_status
from stages.events import EventKind, StageError
from stages.llm.params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    return str(build_demo_model(request.param, tmp_path_factory.mktemp(request.param) / "model"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval(), AutoTokenizer.from_pretrained(checkpoint)


def _engine(path: str, **llm) -> Engine:
    engine = Engine(EngineConfig(models=(ModelSpec("m", path, llm=LLMConfig(**llm)),)))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(checkpoint):
    """Small blocks and a small token budget: long prompts are prefilled in chunks across steps."""
    eng = _engine(checkpoint, kv_cache_mb=8, block_size=4, max_num_batched_tokens=48, max_prefill_chunk=16)
    yield eng
    eng.shutdown()


def _prompt(tok, i: int) -> list[int]:
    text = " ".join(f"word{j % 7} item {i}" for j in range(3 + 5 * i))
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False)


def _generate(reference, ids: list[int], n: int) -> list[int]:
    model, _ = reference
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def _run(engine, ids, **params):
    return engine.submit_chat("m", ChatRequest(prompt=list(ids), params=SamplingParams(**params)))


def test_greedy_alone_equals_generate(engine, reference):
    ids = _prompt(reference[1], 3)
    out = _run(engine, ids, max_tokens=40, **GREEDY).result(timeout=120)
    assert out["choices"][0]["token_ids"] == _generate(reference, ids, 40)
    assert out["choices"][0]["finish_reason"] == "length"


def test_greedy_batched_with_prefix_hits_and_chunks_equals_generate(engine, reference):
    prompts = [_prompt(reference[1], i) for i in range(8)]
    hits_before = engine.chat_model("m").stage.blocks.stats.hits
    handles = [_run(engine, p, max_tokens=32 + i, **GREEDY) for i, p in enumerate(prompts)]
    outs = [h.result(timeout=300) for h in handles]
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert out["choices"][0]["token_ids"] == _generate(reference, p, 32 + i), f"request {i}"
    assert engine.metrics.registry.get_sample_value(
        "mmserve_stage_batch_size_count", {"stage": "m/llm", "model": "m"}) > 0
    # The same prompts again hit the prefix cache and still equal generate().
    again = _run(engine, prompts[5], max_tokens=32, **GREEDY).result(timeout=120)
    assert again["usage"]["cached_tokens"] > 0
    assert engine.chat_model("m").stage.blocks.stats.hits > hits_before
    assert again["choices"][0]["token_ids"] == _generate(reference, prompts[5], 32)


def test_the_next_turn_reads_the_keys_its_reply_decoded(engine, reference):
    """A reply's keys and values, written step after step while it decoded (on a CPU into the decode mirror first,
    the paged cache at the next step that reads it), serve the next turn from the prefix cache: a prompt that
    extends the first request's prompt and reply hits blocks filled by decode steps, and its tokens and their
    log-probabilities are the model's own (the tiny model's greedy tokens alone would survive a wrong key)."""
    first = _prompt(reference[1], 6)
    reply = _run(engine, first, max_tokens=28, **GREEDY).result(timeout=120)["choices"][0]["token_ids"]
    follow = first + reply + _prompt(reference[1], 1)[1:]
    out = _run(engine, follow, max_tokens=8, logprobs=True, **GREEDY).result(timeout=120)
    assert out["usage"]["cached_tokens"] >= len(first) + 24  # whole blocks of the reply's own positions
    tokens = out["choices"][0]["token_ids"]
    assert tokens == _generate(reference, follow, 8)
    with torch.inference_mode():
        logits = reference[0](torch.tensor([follow + tokens])).logits[0, len(follow) - 1:-1]
    expected = logits.float().log_softmax(-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
    got = torch.tensor([entry["logprob"] for entry in out["choices"][0]["logprobs"]])
    assert torch.allclose(got, expected, atol=1e-4), (got, expected)


def test_decode_steps_without_a_plan_equal_the_planned_ones(checkpoint, reference):
    """Decode steps of the same sequences run without a Plan (LLMStage._continue_decode: slots in place or in new
    blocks, keys from the mirror, no layout): the very tokens and log-probabilities of the same requests in an
    engine that plans every step, and generate()'s tokens. Four prompts of different lengths, blocks of 4
    positions: the sequences cross blocks at different steps."""
    prompts = [_prompt(reference[1], i) for i in range(4)]
    outputs, continued = [], []
    for plan_every_step in (False, True):
        eng = _engine(checkpoint, kv_cache_mb=8, block_size=4)
        try:
            stage = eng.chat_model("m").stage
            continue_decode = stage._continue_decode
            stage._continue_decode = (lambda: False) if plan_every_step else \
                (lambda: continued.append(continue_decode()) or continued[-1])
            handles = [_run(eng, p, max_tokens=24, logprobs=True, top_logprobs=2, **GREEDY) for p in prompts]
            outputs.append([h.result(timeout=120)["choices"][0] for h in handles])
            assert stage.blocks.num_used_blocks == 0
        finally:
            eng.shutdown()
    without, planned = outputs
    assert sum(continued) >= 16, continued  # most of the ~24 decode steps
    for p, a, b in zip(prompts, without, planned):
        assert a["token_ids"] == b["token_ids"] == _generate(reference, p, 24)
        assert a["logprobs"] == b["logprobs"]


def test_prefills_run_their_last_layer_for_the_rows_that_sample(engine, reference):
    """A prefill's (and a mixed step's) last layer goes on with the rows that sample alone (DirectDecoder's
    `sampled`): prompts prefilled in chunks beside other requests' decodes still give generate()'s tokens, and
    every token's log-probability is the model's own."""
    runner = engine.chat_model("m").stage.runner
    assert runner.direct is not None
    steps: list[tuple[int, int]] = []  # (rows of the step, rows past its last layer)
    direct = runner.direct

    def counting(input_ids, positions, meta, sampled=None):
        hidden = direct(input_ids, positions, meta, sampled)
        steps.append((len(input_ids), len(hidden)))
        return hidden

    runner.direct = counting
    try:
        prompts = [_prompt(reference[1], i) for i in (2, 5, 7)]
        handles = [_run(engine, p, max_tokens=12, logprobs=True, **GREEDY) for p in prompts]
        outs = [h.result(timeout=120)["choices"][0] for h in handles]
    finally:
        runner.direct = direct
    assert any(1 <= past < rows for rows, past in steps), steps
    for p, out in zip(prompts, outs):
        tokens = out["token_ids"]
        assert tokens == _generate(reference, p, 12)
        with torch.inference_mode():
            logits = reference[0](torch.tensor([p + tokens])).logits[0, len(p) - 1:-1]
        expected = logits.float().log_softmax(-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        got = torch.tensor([entry["logprob"] for entry in out["logprobs"]])
        assert torch.allclose(got, expected, atol=1e-4), (got, expected)


def _streams_as_generate(eng, reference, count: int, interval: int = 1) -> list[list[int]]:
    """`count` greedy requests of 24 tokens and one with a stop string: each one's tokens are generate()'s and its
    deltas' text joined is its output's, the first token's delta alone, then `interval` tokens a delta (the last
    ending it); the stop string cuts where it does. Returns the prompts."""
    prompts = [_prompt(reference[1], i) for i in range(count)]
    handles = [_run(eng, p, max_tokens=24, **GREEDY) for p in prompts]
    stopped = _run(eng, prompts[0], max_tokens=24, stop=["item"], **GREEDY)
    for p, handle in zip(prompts, handles):
        events = list(handle.events(timeout=120))
        final = events[-1].data["outputs"]["choices"][0]
        assert final["token_ids"] == _generate(reference, p, 24)
        deltas = [e.data for e in events if e.kind is EventKind.DELTA]
        assert len(deltas) == 1 + -(-23 // interval) and deltas[-1]["finish_reason"] == "length"
        assert "".join(d["text"] for d in deltas) == final["text"]
    text = stopped.result(timeout=120)["choices"][0]["text"]
    whole = reference[1].decode(_generate(reference, prompts[0], 24), skip_special_tokens=True)
    assert "item" not in text and whole.startswith(text)
    return prompts


def test_a_publisher_thread_streams_the_same_deltas(checkpoint, reference):
    """publish_thread (on by default on a GPU): detokenizing and emitting in a thread beside the forward gives the
    same streamed text, in order, and the same outputs, greedy and with a stop string."""
    eng = _engine(checkpoint, kv_cache_mb=8, block_size=4, publish_thread=True)
    try:
        _streams_as_generate(eng, reference, 4)
    finally:
        eng.shutdown()


def test_stream_interval_coalesces_the_deltas_and_nothing_else(checkpoint, reference):
    """stream_interval 4: the first token's delta at once, then deltas of at most 4 tokens, the last at the end;
    their text joined is the output's, the tokens are generate()'s, a stop string still cuts where it does. A
    request whose caller reads only the result (stream=False) has two deltas, the first token's and the rest."""
    eng = _engine(checkpoint, kv_cache_mb=8, block_size=4, stream_interval=4)
    try:
        prompts = _streams_as_generate(eng, reference, 3, interval=4)  # deltas of 1, 4 x 5, 3 tokens
        # a caller that reads only the result: the first token's delta, then one at the end
        quiet = eng.submit_chat("m", ChatRequest(prompt=prompts[1], params=SamplingParams(max_tokens=24, **GREEDY),
                                                 stream=False))
        events = list(quiet.events(timeout=120))
        final = events[-1].data["outputs"]["choices"][0]
        deltas = [e.data["text"] for e in events if e.kind is EventKind.DELTA]
        assert len(deltas) == 2 and "".join(deltas) == final["text"] == reference[1].decode(
            _generate(reference, prompts[1], 24), skip_special_tokens=True)
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="stream_interval"):
        LLMConfig(stream_interval=0)


def test_preemption_by_recompute_keeps_outputs_exact(checkpoint, reference):
    model, tok = reference
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"request {k} " * 3}], add_generation_prompt=True,
                                       return_dict=False) for k in range(4)]  # short prompts, long outputs
    cfg = model.config
    block_bytes = (2 * cfg.num_hidden_layers * 4 * cfg.num_key_value_heads
                   * (cfg.hidden_size // cfg.num_attention_heads) * 4)
    blocks = max(len(p) + 48 for p in prompts) // 4 + 4  # each fits alone; four growing together do not
    eng = _engine(checkpoint, kv_cache_mb=blocks * block_bytes / 2**20, block_size=4, max_num_batched_tokens=64)
    try:
        stage = eng.chat_model("m").stage
        outs = [h.result(timeout=300) for h in [_run(eng, p, max_tokens=48, **GREEDY) for p in prompts]]
        assert stage.scheduler.num_preemptions > 0
        for p, out in zip(prompts, outs):
            assert out["choices"][0]["token_ids"] == _generate(reference, p, 48)
        assert stage.blocks.num_used_blocks == 0
    finally:
        eng.shutdown()


def test_seeded_sampling_is_the_same_alone_and_batched(engine, reference):
    ids = _prompt(reference[1], 2)
    params = dict(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    metrics = engine.metrics
    pairs = metrics.llm.forwards("m", min_seqs=2)
    alone = _run(engine, ids, **params).result(timeout=120)["choices"][0]["token_ids"]
    assert metrics.llm.forwards("m", min_seqs=2) == pairs  # alone: no forward held a second sequence
    # Three others that outlast it, each past its first token before it starts: every forward of the
    # batched run holds four sequences, and only a forward with the batched run in it can hold four.
    others = [_run(engine, _prompt(reference[1], i), temperature=1.1, seed=i, max_tokens=1000, ignore_eos=True)
              for i in range(3)]
    for h in others:
        next(e for e in h.events(timeout=120) if e.kind is EventKind.DELTA)
    fours = metrics.llm.forwards("m", min_seqs=4)
    batched = _run(engine, ids, **params).result(timeout=120)["choices"][0]["token_ids"]
    shared = metrics.llm.forwards("m", min_seqs=4) - fours
    for h in others:
        h.cancel()
        assert list(h.events(timeout=60))[-1].data["code"] == "cancelled"  # gone before the next test
    assert shared >= len(batched) == 24  # a forward per sampled token, every one of them shared
    assert alone == batched


def test_list_of_prompts_runs_together_and_equals_generate(engine, reference):
    """A completions list of prompts: one request whose prompts share forwards; each choice equals generate()."""
    prompts = [_prompt(reference[1], i) for i in (1, 4, 6)]
    params = SamplingParams(n=2, max_tokens=12, **GREEDY)
    pairs = engine.metrics.llm.forwards("m", min_seqs=2)
    out = engine.submit_chat("m", ChatRequest(prompts=prompts, params=params)).result(timeout=120)
    assert engine.metrics.llm.forwards("m", min_seqs=2) > pairs  # nothing else ran: its prompts shared a forward
    assert [c["index"] for c in out["choices"]] == list(range(6))
    for k, p in enumerate(prompts):
        want = _generate(reference, p, 12)
        assert [out["choices"][2 * k + j]["token_ids"] for j in range(2)] == [want, want], f"prompt {k}"
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert out["usage"]["completion_tokens"] == 6 * 12


def test_list_of_prompts_seeded_equals_each_alone(engine, reference):
    prompts = [_prompt(reference[1], i) for i in (0, 3)]
    params = SamplingParams(temperature=1.0, seed=99, n=2, max_tokens=10, ignore_eos=True)
    together = engine.submit_chat("m", ChatRequest(prompts=prompts, params=params)).result(timeout=120)
    for k, p in enumerate(prompts):
        alone = engine.submit_chat("m", ChatRequest(prompt=p, params=params)).result(timeout=120)
        assert [c["token_ids"] for c in together["choices"][2 * k:2 * k + 2]] == \
            [c["token_ids"] for c in alone["choices"]], f"prompt {k}"


def test_list_of_prompts_names_the_bad_one(engine):
    for prompts, code in (([[1, 2], [10**6]], None), ([[1, 2], []], None),
                          ([[3], [1] * 5000], "context_length_exceeded")):
        with pytest.raises(StageError) as err:
            engine.submit_chat("m", ChatRequest(prompts=prompts, params=SamplingParams(max_tokens=1)))
        assert err.value.param == "prompt[1]" and http_status(err.value) == 400
        if code:
            assert err.value.code == code


def test_n_choices_share_the_prompt_blocks(engine, reference):
    ids = _prompt(reference[1], 4)
    out = _run(engine, ids, temperature=1.0, seed=7, n=3, max_tokens=12, ignore_eos=True).result(timeout=120)
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1  # different streams
    assert out["usage"]["completion_tokens"] == 36


def test_stop_string_and_streamed_text(engine, reference):
    ids = _prompt(reference[1], 1)
    full = _run(engine, ids, max_tokens=30, **GREEDY).result(timeout=120)["choices"][0]["text"]
    stop = full[5:8]
    assert stop
    handle = _run(engine, ids, max_tokens=30, stop=[stop], **GREEDY)
    streamed = "".join(e.data["text"] for e in handle.events(timeout=120) if e.kind is EventKind.DELTA)
    assert streamed == full[:full.find(stop)]


def test_random_cancellations_return_every_block(engine, reference):
    stage = engine.chat_model("m").stage
    baseline = stage.blocks.num_free_blocks
    rng = random.Random(0)
    handles = []
    for i in range(240):  # cancels land while queued (no sleep), prefilling or decoding
        h = _run(engine, _prompt(reference[1], rng.randrange(8)), max_tokens=rng.randrange(1, 16), **GREEDY)
        handles.append(h)
        if rng.random() < 0.6:
            time.sleep(rng.choice([0.0, 0.001, 0.005, 0.02]))
            h.cancel()
    for h in handles:
        events = list(h.events(timeout=120))
        kinds = [e.kind for e in events]
        assert kinds[-1] in (EventKind.FINAL, EventKind.ERROR)
        if kinds[-1] is EventKind.ERROR:
            assert events[-1].data["code"] == "cancelled"
            assert EventKind.DELTA not in kinds[kinds.index(EventKind.ERROR):]
    deadline = time.time() + 30
    while not engine.executor.idle() and time.time() < deadline:
        time.sleep(0.05)
    assert stage.blocks.num_used_blocks == 0
    assert stage.blocks.num_free_blocks == baseline
    stage.blocks.check_invariants()


def test_prompt_longer_than_context_is_refused(engine):
    with pytest.raises(StageError) as err:
        _run(engine, [1] * 5000, max_tokens=1)
    assert http_status(err.value) == 400 and err.value.code == "context_length_exceeded"


def test_all_masked_request_fails_alone(engine, reference):
    ids = _prompt(reference[1], 1)
    vocab = engine.chat_model("m").runner.vocab_size
    good = _run(engine, ids, max_tokens=16, **GREEDY)
    banned = _run(engine, ids, max_tokens=4, temperature=0.7, logit_bias={i: -100 for i in range(vocab)})
    with pytest.raises(StageError) as err:
        banned.result(timeout=60)
    assert err.value.code == "sampling_failed" and http_status(err.value) == 400
    assert good.result(timeout=60)["choices"][0]["token_ids"] == _generate(reference, ids, 16)
