"""Image, video and audio chat through a real server process, driven by the official openai client.

One module-scoped server with the tiny demo LLaVA, Qwen2.5-VL and Qwen2-Audio (random weights: the
text is noise, the code path is real) and the demo Llama (a text model refuses media parts). Greedy
answers equal transformers generate() on the processor's inputs, decoded.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

try:
    from tests.test_serve_support import Server, metric
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_serve_support import Server, metric

GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
QUESTION = "what is in it?"


def png(seed: int, width: int = 90, height: int = 60) -> bytes:
    out = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")).save(out, format="PNG")
    return out.getvalue()


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(data: bytes, detail: str = "auto") -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(data, "image/png"), "detail": detail}},
        {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from pipelines.demo import build_demo_model

    root = tmp_path_factory.mktemp("serve-vlm")
    return {"llava-demo": build_demo_model("llava", root / "llava"),
            "qwen-vl-demo": build_demo_model("qwen2_5_vl", root / "qwen"),
            "llama-demo": build_demo_model("llama", root / "llama"),
            "qwen2-audio-demo": build_demo_model("qwen2_audio", root / "qwen2_audio"),
            "omni-demo": build_demo_model("qwen2_5_omni", root / "omni"), "root": root}


@pytest.fixture(scope="module")
def server(paths):
    models = "".join(f"""
[[models]]
name = "{name}"
path = "{paths[name]}"
[models.llm]
kv_cache_mb = 8
block_size = 4
""" + ("" if name == "llama-demo" else "[models.vlm]\nmax_images = 2\n")
                     for name in ("llava-demo", "qwen-vl-demo", "llama-demo", "qwen2-audio-demo", "omni-demo"))
    # omni-voice: a realtime speech-to-speech voice on omni-demo; audio paced 20 ms ahead of playback, so a reply
    # is still being sent when the client talks over it
    voices = """
[realtime.voice]
vad = "energy"
delta_ms = 20
max_lead_ms = 20
max_input_age_ms = 60000
[[voices]]
name = "omni-voice"
omni = "omni-demo"
max_output_tokens = 12
seed = 0
"""
    srv = Server(paths["root"], voices + models)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)


def reference_text(path, data: bytes, n: int) -> tuple[str, int]:
    """generate() on the processor's inputs: the decoded answer and the prompt's token count."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, processor = AutoModelForImageTextToText.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                          "text": QUESTION}]}],
                                         add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    return processor.tokenizer.decode(ids, skip_special_tokens=True), inputs["input_ids"].shape[1]


@pytest.mark.parametrize("model", ["llava-demo", "qwen-vl-demo"])
def test_image_chat_with_the_openai_client(client, server, paths, model):
    data = png(1)
    expected, prompt_tokens = reference_text(paths[model], data, 8)
    reply = client.chat.completions.create(model=model, messages=image_message(data), **GREEDY)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == prompt_tokens and reply.usage.completion_tokens == 8
    # The same image again, streamed: the encoder cache answers, the text is the same.
    before = metric(server.url, "mmserve_cache_hits_total", cache="encoder_output")
    chunks = list(client.chat.completions.create(model=model, messages=image_message(data), stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert metric(server.url, "mmserve_cache_hits_total", cache="encoder_output") == before + 1


def test_models_list_shows_vision_chat(client):
    entries = {m.id: m.model_dump() for m in client.models.list()}
    assert "vision-chat" in entries["qwen-vl-demo"]["tasks"] and entries["llava-demo"]["family"] == "vlm"


def test_video_chat(client):
    from stages.media.video import encode_video

    video = encode_video((np.random.RandomState(3).rand(8, 56, 84, 3) * 255).astype("uint8"), fps=4.0)
    part = {"type": "video_url", "video_url": {"url": data_uri(video, "video/mp4"), "fps": 2.0, "max_frames": 4}}
    for model in ("qwen-vl-demo", "llava-demo"):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
            part, {"type": "text", "text": "what happens?"}]}], **GREEDY)
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 8


def bad_request(client, model: str, messages, **extra) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=messages, **GREEDY, **extra)
    return err.value


def audio_message(data: bytes) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
        {"type": "text", "text": QUESTION}]}]


