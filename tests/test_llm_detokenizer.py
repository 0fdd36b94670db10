"""Streaming text: incremental detokenization, stop strings held back across tokens (seed 002 D03).

Tokenizers are trained in-process (no downloads): a byte-level BPE wrapped in
`PreTrainedTokenizerFast` (GPT-2 / Llama-3 / Qwen style) and a Llama-2 style SentencePiece BPE
(Metaspace, byte fallback, a decoder that strips the first leading space) built as `LlamaTokenizer`.
The reference is always `tokenizer.decode` of all output ids, and `text.find` on the full text.
"""

from __future__ import annotations

import json
import random

import pytest

from stages.llm.detokenizer import IncrementalDetokenizer, OutputDelta, OutputText, StopStringMatcher

REPLACEMENT = "\ufffd"
CORPUS = [
    "the quick brown fox jumps over the lazy dog. Hello, world!",
    "hello there: streaming text is decoded one token at a time",
    "café naïve résumé — déjà vu",
    "你好 世界 你好",
    "emoji 😀 🎉 party",
]
# Characters for random texts: ASCII, accents, CJK and emoji both seen and unseen in training.
ALPHABET = list("abcdefgh STOP.,!\n") + list("éïà—") + list("你好世界猫語") + ["😀", "🎉", "🦊", "👍🏽"]


def decode(tok, ids: list[int], skip: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE: multi-byte characters split over several tokens unless merged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"]
    )


