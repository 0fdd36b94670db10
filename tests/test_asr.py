"""The asr stage with tiny random Whisper checkpoints: tokens equal generate(), batching, windows, streams,
conversion."""

from __future__ import annotations

import asyncio
import json
import struct

import numpy as np
import pytest
import torch

from pipelines.asr import AsrConfig, TranscriptionRequest, cut_windows
from pipelines.asr_incremental import IncrementalTranscriber
from pipelines.config import EngineConfig, ModelSpec
from pipelines.demo import build_demo_model
from pipelines.engine import Engine
from pipelines.image_request import RequestError
from serve.errors import http_status
from stages.pool import PoolConfig
from stages.speech.asr_transcript import TranscriptStream, window_spans

MAX_NEW_TOKENS = 12  # random weights never end a window: keep the loops short
RATE = 16000


def noise(seconds: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * 0.1).astype(np.float32)


@pytest.fixture(scope="module")
def whisper_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("whisper")
    return {name: build_demo_model(name, root / name) for name in ("whisper", "whisper-en")}


@pytest.fixture(scope="module")
def engine(whisper_paths):
    # A 300 ms batching window, so that requests submitted together surely share a batch.
    pool = {"asr": PoolConfig(max_batch_size=8, max_delay_ms=300.0)}
    asr = AsrConfig(max_new_tokens=MAX_NEW_TOKENS, max_windows=8)
    engine = Engine(EngineConfig(models=(
        ModelSpec("tiny", str(whisper_paths["whisper"]), pools=pool, asr=asr),
        ModelSpec("tiny-en", str(whisper_paths["whisper-en"]), pools=pool, asr=asr))))
    engine.start()
    yield engine
    engine.shutdown()


def reference_tokens(engine, model: str, audio: np.ndarray, *, timestamps: bool, task: str | None = None,
                     language: str | None = None, prompt: str | None = None) -> list[int]:
    """What WhisperForConditionalGeneration.generate() makes for one window (one decode: no re-seek)."""
    asr = engine.transcription_model(model)
    whisper, processor = asr.stage.whisper, asr.processor
    features = processor(audio, sampling_rate=RATE, return_tensors="pt").input_features
    kwargs = {"task": task, "language": language} if not asr.english_only else {}
    if prompt:
        kwargs["prompt_ids"] = torch.tensor(processor.tokenizer.get_prompt_ids(prompt))
    out = whisper.generate(features, max_new_tokens=MAX_NEW_TOKENS, return_timestamps=timestamps,
                           force_unique_generate_call=True, return_dict_in_generate=True, **kwargs)
    sequence = out.sequences[0].tolist()
    # <|startoftranscript|> [<|lang|> <|task|>] [<|notimestamps|>], after the prompt if any
    prefix = (1 if asr.english_only else 3) + (0 if timestamps else 1)
    prompt_len = len(kwargs["prompt_ids"]) if prompt else 0
    return sequence[prompt_len + prefix:]


def run(engine, model: str, audio: np.ndarray, **kwargs) -> dict:
    return engine.submit_transcription(model, TranscriptionRequest(audio, **kwargs)).result(timeout=120)


@pytest.mark.parametrize("timestamps", [False, True])
@pytest.mark.parametrize("model, task, language, prompt", [
    ("tiny", "transcribe", "de", None),
    ("tiny", "translate", "fr", None),
    ("tiny", "transcribe", None, None),  # language detected from the audio, as generate() does
    ("tiny-en", "transcribe", None, None),
    ("tiny-en", "transcribe", None, "Hello there"),
])
def test_tokens_equal_generate(engine, model, task, language, prompt, timestamps):
    audio = noise(5.0, seed=1)
    out = run(engine, model, audio, task=task, language=language, prompt=prompt, timestamps=timestamps)
    [window] = out["windows"]
    expected = reference_tokens(engine, model, audio, timestamps=timestamps, task=task, language=language,
                                prompt=prompt)
    assert list(window.tokens) == expected
    assert len(window.logprobs) == len(window.tokens)