def test_audio_chat_with_the_openai_client(client, server, paths):
    """OpenAI's input_audio part: the answer equals generate() on the processor's inputs; the same clip again,
    streamed, is answered from the encoder-output cache (the series images count in too)."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from tests.helpers import wav_bytes

    samples = 0.3 * np.sin(2 * np.pi * 220 * np.arange(20000) / 16000) * np.linspace(0, 1, 20000)
    data = wav_bytes(samples)
    path = paths["qwen2-audio-demo"]
    model = Qwen2AudioForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "audio"}, {"type": "text",
                                                                                          "text": QUESTION}]}],
                                         add_generation_prompt=True, tokenize=False)
    clip = np.frombuffer(data[44:], dtype="<i2").astype(np.float32) / 32768
    inputs = processor(text=text, audio=[clip], sampling_rate=16000, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    reply = client.chat.completions.create(model="qwen2-audio-demo", messages=audio_message(data), **GREEDY)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
    before = metric(server.url, "mmserve_cache_hits_total", cache="encoder_output")
    chunks = list(client.chat.completions.create(model="qwen2-audio-demo", messages=audio_message(data), stream=True,
                                                 **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert metric(server.url, "mmserve_cache_hits_total", cache="encoder_output") == before + 1
    entries = {m.id: m.model_dump() for m in client.models.list()}
    assert entries["qwen2-audio-demo"]["tasks"] == ["chat", "audio-chat"]


def test_errors_name_the_field(client):
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]
    err = bad_request(client, "qwen-vl-demo", audio)
    assert "model qwen-vl-demo takes no audio input" in err.message
    assert err.body["param"] == "messages[0].content[0].type"
    err = bad_request(client, "qwen2-audio-demo", image_message(png(2)))
    assert "takes no image input" in err.message and err.body["param"] == "messages[0].content[0].type"
    err = bad_request(client, "qwen2-audio-demo", audio_message(b"RIFF" + b"\0" * 200))
    assert err.body["param"] == "messages[0].content[0].input_audio.data"
    err = bad_request(client, "llama-demo", audio)  # a text model reads text parts only
    assert err.body["param"] == "messages[0].content[0]" and "text" in err.message


def test_speech_out_is_refused_naming_the_field(client):
    """modalities ["text", "audio"]: no served model speaks yet (Qwen2.5-Omni's talker is not served); text-only
    modalities work."""
    cases = (({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
             ({"modalities": ["audio"]}, "modalities"), ({"audio": {"voice": "x"}}, "audio"))
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="qwen2-audio-demo", messages=[{"role": "user", "content": "hi"}],
                                           **dict(GREEDY, extra_body=extra))
        assert err.value.body["param"] == param, (extra, err.value.body)
    reply = client.chat.completions.create(model="qwen2-audio-demo", messages=[{"role": "user", "content": "hi"}],
                                           modalities=["text"], **GREEDY)
    assert reply.usage.completion_tokens == 8
    three = [{"role": "user", "content": image_message(png(2))[0]["content"][:1] * 3}]
    err = bad_request(client, "llava-demo", three)
    assert err.body["param"] == "messages[0].content[2].image_url" and "max_images" in err.message
    err = bad_request(client, "llava-demo", image_message(b"\x89PNG broken"))
    assert err.body["param"] == "messages[0].content[0].image_url.url"
    # A text model keeps refusing media parts.
    err = bad_request(client, "llama-demo", image_message(png(2)))
    assert err.body["param"] == "messages[0].content[0]" and "text" in err.message


def test_remote_image_url_is_fetched_under_the_policy(server):
    body = {"model": "llava-demo", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}}]}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url.url"


def test_a_spoken_reply_through_the_openai_client(client, paths):
    """modalities ["text", "audio"] on the omni model: message.audio holds a WAV (decoded with PyAV) equal to
    transformers' generate() for the same seed, up to 16-bit rounding, and its transcript is the reply's text."""
    import av
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    from pipelines.demo.omni import TALKER_EOS
    from tests.test_omni_streaming import streamed_reference

    messages = [{"role": "user", "content": "Say something nice."}]
    path = paths["omni-demo"]
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    torch.manual_seed(5)
    ids, wav = model.generate(**inputs, speaker="Ethan", thinker_max_new_tokens=12, talker_eos_token_id=TALKER_EOS)
    text = processor.tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    reply = client.chat.completions.create(model="omni-demo", messages=messages, modalities=["text", "audio"],
                                           audio={"voice": "Ethan", "format": "wav"}, temperature=0, max_tokens=12,
                                           seed=5)
    message = reply.choices[0].message
    assert message.content is None and message.audio.transcript == text and message.audio.id
    with av.open(io.BytesIO(base64.b64decode(message.audio.data))) as container:
        stream = container.streams.audio[0]
        assert stream.rate == 24000
        samples = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)])
    got = samples.astype(np.float32) / 32768 if samples.dtype == np.int16 else samples
    np.testing.assert_allclose(got, wav.numpy(), rtol=0, atol=1e-4)
    for extra, param in (({"modalities": ["text", "audio"], "audio": {"voice": "Nobody"}}, "audio.voice"),
                         ({"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "ogg"}},
                          "audio.format")):
        err = bad_request(client, "omni-demo", messages, **extra)
        assert err.body["param"] == param, err.body
    with pytest.raises(openai.BadRequestError) as info:  # OpenAI streams pcm16 only
        client.chat.completions.create(model="omni-demo", messages=messages, modalities=["text", "audio"],
                                       audio={"voice": "Ethan", "format": "wav"}, stream=True)
    assert info.value.body["param"] == "audio.format"
    # Streamed: transcript pieces, then pcm16 chunks made while the talker speaks, which concatenate to token2wav's
    # waveform for generate()'s codes with the streamed reply's own noise (tests/test_omni_streaming.py).
    chunks = list(client.chat.completions.create(
        model="omni-demo", messages=messages, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "pcm16"},
        temperature=0, max_tokens=12, seed=5, stream=True, stream_options={"include_usage": True}))
    audio = [c.choices[0].delta.to_dict().get("audio", {}) for c in chunks if c.choices]
    assert "".join(a.get("transcript", "") for a in audio) == text
    pcm = b"".join(base64.b64decode(a["data"]) for a in audio if "data" in a)
    assert len({a["id"] for a in audio if "data" in a}) == 1  # one audio, in chunks
    streamed = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767
    _, _, want = streamed_reference(model, processor, messages, 5, "Ethan", 12, 4096)
    np.testing.assert_allclose(streamed, want.numpy(), rtol=0, atol=1e-4)
    assert chunks[-1].usage.completion_tokens == len(ids[0]) - inputs["input_ids"].shape[1]


def test_a_realtime_omni_voice_through_the_openai_client(server):
    """WS /v1/realtime on the omni voice with the official SDK: a committed audio turn is answered in speech (its
    transcript the reply's text); speech while the next reply is being made (server_vad) cancels it (a barge-in),
    and the interrupting turn is answered. (Talking over audio already playing: test_omni_speech.py.)"""
    import asyncio
    import json

    from tests.test_realtime_voice_support import append_event, voiced

    async def until(conn, seen, kind, **fields):
        async for event in conn:
            seen.append(event)
            if event.type == kind and all(getattr(event, k) == v for k, v in fields.items()):
                return event
        raise AssertionError(f"the socket closed before {kind}")

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        seen = []
        async with client.realtime.connect(model="omni-voice") as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await conn.input_audio_buffer.append(audio=json.loads(append_event(voiced(1.0, seed=3)))["audio"])
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            first = await until(conn, seen, "response.done")
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
                "type": "server_vad", "silence_duration_ms": 300}}}})
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "And again?"}]})
            await conn.response.create()
            # the user talks at once: events apply in order, so the reply is still being made when speech starts
            talk = np.concatenate([voiced(0.6, seed=4), np.zeros(12_000, np.float32)])
            await conn.input_audio_buffer.append(audio=json.loads(append_event(talk))["audio"])
            created = await until(conn, seen, "response.created")
            second = await until(conn, seen, "response.done")
            third = await until(conn, seen, "response.done")  # the answer to the interruption
        return first, (created, second, third), seen

    first, (created, second, third), seen = asyncio.run(asyncio.wait_for(main(), 180))
    text = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta"
                   and e.response_id == first.response.id)
    pcm = [e.delta for e in seen if e.type == "response.output_audio.delta" and e.response_id == first.response.id]
    assert first.response.status in ("completed", "incomplete") and text and pcm
    assert first.response.output[0].content[0].transcript == text
    assert sum(len(base64.b64decode(d)) for d in pcm) % 2 == 0  # pcm16 at 24 kHz
    assert second.response.id == created.response.id
    assert (second.response.status, second.response.status_details.reason) == ("cancelled", "turn_detected")
    assert any(e.type == "input_audio_buffer.speech_started" for e in seen)
    assert third.response.status in ("completed", "incomplete")
    assert any(e.type == "response.output_audio.delta" and e.response_id == third.response.id for e in seen)
