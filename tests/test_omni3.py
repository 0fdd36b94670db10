"""Qwen3-Omni served (the demo checkpoint: random weights, real code path).

The thinker as a chat model: text, audio and image parts through audio_encode / vision_encode and the llm stage, the
prompt's positions from the thinker's own rope index. Greedy answers equal transformers'
`Qwen3OmniMoeForConditionalGeneration.generate()` (text out) on its processor's inputs, token for token, alone and
batched. A checkpoint whose vision tower has deepstack mergers (as the released ones do) is served without image
input, and says so naming the field.

Speech out: the talker (its code predictor inside; streamed from the thinker, reading the encoders' features for a
prompt with media) stepping every reply in one forward, then code2wav. For the same seed the reply's tokens and codes
equal `generate()`'s after `torch.manual_seed(seed)`, alone and batched, and the waveform too (alone bit for bit;
checked at 1e-5: a wrong code moves it by more than 1e-2); the talker's forwards read what `generate()`'s read. A
streamed reply's chunks of code2wav go out while the talker speaks and concatenate to the whole reply's waveform
(measured 1.4e-5 for a reply, 2.2e-5 across decode spans: float rounding of decodes of other lengths, amplified by
the random decoder; checked at 1e-4)."""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import numpy as np
import pytest
import torch

from pipelines.chat import ChatRequest
from pipelines.config import VoiceSessionConfig, VoiceSpec
from pipelines.image_request import RequestError
from pipelines.omni import SpeechOutput
from pipelines.omni3 import DECODE_SPAN, SAMPLE_RATE
from pipelines.omni3_code2wav import FIRST_CHUNK, CodeChunks
from stages.events import EventKind, StageError
from stages.llm.params import SamplingParams
from stages.pool import PoolConfig
from tests.helpers import (
    assert_cancel_after_first_audio_ends_everywhere,
    demo_path,
    running_engine,
    vlm_engine_fixture,
    wav_bytes,
)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SPOKEN = SamplingParams(temperature=0, max_tokens=12)  # generate(thinker_max_new_tokens=12), stopping at eos


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return demo_path(tmp_path_factory, "qwen3_omni")


OMNI_VOICE = VoiceSpec("omni-voice", omni="m", max_output_tokens=12, seed=0)
engine = vlm_engine_fixture(voices=(OMNI_VOICE,))


def load(path: str):
    from transformers import AutoProcessor, Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


def make_reference(path: str, loaded=None):
    """generate() with text out on the processor's inputs (messages in its form: audio as 16 kHz samples)."""
    model, processor = loaded or load(path)

    def answer(messages) -> list[int]:
        inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                               return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, return_audio=False, thinker_max_new_tokens=8, thinker_do_sample=False,
                                 thinker_eos_token_id=None)
        return out[0, inputs["input_ids"].shape[1]:].tolist()
    return answer


@pytest.fixture(scope="module")
def loaded(path):
    return load(path)


@pytest.fixture(scope="module")
def reference(path, loaded):
    return make_reference(path, loaded)


def ask(engine, messages, params=GREEDY):
    async def submit():
        return await engine.asubmit_chat("m", ChatRequest(messages=messages, params=params))
    return asyncio.run(submit())


def tokens(result) -> list[int]:
    return result["choices"][0]["token_ids"]


def clip(seconds: float, seed: int) -> tuple[bytes, np.ndarray]:
    """A noise clip as WAV bytes, and its samples as the media workers decode them (16 kHz float)."""
    from stages.media.audio import decode_audio

    data = wav_bytes(0.1 * np.random.default_rng(seed).standard_normal(int(seconds * 16000)))
    return data, np.array(decode_audio(data, sample_rate=16000).samples)


def image(seed: int, size: tuple[int, int]):
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8)
    picture = Image.fromarray(pixels)
    png = io.BytesIO()
    picture.save(png, format="PNG")
    return png.getvalue(), picture


