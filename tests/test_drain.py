"""Graceful drain (serve/drain.py) on a real `mmserve serve` process: SIGTERM while image requests run, a realtime
session is open and a batch is half done. The requests finish with 200, new ones get 503 with Retry-After, /ready
turns 503, the session gets `session.closing` with its resume token, the process exits once the requests are done
(well inside the grace), and after a restart on the same data directory the batch completes with every line once.

The server runs in its own process group (start_new_session): the SIGTERM goes to the server process alone, and
teardown kills only that group."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import demo_path
from tests.test_serve_support import ENV, REPO, free_port, metric, wait_ready

GRACE_S = 120  # far longer than the requests in flight need: the exit must come from their end, not the grace
STEPS = 40  # each interactive request's denoise steps: long enough to be running when SIGTERM comes
REQUESTS = 4
BATCH_LINES = 6


class ServerProcess:
    """`python -m serve.cli serve` in its own session (process group), life bounded by `stop`."""

    def __init__(self, workdir: Path, config: Path, data_dir: Path, log_name: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / log_name
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serve.cli", "--log-level", "warning", "serve", "--port", str(self.port),
             "--config", str(config), "--data-dir", str(data_dir)],
            cwd=REPO, env=ENV, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(self.url, self.proc, 180, self.log_tail)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """Kill what is left of this server's own process group (its media workers included)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self._log.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    sd = demo_path(tmp_path_factory, "sd")
    workdir = tmp_path_factory.mktemp("serve-drain")
    config = workdir / "mmserve.toml"
    # One denoise item at a time: the requests queue behind each other, so some are still running at SIGTERM.
    config.write_text(f"""
[server]
drain_grace_s = {GRACE_S}

[[models]]
name = "sd-demo"
path = "{sd}"
[models.pools.denoise]
max_batch_size = 1
""")
    return workdir, config, workdir / "data"


def in_denoise(url: str) -> float:
    """Denoise items running or queued, from /metrics."""
    names = ("mmserve_stage_active_items", "mmserve_stage_queue_depth")
    return sum(s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
               for s in f.samples if s.name in names and s.labels.get("stage") == "sd-demo/denoise")


def image_body(steps: int) -> dict:
    return {"model": "sd-demo", "prompt": "a quiet harbour", "size": "64x64", "num_inference_steps": steps}


def test_sigterm_drains_requests_sessions_and_the_batch_resumes(setup):
    workdir, config, data_dir = setup
    server = ServerProcess(workdir, config, data_dir, "server-1.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        # 1. A batch, running at batch priority behind the interactive requests below.
        lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/images/generations",
                  "body": {**image_body(10), "response_format": "b64_json"}} for i in range(BATCH_LINES)]
        upload = client.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines)
                                                                    .encode())), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/images/generations",
                                      completion_window="24h")

        # 2. A realtime video session.
        async def open_session():
            ws = await websockets.connect(server.url.replace("http", "ws") + "/v1/realtime/video", ping_interval=None)
            await ws.send(json.dumps({"type": "session.update", "session": {"mode": "img2img", "model": "sd-demo",
                                                                             "prompt": "neon city"}}))
            created = await _until(ws, "session.created")
            return ws, created

        loop = asyncio.new_event_loop()
        ws, created = loop.run_until_complete(open_session())

        # 3. Interactive requests, in threads; SIGTERM once they are all in flight and the denoise stage is busy.
        replies: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: replies.append(httpx.post(
            f"{server.url}/v1/images/generations", json=image_body(STEPS), timeout=GRACE_S))) for _ in range(REQUESTS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while not (metric(server.url, "mmserve_http_requests_in_flight") == REQUESTS and in_denoise(server.url) > 0):
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.05)
        assert client.batches.retrieve(batch.id).status != "completed"
        os.kill(server.proc.pid, signal.SIGTERM)  # the server process only

        # 4. At once: /ready 503, new work 503 + Retry-After, the session told to close with its resume token.
        ready = httpx.get(f"{server.url}/ready", timeout=10)
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert metric(server.url, "mmserve_draining") == 1  # /metrics is still answered
        refused = httpx.post(f"{server.url}/v1/images/generations", json=image_body(2), timeout=10)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
        assert refused.json()["error"]["code"] == "server_draining"
        with pytest.raises(openai.InternalServerError):  # the official client sees a 503 too
            client.models.list()
        closing = loop.run_until_complete(_until(ws, "session.closing"))
        assert closing["session_id"] == created["session"]["id"]
        assert closing["resume_token"] == created["resume_token"] and closing["closes_in_s"] == GRACE_S
        assert server.proc.poll() is None  # the listener stays open while requests run

        # 5. The requests in flight finish; then the process exits, long before the grace.
        for t in threads:
            t.join(GRACE_S)
        assert [r.status_code for r in replies] == [200] * REQUESTS, [r.text for r in replies]
        assert all(r.json()["data"] for r in replies)
        assert server.proc.wait(GRACE_S) == 0, server.log_tail()
        assert f"drained: {REQUESTS} requests finished, 0 cancelled" in server.log_tail()
        loop.run_until_complete(ws.close())
        loop.close()
    finally:
        server.stop()

    # 6. Restarted on the same data directory, the batch resumes: every line exactly once.
    again = ServerProcess(workdir, config, data_dir, "server-2.log")
    try:
        client = openai.OpenAI(base_url=f"{again.url}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 300
        while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"the batch did not finish after the restart: {done}"
            time.sleep(0.2)
        assert done.status == "completed" and done.request_counts.completed == BATCH_LINES, done
        assert done.output_file_id is not None
        records = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in records) == sorted(x["custom_id"] for x in lines)
        assert all(r["response"]["status_code"] == 200 for r in records)
    finally:
        again.stop()