def test_three_requests_batch_together_without_changing_results(engine):
    audios = [noise(4.0, seed=2), noise(45.0, seed=3), noise(9.0, seed=4)]  # the second has two windows
    solo = [run(engine, "tiny-en", a, timestamps=True)["windows"] for a in audios]
    stage = engine.transcription_model("tiny-en").stage
    sizes, original = [], stage.run_batch

    def recording(items):
        sizes.append(len(items))
        return original(items)

    stage.run_batch = recording
    try:
        handles = [engine.submit_transcription("tiny-en", TranscriptionRequest(a, timestamps=True)) for a in audios]
        together = [h.result(timeout=120)["windows"] for h in handles]
    finally:
        del stage.run_batch
    assert sizes == [3]  # one call: 4 windows in one encoder forward and one token loop
    assert [[w.tokens for w in ws] for ws in together] == [[w.tokens for w in ws] for ws in solo]


def test_long_audio_is_windowed_with_monotonic_times(engine):
    # 75 s of noise with a quiet 0.4 s gap near 27 s and another near 54 s: the cuts go there.
    audio = noise(75.0, seed=5)
    for gap in (27.0, 54.0):
        audio[int(gap * RATE):int((gap + 0.4) * RATE)] *= 0.001
    spans = cut_windows(audio)
    assert len(spans) == 3 and spans[0][0] == 0 and spans[-1][1] == len(audio)
    assert all(b - a <= 30 * RATE for a, b in spans) and all(spans[k][1] == spans[k + 1][0] for k in range(2))
    assert 27.0 <= spans[0][1] / RATE <= 27.4 and 54.0 <= spans[1][1] / RATE <= 54.4
    out = run(engine, "tiny-en", audio, timestamps=True)
    assert len(out["windows"]) == 3 and out["duration"] == pytest.approx(75.0)
    times = [t for s in out["segments"] for t in (s.start, s.end)]
    assert times == sorted(times) and all(0 <= t <= 75.0 for t in times)


def test_window_spans_follow_timestamp_pairs():
    begin, eot = 100, 99
    # <|0.00|> a b <|1.00|><|1.00|> c <|2.00|> d <|3.00|> <eot>
    tokens = (begin, 1, 2, begin + 50, begin + 50, 3, begin + 100, 4, begin + 150, eot)
    assert window_spans(tokens, begin, eot) == [(0.0, 1.0, [1, 2]), (1.0, 2.0, [5]), (2.0, 3.0, [7])]
    assert window_spans((begin, 1, 2), begin, eot) == [(0.0, None, [1, 2])]  # unclosed: to the window's end


def test_stream_deltas_concatenate_to_the_text(engine):
    tokenizer = engine.transcription_model("tiny-en").processor.tokenizer
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_of = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    windows = [tokenizer(" Grüße, café ", add_special_tokens=False).input_ids,
               tokenizer(" naïve über", add_special_tokens=False).input_ids]
    deltas: list[str] = []
    stream = TranscriptStream(2, text_of, eot, deltas.append)
    for token in windows[1]:  # the second window decodes first: held back until the first finishes
        stream.add(1, token)
    assert deltas == []
    for token in windows[0]:
        stream.add(0, token)
    assert all("\ufffd" not in d for d in deltas)  # a multi-byte character is never split across deltas
    stream.add(0, eot)
    stream.finish(1)
    assert "".join(deltas) == "Grüße, café  naïve über"


def test_streamed_request_emits_deltas_then_the_final_text(engine):
    handle = engine.submit_transcription("tiny-en", TranscriptionRequest(noise(3.0, seed=6), stream=True))
    events = list(handle.events(timeout=60))
    deltas = [e.data["text"] for e in events if e.kind.value == "delta"]
    assert events[-1].kind.value == "final"
    assert "".join(deltas) == events[-1].data["outputs"]["text"]


def test_request_checks_name_the_field(engine):
    en, multi = engine.transcription_model("tiny-en"), engine.transcription_model("tiny")
    audio = np.zeros(RATE, np.float32)
    assert en.check(TranscriptionRequest(audio, language="English"))[0] is None  # English-only: no language token
    for model, kwargs, param in [(en, {"language": "de"}, "language"), (en, {"task": "translate"}, "model"),
                                 (multi, {"language": "xx"}, "language"), (multi, {"temperature": 1.5}, "temperature"),
                                 (multi, {"prompt": "<|endoftext|>"}, "prompt")]:
        with pytest.raises(RequestError) as e:
            model.check(TranscriptionRequest(audio, **kwargs))
        assert e.value.param == param and http_status(e.value) == 400
    assert multi.check(TranscriptionRequest(audio, language="german"))[0] == "de"
    assert engine.models["tiny-en"].tasks == ("speech-to-text",)
    assert engine.models["tiny"].tasks == ("speech-to-text", "translations")