def audio_part(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def test_text_audio_and_image_answers_equal_generate_alone_and_batched(engine, reference):
    """Audio of 2.5 s (two full 100-frame chunks and a remainder) + an image + text; a text-only chat; an image
    with audio after it: each alone, then all three at once (one llm batch), equal their generate() answers."""
    long_wav, long_samples = clip(2.5, 1)
    short_wav, short_samples = clip(0.7, 2)
    png, picture = image(3, (48, 80))
    ours = [
        [{"role": "user", "content": [audio_part(long_wav), image_part(png), {"type": "text", "text": "what is it?"}]}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
        [{"role": "user", "content": [image_part(png), {"type": "text", "text": "and now"}, audio_part(short_wav)]}],
    ]
    theirs = [
        [{"role": "user", "content": [{"type": "audio", "audio": long_samples}, {"type": "image", "image": picture},
                                      {"type": "text", "text": "what is it?"}]}],
        ours[1],
        [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "and now"},
                                      {"type": "audio", "audio": short_samples}]}],
    ]
    want = [reference(m) for m in theirs]
    assert [tokens(ask(engine, m).result(timeout=60)) for m in ours] == want  # alone
    handles = [ask(engine, m) for m in ours]  # together
    assert [tokens(h.result(timeout=60)) for h in handles] == want
    assert engine.metrics.stage.max_batch_size("m/llm", "m") >= 2
    assert engine.models["m"].tasks == ("chat", "vision-chat", "audio-chat", "spoken-chat")
    assert set(engine.models["m"].voices) == {"ethan", "chelsie"}


def test_two_clips_in_one_prompt_equal_generate(engine, reference):
    """Two clips of one request share an audio_encode forward; the processor featurizes each alone only when they
    are equally long (it pads a batch of clips to the longest), so the reference gets two clips of one length."""
    first, first_samples = clip(1.2, 4)
    second, second_samples = clip(1.2, 5)
    ours = [{"role": "user", "content": [audio_part(first), {"type": "text", "text": "then"}, audio_part(second)]}]
    theirs = [{"role": "user", "content": [{"type": "audio", "audio": first_samples}, {"type": "text", "text": "then"},
                                           {"type": "audio", "audio": second_samples}]}]
    assert tokens(ask(engine, ours).result(timeout=60)) == reference(theirs)


def test_clips_of_any_lengths_share_one_encoder_forward(loaded):
    """The audio adapter's features for clips of 0.3 s, 1 s and 2.5 s encoded in one forward equal the thinker's
    own `get_audio_features` on the processor's features of each clip alone (measured 4e-7 at most, at a mean
    magnitude of 4e-3), and their token counts are the processor's."""
    from encoders.omni3 import Omni3AudioAdapter
    from encoders.vision import MediaItem

    model, processor = loaded
    adapter = Omni3AudioAdapter(model.thinker, processor, weights_id="w", dtype=torch.float32,
                                device=torch.device("cpu"), low_detail_max_pixels=0)
    clips = [clip(seconds, seed)[1] for seconds, seed in ((0.3, 8), (1.0, 9), (2.5, 10))]
    tasks = [adapter.task(MediaItem("audio", samples, f"clip{i}", 0, 0), "t") for i, samples in enumerate(clips)]
    got = adapter.encode([adapter.prepare(task) for task in tasks])
    for samples, task, features in zip(clips, tasks, got):
        inputs = processor.feature_extractor([samples], sampling_rate=16000, return_attention_mask=True, padding=True,
                                             truncation=False, return_tensors="pt")
        with torch.inference_mode():
            want = model.thinker.model.get_audio_features(inputs["input_features"],
                                                          feature_attention_mask=inputs["attention_mask"])
        assert task.geometry.num_tokens == processor._get_num_audio_tokens(len(samples))
        torch.testing.assert_close(features, want.last_hidden_state, rtol=0, atol=1e-6)


