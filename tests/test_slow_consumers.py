"""Slow consumers (serve/slow_consumers.py): a streaming client that stops reading is cut after the grace, its
engine request cancelled and its pool slot freed, while other clients are served.

The SSE test drives a real `mmserve serve` on the tiny demo Llama with a raw socket that reads the response
headers and then nothing more (a small receive buffer); each step streams a lot (8 choices, 20 top logprobs
each), so the server's socket buffers fill within seconds. The WebSocket rule is checked on serve/ws.py's socket
with a send that never completes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.test_serve_support import Server, metric, wait_for

MODEL = "llama-demo"
GRACE_S = 1.5
# Each step streams N chunks of ~1.3 KB (20 top logprobs each): the server's socket buffers (up to 4 MB with Linux's
# default tcp_wmem) fill within a few hundred steps, far fewer than MAX_TOKENS: the request still runs at the cut.
N = 8
MAX_TOKENS = 2000
SLOW = "mmserve_slow_consumers_total"
ROUTE = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pipelines.demo import build_demo_model

    checkpoint = build_demo_model("llama", tmp_path_factory.mktemp("slow-model") / "llama")
    srv = Server(tmp_path_factory.mktemp("slow"), f"""
[server]
slow_consumer_grace_s = {GRACE_S}
slow_consumer_outbox_bytes = 65536
[[models]]
name = "{MODEL}"
path = "{checkpoint}"
family = "causal-lm"
[models.llm]
kv_cache_mb = 16
""")
    yield srv
    srv.stop()


def open_stream_and_stop_reading(url: str, body: dict) -> socket.socket:
    """POST `body` on a raw socket, read up to the end of the response headers, and return the socket unread."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(f"POST {ROUTE} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    sock.settimeout(60)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        assert chunk, "the server closed before answering"
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"text/event-stream" in head, head
    return sock


