"""Qwen2.5-Omni speaking its reply: thinker (the llm stage, keeping its hidden states) -> talker -> token2wav, on
the demo checkpoint (random weights, real code path). For the same seed the text and the waveform equal
transformers' `Qwen2_5OmniForConditionalGeneration.generate()` after `torch.manual_seed(seed)` (measured within
2.5e-6: the DiT's block-local attention rounds otherwise than the dense one; checked at 1e-5), alone, with audio and
image input, and batched with other requests."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import torch

from pipelines.chat import ChatRequest
from pipelines.config import VoiceSessionConfig, VoiceSpec
from pipelines.image_request import RequestError
from pipelines.omni import SAMPLE_RATE, SpeechOutput
from stages.llm.params import SamplingParams
from tests.helpers import demo_path, running_engine, vlm_engine_fixture, wav_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return demo_path(tmp_path_factory, "qwen2_5_omni")


OMNI_VOICE = VoiceSpec("omni-voice", omni="m", max_output_tokens=12, seed=0)
engine = vlm_engine_fixture(voices=(OMNI_VOICE,))


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


def test_the_talker_and_token2wav_batch_across_requests(path, reference):
    """Four spoken replies gathered into shared batches (pools that wait for company): the talker steps them in one
    forward a step, token2wav's two replicas sample two each, side by side on the one DiT (each call's block mask
    and speaker output its own), the vocoder's replicas work side by side; each reply still equals generate() for
    its seed (1e-5: the batched DiT differs from a lone one by float rounding, measured 3e-6)."""
    from stages.pool import PoolConfig

    waiting = PoolConfig(max_batch_size=8, max_delay_ms=500, max_queue=64)
    pairs = PoolConfig(max_batch_size=2, max_delay_ms=500, max_queue=64, replicas=2)
    prompts = ("Say something nice.", "Tell me a story.", "Count to five.", "Name a color.")
    with running_engine(path, family="vlm", pools={"talker": waiting, "token2wav": pairs}) as eng:
        handles = [submit(eng, [{"role": "user", "content": p}], SpeechOutput(("Chelsie", "Ethan")[i % 2], 20 + i))
                   for i, p in enumerate(prompts)]
        results = [h.result(timeout=120) for h in handles]
        assert eng.metrics.stage.max_batch_size("m/talker", "m") >= 2
        assert eng.metrics.stage.max_batch_size("m/token2wav", "m") >= 2
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        voice = ("Chelsie", "Ethan")[i % 2]
        assert_same_speech(result, reference([{"role": "user", "content": prompt}], 20 + i, voice))


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
    # nor can it be an omni voice (it hears, but does not speak); a voice is one omni model or a whole cascade
    with pytest.raises(ValueError, match="is not a served model that hears audio and speaks"):
        with running_engine(path, family="vlm", voices=(VoiceSpec("v", omni="m"),)):
            pass
    for bad in ({"omni": "m", "chat": "m"}, {"asr": "a", "chat": "c"}, {}):
        with pytest.raises(ValueError, match="voice model v"):
            VoiceSpec("v", **bad)


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


def test_a_realtime_omni_voice_hears_speaks_and_is_interrupted(engine):
    """A `[[voices]] omni = ...` session: the user's audio (no transcription) goes to the omni model as input_audio,
    its spoken reply streams as audio deltas (token2wav's chunks while the talker speaks) with the text as
    transcript; speech over the reply (server_vad) cancels it (turn_detected) and truncates it to what was heard;
    the next reply hears both utterances and equals the model's own streamed answer to that context. The session
    clock is held still, so the first reply cannot finish playing before the interruption (no wall clock in the
    outcome)."""
    import json
    import types

    from realtime.sessions import Journal, Outbox
    from realtime.voice.session import VoiceSession
    from realtime.voice.vad import VadLoader
    from tests.test_realtime_voice_support import ESPEAK, Collector, silence, speech, stream, voiced

    first = speech("What colour is the sky?") if ESPEAK else voiced(1.2, seed=1)
    second = speech("Wait, tell me a story.") if ESPEAK else voiced(1.0, seed=2)

    async def main():
        now = [0.0]
        collector, outbox = Collector(), Outbox(Journal(100_000, 1 << 30))
        await outbox.attach(collector.send)
        s = VoiceSession(engine, engine.voice_model("omni-voice"), VoiceSessionConfig(vad="energy", delta_ms=20,
                         max_lead_ms=20), session_id="sess_omni", resume_token="tok", outbox=outbox,
                         vad=VadLoader("energy"), clock=lambda: now[0])
        await s.start()
        await s.receive(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {
            "output": {"voice": "Nobody"}}}}))
        await stream(s.receive, np.concatenate([silence(0.3), first, silence(0.8)]), realtime=False)
        r1 = (await collector.wait_event("response.created"))["response"]["id"]
        await collector.wait_event("response.output_audio.delta", response_id=r1)  # then it waits for playback
        now[0] += 0.01  # 10 ms of it played
        await stream(s.receive, np.concatenate([second, silence(0.8)]), realtime=False)
        await collector.wait_for(lambda: [e for e in collector.of("response.created") if e["response"]["id"] != r1])

        async def playing():  # from now on the client plays in (fast) time
            while True:
                now[0] += 0.05
                await asyncio.sleep(0.005)
        clock = asyncio.create_task(playing())
        done = await collector.wait_event("response.done", 2)
        clock.cancel()
        context = await s.context_for(types.SimpleNamespace(params=s._default_params()))
        heard = [item.audio for item in s.conversation if item.role == "user"]
        await s.close("test")
        return collector, r1, done, context, heard

    c, r1, done, context, heard = asyncio.run(main())
    error = c.of("error")[0]["error"]
    assert error["param"] == "session.audio.output.voice" and "Chelsie" in error["message"]  # the omni voices
    assert not c.of("conversation.item.input_audio_transcription.completed")  # heard, not transcribed
    cut = c.index(c.of("input_audio_buffer.speech_started")[1])
    assert max(i for i, e in enumerate(c.events) if e["type"] == "response.output_audio.delta"
               and e["response_id"] == r1) < cut
    first_done = next(e for e in c.of("response.done") if e["response"]["id"] == r1)["response"]
    assert (first_done["status"], first_done["status_details"]["reason"]) == ("cancelled", "turn_detected")
    item_id = first_done["output"][0]["id"]
    assert c.of("conversation.item.truncated", item_id=item_id)[0]["audio_end_ms"] == 10
    assert done["response"]["status"] in ("completed", "incomplete")  # incomplete: max_output_tokens
    r2 = done["response"]["id"]
    transcript = "".join(e["delta"] for e in c.of("response.output_audio_transcript.delta", response_id=r2))
    pcm = b"".join(base64.b64decode(e["delta"]) for e in c.of("response.output_audio.delta", response_id=r2))
    # the model heard both utterances (16 kHz, whole, with the VAD's padding and the silence that ended them)
    assert len(heard) == 2 and all(len(x) * 2 // 3 <= len(a) <= len(x) * 2 // 3 + 16_000 * 1.1
                                   for a, x in zip(heard, (first, second)))
    users = [m["content"] for m in context if m["role"] == "user"]
    assert len(users) == 2 and all(part[0]["type"] == "input_audio" for part in users)
    assert context[-1]["role"] == "assistant" and context[-1]["content"] == transcript
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=0)
    want = submit(engine, context[:-1], SpeechOutput("Chelsie", 0, stream=True), params).result(timeout=120)
    assert transcript == want["choices"][0]["text"] and transcript
    got = np.frombuffer(pcm, "<i2").astype(np.float32) / 32767
    np.testing.assert_allclose(got, want["audio"].numpy(), rtol=0, atol=1e-4)