@pytest.mark.parametrize("part, param, words", [
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "messages[0].content[0].type",
     "takes no video input"),
    (audio_part(wav_bytes(np.zeros(150))), "messages[0].content[0].input_audio.data", "at least 201"),
])
def test_unserved_parts_are_refused_naming_the_field(engine, part, param, words):
    with pytest.raises((RequestError, StageError)) as info:
        ask(engine, [{"role": "user", "content": [part]}]).result(timeout=60)
    assert info.value.param == param and words in str(info.value), (info.value.param, info.value)


def speak(engine, messages, speech: SpeechOutput, params=SPOKEN):
    async def submit():
        return await engine.asubmit_chat("m", ChatRequest(messages=messages, params=params, speech=speech))
    return asyncio.run(submit())


@pytest.fixture(scope="module")
def spoken_reference(loaded):
    """generate() with audio out after torch.manual_seed(seed): (reply token ids, waveform, codes [groups, frames]:
    the ones it hands code2wav)."""
    model, processor = loaded
    eos = processor.tokenizer.eos_token_id
    # transformers' talker reads the audio encoder's n_window from its own config, which lacks it: Omni3Voice's fix
    model.talker.config.audio_config = model.config.thinker_config.audio_config
    decode = model.code2wav.chunked_decode

    def answer(messages, seed: int, voice: str = "ethan") -> tuple[list[int], torch.Tensor, torch.Tensor]:
        inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                               return_tensors="pt")
        caught = []

        def catch(codes, **kwargs):
            caught.append(codes[0])
            return decode(codes, **kwargs)
        model.code2wav.chunked_decode = catch
        torch.manual_seed(seed)
        try:
            with torch.inference_mode():
                ids, wav = model.generate(**inputs, speaker=voice, thinker_max_new_tokens=12,
                                          thinker_do_sample=False, thinker_eos_token_id=eos)
        finally:
            del model.code2wav.chunked_decode
        return ids[0, inputs["input_ids"].shape[1]:].tolist(), wav.reshape(-1), caught[0]
    return answer


def assert_same_speech(result, want: tuple[list[int], torch.Tensor, torch.Tensor]) -> None:
    ids, wav, _ = want
    assert result["choices"][0]["token_ids"] == ids
    assert "hidden" not in result["choices"][0]
    assert result["sample_rate"] == SAMPLE_RATE and result["audio"].shape == wav.shape, (result["audio"].shape,
                                                                                         wav.shape)
    assert wav.abs().max() > 0.05  # audible: a wrong code shows
    torch.testing.assert_close(result["audio"], wav, rtol=0, atol=1e-5)


def test_spoken_replies_equal_generate(engine, spoken_reference):
    """Text in, speech out, two seeds and both voices; then an audio + image prompt (the talker reads the thinker's
    states at its media placeholders, recomputed) spoken while a text-only and a spoken text request run beside it.
    Tokens equal, waveforms to 1e-5."""
    text = [{"role": "user", "content": "Say something nice."}]
    for seed, voice in ((7, "ethan"), (8, "chelsie")):
        assert_same_speech(speak(engine, text, SpeechOutput(voice, seed)).result(timeout=120),
                           spoken_reference(text, seed, voice))
    wav, samples = clip(1.0, 11)
    png, picture = image(12, (32, 48))
    ours = [{"role": "user", "content": [audio_part(wav), image_part(png), {"type": "text", "text": "what now?"}]}]
    theirs = [{"role": "user", "content": [{"type": "audio", "audio": samples}, {"type": "image", "image": picture},
                                           {"type": "text", "text": "what now?"}]}]
    handles = [speak(engine, ours, SpeechOutput("chelsie", 3)), speak(engine, text, SpeechOutput("ethan", 4)),
               speak(engine, text, None)]
    results = [h.result(timeout=120) for h in handles]
    assert_same_speech(results[0], spoken_reference(theirs, 3, "chelsie"))
    assert_same_speech(results[1], spoken_reference(text, 4))
    assert "audio" not in results[2] and tokens(results[2]) == spoken_reference(text, 4)[0]