async def _until(ws, kind: str, timeout_s: float = 120) -> dict:
    """The next text event of type `kind` (media frames and other events are skipped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        frame = await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic()))
        if isinstance(frame, str) and (event := json.loads(frame))["type"] == kind:
            return event


def test_requests_past_the_grace_are_cancelled_and_new_ones_refused(tmp_path):
    """In process, on the real drain pieces: a request that outlives the grace is cancelled (counted, its task
    ends), a request arriving meanwhile gets 503 with Retry-After, and /health still answers."""
    from fastapi import FastAPI

    from pipelines.config import RealtimeConfig
    from realtime.sessions import registry_for
    from serve.drain import Drain, DrainGate
    from serve.job_runner import JobRunner
    from serve.jobs import JobStore

    app = FastAPI()
    started = asyncio.Event()

    @app.get("/v1/slow")
    async def slow() -> dict:
        started.set()
        await asyncio.Event().wait()  # never finishes by itself
        return {}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    drain = Drain(grace_s=0.5)
    app.state.job_runner = JobRunner(JobStore(tmp_path), None, app)
    app.state.voice_sessions = registry_for("voice", RealtimeConfig())
    app.state.video_sessions = registry_for("video", RealtimeConfig())
    gated = DrainGate(app, drain=drain)

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gated), base_url="http://test") as client:
            request = asyncio.create_task(client.get("/v1/slow"))
            await asyncio.wait_for(started.wait(), 30)
            draining = asyncio.create_task(drain.run(app))
            await asyncio.sleep(0)  # the drain has begun
            refused = await client.get("/v1/slow")
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "server_draining"
            assert (await client.get("/health")).status_code == 200
            await asyncio.wait_for(draining, 30)
            assert request.done() and request.cancelled()
            assert (drain.finished, drain.cancelled) == (0, 1) and not drain.in_flight

    asyncio.run(main())


def test_drain_grace_is_read_from_the_config_and_checked(tmp_path):
    from serve.config import load_config

    config = tmp_path / "mmserve.toml"
    config.write_text("[server]\ndrain_grace_s = 5\n")
    assert load_config(config).server.drain_grace_s == 5
    assert load_config(None).server.drain_grace_s == 30
    config.write_text("[server]\ndrain_grace_s = 0\n")
    with pytest.raises(ValueError, match="drain_grace_s"):
        load_config(config)
