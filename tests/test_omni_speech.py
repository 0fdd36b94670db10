"""Qwen2.5-Omni speaking its reply: thinker (the llm stage, keeping its hidden states) -> talker -> token2wav, on
the demo checkpoint (random weights, real code path). For the same seed the text and the waveform equal
transformers' `Qwen2_5OmniForConditionalGeneration.generate()` after `torch.manual_seed(seed)` (measured equal
bit for bit; checked at 1e-5), alone, with audio and image input, and batched with other requests."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import torch

from pipelines.chat import ChatRequest
from pipelines.image_request import RequestError
from pipelines.omni import SAMPLE_RATE, SpeechOutput
from stages.llm.params import SamplingParams
from tests.helpers import demo_path, running_engine, vlm_engine_fixture, wav_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return demo_path(tmp_path_factory, "qwen2_5_omni")


engine = vlm_engine_fixture()


@pytest.fixture(scope="module")
def reference(path):
    """transformers' generate() with audio out: (reply token ids, waveform) for messages in its processor's form."""
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    from pipelines.demo.omni import TALKER_EOS

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)

    def speak(messages, seed: int, voice: str = "Chelsie") -> tuple[list[int], torch.Tensor]:
        inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                               return_tensors="pt")
        torch.manual_seed(seed)
        ids, wav = model.generate(**inputs, speaker=voice, thinker_max_new_tokens=12, talker_eos_token_id=TALKER_EOS,
                                  talker_pixel_values=None)
        return ids[0, inputs["input_ids"].shape[1]:].tolist(), wav
    return speak


def submit(engine, messages, speech: SpeechOutput | None, params: SamplingParams = GREEDY):
    async def go():
        return await engine.asubmit_chat("m", ChatRequest(messages=messages, params=params, speech=speech))
    return asyncio.run(go())


def assert_same_speech(result, want: tuple[list[int], torch.Tensor]) -> None:
    ids, wav = want
    assert result["choices"][0]["token_ids"] == ids
    assert "hidden" not in result["choices"][0]  # the thinker's states stay inside the graph
    assert result["sample_rate"] == SAMPLE_RATE and result["audio"].shape == wav.shape
    torch.testing.assert_close(result["audio"], wav, rtol=0, atol=1e-5)


def test_a_spoken_reply_equals_generate(engine, reference):
    messages = [{"role": "user", "content": "Say something nice."}]
    for seed, voice in ((7, "Chelsie"), (8, "Ethan")):
        assert_same_speech(submit(engine, messages, SpeechOutput(voice, seed)).result(timeout=120),
                           reference(messages, seed, voice))
    text = submit(engine, messages, None).result(timeout=120)  # text only: no talker, no audio
    assert "audio" not in text and text["choices"][0]["token_ids"] == reference(messages, 7)[0]
    for node in ("talker", "token2wav"):
        ran = engine.metrics.registry.get_sample_value("mmserve_graph_nodes_total",
                                                       {"model": "m", "node": node, "stage": f"m/{node}"})
        assert ran == 2, (node, ran)


def test_audio_and_image_in_speech_out_batched(engine, reference):
    """Audio + image + text in, speech out; three requests at once (two spoken, one text only) each equal their
    solo reference."""
    from PIL import Image

    from stages.media.audio import decode_audio

    rng = np.random.default_rng(3)
    clip = wav_bytes(0.1 * rng.standard_normal(16000))
    image = Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8))
    png = io.BytesIO()
    image.save(png, format="PNG")
    samples = np.array(decode_audio(clip, sample_rate=16000).samples)
    ours = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}},
        {"type": "image_url",
         "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}},
        {"type": "text", "text": "What do you hear and see?"}]}]
    theirs = [{"role": "user", "content": [{"type": "audio", "audio": samples}, {"type": "image", "image": image},
                                           {"type": "text", "text": "What do you hear and see?"}]}]
    plain = [{"role": "user", "content": "Tell me a story."}]
    handles = [submit(engine, ours, SpeechOutput("Chelsie", 11)), submit(engine, plain, SpeechOutput("Ethan", 12)),
               submit(engine, plain, None)]
    results = [h.result(timeout=120) for h in handles]
    assert_same_speech(results[0], reference(theirs, 11))
    assert_same_speech(results[1], reference(plain, 12, "Ethan"))
    assert results[2]["choices"][0]["token_ids"] == reference(plain, 12)[0]
    assert engine.metrics.stage.max_batch_size("m/llm", "m") >= 2


def test_speech_requests_are_checked_before_any_work(engine, tmp_path):
    with pytest.raises(RequestError) as info:
        submit(engine, [{"role": "user", "content": "hi"}], SpeechOutput("Nobody", 1))
    assert info.value.param == "audio.voice" and "Chelsie" in str(info.value)
    with pytest.raises(RequestError) as info:
        submit(engine, [{"role": "user", "content": "hi"}], SpeechOutput("Chelsie", 1),
               SamplingParams(temperature=0, max_tokens=4, n=2))
    assert info.value.param == "n"
    assert engine.models["m"].tasks == ("chat", "vision-chat", "audio-chat", "spoken-chat")


def test_a_model_without_a_talker_refuses_speech(tmp_path):
    from pipelines.demo import build_demo_model

    path = str(build_demo_model("qwen2_audio", tmp_path / "qwen2_audio"))
    with running_engine(path, family="vlm") as eng:
        with pytest.raises(RequestError) as info:
            submit(eng, [{"role": "user", "content": "hi"}], SpeechOutput("Chelsie", 1))
        assert info.value.param == "modalities" and "does not speak" in str(info.value)


def omni_reference(path, clip: np.ndarray, image, question: str, n: int = 12) -> list[int]:
    """The Qwen2.5-Omni thinker's generate() on its processor's inputs (the text the full model writes too)."""
    from transformers import AutoProcessor, Qwen2_5OmniThinkerForConditionalGeneration

    thinker = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    content = [{"type": "audio", "audio": clip}, {"type": "image", "image": image}, {"type": "text", "text": question}]
    inputs = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True, return_tensors="pt")
    with torch.inference_mode():
        out = thinker.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_the_thinker_reads_audio_image_and_text_in_one_message(path):
    """Qwen2.5-Omni's thinker: audio and image parts in one message, each through its encoder stage (both nodes
    run), positions from the thinker's own M-RoPE; the text equals generate(), alone and batched."""
    from PIL import Image

    from stages.media.audio import decode_audio

    rng = np.random.default_rng(0)
    clips = [wav_bytes(0.1 * rng.standard_normal(n)) for n in (16000, 24000)]
    images = [Image.fromarray((rng.random((32, 48, 3)) * 255).astype(np.uint8)) for _ in clips]
    pngs = []
    for image in images:
        out = io.BytesIO()
        image.save(out, format="PNG")
        pngs.append(out.getvalue())
    questions = ("What do you hear and see?", "Describe both.")
    want = [omni_reference(path, np.array(decode_audio(c, sample_rate=16000).samples), im, q)
            for c, im, q in zip(clips, images, questions)]

    def content(clip, png, question):
        return [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
            {"type": "text", "text": question}]}]

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with running_engine(path, family="vlm") as eng:
        assert tokens(submit(eng, content(clips[0], pngs[0], questions[0]), None, params).result(timeout=60)) == want[0]
        handles = [submit(eng, content(c, p, q), None, params) for c, p, q in zip(clips, pngs, questions)]
        assert [tokens(h.result(timeout=60)) for h in handles] == want
        for node in ("audio_encode", "vision_encode"):
            ran = eng.metrics.registry.get_sample_value("mmserve_graph_nodes_total",
                                                        {"model": "m", "node": node, "stage": f"m/{node}"})
            assert ran == 3, (node, ran)
        assert eng.models["m"].tasks == ("chat", "vision-chat", "audio-chat", "spoken-chat")