def test_a_prompt_with_media_is_spoken_while_the_thinker_writes(engine, spoken_reference):
    """The talker streams from the thinker for a prompt with audio too: it joins at the thinker's first token, with
    the encoders' features (done before the thinker started) for its media rows; the reply still equals generate()."""
    wav, samples = clip(1.0, 21)
    ours = [{"role": "user", "content": [audio_part(wav), {"type": "text", "text": "and then?"}]}]
    theirs = [{"role": "user", "content": [{"type": "audio", "audio": samples}, {"type": "text", "text": "and then?"}]}]
    thinker, thinker_at_talker, final = 0, None, None
    for event in speak(engine, ours, SpeechOutput("ethan", 5, stream=True)).events(timeout=120):
        if event.kind is EventKind.DELTA and event.stage == "llm":
            thinker += 1
        elif event.kind is EventKind.STAGE_STARTED and event.stage == "talker":
            thinker_at_talker = thinker
        elif event.kind is EventKind.FINAL:
            final = event.data["outputs"]
    ids, whole, _ = spoken_reference(theirs, 5)
    assert thinker_at_talker == 1 and thinker == len(ids) > 1  # joined at the first token, not after the reply
    assert final is not None and final["choices"][0]["token_ids"] == ids
    torch.testing.assert_close(final["audio"], whole, rtol=0, atol=1e-4)


def recorded(module: torch.nn.Module) -> tuple[list[dict], Any]:
    """Record the inputs of every forward of `module` (the talker's text model): its embeddings and positions."""
    calls: list[dict] = []

    def hook(_, args, kwargs):
        calls.append({"inputs_embeds": kwargs["inputs_embeds"].clone(), "position_ids": kwargs["position_ids"]})
    return calls, module.register_forward_pre_hook(hook, with_kwargs=True)


def test_the_talker_reads_what_generate_hands_it(engine, loaded, spoken_reference):
    """A random talker samples nearly uniformly (its codes barely depend on what it reads), so the talker's forwards
    are compared directly: for a prompt with audio, an image and text, the prompt's embeddings (the user turn's text
    rows, its media rows from the recomputed thinker states, the reply's start) and positions (the talker's rope
    index over the media), then at every step the frame's embeddings summed (the code predictor's codes) plus the
    reply's next text row, at its position, equal the ones generate()'s talker reads (mean magnitude 2e-3; measured
    6e-11 for the prompt and 7e-9 for the 39 steps: checked at 1e-8 and 1e-7; a 0.1 % change in the recomputed
    thinker states fails it)."""
    voice = engine._served["m"].model.voice
    wav, samples = clip(1.5, 13)
    png, picture = image(14, (64, 48))
    ours = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": [
        {"type": "text", "text": "hear"}, audio_part(wav), {"type": "text", "text": "and see"}, image_part(png)]}]
    theirs = [ours[0], {"role": "user", "content": [
        {"type": "text", "text": "hear"}, {"type": "audio", "audio": samples}, {"type": "text", "text": "and see"},
        {"type": "image", "image": picture}]}]
    (mine, hook), (reference_calls, reference_hook) = recorded(voice.talker.model), recorded(loaded[0].talker.model)
    try:
        want = spoken_reference(theirs, 9)
        assert_same_speech(speak(engine, ours, SpeechOutput("ethan", 9)).result(timeout=120), want)
    finally:
        hook.remove()
        reference_hook.remove()
    assert len(mine) == len(reference_calls) == want[2].shape[1] + 1  # the prompt, then one step a fed frame
    for i, (got, expected) in enumerate(zip(mine, reference_calls)):
        torch.testing.assert_close(got["inputs_embeds"], expected["inputs_embeds"], rtol=0, atol=1e-8 if i == 0 else
                                   1e-7, msg=f"forward {i}")
        assert torch.equal(got["position_ids"][-3:], expected["position_ids"][-3:]), i  # the 3-D rope positions
    assert mine[0]["position_ids"][1:].amax() < mine[0]["inputs_embeds"].shape[1] - 1  # the media's positions


