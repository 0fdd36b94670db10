"""Audio chat on the engine: a tiny random Qwen2-Audio (the demo's: a 10 s encoder window) answering questions about
clips of real speech (espeak-ng). Greedy answers equal transformers generate() on the processor's inputs, token for
token, alone and batched; a second question about the same clip is answered from the encoder-output cache; bad
audio is refused naming the field before any model work."""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch

from pipelines.chat import ChatRequest
from pipelines.image_request import RequestError
from stages.events import StageError
from stages.llm.params import SamplingParams
from tests.helpers import demo_path, vlm_engine_fixture, wav_bytes

ESPEAK = shutil.which("espeak-ng")
needs_espeak = pytest.mark.skipif(ESPEAK is None, reason="needs espeak-ng (make test installs it)")
SENTENCES = ("The cat sat on the mat.", "Please open the green door.", "It rained all night long.")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def speech(text: str, tmp_path) -> bytes:
    path = tmp_path / f"{abs(hash(text))}.wav"
    subprocess.run([ESPEAK, "-v", "en-us", "-s", "160", "-w", str(path), text], check=True, capture_output=True)
    return path.read_bytes()


def message(data: bytes, question: str, fmt: str = "wav") -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}},
        {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return demo_path(tmp_path_factory, "qwen2_audio")


engine = vlm_engine_fixture()


@pytest.fixture(scope="module")
def reference(path):
    """generate() on the processor's inputs (the clip resampled to 16 kHz as the media workers do)."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from stages.media.audio import decode_audio

    model = Qwen2AudioForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)

    def answer(data: bytes, question: str) -> list[int]:
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "audio"}, {"type": "text",
                                                                                              "text": question}]}],
                                             add_generation_prompt=True, tokenize=False)
        clip = np.array(decode_audio(data, sample_rate=16000).samples)
        inputs = processor(text=text, audio=[clip], sampling_rate=16000, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)
        return out[0, inputs["input_ids"].shape[1]:].tolist()
    return answer


def ask(engine, messages, params=GREEDY):
    async def submit():
        return await engine.asubmit_chat("m", ChatRequest(messages=messages, params=params))
    return asyncio.run(submit())


def tokens(result) -> list[int]:
    return result["choices"][0]["token_ids"]


def encoder_hits(engine) -> float:
    return engine.metrics.registry.get_sample_value("mmserve_cache_hits_total", {"cache": "encoder_output"}) or 0.0


@needs_espeak
def test_answers_equal_generate_alone_and_batched(engine, reference, tmp_path):
    clips = [speech(s, tmp_path) for s in SENTENCES]
    questions = ("what was said?", "who is speaking?", "repeat it")
    want = [reference(c, q) for c, q in zip(clips, questions)]
    assert tokens(ask(engine, message(clips[0], questions[0])).result(timeout=60)) == want[0]
    handles = [ask(engine, message(c, q)) for c, q in zip(clips[1:], questions[1:])]  # together: one batch
    handles.append(ask(engine, message(clips[0], questions[0], "wav")))
    got = [tokens(h.result(timeout=60)) for h in handles]
    assert got == [want[1], want[2], want[0]]
    assert engine.metrics.stage.max_batch_size("m/llm", "m") >= 2
    assert engine.metrics.stage.max_batch_size("m/audio_encode", "m") >= 1


@needs_espeak
def test_a_second_question_about_a_clip_hits_the_encoder_cache(engine, reference, tmp_path):
    clip = speech("Turn left at the next corner.", tmp_path)
    first = tokens(ask(engine, message(clip, "where to?")).result(timeout=60))
    before = encoder_hits(engine)
    second = tokens(ask(engine, message(clip, "say it again")).result(timeout=60))
    assert encoder_hits(engine) == before + 1
    assert first == reference(clip, "where to?") and second == reference(clip, "say it again")


def test_audio_url_and_an_mp3_clip(engine, reference):
    from stages.media.audio_encode import encode_audio

    samples = 0.3 * np.sin(2 * np.pi * 330 * np.arange(24000) / 16000)
    mp3 = encode_audio(samples.astype(np.float32), 16000, "mp3")
    got = tokens(ask(engine, message(mp3, "what is it?", "mp3")).result(timeout=60))
    assert got == reference(mp3, "what is it?")
    url = {"type": "audio_url", "audio_url": {"url": "data:audio/mpeg;base64," + base64.b64encode(mp3).decode()}}
    by_url = ask(engine, [{"role": "user", "content": [url, {"type": "text", "text": "what is it?"}]}])
    assert tokens(by_url.result(timeout=60)) == got


@pytest.mark.parametrize("part, param, words", [
    ({"data": "AAAA", "format": "flac"}, "messages[0].content[0].input_audio.format", "must be one of ['wav', 'mp3']"),
    ({"data": "", "format": "wav"}, "messages[0].content[0].input_audio.data", "non-empty base64"),
    ({"data": "AAAA", "format": "wav", "rate": 1}, "messages[0].content[0].input_audio", "unknown field"),
])
def test_malformed_parts_are_refused_before_any_work(engine, part, param, words):
    with pytest.raises(RequestError) as info:
        ask(engine, [{"role": "user", "content": [{"type": "input_audio", "input_audio": part}]}])
    assert info.value.param == param and words in str(info.value), info.value


@pytest.mark.parametrize("data, fmt, code, words", [
    (wav_bytes(0.1 * np.ones(11 * 16000)), "wav", "media_duration", "10"),  # past the encoder's 10 s window
    (b"this is not audio at all, just text" * 20, "wav", None, ""),
    (wav_bytes(0.1 * np.ones(16000)), "mp3", "media_format", "wav"),  # a WAV that says it is an MP3
])
def test_bad_audio_is_refused_naming_the_field(engine, data, fmt, code, words):
    before = engine.metrics.stage.max_batch_size("m/audio_encode", "m")
    with pytest.raises((RequestError, StageError)) as info:
        ask(engine, message(data, "what?", fmt))
    error = info.value
    assert error.param == "messages[0].content[0].input_audio.data", error
    assert code is None or error.code == code, error
    assert words in str(error)
    deadline = time.monotonic() + 10  # the failed run's last node lets go on the executor's thread
    while not engine.executor.idle():
        assert time.monotonic() < deadline, "the refused request left work behind"
        time.sleep(0.01)
    assert engine.metrics.stage.max_batch_size("m/audio_encode", "m") == before  # nothing reached the encoder


def test_text_parts_still_work_and_the_model_lists_audio_chat(engine):
    reply = ask(engine, [{"role": "user", "content": "hello"}]).result(timeout=60)
    assert len(tokens(reply)) == 8
    assert engine.models["m"].tasks == ("chat", "audio-chat")