def tokens(result) -> list[int]:
    return result["choices"][0]["token_ids"]


def test_cancel_mid_talker_stops_every_stage(engine):
    """A talker that would run 4096 codes (its end codes made unreachable for this test): cancelled while it runs,
    it stops within a code, no token2wav runs for it, the engine is idle, and the next request speaks."""
    import time

    from stages.events import ErrorKind, StageError

    talker = engine._served["m"].model.voice.talker
    ends = talker.codec_pad_token, talker.codec_eos_token
    before = engine.metrics.registry.get_sample_value("mmserve_graph_nodes_total",
                                                      {"model": "m", "node": "token2wav", "stage": "m/token2wav"})
    talker.codec_pad_token = talker.codec_eos_token = talker.codebook_size + 7  # never sampled
    try:
        handle = submit(engine, [{"role": "user", "content": "Talk forever."}], SpeechOutput("Chelsie", 3))
        deadline = time.monotonic() + 30
        while engine.executor.pools["m/talker"].idle:  # the thinker's reply is done, the talker at work
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)  # well inside the talker's 4096 codes
        cancelled = time.monotonic()
        handle.cancel()
        with pytest.raises(StageError) as info:
            handle.result(timeout=30)
        assert info.value.kind is ErrorKind.CANCELLED
        while not engine.executor.idle():
            assert time.monotonic() - cancelled < 1.0, "the talker kept running after the cancel"
            time.sleep(0.01)
    finally:
        talker.codec_pad_token, talker.codec_eos_token = ends
    after = engine.metrics.registry.get_sample_value("mmserve_graph_nodes_total",
                                                     {"model": "m", "node": "token2wav", "stage": "m/token2wav"})
    assert after == before  # token2wav never started for it
    result = submit(engine, [{"role": "user", "content": "Say something nice."}], SpeechOutput("Chelsie", 7))
    assert result.result(timeout=120)["audio"].numel() > 0