def test_the_talker_batches_replies_equal_generate(path, spoken_reference):
    """Four spoken replies in one talker pool that waits for company (three text prompts streamed from their
    thinkers, one with audio after its thinker): the talker steps them in shared forwards (its code predictor for
    all rows at once), each drawing from its own generator: each reply's codes and waveform equal generate()'s for its
    seed."""
    waiting = PoolConfig(max_batch_size=8, max_delay_ms=500, max_queue=64)
    wav, samples = clip(1.0, 15)
    prompts = [([{"role": "user", "content": text}],) * 2 for text in ("Tell me a story.", "Count to five.",
                                                                       "Name a color.")]
    prompts.append(([{"role": "user", "content": [audio_part(wav), {"type": "text", "text": "and?"}]}],
                    [{"role": "user", "content": [{"type": "audio", "audio": samples},
                                                  {"type": "text", "text": "and?"}]}]))
    seeds = (15, 12, 9, 16)
    with running_engine(path, family="vlm", pools={"talker": waiting}) as eng:
        handles = [speak(eng, ours, SpeechOutput(("ethan", "chelsie")[i % 2], seed))
                   for i, ((ours, _), seed) in enumerate(zip(prompts, seeds))]
        results = [h.result(timeout=120) for h in handles]
        assert eng.metrics.stage.max_batch_size("m/talker", "m") >= 2
    for i, ((_, theirs), seed, result) in enumerate(zip(prompts, seeds, results)):
        assert_same_speech(result, spoken_reference(theirs, seed, ("ethan", "chelsie")[i % 2]))


STORY = [{"role": "user", "content": "Tell me a story."}]  # seed 15: 75 frames (chunks of 4, 8, 16, 32, then 15)


def test_a_streamed_reply_comes_in_chunks_while_the_talker_speaks(engine, spoken_reference):
    """A streamed reply: the talker joins at the thinker's first token and tells its frames as it draws them
    (generate()'s codes); code2wav's first chunk goes to its pool once the talker has drawn FIRST_CHUNK frames, not at
    its end; the chunks (DELTAs {"audio", "sample_rate"} of the `vocoder` node, as Qwen2.5-Omni's) concatenate to the
    reply's waveform, which equals generate()'s to 1e-4 (measured 1.4e-5)."""
    ids, whole, codes = spoken_reference(STORY, 15)
    handle = speak(engine, STORY, SpeechOutput("ethan", 15, stream=True))
    thinker, thinker_at_talker, frames, frames_at_first_chunk, chunks, final = 0, None, [], None, [], None
    for event in handle.events(timeout=120):
        if event.kind is EventKind.DELTA and event.stage == "llm":
            thinker += 1
        elif event.kind is EventKind.STAGE_STARTED and event.stage == "talker":
            thinker_at_talker = thinker
        elif event.kind is EventKind.DELTA and event.stage == "talker":
            frames += event.data["codes"]
        elif event.kind is EventKind.STAGE_STARTED and event.stage == "vocoder":
            frames_at_first_chunk = len(frames)
        elif event.kind is EventKind.DELTA and event.stage == "vocoder":
            assert event.data["sample_rate"] == SAMPLE_RATE
            chunks.append(event.data["audio"])
        elif event.kind is EventKind.FINAL:
            final = event.data["outputs"]
    assert final is not None and final["choices"][0]["token_ids"] == ids and "hidden" not in final["choices"][0]
    assert thinker == len(ids) and thinker_at_talker == 1  # the talker joined at the thinker's first token
    assert torch.equal(torch.tensor(frames).T, codes) and codes.shape[1] == 75
    assert frames_at_first_chunk == FIRST_CHUNK and len(chunks) == 5
    audio = torch.cat(chunks)
    assert final["sample_rate"] == SAMPLE_RATE and torch.equal(final["audio"], audio)
    assert audio.shape == whole.shape and whole.abs().max() > 0.05
    torch.testing.assert_close(audio, whole, rtol=0, atol=1e-4)