def test_incremental_transcriber_gives_partials_and_a_final(engine):
    async def session():
        asr = IncrementalTranscriber(engine, "tiny-en", partial_every_s=1.0, max_utterance_s=3.0)
        audio = noise(4.0, seed=7)
        hypotheses = []
        for start in range(0, len(audio), RATE // 2):  # 0.5 s chunks
            hypotheses += await asr.feed(audio[start:start + RATE // 2])
        hypotheses.append(await asr.endpoint())
        return hypotheses

    hypotheses = asyncio.run(session())
    finals = [h for h in hypotheses if h.final]
    assert [h.audio_s for h in hypotheses if not h.final] == [1.0, 2.0, 1.0]  # the first utterance ends at 3 s
    assert [(h.start_s, h.audio_s) for h in finals] == [(0.0, 3.0), (3.0, 1.0)]
    # a final hypothesis is the transcript of its audio
    first = run(engine, "tiny-en", noise(4.0, seed=7)[:3 * RATE])
    assert finals[0].text == first["text"]


def test_cancelled_request_leaves_the_loop(engine):
    handle = engine.submit_transcription("tiny", TranscriptionRequest(noise(60.0, seed=8)))
    handle.cancel()
    with pytest.raises(Exception) as e:
        handle.result(timeout=60)
    assert getattr(e.value, "code", None) == "cancelled"


# -- the CTranslate2 converter, on a tiny checkpoint written in CTranslate2's format ------------------------

def _ct2_bytes(variables: dict[str, np.ndarray], aliases: dict[str, str]) -> bytes:
    def string(s: str) -> bytes:
        data = s.encode() + b"\0"
        return struct.pack("<H", len(data)) + data

    ids = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.float16): 4}
    out = [struct.pack("<I", 6), string("WhisperSpec"), struct.pack("<I", 3), struct.pack("<I", len(variables))]
    for name, value in variables.items():
        out += [string(name), struct.pack("<B", value.ndim), *(struct.pack("<I", d) for d in value.shape),
                struct.pack("<B", ids[value.dtype]), struct.pack("<I", value.nbytes), value.tobytes()]
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        out += [string(alias), string(target)]
    return b"".join(out)


def _to_ct2(model) -> dict[str, np.ndarray]:
    """A transformers Whisper's weights in CTranslate2's layout (fused q/k/v, k without bias), float16."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    f16 = lambda a: np.ascontiguousarray(a, dtype=np.float16)  # noqa: E731
    v = {"encoder/num_heads": np.array(model.config.encoder_attention_heads, np.int16),
         "decoder/num_heads": np.array(model.config.decoder_attention_heads, np.int16),
         "encoder/position_encodings/encodings": f16(sd["model.encoder.embed_positions.weight"]),
         "decoder/position_encodings/encodings": f16(sd["model.decoder.embed_positions.weight"]),
         "decoder/embeddings/weight": f16(sd["model.decoder.embed_tokens.weight"])}
    for side in ("encoder", "decoder"):
        v[f"{side}/layer_norm/gamma"] = f16(sd[f"model.{side}.layer_norm.weight"])
        v[f"{side}/layer_norm/beta"] = f16(sd[f"model.{side}.layer_norm.bias"])
    for conv in ("conv1", "conv2"):
        v[f"encoder/{conv}/weight"] = f16(sd[f"model.encoder.{conv}.weight"])
        v[f"encoder/{conv}/bias"] = f16(sd[f"model.encoder.{conv}.bias"])

    def attention(src, dst, cross):
        q, k, w = (sd[f"{src}.{p}_proj.weight"] for p in "qkv")
        zeros = np.zeros_like(sd[f"{src}.q_proj.bias"])
        if cross:
            v[f"{dst}/linear_0/weight"], v[f"{dst}/linear_0/bias"] = f16(q), f16(sd[f"{src}.q_proj.bias"])
            v[f"{dst}/linear_1/weight"] = f16(np.concatenate([k, w]))
            v[f"{dst}/linear_1/bias"] = f16(np.concatenate([zeros, sd[f"{src}.v_proj.bias"]]))
            out = f"{dst}/linear_2"
        else:
            v[f"{dst}/linear_0/weight"] = f16(np.concatenate([q, k, w]))
            v[f"{dst}/linear_0/bias"] = f16(np.concatenate([sd[f"{src}.q_proj.bias"], zeros, sd[f"{src}.v_proj.bias"]]))
            out = f"{dst}/linear_1"
        v[f"{out}/weight"], v[f"{out}/bias"] = f16(sd[f"{src}.out_proj.weight"]), f16(sd[f"{src}.out_proj.bias"])

    def norm(src, dst):
        v[f"{dst}/gamma"], v[f"{dst}/beta"] = f16(sd[f"{src}.weight"]), f16(sd[f"{src}.bias"])

    for side, n in (("encoder", model.config.encoder_layers), ("decoder", model.config.decoder_layers)):
        for i in range(n):
            src, dst = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            attention(f"{src}.self_attn", f"{dst}/self_attention", False)
            norm(f"{src}.self_attn_layer_norm", f"{dst}/self_attention/layer_norm")
            if side == "decoder":
                attention(f"{src}.encoder_attn", f"{dst}/attention", True)
                norm(f"{src}.encoder_attn_layer_norm", f"{dst}/attention/layer_norm")
            for j, fc in ((0, "fc1"), (1, "fc2")):
                v[f"{dst}/ffn/linear_{j}/weight"] = f16(sd[f"{src}.{fc}.weight"])
                v[f"{dst}/ffn/linear_{j}/bias"] = f16(sd[f"{src}.{fc}.bias"])
            norm(f"{src}.final_layer_norm", f"{dst}/ffn/layer_norm")
    return v


def test_ct2_conversion_round_trips(engine, tmp_path):
    from transformers import WhisperForConditionalGeneration

    from pipelines.convert_whisper import convert_whisper_ct2
    from serve.cli import main

    asr = engine.transcription_model("tiny-en")
    model, tokenizer = asr.stage.whisper, asr.processor.tokenizer
    src = tmp_path / "ct2"
    src.mkdir()
    (src / "model.bin").write_bytes(_ct2_bytes(_to_ct2(model),
                                               {"decoder/projection/weight": "decoder/embeddings/weight"}))
    g = model.generation_config
    (src / "config.json").write_text(json.dumps({"suppress_ids": g.suppress_tokens,
                                                 "suppress_ids_begin": g.begin_suppress_tokens, "alignment_heads": []}))
    # CTranslate2 ships the tokenizer without the timestamp tokens: the converter adds them back
    tokenizer.save_pretrained(tmp_path / "hf-tokenizer")
    data = json.loads((tmp_path / "hf-tokenizer" / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["special"]]
    (src / "tokenizer.json").write_text(json.dumps(data))

    assert main(["convert", "whisper-ct2", str(src), str(tmp_path / "out")]) == 0
    converted = WhisperForConditionalGeneration.from_pretrained(tmp_path / "out")
    for name, tensor in model.state_dict().items():
        expected = tensor.to(torch.float16).to(torch.float32)  # CTranslate2 held it in float16
        assert torch.equal(converted.state_dict()[name], expected), name
    assert converted.generation_config.no_timestamps_token_id == g.no_timestamps_token_id
    assert converted.generation_config.is_multilingual is False
    with pytest.raises(ValueError, match="model.bin is missing"):
        convert_whisper_ct2(tmp_path, tmp_path / "nowhere")


def test_sampling_at_a_temperature_runs_and_reports_it(engine):
    out = run(engine, "tiny", noise(3.0, seed=9), language="en", temperature=0.7, timestamps=True)
    [window] = out["windows"]
    assert 0 < len(window.tokens) <= MAX_NEW_TOKENS and all(np.isfinite(window.logprobs))
    assert all(s.temperature == 0.7 for s in out["segments"])
