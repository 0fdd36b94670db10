"""Demo checkpoints: built offline, reloaded with the real `from_pretrained`, seeded runs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from diffusers import FluxPipeline, StableDiffusion3Pipeline, StableDiffusionPipeline, StableDiffusionXLPipeline

from pipelines import demo
from pipelines.demo import FAMILIES, build_demo_model
from tests.helpers import seeded

PIPELINES = {
    "sd": StableDiffusionPipeline,
    "sdxl": StableDiffusionXLPipeline,
    "sd3": StableDiffusion3Pipeline,
    "flux": FluxPipeline,
}
DEFAULT_SIZE = {"sd": 64, "sdxl": 64, "sd3": 64, "flux": 512}  # px, square; see pipelines/demo/__init__.py
# SD3 without T5: these two are not optional components, so from_pretrained needs them named.
LOAD_KWARGS = {"sd3": {"text_encoder_3": None, "tokenizer_3": None}}
# diffusers' EulerDiscreteScheduler.set_timesteps calls np.array on a torch tensor (numpy 2 deprecation).
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword"
                                        ":DeprecationWarning")


def _load(family, path):
    pipe = PIPELINES[family].from_pretrained(path, **LOAD_KWARGS.get(family, {}))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("family", FAMILIES)
def test_builds_reloads_and_generates_deterministically(family, tmp_path):
    path = build_demo_model(family, tmp_path / family)
    pipe = _load(family, path)

    def generate(seed):
        (image,) = pipe("a red cube on a table", num_inference_steps=2, generator=seeded(seed)).images
        return image

    first, again, other = generate(0), generate(0), generate(1)
    size = DEFAULT_SIZE[family]
    assert first.size == (size, size)
    assert np.array_equal(np.asarray(first), np.asarray(again))
    assert not np.array_equal(np.asarray(first), np.asarray(other))


def test_same_seed_gives_identical_weights_and_other_seed_differs(tmp_path):
    a = build_demo_model("sd", tmp_path / "a", seed=0)
    b = build_demo_model("sd", tmp_path / "b", seed=0)
    c = build_demo_model("sd", tmp_path / "c", seed=1)
    weights = "unet/diffusion_pytorch_model.safetensors"
    assert (a / weights).read_bytes() == (b / weights).read_bytes()
    assert (a / weights).read_bytes() != (c / weights).read_bytes()


def test_tokenizers_reload_offline_and_encode_the_same(tmp_path):
    from transformers import AutoTokenizer

    path = build_demo_model("flux", tmp_path / "flux")
    pipe = _load("flux", path)
    text = "Ünïcode, emoji 🐱 and   spaces!"
    for name, fresh in (("tokenizer", demo._clip_tokenizer()), ("tokenizer_2", demo._t5_tokenizer())):
        reloaded = AutoTokenizer.from_pretrained(path / name)
        assert reloaded(text).input_ids == fresh(text).input_ids == getattr(pipe, name)(text).input_ids
    clip_ids = pipe.tokenizer(text).input_ids
    assert pipe.tokenizer.unk_token_id not in clip_ids[1:-1]  # byte-level: every character encodes


def test_build_is_idempotent_and_rebuilds_on_another_seed(tmp_path):
    path = build_demo_model("sd3", tmp_path / "sd3")
    weights = path / "transformer" / "diffusion_pytorch_model.safetensors"
    before = weights.stat()
    assert build_demo_model("sd3", path) == path
    assert weights.stat().st_ino == before.st_ino and weights.stat().st_mtime_ns == before.st_mtime_ns
    build_demo_model("sd3", path, seed=1)
    assert weights.read_bytes() != (build_demo_model("sd3", tmp_path / "fresh")
                                    / weights.relative_to(path)).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "sd3"]  # no temporary or stale dirs left


def test_concurrent_builders_agree_and_leave_no_temporaries(tmp_path):
    out, errors, results = tmp_path / "sdxl", [], []

    def build():
        try:
            results.append(build_demo_model("sdxl", out))
        except Exception as exc:  # reported below; a thread swallows exceptions otherwise
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and results == [out] * 3
    assert [p.name for p in tmp_path.iterdir()] == ["sdxl"]
    _load("sdxl", out)


def test_losing_a_race_keeps_the_winners_files(tmp_path, monkeypatch):
    out = build_demo_model("sd", tmp_path / "sd")
    winner = (out / "model_index.json").stat().st_ino
    real_is_built = demo._is_built
    calls = []

    def not_yet_then_real(path, stamp):  # the first check runs before the "other process" finished
        calls.append(path)
        return False if len(calls) == 1 else real_is_built(path, stamp)

    monkeypatch.setattr(demo, "_is_built", not_yet_then_real)
    assert build_demo_model("sd", out) == out
    assert (out / "model_index.json").stat().st_ino == winner
    assert [p.name for p in tmp_path.iterdir()] == ["sd"]


def test_refuses_to_replace_a_directory_it_did_not_build(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "model_index.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not an mmserve demo checkpoint"):
        build_demo_model("sd", tmp_path / "mine")
    assert (tmp_path / "mine" / "model_index.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


@pytest.mark.parametrize(("family", "scale"), [("nope", "tiny"), ("sd", "huge"), ("flux", "small")])
def test_rejects_unknown_family_or_scale(family, scale, tmp_path):
    with pytest.raises(ValueError, match="must be one of"):
        build_demo_model(family, tmp_path / "x", scale=scale)