def test_streamed_replies_share_code2wav_forwards(path):
    """Two replies streamed at once, the talker stepping both: code2wav decodes their chunks in shared forwards (its
    pool waits a little for company), and each reply's chunks still concatenate to its own whole decode (1e-4)."""
    chat = [[{"role": "user", "content": text}] for text in ("Tell me a story.", "Count to five.")]
    pools = {"code2wav": PoolConfig(max_batch_size=8, max_delay_ms=300, max_queue=64)}
    with running_engine(path, family="vlm", pools=pools) as eng:
        handles = [speak(eng, prompt, SpeechOutput("ethan", seed, stream=True)) for prompt, seed in zip(chat, (15, 12))]
        streamed = []
        for handle in handles:
            frames, chunks = [], []
            for event in handle.events(timeout=120):
                if event.kind is EventKind.DELTA and event.stage == "talker":
                    frames += event.data["codes"]
                elif event.kind is EventKind.DELTA and event.stage == "vocoder":
                    chunks.append(event.data["audio"])
            streamed.append((torch.tensor(frames).T, torch.cat(chunks)))
        assert eng.metrics.stage.max_batch_size("m/code2wav", "m") >= 2
        voice = eng._served["m"].model.voice
        for codes, audio in streamed:
            whole = voice.waveform(codes)
            assert audio.shape == whole.shape and whole.abs().max() > 0.05
            torch.testing.assert_close(audio, whole, rtol=0, atol=1e-4)


def test_streamed_chunks_across_decode_spans_equal_whole_decoding(engine):
    """generate() decodes a reply in spans of 300 codes (25 of left context, the last samples of each span lost):
    chunks never cross a span, and the chunks of 340 random codes (4, 8, ..., 64, then the span's rest, then the next
    span's) concatenate to `Omni3Voice.waveform`, transformers' chunked decode (measured 2.2e-5; checked at 1e-4)."""
    voice = engine._served["m"].model.voice
    codes = torch.randint(0, 16, (4, DECODE_SPAN + 40), generator=torch.Generator().manual_seed(3))
    cut = CodeChunks()
    pieces = [piece for i in range(codes.shape[1]) for piece in cut.feed({"codes": [codes[:, i].tolist()]})]
    pieces += cut.flush({})
    assert [(p["window"].shape[1] - p["context"], p["opens_span"]) for p in pieces] == [
        (4, True), (8, False), (16, False), (32, False), (64, False), (64, False), (64, False), (48, False),
        (40, True)]
    assert pieces[-1]["context"] == 25  # the span's own left context, as generate() decodes it
    windows = [(p["window"], p["context"], p["opens_span"]) for p in pieces]
    audio = torch.cat([chunk for window in windows for chunk in voice.chunks([window])])
    whole = voice.waveform(codes)
    assert audio.shape == whole.shape
    torch.testing.assert_close(audio, whole, rtol=0, atol=1e-4)
    # All nine in one forward (as code2wav's pool batches several replies' chunks): each as decoded alone.
    together = voice.chunks(windows)
    torch.testing.assert_close(torch.cat(together), audio, rtol=0, atol=2e-5)


def test_cancel_mid_stream_ends_the_request_everywhere(engine):
    """A cancel after the first audio chunk: the request ends with a cancelled error, no chunk follows it, and every
    stage lets go of it (the executor is idle: no talker row or code2wav chunk left queued or running)."""
    handle = speak(engine, STORY, SpeechOutput("ethan", 15, stream=True))
    assert_cancel_after_first_audio_ends_everywhere(engine, handle)


