"""The embeddings' truncation rule as the README states it, on a tiny seeded BERT with sentence-transformers files.

The limit is the lower of `sentence_bert_config.json`'s max_seq_length and the model's own (the tokenizer's
model_max_length, or max_position_embeddings when the tokenizer sets none), special tokens included. A longer
input keeps its special tokens and loses its end; token-id inputs get the same special tokens and the same cut.
`usage.prompt_tokens` counts what the model read.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.config import EngineConfig, ModelSpec
from pipelines.engine import Engine
from tests.test_embeddings import VOCAB, embed, tiny_sentence_model

WORDS = ["the", "cat", "sat", "on", "the", "mat"] * 20  # 120 whole-word tokens of VOCAB


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """max_seq_length 8 (below the model's 64 positions) and 1000 (above them)."""
    root = tmp_path_factory.mktemp("bert")
    specs = (ModelSpec("short", str(tiny_sentence_model(root / "a", pooling="mean", max_seq_length=8))),
             ModelSpec("long", str(tiny_sentence_model(root / "b", pooling="mean", max_seq_length=1000))))
    eng = Engine(EngineConfig(models=specs))
    eng.start()
    yield eng
    eng.shutdown()


def ids_of(words: list[str]) -> list[int]:
    return [VOCAB.index(w) for w in words]


def test_a_long_text_loses_its_end_and_keeps_its_special_tokens(engines):
    out = embed(engines, "short", [" ".join(WORDS)])
    assert out["prompt_tokens"] == 8  # [CLS] + 6 words + [SEP]
    cut = embed(engines, "short", [" ".join(WORDS[:6])])  # the same text, its end cut by hand
    assert cut["prompt_tokens"] == 8
    np.testing.assert_allclose(out["embeddings"], cut["embeddings"], atol=1e-6)
    other = embed(engines, "short", [" ".join(WORDS[1:7])])  # a cut elsewhere gives another vector
    assert not np.allclose(out["embeddings"], other["embeddings"])


def test_token_ids_get_the_special_tokens_and_the_same_cut(engines):
    ids = ids_of(WORDS)
    out = embed(engines, "short", [ids])
    assert out["prompt_tokens"] == 8
    np.testing.assert_allclose(out["embeddings"], embed(engines, "short", [ids[:6]])["embeddings"], atol=1e-6)
    np.testing.assert_allclose(out["embeddings"], embed(engines, "short", [" ".join(WORDS)])["embeddings"], atol=1e-6)


def test_the_model_limit_wins_over_a_larger_max_seq_length(engines):
    out = embed(engines, "long", [" ".join(WORDS)])
    assert out["prompt_tokens"] == 64  # max_position_embeddings: 62 words + [CLS] + [SEP]
    np.testing.assert_allclose(out["embeddings"], embed(engines, "long", [ids_of(WORDS[:62])])["embeddings"], atol=1e-6)
