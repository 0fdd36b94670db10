"""/v1/audio/speech and /v1/audio/voices through a real server process, with httpx and the official openai client.

One module-scoped server with the tiny demo VITS and SpeechT5 (random weights: the audio is shaped
noise, the code path is real) and the tiny demo Llama (a model that does not speak). Every
response is decoded with PyAV and measured.
"""

from __future__ import annotations

import base64
import io
import json

import av
import httpx
import numpy as np
import openai
import pytest

try:
    from tests.test_serve_support import Server, metric, wait_for
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_serve_support import Server, metric, wait_for

TEXT = "Hello there. This is a test of the speech server, with several phrases! Does it stream? Yes, it does."
# Codec frame in samples at 16 kHz (mp3, aac) or 48 kHz (opus); lossless formats are exact.
FRAME = {"mp3": 1152 / 16000, "aac": 1024 / 16000, "opus": 960 / 48000, "wav": 0.0, "flac": 0.0, "pcm": 0.0}
FORMATS = list(FRAME)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pipelines.demo import build_demo_model

    workdir = tmp_path_factory.mktemp("serve-speech")
    vits, t5, llama = (build_demo_model(f, workdir / f) for f in ("vits", "speecht5", "llama"))
    srv = Server(workdir, f"""
[[models]]
name = "vits-demo"
path = "{vits}"
[[models]]
name = "speecht5-demo"
path = "{t5}"
[[models]]
name = "llama-demo"
path = "{llama}"
family = "causal-lm"
[models.llm]
kv_cache_mb = 8
block_size = 4
""")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)


def post(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/audio/speech", json={"model": "vits-demo", "input": TEXT, **body}, timeout=60)


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """Mono float32 samples and the sample rate PyAV decodes from a response body."""
    kwargs = {"format": "s16le", "options": {"sample_rate": "24000", "ch_layout": "mono"}} if fmt == "pcm" else {}
    with av.open(io.BytesIO(data), **kwargs) as container:
        frames = [f for f in container.decode(audio=0)]
    rate = frames[0].sample_rate
    samples = np.concatenate([f.to_ndarray().astype(np.float32).reshape(-1) for f in frames])
    return samples, rate


def duration(data: bytes, fmt: str) -> float:
    samples, rate = decode(data, fmt)
    return len(samples) / rate


def pcm_seconds(data: bytes) -> float:
    return len(data) / 2 / 24000


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


# -- whole files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["vits-demo", "speecht5-demo"])
def test_every_format_decodes_to_the_right_duration(server, model):
    expected = pcm_seconds(post(server, model=model, response_format="pcm").content)
    for fmt in FORMATS:
        response = post(server, model=model, response_format=fmt)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("audio/")
        got = duration(response.content, fmt)
        # within a codec frame or two (encoder priming / padding), plus resampling rounding
        assert abs(got - expected) <= 2 * FRAME[fmt] + 1e-3, (fmt, got, expected)


def test_wav_holds_the_model_rate_and_pcm_is_24khz(server):
    wav = post(server, response_format="wav")
    assert wav.headers["x-sample-rate"] == "16000" and decode(wav.content, "wav")[1] == 16000
    pcm = post(server, response_format="pcm")
    assert pcm.headers["x-sample-rate"] == "24000" and len(pcm.content) % 2 == 0
    assert abs(pcm_seconds(pcm.content) - duration(wav.content, "wav")) < 0.01


# -- streaming -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["vits-demo", "speecht5-demo"])
def test_streamed_audio_concatenates_to_the_whole_file(server, model):
    whole = post(server, model=model, response_format="pcm").content
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60,
                      json={"model": model, "input": TEXT, "response_format": "pcm", "stream_format": "audio"}) as r:
        assert r.status_code == 200
        chunks = [c for c in r.iter_raw() if c]
    assert len(chunks) >= 2  # phrase by phrase
    assert b"".join(chunks) == whole
    # WAV: a streaming header (unknown length), then exactly the same samples
    wav = post(server, model=model, response_format="wav").content
    streamed = post(server, model=model, response_format="wav", stream_format="audio").content
    assert streamed[44:] == wav[44:] and decode(streamed, "wav")[0].shape == decode(wav, "wav")[0].shape


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
def test_streamed_compressed_formats_decode_to_the_right_duration(server, fmt):
    expected = pcm_seconds(post(server, response_format="pcm").content)
    streamed = post(server, response_format=fmt, stream_format="audio")
    assert streamed.status_code == 200
    assert abs(duration(streamed.content, fmt) - expected) <= 2 * FRAME[fmt] + 1e-3