def test_a_realtime_omni_voice_speaks_streamed_chunks(engine):
    """A realtime omni voice on Qwen3-Omni: it hears the user's audio and answers with the streamed reply's chunks
    (the `vocoder` node's DELTAs), which equal the model's own streamed answer to the session's context (the session
    clock runs only as the client plays)."""
    import types

    from realtime.sessions import Journal, Outbox
    from realtime.voice.session import VoiceSession
    from realtime.voice.vad import VadLoader
    from tests.test_realtime_voice_support import Collector, silence, stream, voiced

    async def main():
        now = [0.0]
        collector, outbox = Collector(), Outbox(Journal(100_000, 1 << 30))
        await outbox.attach(collector.send)
        s = VoiceSession(engine, engine.voice_model("omni-voice"), VoiceSessionConfig(vad="energy", delta_ms=20,
                         max_lead_ms=20), session_id="sess_omni3", resume_token="tok", outbox=outbox,
                         vad=VadLoader("energy"), clock=lambda: now[0])
        await s.start()
        await stream(s.receive, np.concatenate([silence(0.3), voiced(1.0, seed=3), silence(0.8)]), realtime=False)

        async def playing():  # the client plays in (fast) time
            while True:
                now[0] += 0.05
                await asyncio.sleep(0.005)
        clock = asyncio.create_task(playing())
        done = await collector.wait_event("response.done")
        clock.cancel()
        context = await s.context_for(types.SimpleNamespace(params=s._default_params()))
        await s.close("test")
        return collector, done, context

    c, done, context = asyncio.run(main())
    assert done["response"]["status"] in ("completed", "incomplete"), done  # incomplete: max_output_tokens
    r = done["response"]["id"]
    pcm = b"".join(base64.b64decode(e["delta"]) for e in c.of("response.output_audio.delta", response_id=r))
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=0)
    want = speak(engine, context[:-1], SpeechOutput(engine.models["m"].voices[0], 0, stream=True), params)
    want = want.result(timeout=120)
    transcript = "".join(e["delta"] for e in c.of("response.output_audio_transcript.delta", response_id=r))
    assert transcript == want["choices"][0]["text"] and transcript
    got = np.frombuffer(pcm, "<i2").astype(np.float32) / 32767
    assert len(got) == len(want["audio"]) > 0
    np.testing.assert_allclose(got, want["audio"].numpy(), rtol=0, atol=1e-4)


def test_speech_refusals_name_the_field(engine):
    with pytest.raises(RequestError) as info:
        speak(engine, [{"role": "user", "content": "hi"}], SpeechOutput("nobody", 1))
    assert info.value.param == "audio.voice", info.value


def test_a_deepstack_checkpoint_is_served_without_images(tmp_path):
    """The released checkpoints' vision towers add deepstack features inside the text model, which the llm runner
    does not inject yet: such a checkpoint serves text and audio (still equal to generate()) and refuses images."""
    from pipelines.demo.omni3 import build_qwen3_omni

    path = str(tmp_path / "deepstack")
    with torch.random.fork_rng(devices=[]):
        build_qwen3_omni(seed=1, deepstack=True).save_pretrained(path)
    wav, samples = clip(1.0, 6)
    png, _ = image(7, (32, 32))
    with running_engine(path, family="vlm") as eng:
        assert eng.models["m"].tasks == ("chat", "audio-chat", "spoken-chat")
        with pytest.raises(RequestError) as info:
            ask(eng, [{"role": "user", "content": [image_part(png)]}])
        assert info.value.param == "messages[0].content[0].type" and "takes no image input" in str(info.value)
        got = tokens(ask(eng, [{"role": "user", "content": [audio_part(wav)]}]).result(timeout=60))
    assert got == make_reference(path)([{"role": "user", "content": [{"type": "audio", "audio": samples}]}])
