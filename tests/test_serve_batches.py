"""/v1/files, /v1/batches and /v1/videos through a real server process with its job store in a tmp data dir.

The official openai client drives files and batches over chat, embeddings and images lines on the tiny demo
models; a batch with bad lines reports them per line; SIGKILL mid-batch and mid-video and a restart on the same
data dir finish every job with exactly one output line per input line.
"""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import openai
import pytest

try:
    from tests.test_serve_support import Server, metric, wait_for
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_serve_support import Server, metric, wait_for

VIDEO = {"model": "wan-demo", "prompt": "a boat", "size": "32x32", "num_frames": 5, "num_inference_steps": 4}
CHAT = {"model": "llama-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from pipelines.demo import build_demo_model

    root = tmp_path_factory.mktemp("batch-models")
    names = ("llama", "clip", "sd", "vits", "whisper", "wan", "wan-i2v")
    return {name: build_demo_model(name, root / name) for name in names}


def _config(models, data_dir, names=("llama", "clip", "sd", "vits", "whisper", "wan", "wan-i2v")) -> str:
    families = {"llama": ("llama-demo", "causal-lm"), "clip": ("clip-demo", "clip-embedding"),
                "sd": ("sd-demo", "sd"), "vits": ("vits-demo", "vits"), "whisper": ("whisper-demo", "whisper"),
                "wan": ("wan-demo", "wan"), "wan-i2v": ("wan-i2v-demo", "wan")}
    text = f'[server]\ndata_dir = "{data_dir}"\n[jobs]\nbatch_line_concurrency = 2\n'
    for key in names:
        if key in models:
            name, family = families[key]
            text += f'[[models]]\nname = "{name}"\npath = "{models[key]}"\nfamily = "{family}"\n'
            if key == "llama":
                text += "[models.llm]\nkv_cache_mb = 8\nblock_size = 4\n"
            if key == "whisper":  # random weights never end a window: cap what they ramble
                text += "[models.asr]\nmax_new_tokens = 8\n"
    return text


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serve-batches")
    srv = Server(workdir, _config(models, workdir / "data"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)


def _jsonl(lines) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def _wait_batch(client, batch_id: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} did not finish: {batch}")


def _records(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.mark.parametrize("endpoint,body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/embeddings", {"model": "clip-demo", "input": "a red square"}),
    ("/v1/images/generations", {"model": "sd-demo", "prompt": "a cat", "size": "64x64", "num_inference_steps": 2,
                                "response_format": "b64_json"}),
    ("/v1/audio/speech", {"model": "vits-demo", "input": "hello there", "response_format": "wav"}),
])
def test_openai_client_files_and_batches(client, endpoint, body):
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": body} for i in range(3)]
    f = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0
    assert client.files.retrieve(f.id).filename == "in.jsonl"
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    assert batch.input_file_id == f.id
    batch = _wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 3 and batch.request_counts.completed == 3 and batch.request_counts.failed == 0
    records = _records(client, batch.output_file_id)
    assert [r["custom_id"] for r in records] == ["req-0", "req-1", "req-2"]
    for r in records:
        assert r["response"]["status_code"] == 200 and r["error"] is None
        if endpoint == "/v1/audio/speech":  # binary bodies come back as base64
            assert r["response"]["body"]["content_type"] == "audio/wav"
            assert base64.b64decode(r["response"]["body"]["b64"])[:4] == b"RIFF"
    assert batch.error_file_id is None
    assert any(b.id == batch.id for b in client.batches.list())


def test_batch_with_bad_lines(client):
    lines = [{"custom_id": "good-1", "url": "/v1/chat/completions", "body": CHAT},
             "this is not json",
             {"url": "/v1/chat/completions", "body": CHAT},  # no custom_id
             {"custom_id": "wrong-url", "url": "/v1/embeddings", "body": {"input": "x"}},
             {"custom_id": "bad-field", "url": "/v1/chat/completions", "body": {**CHAT, "max_tokens": -1}},
             {"custom_id": "good-2", "url": "/v1/chat/completions", "body": CHAT}]
    f = client.files.create(file=("bad.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = _wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                      completion_window="24h").id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 2, 4)
    assert [r["custom_id"] for r in _records(client, batch.output_file_id)] == ["good-1", "good-2"]
    errors = _records(client, batch.error_file_id)
    assert [r["custom_id"] for r in errors] == [None, None, "wrong-url", "bad-field"]
    assert errors[0]["error"]["code"] == "invalid_json" and errors[2]["error"]["code"] == "mismatched_url"
    assert errors[3]["response"]["status_code"] == 400


def test_unknown_ids_and_bad_requests(server, client):
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    r = httpx.post(f"{server.url}/v1/batches", json={"input_file_id": "x", "endpoint": "/v1/models",
                                                     "completion_window": "24h"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "endpoint"


def test_batch_cancel(client):
    lines = [{"custom_id": f"c{i}", "url": "/v1/chat/completions", "body": {**CHAT, "max_tokens": 16}}
             for i in range(40)]
    f = client.files.create(file=("c.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    batch = _wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.request_counts.completed < 40


def test_batch_cancel_counts_in_flight_lines_as_cancelled_not_500(client, server):
    route = "/v1/images/generations"
    counts = lambda status: metric(server.url, "mmserve_requests_total", route=route, status=status)  # noqa: E731
    before_499, before_500 = counts("499"), counts("500")
    slow = {"model": "sd-demo", "prompt": "a slow one", "size": "512x512", "num_inference_steps": 200,
            "response_format": "b64_json"}
    lines = [{"custom_id": f"s{i}", "url": route, "body": slow} for i in range(4)]
    f = client.files.create(file=("slow.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=route, completion_window="24h")
    # batch_line_concurrency = 2: two lines are inside the app, denoising, when the batch is cancelled
    busy = lambda: metric(server.url, "mmserve_stage_active_items", stage="sd-demo/denoise") == 2  # noqa: E731
    assert wait_for(busy, timeout_s=60), server.log_tail()
    client.batches.cancel(batch.id)
    batch = _wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.request_counts.completed == 0
    assert wait_for(lambda: counts("499") == before_499 + 2, timeout_s=30), (counts("499"), counts("500"))
    assert counts("500") == before_500  # no client saw a 500


# -- crash safety ------------------------------------------------------------------------------------


def test_sigkill_mid_batch_then_restart_completes_every_line_once(models, tmp_path):
    names = ("llama", "wan")
    data = tmp_path / "data"
    lines = [{"custom_id": f"line-{i}", "url": "/v1/chat/completions", "body": {**CHAT, "max_tokens": 12}}
             for i in range(50)]
    srv = Server(tmp_path, _config(models, data, names))
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        f = c.files.create(file=("crash.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
        batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        # enough steps to still be running when the batch has 5 lines done (no race)
        video = httpx.post(f"{srv.url}/v1/videos", json={**VIDEO, "num_inference_steps": 200}, timeout=30).json()
        assert wait_for(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 5, timeout_s=30)
        assert c.batches.retrieve(batch.id).status == "in_progress"
        # killed mid-run: the restart runs it again from the beginning
        assert httpx.get(f"{srv.url}/v1/videos/{video['id']}").json()["status"] in ("queued", "in_progress")
    finally:
        srv.proc.kill()  # SIGKILL: no shutdown code runs
        srv.proc.wait(10)
        srv._log.close()
    srv = Server(tmp_path, _config(models, data, names))
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        done = _wait_batch(c, batch.id, timeout_s=60)
        assert done.status == "completed" and done.request_counts.completed == 50
        ids = [r["custom_id"] for r in _records(c, done.output_file_id)]
        assert sorted(ids) == sorted(x["custom_id"] for x in lines) and len(ids) == 50  # once each, none lost
        assert done.error_file_id is None
        status = lambda: httpx.get(f"{srv.url}/v1/videos/{video['id']}").json()  # noqa: E731
        assert wait_for(lambda: status()["status"] == "completed", timeout_s=120), status()
    finally:
        srv.stop()


def test_jobs_turned_away_busy_run_again_and_finish_once(models, tmp_path):
    """Each model admits one request at a time (max_inflight = 1): of two videos started together and four batch
    lines sent at once, all but one meet a 429 (queue_full); they run again after its Retry-After and every job
    completes, each line with one result."""
    data = tmp_path / "data"
    text = (f'[server]\ndata_dir = "{data}"\n[jobs]\nbatch_line_concurrency = 4\nvideo_concurrency = 2\n'
            f'video_start_window_s = 0.2\nretries = 30\n')
    for name, family, key in (("sd-demo", "sd", "sd"), ("wan-demo", "wan", "wan")):
        text += f'[[models]]\nname = "{name}"\npath = "{models[key]}"\nfamily = "{family}"\nmax_inflight = 1\n'
    srv = Server(tmp_path, text)
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        image = {"model": "sd-demo", "prompt": "a cat", "size": "64x64", "num_inference_steps": 2}
        lines = [{"custom_id": f"img-{i}", "url": "/v1/images/generations", "body": {**image, "seed": i}}
                 for i in range(4)]
        f = c.files.create(file=("busy.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
        batch = c.batches.create(input_file_id=f.id, endpoint="/v1/images/generations", completion_window="24h")
        videos = [httpx.post(f"{srv.url}/v1/videos", json={**VIDEO, "seed": i}, timeout=30).json() for i in range(2)]
        done = _wait_batch(c, batch.id, timeout_s=120)
        assert done.status == "completed" and done.request_counts.completed == 4 and done.error_file_id is None
        assert sorted(r["custom_id"] for r in _records(c, done.output_file_id)) == [x["custom_id"] for x in lines]
        status = lambda v: httpx.get(f"{srv.url}/v1/videos/{v['id']}").json()  # noqa: E731
        assert wait_for(lambda: all(status(v)["status"] in ("completed", "failed") for v in videos), timeout_s=120)
        assert [status(v)["status"] for v in videos] == ["completed", "completed"], [status(v) for v in videos]
        # The retries happened: the lines' 429s were answered, a video was turned away and ran again.
        assert metric(srv.url, "mmserve_requests_total", route="/v1/images/generations", status="429") >= 3
        assert "queue_full" in srv.log_tail(200_000) and "runs again (retry 1 of 30)" in srv.log_tail(200_000)
    finally:
        srv.stop()


# -- videos ------------------------------------------------------------------------------------------


def test_video_job_lifecycle(server):
    import av

    url = server.url
    body = VIDEO
    job = httpx.post(f"{url}/v1/videos", json=body, headers={"Idempotency-Key": "boat-1"}, timeout=30).json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress"), job
    retry = httpx.post(f"{url}/v1/videos", json=body, headers={"Idempotency-Key": "boat-1"}, timeout=30).json()
    assert retry["id"] == job["id"]
    seen = []

    def finished():
        j = httpx.get(f"{url}/v1/videos/{job['id']}").json()
        seen.append(j["progress"])
        return j["status"] in ("completed", "failed")

    assert job["seconds"] == "0.25"  # 5 frames at wan-demo's default 16 fps, though the body sent no seconds
    assert wait_for(finished, timeout_s=60)
    assert seen == sorted(seen) and seen[-1] == 100
    mp4 = httpx.get(f"{url}/v1/videos/{job['id']}/content")
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(mp4.content)) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == (32, 32)
    thumb = httpx.get(f"{url}/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
    assert thumb.headers["content-type"] == "image/jpeg"

    slow = httpx.post(f"{url}/v1/videos", json={**body, "num_inference_steps": 200}, timeout=30).json()
    assert wait_for(lambda: httpx.get(f"{url}/v1/videos/{slow['id']}").json()["status"] == "in_progress")
    cancelled = httpx.delete(f"{url}/v1/videos/{slow['id']}", timeout=30).json()
    assert cancelled["status"] == "cancelled"
    listing = httpx.get(f"{url}/v1/videos", params={"limit": 1}).json()
    assert listing["has_more"] and len(listing["data"]) == 1


def test_video_bad_input_is_refused_up_front(server):
    try:
        from tests.test_serve_support import png_bytes
    except ImportError:
        from test_serve_support import png_bytes

    bad_size = httpx.post(f"{server.url}/v1/videos", json={**VIDEO, "size": "30x30"}, timeout=30)
    assert bad_size.status_code == 400 and bad_size.json()["error"]["param"] == "size", bad_size.text
    bad_frames = httpx.post(f"{server.url}/v1/videos", json={**VIDEO, "num_frames": 6}, timeout=30)
    assert bad_frames.status_code == 400 and bad_frames.json()["error"]["param"] == "num_frames", bad_frames.text
    form = {k: str(v) for k, v in VIDEO.items()}
    multipart = httpx.post(f"{server.url}/v1/videos", data=form, timeout=30,
                           files={"input_reference": ("ref.png", png_bytes(32, 32), "image/png")})
    assert multipart.status_code == 400 and multipart.json()["error"]["param"] == "image", multipart.text  # t2v model
    corrupt = httpx.post(f"{server.url}/v1/videos", data=form, timeout=30,
                         files={"input_reference": ("ref.png", b"not an image", "image/png")})
    assert corrupt.status_code == 400 and corrupt.json()["error"]["param"] == "input_reference", corrupt.text


def test_video_model_choice_seconds_and_idempotency_errors(server):
    url = server.url
    for model in ("sd-demo", "llama-demo"):  # an image model (it does realtime-video, not videos), a chat model
        r = httpx.post(f"{url}/v1/videos", json={**VIDEO, "model": model}, timeout=30)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("model", "unsupported_task"), r.text
    # no model: the default for the task (serve/models.py); every video model here is a random-weight demo
    default = httpx.post(f"{url}/v1/videos", json={k: v for k, v in VIDEO.items() if k != "model"}, timeout=30)
    assert default.status_code == 200 and default.json()["model"] == "wan-demo", default.text  # text-to-video
    httpx.delete(f"{url}/v1/videos/{default.json()['id']}", timeout=30)
    long = httpx.post(f"{url}/v1/videos", json={**VIDEO, "num_frames": None, "seconds": "99999"}, timeout=30)
    error = long.json()["error"]
    assert long.status_code == 400 and error["param"] == "seconds", long.text
    assert "16 seconds" in error["message"] and "257 frames" in error["message"]  # at wan-demo's 16 fps
    body = {**VIDEO, "num_frames": None, "seconds": "1", "num_inference_steps": 1}
    first = httpx.post(f"{url}/v1/videos", json=body, headers={"Idempotency-Key": "k-1"}, timeout=30)
    assert first.status_code == 200 and first.json()["seconds"] == "1", first.text
    same = httpx.post(f"{url}/v1/videos", json=body, headers={"Idempotency-Key": "k-1"}, timeout=30)
    assert same.status_code == 200 and same.json()["id"] == first.json()["id"], same.text
    changed = httpx.post(f"{url}/v1/videos", json={**body, "prompt": "a ship"}, headers={"Idempotency-Key": "k-1"},
                         timeout=30)
    assert changed.status_code == 422 and changed.json()["error"]["code"] == "idempotency_key_reused", changed.text
    assert changed.json()["error"]["param"] == "Idempotency-Key"


def test_video_fps_floor_and_blank_idempotency_keys(server):
    url = server.url
    # an fps the MP4 time base cannot hold is refused at the POST, not a failed job later (it was Fraction(1, 0))
    tiny = httpx.post(f"{url}/v1/videos", json={**VIDEO, "fps": 1e-300}, timeout=30)
    assert tiny.status_code == 400 and tiny.json()["error"]["param"] == "fps", tiny.text
    assert "[1, 60]" in tiny.json()["error"]["message"]
    # an empty Idempotency-Key is no key: it ties nothing to the first request sent with it
    ids = []
    for prompt, key in (("one", ""), ("two", ""), ("three", "")):
        r = httpx.post(f"{url}/v1/videos", json={**VIDEO, "prompt": prompt}, headers={"Idempotency-Key": key},
                       timeout=30)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    assert len(set(ids)) == 3
    for video_id in ids:
        httpx.delete(f"{url}/v1/videos/{video_id}", timeout=30)
    long = httpx.post(f"{url}/v1/videos", json=VIDEO, headers={"Idempotency-Key": "k" * 256}, timeout=30)
    assert long.status_code == 400 and long.json()["error"]["param"] == "Idempotency-Key", long.text


def test_batch_idempotency_key_needs_the_same_body(client):
    lines = [{"custom_id": "e", "url": "/v1/embeddings", "body": {"model": "clip-demo", "input": "a"}}]
    f = client.files.create(file=("one.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    headers = {"Idempotency-Key": "batch-k"}
    first = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h",
                                  extra_headers=headers)
    again = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h",
                                  extra_headers=headers)
    assert again.id == first.id
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h",
                              metadata={"run": "2"}, extra_headers=headers)
    assert e.value.code == "idempotency_key_reused" and first.id in e.value.message
    _wait_batch(client, first.id)


@pytest.mark.parametrize("how", ["multipart", "json-data-uri", "json-image-url"])
def test_image_to_video_job_end_to_end(server, how):
    import av

    try:
        from tests.test_serve_support import png_bytes
    except ImportError:
        from test_serve_support import png_bytes

    url = server.url
    body = {**VIDEO, "model": "wan-i2v-demo", "prompt": "the boat sails"}
    png = png_bytes(48, 40)  # resized to the request size, as the pipeline does
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    if how == "multipart":
        reply = httpx.post(f"{url}/v1/videos", data={k: str(v) for k, v in body.items()}, timeout=30,
                           files={"input_reference": ("ref.png", png, "image/png")})
    else:
        ref = uri if how == "json-data-uri" else {"image_url": uri}
        reply = httpx.post(f"{url}/v1/videos", json={**body, "input_reference": ref}, timeout=30)
    assert reply.status_code == 200, reply.text
    job = reply.json()
    assert job["model"] == "wan-i2v-demo" and job["status"] in ("queued", "in_progress", "completed"), job
    state = lambda: httpx.get(f"{url}/v1/videos/{job['id']}").json()  # noqa: E731
    assert wait_for(lambda: state()["status"] in ("completed", "failed"), timeout_s=60), state()
    assert state()["status"] == "completed" and state()["progress"] == 100, state()
    mp4 = httpx.get(f"{url}/v1/videos/{job['id']}/content")
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(mp4.content)) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == (32, 32)


def test_image_to_video_bad_reference_is_refused_up_front(server):
    body = {**VIDEO, "model": "wan-i2v-demo"}
    missing = httpx.post(f"{server.url}/v1/videos", json=body, timeout=30)  # i2v without an image
    assert missing.status_code == 400, missing.text
    bad = httpx.post(f"{server.url}/v1/videos", json={**body, "input_reference": {"image_url": 3}}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input_reference", bad.text
    junk = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    corrupt = httpx.post(f"{server.url}/v1/videos", json={**body, "input_reference": {"image_url": junk}}, timeout=30)
    assert corrupt.status_code == 400 and corrupt.json()["error"]["param"] == "input_reference", corrupt.text


# -- audio batch lines (extension: the upload as a data: URI in body.file) ----------------------------


def _wav_uri(seconds: float = 0.5) -> str:
    import numpy as np

    from stages.media.audio import encode_audio

    t = np.arange(int(16000 * seconds), dtype=np.float32) / 16000
    wav = encode_audio((0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, "wav")
    assert wav[:4] == b"RIFF"
    return "data:audio/wav;base64," + base64.b64encode(wav).decode()


def test_transcription_batch_lines(client):
    endpoint = "/v1/audio/transcriptions"
    audio = _wav_uri()
    lines = [{"custom_id": "t-json", "url": endpoint, "body": {"model": "whisper-demo", "file": audio}},
             {"custom_id": "t-verbose", "url": endpoint,
              "body": {"model": "whisper-demo", "file": audio, "filename": "tone.wav", "language": "en",
                       "response_format": "verbose_json", "timestamp_granularities": ["segment"], "temperature": 0}},
             {"custom_id": "t-text", "url": endpoint,
              "body": {"model": "whisper-demo", "file": audio, "response_format": "text"}},
             {"custom_id": "no-file", "url": endpoint, "body": {"model": "whisper-demo"}},
             {"custom_id": "a-url", "url": endpoint, "body": {"model": "whisper-demo", "file": "https://x/a.wav"}},
             {"custom_id": "not-audio", "url": endpoint,
              "body": {"model": "whisper-demo",
                       "file": "data:audio/wav;base64," + base64.b64encode(b"noise").decode()}},
             {"custom_id": "bad-field", "url": endpoint, "body": {"model": "whisper-demo", "file": audio, "nope": 1}}]
    f = client.files.create(file=("asr.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = _wait_batch(client, client.batches.create(input_file_id=f.id, endpoint=endpoint,
                                                      completion_window="24h").id, timeout_s=120)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 3, 4)
    out = {r["custom_id"]: r for r in _records(client, batch.output_file_id)}
    assert list(out) == ["t-json", "t-verbose", "t-text"]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out.values())
    assert isinstance(out["t-json"]["response"]["body"]["text"], str)  # random weights: noise text, shape only
    verbose = out["t-verbose"]["response"]["body"]
    assert verbose["task"] == "transcribe" and isinstance(verbose["segments"], list) and verbose["duration"] > 0
    assert out["t-text"]["response"]["body"]["content_type"].startswith("text/plain")
    errors = {r["custom_id"]: r for r in _records(client, batch.error_file_id)}
    assert errors["no-file"]["error"]["code"] == "invalid_file" and errors["no-file"]["response"] is None
    assert errors["a-url"]["error"]["code"] == "invalid_file"
    assert errors["not-audio"]["response"]["status_code"] == 400
    assert errors["not-audio"]["response"]["body"]["error"]["param"] == "file"
    assert errors["bad-field"]["response"]["status_code"] == 400


# -- mmserve batch run --------------------------------------------------------------------------------


def test_batch_run_cli_against_the_server_resumes(server, tmp_path):
    import subprocess
    import sys

    try:
        from tests.test_serve_support import ENV, REPO
    except ImportError:
        from test_serve_support import ENV, REPO

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(_jsonl([{"custom_id": f"k{i}", "body": CHAT} for i in range(4)]))
    out.write_text(json.dumps({"custom_id": "k0", "response": {"status_code": 200}, "error": None}) + "\n")
    cmd = [sys.executable, "-m", "serve.cli", "batch", "run", str(src), "-o", str(out),
           "--endpoint", "/v1/chat/completions", "--server", server.url]
    run = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "4/4 lines" in run.stderr and "ETA" in run.stderr
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in records) == ["k0", "k1", "k2", "k3"]  # k0 was already done
    rerun = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert rerun.returncode == 0 and "0 line(s) run" in rerun.stderr
    assert len(out.read_text().splitlines()) == 4


def test_batch_run_cli_in_process(models, tmp_path):
    import subprocess
    import sys

    try:
        from tests.test_serve_support import ENV, REPO, mmserve_left_in, scratch_tmpdir
    except ImportError:
        from test_serve_support import ENV, REPO, mmserve_left_in, scratch_tmpdir

    config = tmp_path / "m.toml"
    config.write_text(_config(models, tmp_path / "unused", ("llama",)))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(_jsonl([{"custom_id": "a", "url": "/v1/chat/completions", "body": CHAT}, "{broken"]))
    scratch = scratch_tmpdir(tmp_path)  # the in-process server's job store is a temporary directory, gone at the end
    run = subprocess.run([sys.executable, "-m", "serve.cli", "--log-level", "warning", "batch", "run", str(src),
                          "-o", str(out), "--config", str(config)], cwd=REPO, env={**ENV, "TMPDIR": str(scratch)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stderr  # one line failed
    assert mmserve_left_in(scratch) == []
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["a"]["response"]["status_code"] == 200
    assert records["#line2"]["error"]["code"] == "invalid_json"
