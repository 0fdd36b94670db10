"""The job store (serve/jobs.py) and the job runner, with a stand-in video engine: atomic writes, no duplicate
batch lines, recovery on restart, idempotency keys, the /v1/videos lifecycle and the `mmserve batch run` resume
logic. The stand-in validates requests with the real pipelines.video.VideoRequest (as Engine.check_video does
through a family) and only fakes the denoising, so the route runs exactly the code it runs on the real engine."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sqlite3
import threading
import time
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from pipelines.config import RealtimeConfig
from pipelines.engine import ModelInfo
from pipelines.video import VideoLimits, VideoRequest
from serve.jobs import IdempotencyKeyReused, JobStore, request_digest, write_atomic
from stages.events import EventKind
from stages.metrics import Metrics
from stages.request_state import RequestHandle, RequestState

# -- store --------------------------------------------------------------------------------------


def test_write_atomic_never_leaves_a_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "r" / "out.bin"
    write_atomic(target, b"first")

    def crash(*_a, **_k):
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_atomic(target, b"second, longer")
    assert target.read_bytes() == b"first"  # the old complete result, never a torn new one


def test_store_survives_reopen_and_keeps_first_line_result(tmp_path):
    store = JobStore(tmp_path)
    job, created = store.create_job("batch", "alice", {"x": 1}, prefix="batch", idempotency_key="k1")
    again, created_again = store.create_job("batch", "alice", {"x": 2}, prefix="batch", idempotency_key="k1")
    other, _ = store.create_job("batch", "bob", {"x": 3}, prefix="batch", idempotency_key="k1")
    assert created and not created_again and again.id == job.id and other.id != job.id
    store.put_line(job.id, 0, "a", True, {"custom_id": "a", "n": 1})
    store.put_line(job.id, 0, "a", True, {"custom_id": "a", "n": 2})  # a rerun line: the first result stays
    store.put_line(job.id, 1, "b", False, {"custom_id": "b"})
    f = store.add_file("alice", "batch", "in.jsonl", b"{}\n")
    store.close()

    store = JobStore(tmp_path)  # a restart: everything committed is still there
    assert store.get_job(job.id).request == {"x": 1}
    assert store.get_job(job.id, tenant="bob") is None
    assert store.done_lines(job.id) == {0, 1}
    assert store.lines(job.id, True) == [{"custom_id": "a", "n": 1}]
    assert store.line_counts(job.id) == (1, 1)
    assert store.get_file(f.id).path.read_bytes() == b"{}\n"
    assert not list(tmp_path.rglob("*.tmp"))


def test_expiry_drops_results(tmp_path):
    store = JobStore(tmp_path)
    job, _ = store.create_job("video", "t", {}, prefix="video")
    write_atomic(store.results_dir / f"{job.id}.mp4", b"mp4")
    store.finish_job(job.id, "completed", result={}, ttl_s=10)
    assert store.expire(now=int(time.time()) + 5) == 0
    assert store.expire(now=int(time.time()) + 60) == 1
    assert store.get_job(job.id).status == "expired"
    assert not (store.results_dir / f"{job.id}.mp4").exists()


def test_writes_recovery_discards_commit_without_fsync_and_the_rest_stay_full(tmp_path):
    store = JobStore(tmp_path)
    job, _ = store.create_job("video", "t", {}, prefix="video")
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    store.update_job(job.id, status="in_progress", progress=40, durable=False)
    assert statements[0] == "PRAGMA synchronous=NORMAL" and statements[-1] == "PRAGMA synchronous=FULL"
    statements.clear()
    store.finish_job(job.id, "completed", result={})  # terminal: fsynced as before
    assert not any(s.startswith("PRAGMA") for s in statements)
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    with pytest.raises(sqlite3.OperationalError):
        store._exec("UPDATE no_such_table SET x=1", durable=False)
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL again after a failed statement
    store.update_job(job.id, progress=70, durable=False)
    store.close()
    reopened = JobStore(tmp_path).get_job(job.id)  # committed: a process restart keeps it
    assert (reopened.status, reopened.progress) == ("completed", 70)


def test_a_reused_idempotency_key_needs_the_same_body(tmp_path):
    store = JobStore(tmp_path)
    first = request_digest({"prompt": "a cat", "seconds": 2})
    assert request_digest({"seconds": 2, "prompt": "a cat"}) == first  # canonical: key order does not matter
    assert request_digest({"prompt": "a cat", "seconds": 2}, b"png") != first  # an uploaded image is body too
    job, created = store.create_job("video", "alice", {"x": 1}, prefix="video", idempotency_key="k", request_hash=first)
    again, created_again = store.create_job("video", "alice", {"x": 1}, prefix="video", idempotency_key="k",
                                            request_hash=first)
    assert created and not created_again and again.id == job.id and store.find_by_key("alice", "video", "k", first)
    other = request_digest({"prompt": "a dog", "seconds": 2})
    with pytest.raises(IdempotencyKeyReused) as e:
        store.create_job("video", "alice", {"x": 2}, prefix="video", idempotency_key="k", request_hash=other)
    assert (e.value.status, e.value.code, e.value.param) == (422, "idempotency_key_reused", "Idempotency-Key")
    assert job.id in e.value.message
    with pytest.raises(IdempotencyKeyReused):
        store.find_by_key("alice", "video", "k", other)
    # per tenant
    assert store.create_job("video", "bob", {}, prefix="video", idempotency_key="k", request_hash=other)[1]


def test_a_store_made_before_request_hashes_opens_and_keeps_its_keys(tmp_path):
    old = sqlite3.connect(tmp_path / "jobs.sqlite3")  # the jobs table as it was, without request_hash
    old.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, kind TEXT NOT NULL, tenant TEXT NOT NULL, status TEXT NOT "
                "NULL, progress INTEGER NOT NULL DEFAULT 0, request TEXT NOT NULL, result TEXT, created_at INTEGER NOT "
                "NULL, started_at INTEGER, completed_at INTEGER, error TEXT, idempotency_key TEXT, expires_at INTEGER)")
    old.execute("CREATE UNIQUE INDEX jobs_idempotency ON jobs (tenant, kind, idempotency_key)")
    old.execute("INSERT INTO jobs (id, kind, tenant, status, request, created_at, idempotency_key) "
                "VALUES ('video_old', 'video', 't', 'completed', '{}', 1, 'k')")
    old.commit()
    old.close()
    store = JobStore(tmp_path)
    job, created = store.create_job("video", "t", {}, prefix="video", idempotency_key="k", request_hash="abc")
    assert not created and job.id == "video_old" and job.request_hash is None  # no hash then: not checked


# A job store of its own in a temporary directory when create_app is given no data_dir: removed when the process
# ends (create_app's docstring: nothing persists), never left in the temp folder.
NO_DATA_DIR = """
import gc, os, sys
from fastapi.testclient import TestClient
from pipelines.config import EngineConfig
from pipelines.engine import Engine
from serve.app import create_app

