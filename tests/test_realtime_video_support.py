"""Helpers for the realtime video tests: an in-process server (engine + app + uvicorn in a thread) that can
be restarted, a WebSocket client that speaks the video protocol, and frames with their index painted in.

No tests here; the realtime video test modules import from this file.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from realtime.sessions import pack_frame, unpack_frame
from tests.test_serve_support import free_port


@pytest.fixture(scope="session")
def video_demo_models(demo_models, tmp_path_factory) -> dict[str, str]:
    """The sd demo checkpoint plus the ltx (t2v + i2v) and wan (t2v only) ones."""
    from pipelines.demo import build_demo_model

    root = tmp_path_factory.mktemp("video-demo-models")
    return {"sd": str(demo_models["sd"]), **{f: str(build_demo_model(f, root / f)) for f in ("ltx", "wan")}}


@pytest.fixture(scope="module")
def server(video_demo_models):
    """An in-process server over a fresh engine serving the video demo models, for one test module."""
    engine = start_engine(video_demo_models)
    srv = InProcessServer(engine)
    yield srv
    srv.stop()
    engine.shutdown()


def start_engine(paths: dict[str, str], **config):
    """An Engine serving sd-demo, ltx-demo and wan-demo (CPU-sized video defaults), started."""
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine
    from serve.config import DEMO_VIDEO

    models = (ModelSpec("sd-demo", paths["sd"], family="sd"),
              ModelSpec("ltx-demo", paths["ltx"], family="ltx", video=DEMO_VIDEO),
              ModelSpec("wan-demo", paths["wan"], family="wan", video=DEMO_VIDEO))
    engine = Engine(EngineConfig(models=models, **config))
    engine.start()
    return engine


@contextmanager
def slow_denoiser(engine, model: str, seconds: float):
    """Every denoiser forward of `model` first sleeps `seconds` (a known, load-independent floor)."""
    family = engine.family(model)
    original = family.forward

    def slow(items):
        time.sleep(seconds)
        return original(items)

    family.forward = slow
    try:
        yield
    finally:
        del family.forward  # the class's method again


def batches_of_two_or_more(engine, pool: str) -> float:
    """How many forwards of a stage pool held more than one work item so far."""
    samples = engine.metrics.stage.batch_size_samples(pool, pool.split("/")[0])
    return max(samples.values(), default=0.0) - samples.get(1, 0.0)


class InProcessServer:
    """create_app(engine) served by uvicorn on loopback in a thread. `restart()` stops it and serves a *new* app
    (new session registry: every session's state is gone, as after a process restart) on the same engine."""

    def __init__(self, engine, **app_kwargs):
        self.engine = engine
        self.app_kwargs = app_kwargs
        self.port = free_port()
        self.app = None
        self._server = None
        self._thread = None
        self.start()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime/video"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import uvicorn

        from serve.app import create_app

        self.app = create_app(self.engine, **self.app_kwargs)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                ws_ping_interval=None)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class Media:
    header: dict[str, Any]
    payload: bytes
    received_ms: float


@dataclass
class Client:
    """One WebSocket session, as a test drives it: events and media frames as they arrive."""

    ws: Any
    events: list[dict[str, Any]] = field(default_factory=list)
    media: list[Media] = field(default_factory=list)

    @classmethod
    async def connect(cls, url: str, **kwargs) -> "Client":
        import websockets

        return cls(await websockets.connect(url, max_size=64 << 20, ping_interval=None, **kwargs))

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def send_frame(self, header: dict[str, Any], payload: bytes) -> None:
        await self.ws.send(pack_frame(header, payload))

    async def receive(self, timeout: float = 120) -> dict[str, Any] | Media:
        frame = await asyncio.wait_for(self.ws.recv(), timeout)
        if isinstance(frame, bytes):
            header, payload = unpack_frame(frame)
            item = Media(header, payload, time.time() * 1000)
            self.media.append(item)
            return item
        event = json.loads(frame)
        self.events.append(event)
        return event

    async def until(self, predicate, timeout: float = 120) -> dict[str, Any]:
        """Receive until an event satisfies `predicate`; return it."""
        deadline = time.monotonic() + timeout
        while True:
            item = await self.receive(max(0.01, deadline - time.monotonic()))
            if isinstance(item, dict) and predicate(item):
                return item

    async def until_type(self, kind: str, timeout: float = 120) -> dict[str, Any]:
        return await self.until(lambda e: e["type"] == kind, timeout)

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    async def close(self) -> None:
        await self.ws.close()


def painted_frame(index: int, size: int = 64) -> np.ndarray:
    """uint8 [size, size, 3]: a colour from the index plus its bits as black/white bars (frames differ a lot)."""
    rng = np.random.default_rng(index)
    frame = np.empty((size, size, 3), np.uint8)
    frame[:] = rng.integers(0, 256, 3, dtype=np.uint8)
    bar = size // 8
    for bit in range(8):
        frame[: size // 2, bit * bar:(bit + 1) * bar] = 255 if (index >> bit) & 1 else 0
    return frame


def jpeg(pixels: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def decode_jpeg(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def decode_mp4(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def img2img_session_spreads(engine, items: Callable[[int], float], *, frames: int = 12, sessions: int = 2
                            ) -> list[tuple[list[float], int]]:
    """Run `sessions` img2img sessions of model "m", one after another, over WS /v1/realtime/video of an in-process
    server on `engine` (two denoise replicas), each sending `frames` frames faster than they run (lookahead 2: two
    frames in the engine at once). Per session: how many items each replica took (`items(r)` reads replica r's
    counter) and how many frames came back. A session may live on either replica; it should stay there."""
    server = InProcessServer(engine)

    async def session() -> Client:
        client = await Client.connect(server.url)
        await client.send({"type": "session.update", "session": {
            "mode": "img2img", "model": "m", "prompt": "a fox", "steps": 4, "strength": 0.5, "lookahead": 2,
            "frame_deadline_ms": 60_000}})
        await client.until_type("session.created")
        for seq in range(frames):
            await client.send_frame({"seq": seq, "content_type": "image/jpeg"}, jpeg(painted_frame(seq)))
            await asyncio.sleep(0.01)
        deadline = time.monotonic() + 120
        while len({e["seq"] for e in client.events if e["type"] in ("chunk.done", "frame.dropped")}) < frames:
            await client.receive(max(0.01, deadline - time.monotonic()))
        await client.close()
        return client

    results = []
    try:
        for _ in range(sessions):
            before = [items(r) for r in (0, 1)]
            client = asyncio.run(session())
            deadline = time.monotonic() + 30
            while not engine.executor.idle():  # the last frame's request closes just after its chunk.done
                assert time.monotonic() < deadline, "the engine did not become idle"
                time.sleep(0.01)
            results.append(([items(r) - before[r] for r in (0, 1)], len(client.media)))
    finally:
        server.stop()
    return results