@pytest.fixture(scope="module")
def llama():
    """A Llama-2 style tokenizer: "▁" word pieces, byte fallback, first leading space stripped."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    raw.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=150, limit_alphabet=40))
    trained = json.loads(raw.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    return LlamaTokenizer(vocab=vocab, merges=merges)


def stream(tok, ids: list[int], **kwargs) -> tuple[list[str], str]:
    """Push ids one by one; return the deltas and the flushed remainder."""
    detok = IncrementalDetokenizer(tok, kwargs.pop("prompt_ids", []), **kwargs)
    deltas = [detok.push(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


# --- D03 (seed 002 §8) -------------------------------------------------------------------


def test_d03_stop_string_spanning_three_chunks_is_cut_without_leaking_a_prefix():
    matcher = StopStringMatcher(["STOP"])
    emitted, stopped = "", False
    for chunk in ["ab", "cS", "TO", "Pxyz"]:
        text, stopped = matcher.push(chunk)
        emitted += text
        assert not emitted.endswith(("S", "ST", "STO"))
    assert (emitted, stopped) == ("abc", True)


def test_d03_without_a_match_flush_recovers_the_full_text():
    matcher = StopStringMatcher(["STOP"])
    emitted = "".join(matcher.push(c)[0] for c in ["ab", "cd", "ef"])
    assert not matcher.matched
    assert emitted + matcher.flush() == "abcdef"
    assert not matcher.matched


def test_d03_through_tokens(bpe):
    ids = bpe.encode("abcSTOPxyz")
    stop_tokens = [i for i in ids if any(c in decode(bpe, [i]) for c in "STOP")]
    assert len(stop_tokens) >= 3  # the stop string really spans several tokens
    out = OutputText(bpe, [], ["STOP"])
    for i in ids:
        delta = out.push(i)
        assert not out.text.endswith(("S", "ST", "STO"))
    assert delta.stopped and out.stopped and out.text == "abc"
    assert out.finished and out.push(ids[0]) == OutputDelta("", True) == out.finish()  # in flight: dropped


def test_output_text_finish_releases_held_text_and_drops_later_tokens(bpe):
    ids = bpe.encode("say ST🦊")
    out = OutputText(bpe, [], ["STOP"])
    streamed = "".join(out.push(i).text for i in ids[:-1])  # the fox's last byte is missing
    assert streamed == "say " and not out.finished
    last = out.finish()
    assert (last.text, last.stopped, out.finished) == ("ST" + REPLACEMENT, False, True)
    assert out.push(ids[-1]) == OutputDelta("", False) and out.text == "say ST" + REPLACEMENT


# --- Incremental detokenization ----------------------------------------------------------


@pytest.mark.parametrize("text", ["a 🦊 b", "你好猫語", "猫語🦊👍🏽", "déjà 🎉👍🏽 vu"])
def test_multibyte_characters_split_over_byte_tokens_are_never_half_emitted(bpe, text):
    ids = bpe.encode(text)
    assert any(REPLACEMENT in decode(bpe, [i]) for i in ids)  # some character spans tokens
    deltas, tail = stream(bpe, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text and tail == ""


def test_each_character_is_emitted_as_soon_as_its_last_byte_arrives(bpe):
    ids = bpe.encode("x😀y")
    deltas, _ = stream(bpe, ids)
    emitted = ""
    for k, delta in enumerate(deltas):
        emitted += delta
        assert emitted == decode(bpe, ids[: k + 1]).rstrip(REPLACEMENT)


def test_llama_leading_spaces_survive_token_boundaries(llama):
    text = "hello world,  the  lazy dog"
    ids = llama.encode(text, add_special_tokens=False)
    deltas, tail = stream(llama, ids)
    assert "".join(deltas) + tail == decode(llama, ids) == text
    assert " world" in deltas or " wor" in deltas  # the space travels with the next word


def test_llama_first_token_space_follows_decode_or_the_prompt(llama):
    prompt = llama.encode("hello there", add_special_tokens=False)
    ids = llama.encode(" the dog", add_special_tokens=False)
    assert llama.convert_ids_to_tokens(ids)[0].startswith("▁")
    deltas, _ = stream(llama, ids, prompt_ids=prompt)
    assert "".join(deltas) == decode(llama, ids) == "the dog"  # default: as decode(output ids)
    deltas, _ = stream(llama, ids, prompt_ids=prompt, continue_prompt=True)
    assert "".join(deltas) == " the dog"  # /v1/completions reading: continues the prompt


def test_llama_byte_fallback_characters(llama):
    text = "hello 你好猫 🦊 dog"
    ids = llama.encode(text, add_special_tokens=False)
    assert "<0xF0>" in llama.convert_ids_to_tokens(ids)
    deltas, tail = stream(llama, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) + tail == text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept_as_decode_does(bpe, llama, skip):
    for tok, special in ((bpe, "<|im_end|>"), (llama, "</s>")):
        sid = tok.convert_tokens_to_ids(special)
        words = tok.encode("hello 😀 world", add_special_tokens=False)
        ids = [sid] + words[:2] + [sid, sid] + words[2:] + [sid]
        deltas, tail = stream(tok, ids, skip_special_tokens=skip)
        text = "".join(deltas) + tail
        assert text == decode(tok, ids, skip)
        assert (special in text) is not skip


def test_unfinished_character_at_the_end_is_released_by_flush(bpe):
    ids = bpe.encode("ok 🦊")
    deltas, tail = stream(bpe, ids[:-1])
    assert REPLACEMENT not in "".join(deltas) and tail.endswith(REPLACEMENT)
    assert "".join(deltas) + tail == decode(bpe, ids[:-1])


def test_negative_token_id_is_rejected(bpe):
    with pytest.raises(ValueError, match="token_id"):
        IncrementalDetokenizer(bpe, []).push(-1)


# --- Stop strings ------------------------------------------------------------------------


def run_matcher(stops: list[str], chunks: list[str]) -> tuple[str, bool, list[str]]:
    matcher = StopStringMatcher(stops)
    emitted = []
    for chunk in chunks:
        text, stopped = matcher.push(chunk)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True, emitted
    emitted.append(matcher.flush())
    return "".join(emitted), matcher.matched, emitted


def test_stop_at_the_very_start():
    assert StopStringMatcher(["STOP"]).push("STOP and more") == ("", True)
    assert run_matcher(["STOP"], list("STOP!")) == ("", True, ["", "", "", ""])


def test_match_inside_a_single_delta():
    assert StopStringMatcher(["STOP", "x"]).push("hello STOP world x") == ("hello ", True)


@pytest.mark.parametrize(
    ("stops", "text", "expected"),
    [
        (["ab", "abc"], "xabcd", "x"),
        (["abc", "ab"], "xabcd", "x"),
        (["aab"], "aaab", "a"),
        (["abc", "b"], "abd", "a"),  # "b" completes first but must wait for "abc" to fail
        (["abc", "b"], "abc", ""),  # ... which would have started earlier
        (["\n\n", "END", "###"], "one\ntwo ### END\n\n", "one\ntwo "),
        (["END", "###"], "no stop here #", "no stop here #"),
    ],
)
def test_overlapping_and_several_stops_match_the_reference(stops, text, expected):
    for chunks in (list(text), [text], [text[:2], text[2:]]):
        out, stopped, _ = run_matcher(stops, chunks)
        assert (out, stopped) == reference_stop(text, stops) == (expected, expected != text)


def test_prefix_is_held_only_while_it_can_still_become_a_stop():
    matcher = StopStringMatcher(["aab"])
    assert [matcher.push(c)[0] for c in "aaa"] == ["", "", "a"]
    assert matcher.push("c") == ("aac", False)


def test_a_stop_waiting_on_a_longer_one_matches_at_flush():
    matcher = StopStringMatcher(["abc", "b"])
    assert matcher.push("xab") == ("x", False)
    assert matcher.flush() == "a" and matcher.matched


@pytest.mark.parametrize("stops", [["ok", ""], "STOP", [None]])
def test_bad_stops_are_rejected(stops):
    with pytest.raises(ValueError, match="stops"):
        StopStringMatcher(stops)


def test_no_stops_passes_text_through():
    assert StopStringMatcher([]).push("anything") == ("anything", False)


# --- Randomized: reference equivalence on the full decoded text --------------------------


def test_random_matcher_against_reference():
    rng = random.Random(2)
    for _ in range(2000):  # a tiny alphabet makes overlapping stops common
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        out, stopped, emitted = run_matcher(stops, chunks)
        assert (out, stopped) == reference_stop(text, stops), (text, stops, chunks)


@pytest.mark.parametrize("name", ["bpe", "llama"])
def test_random_text_streams_to_decode_and_cuts_at_the_reference_stop(request, name):
    tok = request.getfixturevalue(name)
    rng = random.Random(7)
    for _ in range(150):
        ids = tok.encode(random_text(rng, rng.randint(1, 30)), add_special_tokens=False)
        full = decode(tok, ids)
        deltas, tail = stream(tok, ids)
        assert "".join(deltas) + tail == full
        assert all(REPLACEMENT not in d for d in deltas) and tail == ""
        stops = [random_text(rng, rng.randint(1, 3)) for _ in range(rng.randint(0, 2))]
        if full:
            start = rng.randrange(len(full))
            stops.append(full[start : start + rng.randint(1, 4)])
        out = OutputText(tok, [], stops)
        streamed = "".join(out.push(i).text for i in ids) + out.finish().text
        assert (streamed, out.stopped) == reference_stop(full, stops) and out.text == streamed


def test_random_ids_even_invalid_utf8_stream_to_decode(bpe):
    rng = random.Random(3)
    for _ in range(300):
        ids = [rng.randrange(len(bpe)) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            deltas, tail = stream(bpe, ids, skip_special_tokens=skip)
            assert "".join(deltas) + tail == decode(bpe, ids, skip)


@pytest.mark.parametrize("name", ["bpe", "llama"])
def test_tokens_pushed_in_groups_give_the_text_of_one_by_one(request, name):
    """A coalesced delta's tokens (LLMConfig.stream_interval) go in together: the joined text is the same, a group
    never ends in half a character, and a stop string cuts where it does token by token."""
    tok = request.getfixturevalue(name)
    rng = random.Random(11)
    for _ in range(100):
        ids = tok.encode(random_text(rng, rng.randint(1, 30)), add_special_tokens=False)
        cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randint(0, 4)))) if len(ids) > 1 else []
        groups = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        detok = IncrementalDetokenizer(tok, [])
        deltas = [detok.push_ids(group) for group in groups]
        assert "".join(deltas) + detok.flush() == decode(tok, ids) and all(REPLACEMENT not in d for d in deltas)
        stops = [random_text(rng, rng.randint(1, 3))]
        one, grouped = OutputText(tok, [], stops), OutputText(tok, [], stops)
        want = "".join(one.push(i).text for i in ids) + one.finish().text
        got = "".join(grouped.push_ids(group).text for group in groups) + grouped.finish().text
        assert (got, grouped.stopped) == (want, one.stopped)