def read_until_cut(sock: socket.socket, timeout_s: float) -> str:
    """Read what is left; how the stream ended ("reset" or "eof"), or "open" if it still runs after timeout_s."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 16):
            pass
        return "eof"
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "open"


def test_sse_client_that_stops_reading_is_cut_and_its_slot_freed(server):
    url = server.url
    cancelled_before = metric(url, "mmserve_graph_requests_total", model=MODEL, outcome="cancelled")
    slow_before = metric(url, SLOW, route=ROUTE, transport="sse")
    tokens_before = metric(url, "mmserve_llm_generated_tokens_total", model=MODEL)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True, "temperature": 0,
            "ignore_eos": True, "max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 20, "n": N}
    sock = open_stream_and_stop_reading(url, body)
    stopped = time.monotonic()
    try:
        # another client meanwhile is served in full
        reply = httpx.post(f"{url}{ROUTE}", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"
        # cut: the buffers fill within seconds, then the grace runs out (generous bound: a loaded CI machine)
        assert wait_for(lambda: metric(url, SLOW, route=ROUTE, transport="sse") == slow_before + 1, timeout_s=60), \
            server.log_tail()
        cut_after_s = time.monotonic() - stopped
        assert cut_after_s >= GRACE_S
        # the client finds its connection reset (or closed), not a stream that goes on
        assert read_until_cut(sock, timeout_s=10) in ("reset", "eof")
    finally:
        sock.close()
    # the engine request was cancelled, the llm pool let it go, and it stopped long before max_tokens
    assert wait_for(lambda: metric(url, "mmserve_graph_requests_total", model=MODEL, outcome="cancelled")
                    == cancelled_before + 1, timeout_s=30), server.log_tail()
    assert wait_for(lambda: metric(url, "mmserve_stage_active_items", stage=f"{MODEL}/llm") == 0, timeout_s=30)
    generated = metric(url, "mmserve_llm_generated_tokens_total", model=MODEL)
    assert generated - tokens_before < N * MAX_TOKENS / 2
    time.sleep(0.2)
    assert metric(url, "mmserve_llm_generated_tokens_total", model=MODEL) == generated  # and stays stopped
    assert "slow consumer cut: sse /v1/chat/completions" in server.log_tail(20000)
    # and the server keeps serving streams to clients that read
    with httpx.stream("POST", f"{url}{ROUTE}", timeout=60, json={**body, "max_tokens": 8}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"


# -- units -------------------------------------------------------------------------------


def test_stream_outbox_is_bounded_and_passes_errors():
    from serve.slow_consumers import StreamOutbox

    async def run() -> None:
        outbox = StreamOutbox(max_bytes=10)
        await outbox.put(b"x" * 8)
        blocked = asyncio.ensure_future(outbox.put(b"y" * 8))  # 16 > 10: waits for the sender
        await asyncio.sleep(0.01)
        assert not blocked.done()
        assert await outbox.get() == b"x" * 8
        await asyncio.wait_for(blocked, 1)
        assert await outbox.get() == b"y" * 8
        await outbox.put(b"z" * 20)  # an empty outbox takes any one chunk
        outbox.finish(ValueError("body failed"))
        assert await outbox.get() == b"z" * 20  # what is queued goes out (in one send) before the error
        with pytest.raises(ValueError, match="body failed"):
            await outbox.get()
        done = StreamOutbox(max_bytes=10)
        await done.put(b"a")
        await done.put(b"b")
        done.finish()
        assert await done.get() == b"ab"
        assert await done.get() is None

    asyncio.run(asyncio.wait_for(run(), 10))


def test_websocket_that_stops_reading_is_cut_and_its_outbox_detaches():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from realtime.sessions import Journal, Outbox
    from serve.slow_consumers import SlowConsumerMetrics, SlowConsumers
    from serve.ws import StarletteSocket

    class StalledWebSocket:  # a client whose buffers are full: a send never completes
        def __init__(self, app):
            self.app = app
            self.scope = {"client": ("127.0.0.1", 5555), "route": SimpleNamespace(path="/v1/realtime")}

        async def send(self, message) -> None:
            await asyncio.Event().wait()

    class Connection:  # what uvicorn keeps per connection
        def __init__(self):
            self.client = ("127.0.0.1", 5555)
            self.aborted = False
            self.transport = SimpleNamespace(get_extra_info=lambda name: None, abort=self.abort)

        def abort(self) -> None:
            self.aborted = True

    registry = CollectorRegistry()
    metrics = SlowConsumerMetrics(registry)
    rule = SlowConsumers(grace_s=0.05, metrics=metrics)
    connection = Connection()
    rule.connections = {connection}
    socket_ = StarletteSocket(StalledWebSocket(SimpleNamespace(state=SimpleNamespace(slow_consumers=rule))))

    async def run() -> None:
        outbox = Outbox(Journal(16, 1 << 20))
        await outbox.attach(socket_.send)
        seq = await asyncio.wait_for(outbox.emit({"type": "response.created"}), 5)  # returns after the grace
        assert seq == 1 and not outbox.attached  # detached as after a drop; the frame stays journalled
        assert outbox.journal.after(0) is not None and len(outbox.journal.after(0)) == 1

    asyncio.run(run())
    assert connection.aborted
    assert registry.get_sample_value(SLOW, {"route": "/v1/realtime", "transport": "websocket"}) == 1


def test_config_checks_the_slow_consumer_settings(tmp_path):
    from serve.config import load_config

    path = tmp_path / "c.toml"
    path.write_text("[server]\nslow_consumer_grace_s = 2.5\nslow_consumer_outbox_bytes = 4096\n")
    server = load_config(path).server
    assert (server.slow_consumer_grace_s, server.slow_consumer_outbox_bytes) == (2.5, 4096)
    path.write_text("[server]\nslow_consumer_grace_s = 0\n")
    with pytest.raises(ValueError, match="slow_consumer_grace_s"):
        load_config(path)
