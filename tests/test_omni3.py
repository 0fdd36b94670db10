"""Qwen3-Omni served (the demo checkpoint: random weights, real code path).

The thinker as a chat model: text, audio and image parts through audio_encode / vision_encode and the llm stage, the
prompt's positions from the thinker's own rope index. Greedy answers equal transformers'
`Qwen3OmniMoeForConditionalGeneration.generate()` (text out) on its processor's inputs, token for token, alone and
batched. A checkpoint whose vision tower has deepstack mergers (as the released ones do) is served without image
input, and says so naming the field.

Speech out: the talker (its code predictor inside) and code2wav after the thinker. For the same seed the reply's
tokens and waveform equal `generate()` after `torch.manual_seed(seed)` (measured equal bit for bit; checked at 1e-5),
and the talker is handed the inputs `generate()` hands it."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import torch

from pipelines.chat import ChatRequest
from pipelines.image_request import RequestError
from pipelines.omni import SpeechOutput
from pipelines.omni3 import SAMPLE_RATE
from stages.events import StageError
from stages.llm.params import SamplingParams
from tests.helpers import demo_path, running_engine, vlm_engine_fixture, wav_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SPOKEN = SamplingParams(temperature=0, max_tokens=12)  # generate(thinker_max_new_tokens=12), stopping at eos


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return demo_path(tmp_path_factory, "qwen3_omni")


engine = vlm_engine_fixture()


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
    """generate() with audio out after torch.manual_seed(seed): (reply token ids, waveform)."""
    model, processor = loaded
    eos = processor.tokenizer.eos_token_id
    # transformers' talker reads the audio encoder's n_window from its own config, which lacks it: Omni3Voice's fix
    model.talker.config.audio_config = model.config.thinker_config.audio_config

    def answer(messages, seed: int, voice: str = "ethan") -> tuple[list[int], torch.Tensor]:
        inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                               return_tensors="pt")
        torch.manual_seed(seed)
        with torch.inference_mode():
            ids, wav = model.generate(**inputs, speaker=voice, thinker_max_new_tokens=12, thinker_do_sample=False,
                                      thinker_eos_token_id=eos)
        return ids[0, inputs["input_ids"].shape[1]:].tolist(), wav.reshape(-1)
    return answer


def assert_same_speech(result, want: tuple[list[int], torch.Tensor]) -> None:
    ids, wav = want
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


def recorded(talker) -> list[dict]:
    """Record every call of `talker.generate` (the instance's, then the real method runs)."""
    calls: list[dict] = []
    real = talker.generate

    def generate(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)
    talker.generate = generate
    return calls


def test_the_talker_reads_what_generate_hands_it(engine, loaded, spoken_reference):
    """A random talker samples nearly uniformly (its codes barely depend on what it reads), so the talker's inputs
    are compared directly: for a prompt with audio, an image and text, the embeddings (the user turn's text rows, its
    media rows from the recomputed thinker states, the reply's start), the reply's later steps, the ids and the media
    geometry equal the ones generate() hands its talker (embeddings of magnitude 4e-2 measured to 6e-11: checked at
    1e-8; a 0.1 % change in the recomputed thinker states fails it)."""
    voice = engine._served["m"].model.voice
    wav, samples = clip(1.5, 13)
    png, picture = image(14, (64, 48))
    ours = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": [
        {"type": "text", "text": "hear"}, audio_part(wav), {"type": "text", "text": "and see"}, image_part(png)]}]
    theirs = [ours[0], {"role": "user", "content": [
        {"type": "text", "text": "hear"}, {"type": "audio", "audio": samples}, {"type": "text", "text": "and see"},
        {"type": "image", "image": picture}]}]
    mine, reference_calls = recorded(voice.talker), recorded(loaded[0].talker)
    try:
        assert_same_speech(speak(engine, ours, SpeechOutput("ethan", 5)).result(timeout=120),
                           spoken_reference(theirs, 5))
    finally:
        del voice.talker.generate, loaded[0].talker.generate
    (got,), (want,) = mine, reference_calls
    for key in ("inputs_embeds", "trailing_text_hidden", "tts_pad_embed"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-8, msg=key)
    for key in ("talker_input_ids", "attention_mask", "audio_feature_lengths", "image_grid_thw"):
        assert torch.equal(got[key], want[key]), key
    assert (got["talker_input_ids"] == loaded[0].config.thinker_config.audio_token_id).sum() > 0  # the user's media


@pytest.mark.parametrize("speech, param", [(SpeechOutput("nobody", 1), "audio.voice"),
                                           (SpeechOutput("ethan", 1, stream=True), "stream")])
def test_speech_refusals_name_the_field(engine, speech, param):
    with pytest.raises(RequestError) as info:
        speak(engine, [{"role": "user", "content": "hi"}], speech)
    assert info.value.param == param, info.value


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