engine = Engine(EngineConfig(models=()))
engine.start()
app = create_app(engine)
store = app.state.job_store.data_dir
with TestClient(app) as client:
    assert client.get("/health").status_code == 200
assert store.is_dir() and str(store).startswith(os.environ["TMPDIR"]), store
again = create_app(engine).state.job_store.data_dir
gc.collect()
assert store.is_dir() and not again.exists(), again  # a collected app takes its directory with it
engine.shutdown()
print(store)
"""


def test_an_app_without_a_data_dir_leaves_nothing_in_the_temp_folder(tmp_path):
    import subprocess
    import sys

    from tests.test_serve_support import ENV, REPO, mmserve_left_in, scratch_tmpdir

    scratch = scratch_tmpdir(tmp_path)
    run = subprocess.run([sys.executable, "-c", NO_DATA_DIR], cwd=REPO, env={**ENV, "TMPDIR": str(scratch)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith(str(scratch / "mmserve-jobs-"))
    assert mmserve_left_in(scratch) == []


# -- a stand-in video engine --------------------------------------------------------------------


class _Executor:
    def __init__(self):
        self.states: dict[str, RequestState] = {}

    def cancel(self, request_id: str) -> None:
        self.states[request_id].request_cancel()


# What the stand-in model declares, as a video family would (pipelines/families/video_base.py).
FAKE_VIDEO = dict(size_factor=8, frame_factor=4, default_size=(16, 16), default_frames=5, default_fps=8,
                  default_steps=4, default_guidance=5.0)


class FakeEngine:
    """Engine.check_video / submit_video with the real request validation; submit_video then emits one PROGRESS
    per step (step_s apart) and frames instead of denoising; a cancel stops it within a step."""

    def __init__(self, step_s: float = 0.02):
        self.ready = True
        tasks = ("text-to-video", "image-to-video")
        width, height = FAKE_VIDEO["default_size"]
        defaults = {"width": width, "height": height, "num_frames": FAKE_VIDEO["default_frames"],
                    "fps": FAKE_VIDEO["default_fps"], "frame_factor": FAKE_VIDEO["frame_factor"]}
        self.models = {"wan-fake": ModelInfo("wan-fake", "wan", "/nowhere", tasks, FAKE_VIDEO["size_factor"],
                                             max(width, height), video_defaults=defaults, random_weights=True)}
        self.metrics = Metrics()
        self.step_s = step_s
        self.executor = _Executor()
        self.submitted: list[VideoRequest] = []
        self.config = types.SimpleNamespace(realtime=RealtimeConfig())  # what create_app reads of the config

    def check_video(self, model: str, request: VideoRequest) -> VideoRequest:
        return request.validate(tasks=self.models[model].tasks, model=model, limits=VideoLimits(), **FAKE_VIDEO)

    def submit_video(self, model: str, request: VideoRequest) -> RequestHandle:
        request = self.check_video(model, request)
        self.submitted.append(request)
        state = RequestState(f"vid-{len(self.submitted)}", deadline=None, model=model)
        self.executor.states[state.request_id] = state
        steps = request.num_inference_steps  # validated: every field is filled

        def work():
            for step in range(steps):
                if state.cancelled:
                    state.emit(EventKind.ERROR, code="cancelled", message="cancelled", param=None, status=499)
                    return
                time.sleep(self.step_s)
                state.emit(EventKind.PROGRESS, step=step + 1, total=steps)
            frames = np.zeros((request.num_frames, request.height, request.width, 3), np.uint8)
            state.emit(EventKind.FINAL, outputs={"frames": frames, "fps": request.fps, "seed": request.seed})

        threading.Thread(target=work, daemon=True).start()
        return RequestHandle(state, self.executor)

    def media(self):
        return types.SimpleNamespace(run=lambda name, frames, fps, fmt: b"MP4" + bytes(len(frames)))

    def encode_images(self, images, fmt, quality=None):
        out = []
        for image in images:
            buf = io.BytesIO()
            image.save(buf, format="JPEG")
            out.append(buf.getvalue())
        return out

    def decode_image(self, data: bytes, *, param: str, mode: str = "RGB"):
        from PIL import Image

        return Image.open(io.BytesIO(data)).convert(mode)


def _app(engine, data_dir: Path, **policy):
    from serve.app import create_app
    from serve.job_runner import JobPolicy

    return create_app(engine, data_dir=data_dir, job_policy=JobPolicy(ready_poll_s=0.01, **policy))


def _wait(client, video_id: str, statuses=("completed", "failed", "cancelled"), timeout_s: float = 10):
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/videos/{video_id}").json()
        seen.append(job["progress"])
        if job["status"] in statuses:
            return job, seen
        time.sleep(0.01)
    raise AssertionError(f"video {video_id} stuck: {job}")


def test_video_lifecycle_with_fake_engine(tmp_path):
    engine = FakeEngine()
    with TestClient(_app(engine, tmp_path)) as client:
        body = {"prompt": "a cat", "size": "32x16", "num_frames": 9, "fps": 8, "num_inference_steps": 10}
        r = client.post("/v1/videos", json=body, headers={"Idempotency-Key": "abc"})
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["object"] == "video" and job["status"] in ("queued", "in_progress") and job["seconds"] == "1"
        # the same key and body (however the keys are ordered): the same job
        again = client.post("/v1/videos", json=dict(reversed(body.items())), headers={"Idempotency-Key": "abc"})
        assert again.status_code == 200 and again.json()["id"] == job["id"]
        other = client.post("/v1/videos", json={"prompt": "a cat"}, headers={"Idempotency-Key": "abc"})
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused", other.text
        assert other.json()["error"]["param"] == "Idempotency-Key" and job["id"] in other.json()["error"]["message"]
        done, seen = _wait(client, job["id"])
        assert done["status"] == "completed" and done["progress"] == 100
        assert seen == sorted(seen)  # monotonic
        assert len(engine.submitted) == 1 and engine.submitted[0].width == 32
        content = client.get(f"/v1/videos/{job['id']}/content")
        assert content.headers["content-type"] == "video/mp4" and content.content.startswith(b"MP4")
        thumb = client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
        assert thumb.headers["content-type"] == "image/jpeg"
        listing = client.get("/v1/videos", params={"limit": 1}).json()
        assert listing["data"][0]["id"] == job["id"]
        assert client.get("/v1/videos/video_nope").status_code == 404
        deleted = client.delete(f"/v1/videos/{job['id']}").json()
        assert deleted["deleted"] is True and client.get(f"/v1/videos/{job['id']}").status_code == 404


def test_polled_video_replies_are_the_bytes_fastapi_would_render(tmp_path):
    from fastapi.encoders import jsonable_encoder

    from serve.routes.videos import video_object

    engine = FakeEngine(step_s=0.0)
    with TestClient(_app(engine, tmp_path)) as client:
        ids = [client.post("/v1/videos", json={"prompt": f"p{i}", "seed": i}).json()["id"] for i in range(3)]
        bad = client.post("/v1/videos", json={"prompt": "x", "num_frames": 6})  # a 400, not a job
        assert bad.status_code == 400
        for video_id in ids:
            _wait(client, video_id)
        store = client.app.state.job_store
        jobs = store.list_jobs("video", "default", limit=3)
        listed = client.get("/v1/videos", params={"limit": 2})
        data = [video_object(j) for j in jobs[:2]]
        expected = {"object": "list", "data": data, "first_id": data[0]["id"], "last_id": data[1]["id"],
                    "has_more": True}
        assert listed.headers["content-type"] == "application/json"
        assert listed.content == JSONResponse(jsonable_encoder(expected)).body  # as a returned dict rendered
        one = client.get(f"/v1/videos/{ids[0]}")
        assert one.content == JSONResponse(jsonable_encoder(video_object(store.get_job(ids[0])))).body
        assert client.get("/v1/videos", params={"limit": 0}).status_code == 400  # the query checks still run


def test_video_seconds_come_from_the_frames_and_the_models_fps(tmp_path):
    engine = FakeEngine()
    with TestClient(_app(engine, tmp_path)) as client:
        framed = client.post("/v1/videos", json={"prompt": "a", "num_frames": 17})
        assert framed.status_code == 200 and framed.json()["seconds"] == "2", framed.text  # (17 - 1) / 8 fps
        timed = client.post("/v1/videos", json={"prompt": "a", "seconds": "1.5"}).json()
        assert timed["seconds"] == "1.5"  # what the caller asked; it runs as 13 frames (3 x 4 + 1) at 8 fps
        long = client.post("/v1/videos", json={"prompt": "a", "seconds": "99999"})
        error = long.json()["error"]
        assert long.status_code == 400 and error["param"] == "seconds", long.text
        assert "the limit is 32 seconds" in error["message"]  # 257 frames at the model's 8 fps
        _wait(client, framed.json()["id"])
        _wait(client, timed["id"])
    assert sorted(r.num_frames for r in engine.submitted) == [13, 17]


def test_video_cancel_and_tenant_limit(tmp_path):
    engine = FakeEngine(step_s=0.05)
    with TestClient(_app(engine, tmp_path, max_jobs_per_tenant=1)) as client:
        job = client.post("/v1/videos", json={"prompt": "slow", "num_inference_steps": 200}).json()
        busy = client.post("/v1/videos", json={"prompt": "second"})
        assert busy.status_code == 429 and busy.headers["retry-after"]
        _wait(client, job["id"], statuses=("in_progress",))
        started = time.monotonic()
        cancelled = client.delete(f"/v1/videos/{job['id']}").json()
        assert cancelled["status"] == "cancelled"
        assert time.monotonic() - started < 1.0  # within a step or so
        assert client.get(f"/v1/videos/{job['id']}/content").status_code == 409


def test_in_progress_video_restarts_after_a_crash(tmp_path):
    store = JobStore(tmp_path)
    job, _ = store.create_job("video", "default", {"model": "wan-fake", "prompt": "p", "num_inference_steps": 3,
                                                   "size": None, "seconds": None}, prefix="video")
    store.update_job(job.id, status="in_progress", progress=40)  # the server died here
    store.close()
    engine = FakeEngine()
    with TestClient(_app(engine, tmp_path)) as client:
        done, _ = _wait(client, job.id)
    assert done["status"] == "completed" and len(engine.submitted) == 1


def test_a_burst_of_video_jobs_starts_together_and_a_stream_does_not_hold_the_window(tmp_path):
    from serve.job_runner import JobPolicy, JobRunner

    async def main():
        runner = JobRunner(JobStore(tmp_path), FakeEngine(), app=None, policy=JobPolicy(video_start_window_s=0.2))
        loop = asyncio.get_running_loop()
        released: list[tuple[int, object, float]] = []  # (job, its window, when it was let go)

        async def job(i: int, after_s: float) -> None:
            await asyncio.sleep(after_s)
            await runner._burst()
            released.append((i, runner._start_window, loop.time()))

        # a burst (10 ms apart, under a quarter of the window), then one job after the window closed
        start = loop.time()
        await asyncio.gather(*(job(i, 0.01 * i) for i in range(4)), job(4, 0.6))
        burst = [r for r in released if r[0] < 4]
        assert len({id(w) for _, w, _ in burst}) == 1  # one window let all four go, in the same tick
        assert max(t for *_, t in burst) - min(t for *_, t in burst) < 0.005
        assert 0.03 + 0.05 <= burst[0][2] - start < 0.2  # a quarter (50 ms) after the last joined: not the cap
        assert released[-1][0] == 4 and released[-1][1] is not burst[0][1]  # a later job opens a new window

        # a steady stream (a job every 30 ms: each joins before the quarter runs out) is let go at the cap
        released.clear()
        start = loop.time()
        await asyncio.gather(*(job(i, 0.03 * i) for i in range(20)))
        windows = {id(w) for _, w, _ in released}
        assert len(windows) >= 2  # the first window closed 0.2 s after it opened, with jobs still coming
        first = [t for _, w, t in released if w is released[0][1]]
        assert max(first) - start < 0.2 + 0.1

    asyncio.run(main())


def test_no_start_window_starts_each_video_job_at_once(tmp_path):
    from serve.job_runner import JobPolicy, JobRunner

    runner = JobRunner(JobStore(tmp_path), FakeEngine(), app=None, policy=JobPolicy(video_start_window_s=0))
    asyncio.run(runner._burst())  # returns without waiting
    assert runner._start_window is None
    with pytest.raises(ValueError, match="video_start_window_s"):
        JobPolicy(video_start_window_s=-0.01)
    from serve.config import load_config

    config = tmp_path / "mmserve.toml"
    config.write_text("[jobs]\nvideo_start_window_s = 0\n")  # [jobs] turns it off
    assert load_config(config).jobs.video_start_window_s == 0
    config.write_text("[jobs]\nvideo_start_window_s = 5\n")
    with pytest.raises(ValueError, match=r"\[jobs\].*video_start_window_s must be in \[0, 1\] seconds"):
        load_config(config)


class _ResultEngine(FakeEngine):
    """The MP4 and thumbnail encoders meet at a barrier: a job completes only if they run at the same time;
    `fail` names the encoders that raise instead."""

    def __init__(self, fail: tuple[str, ...] = ()):
        super().__init__(step_s=0.0)
        self.fail = fail
        self.barrier = threading.Barrier(2, timeout=10)

    def media(self):
        def run(name, frames, fps, fmt):
            self.barrier.wait()
            if "mp4" in self.fail:
                raise RuntimeError("the encoder broke")
            return b"MP4" + bytes(len(frames))
        return types.SimpleNamespace(run=run)

    def encode_images(self, images, fmt, quality=None):
        from pipelines.image_request import RequestError

        self.barrier.wait()
        if "jpeg" in self.fail:
            raise RequestError("output_format", "no jpeg today", code="media_format")
        return super().encode_images(images, fmt, quality)


def test_the_mp4_and_the_thumbnail_encode_at_once_and_their_errors_keep_their_order(tmp_path):
    engine = _ResultEngine()
    with TestClient(_app(engine, tmp_path / "ok")) as client:
        job = client.post("/v1/videos", json={"prompt": "a cat"}).json()
        done, _ = _wait(client, job["id"])
        assert done["status"] == "completed", done  # not a barrier timeout: both encoders ran together
        assert client.get(f"/v1/videos/{job['id']}/content").content.startswith(b"MP4")
        thumb = client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
        assert thumb.status_code == 200 and thumb.content.startswith(b"\xff\xd8")  # a JPEG
    for fail, code in ((("jpeg",), "media_format"), (("mp4", "jpeg"), "internal_error")):
        engine = _ResultEngine(fail)
        with TestClient(_app(engine, tmp_path / "-".join(fail))) as client:
            job = client.post("/v1/videos", json={"prompt": "a cat"}).json()
            done, _ = _wait(client, job["id"])
            assert done["status"] == "failed" and done["error"]["code"] == code, done  # the MP4's error first


# -- mmserve batch run: resume ------------------------------------------------------------------


def test_batch_run_resumes_and_drops_a_torn_line(tmp_path):
    from serve.batch_cli import run_file

    calls = []
    app = FastAPI()

    @app.post("/v1/embeddings")
    async def embed(request: Request):
        body = await request.json()
        calls.append(body["input"])
        if body["input"] == "bad":
            return JSONResponse({"error": {"message": "no"}}, status_code=400)
        return {"object": "list", "data": [{"embedding": [1.0]}]}

    src = tmp_path / "in.jsonl"
    lines = [{"custom_id": f"c{i}", "url": "/v1/embeddings", "body": {"input": f"x{i}"}} for i in range(5)]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n"
                   + json.dumps({"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "bad"}}) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"custom_id": "c0", "response": {"status_code": 200}}) + "\n{\"custom_id\": \"c1\"")

    def client():
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")

    assert asyncio.run(run_file(client(), src, out, "/v1/embeddings", 2)) == 1  # the bad lines fail
    assert sorted(calls) == ["bad", "x1", "x2", "x3", "x4"]  # c0 was done; the torn c1 line runs again
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in records) == ["#line6", "c0", "c1", "c2", "c3", "c4", "e"]
    calls.clear()
    asyncio.run(run_file(client(), src, out, "/v1/embeddings", 2))  # a rerun finds everything done
    assert calls == []
