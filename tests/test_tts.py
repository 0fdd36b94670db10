"""Text to speech below HTTP: phrase splitting, resampling and fades, the family adapters against the
models' own forward / generate_speech, and the tts stage through the engine (streaming, speed, checks).

Tiny seeded random checkpoints (pipelines/demo/tts.py), saved and reloaded with from_pretrained.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.image_request import RequestError
from pipelines.phrases import PhraseLimits, PhraseSplitter, ends_sentence, split_phrases
from pipelines.tts import SpeechRequest
from serve.errors import http_status
from stages.events import EventKind, StageError
from stages.speech.audio_dsp import fade_edges, resample, stretch_frames

TEXT = ("Hello there. This is a test of the speech server, with several phrases! Does it stream? "
        "Yes, it does, phrase by phrase.")


@pytest.fixture(scope="module")
def tts_paths(tmp_path_factory):
    from pipelines.demo import build_demo_model

    root = tmp_path_factory.mktemp("tts-models")
    return {family: str(build_demo_model(family, root / family)) for family in ("vits", "speecht5")}


@pytest.fixture(scope="module")
def engine(tts_paths):
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine

    specs = (ModelSpec("vits", tts_paths["vits"]), ModelSpec("speecht5", tts_paths["speecht5"]))
    eng = Engine(EngineConfig(models=specs))
    eng.start()
    yield eng
    eng.shutdown()


def speak(engine, model: str, text: str = TEXT, **kwargs) -> tuple[list[np.ndarray], dict]:
    """The DELTA chunks and the FINAL outputs of one request."""
    chunks, outputs = [], None
    for event in engine.submit_speech(model, SpeechRequest(text, **kwargs)).events(timeout=120):
        if event.kind is EventKind.DELTA:
            chunks.append(event.data["audio"])
        elif event.kind is EventKind.FINAL:
            outputs = event.data["outputs"]
        elif event.kind is EventKind.ERROR:
            raise AssertionError(event.data)
    return chunks, outputs


# -- phrases --------------------------------------------------------------------------------


def test_phrases_end_at_sentences_and_keep_abbreviations():
    text = "Mr. Smith met Dr. J. Watson at 3.5 p.m. today! Was it fun?\nYes… it was (really)."
    assert split_phrases(text) == ["Mr. Smith met Dr. J. Watson at 3.5 p.m. today!", "Was it fun?", "Yes…",
                                   "it was (really)."]


def test_long_sentences_are_cut_at_clauses_then_spaces_within_the_limits():
    limits = PhraseLimits(max_chars=40, first_max_chars=20)
    text = ("One two three, four five six seven eight nine ten eleven, twelve thirteen fourteen. "
            + "x" * 50 + " end.")
    phrases = split_phrases(text, limits)
    assert phrases[0] == "One two three,"  # first phrase: its own lower limit, cut at the clause
    assert all(len(p) <= 40 for p in phrases)
    assert "".join(phrases).replace(" ", "") == text.replace(" ", "")  # nothing lost, nothing added
    assert phrases[-2:] == ["x" * 40, "xxxxxxxxxx end."]  # a word longer than the limit is cut hard


def test_the_first_phrase_may_end_at_a_clause_once_it_is_long_enough():
    limits = PhraseLimits(max_chars=200, first_max_chars=60, first_clause_chars=24)
    text = "Well, the red car is parked outside, right by the door. Then we left, quickly."
    assert split_phrases(text, limits) == ["Well, the red car is parked outside,", "right by the door.",
                                           "Then we left, quickly."]  # "Well," is too short; later ones: sentences
    assert split_phrases("Yes. Of course, gladly.", limits) == ["Yes.", "Of course, gladly."]  # a sentence first
    assert split_phrases(text) == ["Well, the red car is parked outside, right by the door.", "Then we left, quickly."]
    assert [ends_sentence(t) for t in ("The door.", "the door", "Is it 'ok?' ", "Ask Mr.", "a, b,")] == \
        [True, False, True, False, False]  # the splitter's sentence end (the adaptive end of turn reads it)


def test_feeding_pieces_gives_the_same_phrases_as_the_whole_text():
    rng = random.Random(0)
    words = ["alpha", "beta,", "gamma.", "delta!", "Mr.", "e.g.", "x" * 35, "omega;", "pi?\n", "rho"]
    for k in range(100):
        limits = PhraseLimits(max_chars=30, first_max_chars=12, first_clause_chars=6 if k % 2 else None)
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        splitter, got = PhraseSplitter(limits), []
        i = 0
        while i < len(text):
            j = i + rng.randint(1, 7)
            got += splitter.feed(text[i:j])
            i = j
        got += splitter.flush()
        assert got == split_phrases(text, limits), text
        assert "".join(got).replace(" ", "") == text.replace(" ", "").replace("\n", "")


# -- audio helpers ---------------------------------------------------------------------------


def test_resample_keeps_a_tone_and_the_length():
    t = np.arange(16000) / 16000
    tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    up = resample(tone, 16000, 24000)
    assert len(up) == 24000
    expected = np.sin(2 * np.pi * 440 * np.arange(24000) / 24000)
    assert np.abs(up - expected)[100:-100].max() < 2e-3


def test_fades_make_every_piece_start_and_end_at_zero():
    piece = fade_edges(np.ones(1000, np.float32), 80)
    assert piece[0] == 0 and piece[-1] == 0 and piece[500] == 1
    assert np.all(np.diff(piece[:80]) >= 0)  # a monotone ramp, no step
    assert fade_edges(np.ones(3, np.float32), 80).tolist() == [0, 1, 0]


def test_stretch_frames_changes_the_frame_count():
    frames = torch.randn(40, 80)
    assert stretch_frames(frames, 2.0).shape == (20, 80)
    assert stretch_frames(frames, 0.5).shape == (80, 80)
    assert torch.equal(stretch_frames(frames, 1.0), frames)


# -- family adapters against the model's own forward ------------------------------------------


@pytest.mark.parametrize("voice,speed", [("alloy", 1.0), ("echo", 1.0), ("echo", 1.7)])
def test_vits_equals_the_model_forward_for_the_same_seed(tts_paths, voice, speed):
    from pipelines.tts_vits import VitsSpeaker

    speaker = VitsSpeaker(tts_paths["vits"])
    phrases = [speaker.tokenize(t) for t in ("Hello there.", "A second, longer phrase follows it!")]
    generator = torch.Generator().manual_seed(1234)
    ours = [speaker.synthesize(ids, speaker.voices[voice], speed, generator) for ids in phrases]
    torch.manual_seed(1234)  # one seed, then the phrases in order: the global RNG is consumed the same way
    with torch.no_grad():
        theirs = [speaker.model(torch.tensor([ids]), speaker_id=speaker.voices[voice], speaking_rate=speed)
                  .waveform[0].numpy() for ids in phrases]
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and np.array_equal(a, b)


def test_vits_without_stochastic_durations_or_speakers(tmp_path, tts_paths):
    from transformers import VitsConfig, VitsModel

    from pipelines.tts_vits import VitsSpeaker

    config = VitsConfig.from_pretrained(tts_paths["vits"])
    config.use_stochastic_duration_prediction, config.num_speakers, config.speaker_embedding_size = False, 1, 0
    torch.manual_seed(0)
    VitsModel(config).save_pretrained(tmp_path)
    for name in ("vocab.json", "tokenizer_config.json", "added_tokens.json"):
        (tmp_path / name).write_bytes((Path(tts_paths["vits"]) / name).read_bytes())
    speaker = VitsSpeaker(str(tmp_path))
    assert speaker.voices == {"default": None}
    ids = speaker.tokenize("plain durations")
    ours = speaker.synthesize(ids, None, 1.0, torch.Generator().manual_seed(5))
    torch.manual_seed(5)
    with torch.no_grad():
        theirs = speaker.model(torch.tensor([ids])).waveform[0].numpy()
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("stop_by_threshold", [False, True])
def test_speecht5_equals_generate_speech_for_the_same_seed(tts_paths, stop_by_threshold):
    from pipelines.tts_speecht5 import SpeechT5Speaker

    speaker = SpeechT5Speaker(tts_paths["speecht5"])
    kwargs = {"maxlenratio": speaker.generation["maxlenratio"]}
    if stop_by_threshold:  # a random stop head: generation ends where the probability first crosses 0.5
        torch.manual_seed(3)
        with torch.no_grad():
            speaker.model.speech_decoder_postnet.prob_out.weight.normal_(0, 0.5)
            speaker.model.speech_decoder_postnet.prob_out.bias.fill_(-1.0)
        speaker.generation = dict(speaker.generation, maxlenratio=20.0)
        kwargs = {"maxlenratio": 20.0}
    phrases = [speaker.tokenize(t) for t in ("Hello there.", "A second phrase!")]
    voice = speaker.voices["nova"]
    generator = torch.Generator().manual_seed(99)
    ours = [speaker.synthesize(ids, voice, 1.0, generator) for ids in phrases]
    torch.manual_seed(99)
    with torch.no_grad():
        theirs = [speaker.model.generate_speech(torch.tensor([ids]), voice[None], vocoder=speaker.vocoder, **kwargs)
                  .numpy() for ids in phrases]
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and np.array_equal(a, b)


# -- the tts stage through the engine ---------------------------------------------------------


@pytest.mark.parametrize("model", ["vits", "speecht5"])
def test_streamed_chunks_are_the_whole_output_and_join_click_free(engine, model):
    chunks, outputs = speak(engine, model)
    assert outputs["phrases"] == len(chunks) == len(split_phrases(TEXT)) > 1
    assert np.array_equal(np.concatenate(chunks), outputs["audio"])
    fade = 80  # 5 ms at 16 kHz
    ramp = np.sin(np.arange(fade) / fade * np.pi / 2) ** 2 + 1e-6  # the envelope of a full-scale (|x| <= 1) signal
    for chunk in chunks:  # every join goes through zero, and each edge is a ramp, not a step
        assert chunk[0] == 0 and chunk[-1] == 0
        assert np.all(np.abs(chunk[:fade]) <= ramp) and np.all(np.abs(chunk[::-1][:fade]) <= ramp)
    assert outputs["sample_rate"] == 16000 and outputs["input_tokens"] > 0


@pytest.mark.parametrize("model", ["vits", "speecht5"])
def test_the_stage_renders_what_the_adapter_makes_faded(engine, model):
    from stages.speech.tts import FADE_S

    speaker = engine.speech_model(model).speaker
    [chunk], outputs = speak(engine, model, "Just one phrase here", seed=7, voice="echo")
    raw = speaker.synthesize(speaker.tokenize("Just one phrase here"), speaker.voices["echo"], 1.0,
                             torch.Generator().manual_seed(7))
    assert np.array_equal(chunk, fade_edges(raw, round(FADE_S * 16000)))


def test_the_same_seed_gives_the_same_audio_and_another_seed_other_audio(engine):
    _, a = speak(engine, "vits", seed=1)
    _, b = speak(engine, "vits", seed=1)
    _, c = speak(engine, "vits", seed=2)
    assert np.array_equal(a["audio"], b["audio"])
    assert not (len(a["audio"]) == len(c["audio"]) and np.array_equal(a["audio"], c["audio"]))


@pytest.mark.parametrize("model", ["vits", "speecht5"])
def test_speed_changes_the_duration(engine, model):
    base = len(speak(engine, model)[1]["audio"])
    fast = len(speak(engine, model, speed=2.0)[1]["audio"])
    slow = len(speak(engine, model, speed=0.5)[1]["audio"])
    assert 0.3 < fast / base < 0.7, (fast, base)
    assert 1.5 < slow / base < 2.6, (slow, base)


def test_a_requested_sample_rate_resamples_each_phrase(engine):
    _, native = speak(engine, "speecht5")
    chunks, at24k = speak(engine, "speecht5", sample_rate=24000)
    assert at24k["sample_rate"] == 24000
    assert abs(len(at24k["audio"]) - 1.5 * len(native["audio"])) <= len(chunks)  # ceil per phrase
    assert all(c[0] == 0 and c[-1] == 0 for c in chunks)


def test_cancel_stops_at_a_phrase_boundary(engine):
    handle = engine.submit_speech("vits", SpeechRequest(" ".join(["Another sentence here."] * 40)))
    deltas = 0
    with pytest.raises(StageError) as err:
        for event in handle.events(timeout=60):
            if event.kind is EventKind.DELTA:
                deltas += 1
                handle.cancel()
        handle.result(timeout=10)
    assert err.value.code == "cancelled" and deltas < 40


@pytest.mark.parametrize("request_kwargs,param", [
    (dict(input=""), "input"), (dict(input="   "), "input"), (dict(input="x" * 4097), "input"),
    (dict(input="hello", voice="nobody"), "voice"), (dict(input="hello", speed=0.2), "speed"),
    (dict(input="hello", speed=4.5), "speed"), (dict(input="hello", speed=float("nan")), "speed"),
    (dict(input="hello", seed=-1), "seed"), (dict(input="%%% ### !!!"), "input"),
])
def test_bad_requests_name_the_field(engine, request_kwargs, param):
    text = request_kwargs.pop("input")
    with pytest.raises(RequestError) as err:
        engine.submit_speech("vits", SpeechRequest(text, **request_kwargs))
    assert err.value.param == param and http_status(err.value) == 400


def test_unknown_model_is_404(engine):
    with pytest.raises(RequestError) as err:
        engine.submit_speech("nope", SpeechRequest("hello"))
    assert http_status(err.value) == 404 and err.value.param == "model"


def test_benchmark_script_prints_the_ratio(tts_paths):
    import re
    import subprocess
    import sys

    from tests.test_serve_support import ENV, REPO

    run = subprocess.run([sys.executable, "examples/bench_tts.py", "--checkpoint", tts_paths["vits"], "--repeats", "1"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert re.search(r"first audio / full synthesis: \d+\.\d+x", run.stdout), run.stdout