def test_sse_sends_openai_events_whose_audio_is_the_stream(server):
    response = post(server, response_format="pcm", stream_format="sse")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["input_tokens"] > 0
    assert events[-1]["usage"]["total_tokens"] == events[-1]["usage"]["input_tokens"]
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert audio == post(server, response_format="pcm").content


def test_a_client_that_leaves_mid_stream_cancels_the_request(server):
    before = metric(server.url, "mmserve_graph_requests_total", model="vits-demo", outcome="cancelled")
    long_text = " ".join(["This sentence is spoken again and again."] * 60)
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60,
                      json={"model": "vits-demo", "input": long_text, "response_format": "pcm",
                            "stream_format": "audio"}) as r:
        next(r.iter_raw())
    assert wait_for(lambda: metric(server.url, "mmserve_graph_requests_total", model="vits-demo",
                                   outcome="cancelled") > before, timeout_s=20)


# -- speed ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["vits-demo", "speecht5-demo"])
def test_speed_changes_the_duration(server, model):
    normal = pcm_seconds(post(server, model=model, response_format="pcm").content)
    fast = pcm_seconds(post(server, model=model, response_format="pcm", speed=2.0).content)
    slow = pcm_seconds(post(server, model=model, response_format="pcm", speed=0.5).content)
    assert 0.3 < fast / normal < 0.7 and 1.5 < slow / normal < 2.6, (fast, normal, slow)


# -- the openai client ---------------------------------------------------------------------------


def test_openai_client_create(client):
    response = client.audio.speech.create(model="speecht5-demo", voice="nova", input=TEXT, response_format="mp3",
                                          instructions="Speak cheerfully.")
    samples, rate = decode(response.content, "mp3")
    assert rate == 16000 and len(samples) / rate > 1.0


def test_openai_client_streaming_response(server, client):
    whole = post(server, model="vits-demo", voice="echo", response_format="pcm").content
    with client.audio.speech.with_streaming_response.create(
            model="vits-demo", voice="echo", input=TEXT, response_format="pcm", stream_format="audio") as response:
        chunks = [c for c in response.iter_bytes(4096)]
    assert b"".join(chunks) == whole and len(chunks) > 1


def test_openai_client_voice_object_and_seed(server):
    a = post(server, voice={"id": "echo"}, response_format="pcm", seed=5).content
    b = post(server, voice="echo", response_format="pcm", seed=5).content
    c = post(server, voice="echo", response_format="pcm", seed=6).content
    assert a == b and a != c


# -- voices and models ---------------------------------------------------------------------------


def test_voices_are_listed_per_model(server):
    models = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert models["vits-demo"]["voices"] == ["alloy", "echo"] and "text-to-speech" in models["vits-demo"]["tasks"]
    assert models["speecht5-demo"]["voices"] == ["alloy", "echo", "fable", "nova", "onyx", "shimmer"]
    assert "voices" not in models["llama-demo"]
    listed = httpx.get(f"{server.url}/v1/audio/voices", params={"model": "speecht5-demo"}).json()["data"]
    assert [v["id"] for v in listed] == models["speecht5-demo"]["voices"]
    everything = httpx.get(f"{server.url}/v1/audio/voices").json()["data"]
    assert {v["model"] for v in everything} == {"vits-demo", "speecht5-demo"}
    assert_error(httpx.get(f"{server.url}/v1/audio/voices", params={"model": "llama-demo"}), 400, "model")


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("body,status,param,code", [
    ({"input": ""}, 400, "input", None),
    ({"input": "x" * 4097}, 400, "input", "input_too_long"),
    ({"voice": "nobody"}, 400, "voice", "unknown_voice"),
    ({"voice": {"id": "nobody"}}, 400, "voice", "unknown_voice"),
    ({"response_format": "ogg"}, 400, "response_format", "unsupported_format"),
    ({"speed": 0.1}, 400, "speed", None),
    ({"speed": 4.01}, 400, "speed", None),
    ({"speed": "fast"}, 400, "speed", None),
    ({"stream_format": "chunks"}, 400, "stream_format", None),
    ({"model": "no-such-model"}, 404, "model", "model_not_found"),
    ({"model": "llama-demo"}, 400, "model", "unsupported_task"),
    ({"volume": 11}, 400, "volume", "unknown_parameter"),
])
def test_bad_requests_name_the_field(server, body, status, param, code):
    assert_error(post(server, **body), status, param, code)


def test_missing_input_names_the_field(server):
    response = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "vits-demo"}, timeout=10)
    assert_error(response, 400, "input", "missing_required_parameter")


def test_openai_client_sees_the_error(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.speech.create(model="vits-demo", voice="nobody", input="hello")
    assert err.value.body["param"] == "voice"
