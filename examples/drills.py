"""Drills: break a running `mmserve serve` on purpose and report what was lost and how long recovery took.

    python examples/drills.py [--quick] [--only media,llm,slow,flood,server,disk] [--keep DIR]

Each drill runs against a real server on loopback (the tiny random demo models, built into a temporary
directory) and prints one block: what was done, what the server had acknowledged, what of that was lost (must be
0), how long recovery took, and the drill's own numbers. The last line is one JSON object with every drill.

* media: kill -9 a busy media worker while image edits (which decode an upload in a worker) run; the edit on the
  killed worker fails alone with a clear code, the pool replaces the worker. Recovery: kill -> the next 200 of an
  edit sent after the kill.
* llm: a streamed chat request abandoned mid-generation (the client closes its socket between steps) while
  another request runs. Recovery: close -> every KV block free again and no sequence running.
* slow: a client that reads the response headers of a streamed chat (4 choices, 20 top logprobs a token: more
  than the socket buffers hold) and then nothing. The server cuts it after `[server] slow_consumer_grace_s` and
  its generation stops there, freeing its slot. Recovery: stop reading -> cut and slot free.
* flood: tenant "flood" runs 10x its `concurrent` limit of clients sending chats back to back (far over its
  `requests_per_min` too) while tenant "steady" sends one chat at a time. Reported: 429 counts by limit (each
  with Retry-After and the x-ratelimit headers) against the server's counters, steady's median latency during the
  flood over alone. Recovery: the flood's end -> steady's next chat answered.
* server: kill -9 the server's process group (the server and its media workers) while a batch runs, restart it
  on the same --data-dir: every line must be in the output exactly once. Recovery: kill -> ready again; the
  batch's completion is reported beside it.
* disk: the job store on a tmpfs of a few MB (`unshare -rm`, a user and mount namespace: no root needed). Uploads
  until the disk is full, then: the refusals' status and code, the server still up, every acknowledged file
  read back intact; then files deleted and an upload tried again. Recovery: space freed -> the next stored
  upload. Skipped, with the reason, where unprivileged namespaces are not allowed.

"Acknowledged" is what the server answered 200 to: a finished request, a stored file, a created batch and its
committed lines. Every listening address of the servers must be 127.0.0.1 (checked, and printed).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SD, LLAMA = "sd-demo", "llama-demo"
KEYS = {"ops": "sk-drill-ops", "flood": "sk-drill-flood", "steady": "sk-drill-steady"}
FLOOD_PER_MIN = 30  # the flooding tenant's requests_per_min
FLOOD_CONCURRENT = 2  # and its concurrent limit: it runs 10x this many clients
SLOW_GRACE_S = 1.5  # [server] slow_consumer_grace_s of the drill server
SLOW_CHOICES = 4  # the never-reading client's stream carries 4 choices: more than the socket buffers hold
MEDIA_WORKER = "_worker_main"  # in a media worker's command line (stages/media/pool.py)


@dataclass
class Report:
    """One drill's outcome: `lost` counts acknowledged things missing or wrong afterwards (must be 0)."""

    drill: str  # media, llm, slow, flood, server, disk
    done: str  # what the drill did, in a sentence
    acknowledged: int = 0  # what the server answered 200 to (requests, files, batch lines)
    lost: int = 0  # of those, missing, changed, duplicated or never answered
    recovery_s: float | None = None  # fault -> service back, as the drill defines it; None: did not recover
    numbers: dict = field(default_factory=dict)  # the drill's own figures
    skipped: str | None = None  # why the drill could not run here

    @property
    def passed(self) -> bool:
        return self.skipped is None and self.lost == 0 and self.recovery_s is not None

    def print(self) -> None:
        print(f"\n== {self.drill}: {self.done}")
        if self.skipped:
            print(f"   skipped: {self.skipped}")
            return
        rec = "did not recover" if self.recovery_s is None else f"{self.recovery_s:.2f} s"
        print(f"   acknowledged {self.acknowledged}, lost {self.lost}; recovery {rec}")
        for k, v in self.numbers.items():
            print(f"   {k}: {v}")
        print(f"   -> {'PASS' if self.passed else 'FAIL'}")


# -- the server ---------------------------------------------------------------------------------------------------


class Server:
    """`python -m serve.cli serve` on 127.0.0.1 in its own process group (its media workers too); `prefix` wraps the
    command (the disk drill's namespace). `kill9` and `stop` kill the whole group."""

    def __init__(self, workdir: Path, config: Path, data_dir: Path, *, prefix: str = "", log_name: str = "server.log"):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / log_name
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "serve.cli", "--log-level", "warning", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--config", str(config), "--data-dir", str(data_dir)]
        if prefix:  # `sh -c 'PREFIX && exec CMD'`: the server keeps the pid Popen sees
            cmd = ["unshare", "-rm", "sh", "-c", f"{prefix} && exec " + " ".join(_quote(c) for c in cmd)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started = time.monotonic()
        try:
            self.wait_ready(240)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def listening(self) -> list[str]:
        """host:port of every listening inet socket of the server and its children."""
        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        return sorted({f"{c.laddr.ip}:{c.laddr.port}" for p in procs for c in _connections(p)
                       if c.status == psutil.CONN_LISTEN})

    def media_workers(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if any(MEDIA_WORKER in part for part in _cmdline(p))]

    def kill9(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def stop(self) -> None:
        self.kill9()
        self._log.close()


def _connections(p: psutil.Process) -> list:
    try:
        return p.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 when none)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05) -> float | None:
    """Seconds until `predicate()` held, or None past `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval_s)
    return None


def auth(tenant: str = "ops") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def write_config(workdir: Path, models: dict[str, Path], *, data_dir: Path, chat_model: bool = True) -> Path:
    """The tenants file and the server config: sd-demo, and llama-demo unless `chat_model` is False."""
    tenants = workdir / "tenants.toml"
    tenants.write_text(f"""
[[tenants]]
name = "ops"
keys = ["{KEYS['ops']}"]

[[tenants]]
name = "flood"
keys = ["{KEYS['flood']}"]
requests_per_min = {FLOOD_PER_MIN}
concurrent = {FLOOD_CONCURRENT}

[[tenants]]
name = "steady"
keys = ["{KEYS['steady']}"]
""")
    config = workdir / "mmserve.toml"
    config.write_text(f"""
[server]
api_keys_file = "{tenants}"
data_dir = "{data_dir}"
slow_consumer_grace_s = {SLOW_GRACE_S}
slow_consumer_outbox_bytes = 65536

[[models]]
name = "{SD}"
path = "{models['sd']}"

""")
    if chat_model:
        with config.open("a") as f:
            f.write(f"""
[[models]]
name = "{LLAMA}"
path = "{models['llama']}"
family = "causal-lm"
[models.llm]
kv_cache_mb = 8
""")
    return config


# -- request helpers ----------------------------------------------------------------------------------------------


def noise_png(side: int, seed: int = 0) -> bytes:
    """A PNG of noise: it does not compress, so its decode takes a while."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=1)
    return out.getvalue()


def edit(url: str, image: bytes) -> httpx.Response:
    data = {"model": SD, "prompt": "repaint", "num_inference_steps": "2", "size": "64x64"}
    return httpx.post(f"{url}/v1/images/edits", data=data, files={"image": ("in.png", image, "image/png")},
                      headers=auth(), timeout=120)


def chat(url: str, tenant: str = "ops", max_tokens: int = 8, client: httpx.Client | None = None) -> httpx.Response:
    """A short chat; `client` keeps its connections open (the flood's thousands of requests)."""
    post = client.post if client is not None else httpx.post
    return post(f"{url}/v1/chat/completions", headers=auth(tenant), timeout=120, json={
        "model": LLAMA, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True})


def expect_ok(r: httpx.Response) -> httpx.Response:
    if r.status_code != 200:
        raise RuntimeError(f"{r.request.method} {r.request.url.path} answered {r.status_code}: {r.text[:500]}")
    return r


def error_code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def open_stream(url: str, max_tokens: int, *, n: int = 1, rcvbuf: int | None = None) -> socket.socket:
    """POST a streamed chat (`n` choices, 20 top logprobs a token: large chunks) on a raw socket; returns it once the
    response headers are read."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window stays small
    host, port = url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    payload = json.dumps({"model": LLAMA, "messages": [{"role": "user", "content": "hello"}], "stream": True,
                          "temperature": 0, "ignore_eos": True, "max_tokens": max_tokens, "logprobs": True,
                          "top_logprobs": 20, "n": n}).encode()
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {KEYS['ops']}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    sock.settimeout(60)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            raise RuntimeError("the server closed the stream before answering")
        head += chunk
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"streamed chat refused: {head!r}")
    return sock


def llm_idle(url: str, free_blocks: float) -> bool:
    """No sequence running in the llm stage and `free_blocks` KV blocks free again."""
    return (metric(url, "mmserve_llm_running_sequences", model=LLAMA) == 0
            and metric(url, "mmserve_stage_active_items", stage=f"{LLAMA}/llm") == 0
            and kv_free(url) == free_blocks)


def kv_free(url: str) -> float:
    """KV blocks not held by a running sequence (free, or cached and reclaimable)."""
    return (metric(url, "mmserve_llm_kv_blocks", model=LLAMA, state="free")
            + metric(url, "mmserve_llm_kv_blocks", model=LLAMA, state="cached"))


# -- the drills ---------------------------------------------------------------------------------------------------


def drill_media_worker(server: Server, *, requests: int = 12, clients: int = 3, side: int = 1024) -> Report:
    """kill -9 the busiest media worker while `clients` threads send `requests` image edits of a noise PNG."""
    image = noise_png(side)
    expect_ok(edit(server.url, image))  # warm: the model's first call is not part of the drill
    before = {p.pid for p in server.media_workers()}
    results: list[tuple[float, float, httpx.Response | Exception]] = []  # (sent, answered, reply)
    lock, sent = threading.Lock(), iter(range(requests))

    def client() -> None:
        while True:
            with lock:
                if next(sent, None) is None:
                    return
            t0 = time.monotonic()
            try:
                reply: httpx.Response | Exception = edit(server.url, image)
            except httpx.HTTPError as e:
                reply = e
            with lock:
                results.append((t0, time.monotonic(), reply))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    killed, killed_at = _kill_busiest(server.media_workers(), wait_s=60), time.monotonic()
    for t in threads:
        t.join(300)
    after = {p.pid for p in server.media_workers()}
    ok = [r for r in results if isinstance(r[2], httpx.Response) and r[2].status_code == 200]
    failed = {}
    for _, _, r in results:
        if isinstance(r, Exception):
            failed[type(r).__name__] = failed.get(type(r).__name__, 0) + 1
        elif r.status_code != 200:
            key = f"{r.status_code} {error_code(r)}"
            failed[key] = failed.get(key, 0) + 1
    unclear = sum(n for k, n in failed.items() if not k.split()[-1].startswith("media_"))  # no reply, or no code
    recovered = [done - killed_at for t0, done, r in ok if t0 > killed_at]
    if not recovered and edit(server.url, image).status_code == 200:  # every edit had started before the kill
        recovered = [time.monotonic() - killed_at]
    return Report(
        "media", f"kill -9 media worker pid {killed} during {requests} image edits ({clients} clients, "
                 f"{side}x{side} noise PNG uploads)",
        acknowledged=len(ok), lost=unclear, recovery_s=min(recovered) if recovered else None,
        numbers={"edits answered 200": len(ok), "edits failed (status code: count)": failed,
                 "workers before -> after": f"{sorted(before)} -> {sorted(after)}",
                 "worker replaced": killed not in after and len(after) == len(before)})


def _kill_busiest(workers: list[psutil.Process], wait_s: float) -> int:
    """kill -9 the first worker seen using CPU (decoding); returns its pid."""
    deadline = time.monotonic() + wait_s
    last = {p.pid: p.cpu_times().user + p.cpu_times().system for p in workers}
    while time.monotonic() < deadline:
        time.sleep(0.02)
        for p in workers:
            try:
                used = p.cpu_times().user + p.cpu_times().system
            except psutil.NoSuchProcess:
                continue
            if used - last[p.pid] > 0.005:
                p.kill()
                return p.pid
            last[p.pid] = used
    workers[0].kill()
    return workers[0].pid


def drill_llm_abandoned(server: Server, *, read_chunks: int = 5, others: int = 2) -> Report:
    """A streamed chat abandoned after `read_chunks` SSE chunks, while `others` plain chats run."""
    url = server.url
    expect_ok(chat(url))  # warm
    wait_for(lambda: metric(url, "mmserve_llm_running_sequences", model=LLAMA) == 0, 30)
    free_before = kv_free(url)
    cancelled_before = metric(url, "mmserve_graph_requests_total", model=LLAMA, outcome="cancelled")
    sock = open_stream(url, max_tokens=2000)
    buf = b""
    while buf.count(b"data: ") < read_chunks:
        buf += sock.recv(1 << 16)
    held = free_before - kv_free(url)
    with ThreadPoolExecutor(others) as pool:
        replies = [pool.submit(chat, url, "ops", 16) for _ in range(others)]
        sock.close()  # mid-generation: the sequence is between two steps
        closed = time.monotonic()
        replies = [f.result() for f in replies]
    freed = wait_for(lambda: llm_idle(url, free_before), 60)
    ok = [r for r in replies if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"]
    cancelled = metric(url, "mmserve_graph_requests_total", model=LLAMA, outcome="cancelled") - cancelled_before
    return Report(
        "llm", f"a streamed chat (max_tokens 2000) abandoned after {read_chunks} chunks, {others} chats beside it",
        acknowledged=len(replies), lost=len(replies) - len(ok),
        recovery_s=None if freed is None else time.monotonic() - closed,
        numbers={"KV blocks held by the stream before the close": held,
                 "KV blocks free before / after": f"{free_before} / {kv_free(url)}",
                 "requests counted cancelled": cancelled, "other chats answered in full": f"{len(ok)}/{others}"})


def drill_slow_consumer(server: Server, *, max_tokens: int = 2000, timeout_s: float = 60) -> Report:
    """A streamed chat whose client reads the headers and then nothing (a 4 KB receive window)."""
    url = server.url
    free_before = kv_free(url)
    cut_before = metric(url, "mmserve_slow_consumers_total", route="/v1/chat/completions", transport="sse")
    tokens_before = metric(url, "mmserve_llm_generated_tokens_total", model=LLAMA)
    sock = open_stream(url, max_tokens=max_tokens, n=SLOW_CHOICES, rcvbuf=4096)
    stopped = time.monotonic()
    cut_s = freed_s = None
    try:
        other = chat(url, max_tokens=4)
        while time.monotonic() - stopped < timeout_s and (cut_s is None or freed_s is None):
            now = time.monotonic() - stopped
            if cut_s is None and metric(url, "mmserve_slow_consumers_total", route="/v1/chat/completions",
                                        transport="sse") > cut_before:
                cut_s = now
            if freed_s is None and llm_idle(url, free_before):
                freed_s = now
            time.sleep(0.05)
        ended = _read_until_closed(sock, 10)
    finally:
        sock.close()
    tokens = metric(url, "mmserve_llm_generated_tokens_total", model=LLAMA) - tokens_before - 4  # less the other's
    tokens /= SLOW_CHOICES  # per choice
    return Report(
        "slow", f"a streamed chat (n {SLOW_CHOICES}, max_tokens {max_tokens}) whose client stopped reading after "
                f"the headers (slow_consumer_grace_s {SLOW_GRACE_S})",
        acknowledged=1, lost=int(other.status_code != 200),
        recovery_s=None if cut_s is None or freed_s is None else max(cut_s, freed_s),
        numbers={"cut after (s)": None if cut_s is None else round(cut_s, 2), "the client saw": ended,
                 "slot free after (s)": None if freed_s is None else round(freed_s, 2),
                 f"tokens generated per choice (of {max_tokens})": tokens,
                 "generation ended before the cut": tokens >= max_tokens,
                 "another chat meanwhile": other.status_code})


def _read_until_closed(sock: socket.socket, timeout_s: float) -> str:
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 16):
            pass
        return "eof"
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "still open"


def drill_flood(server: Server, *, seconds: float = 10, steady_requests: int = 5) -> Report:
    """Tenant "flood" runs 10x its `concurrent` limit of clients for `seconds`, each sending its next chat as soon as
    the last is answered (after a 429, 100 ms later: the drill's own CPU stays mostly out of the measurement), far
    over its requests_per_min too; tenant "steady" sends one chat at a time, alone first for the latency ratio."""
    url = server.url
    clients = 10 * FLOOD_CONCURRENT
    client = httpx.Client(limits=httpx.Limits(max_connections=clients + 2))

    def steady() -> tuple[float, float]:
        t0 = time.monotonic()
        expect_ok(chat(url, "steady", client=client))
        return t0, time.monotonic()

    def flooder(until: float) -> list[httpx.Response]:
        replies = []
        while time.monotonic() < until:
            replies.append(chat(url, "flood", max_tokens=32, client=client))
            if replies[-1].status_code == 429:
                time.sleep(0.1)
        return replies

    alone = [end - t0 for t0, end in (steady() for _ in range(steady_requests))]
    outcomes = ("admitted", "over_requests_per_min", "over_concurrent")
    counted = {o: metric(url, "mmserve_tenant_requests_total", tenant="flood", outcome=o) for o in outcomes}
    with ThreadPoolExecutor(clients) as pool:
        started = time.monotonic()
        futures = [pool.submit(flooder, started + seconds) for _ in range(clients)]
        during = []
        while time.monotonic() < started + seconds:
            t0, end = steady()
            if end <= started + seconds:  # only chats wholly inside the flood
                during.append(end - t0)
        flood = [r for f in futures for r in f.result()]
    ended = time.monotonic()
    after = steady()
    recovery = after[1] - ended
    client.close()
    refused = [r for r in flood if r.status_code == 429]
    admitted = [r for r in flood if r.status_code != 429]
    by_limit: dict[str, int] = {}
    for r in refused:
        limit = r.json()["error"]["param"]
        by_limit[limit] = by_limit.get(limit, 0) + 1
    with_headers = sum(1 for r in refused if "retry-after" in r.headers and "x-ratelimit-remaining-requests"
                       in r.headers and error_code(r) == "rate_limit_exceeded")
    counted = {o: metric(url, "mmserve_tenant_requests_total", tenant="flood", outcome=o) - n
               for o, n in counted.items()}
    ratio = statistics.median(during) / statistics.median(alone) if during else None
    return Report(
        "flood", f"tenant flood: {clients} clients (10x its concurrent={FLOOD_CONCURRENT}; requests_per_min="
                 f"{FLOOD_PER_MIN}) sending chats back to back for {seconds:.0f} s; tenant steady one chat at a time",
        acknowledged=len(admitted) + len(alone) + len(during) + 1,
        lost=sum(1 for r in admitted if r.status_code != 200),
        recovery_s=recovery,
        numbers={"flood sent / admitted / 429": f"{len(flood)} / {len(admitted)} / {len(refused)}",
                 "429s by limit": by_limit, "429s per second": round(len(refused) / seconds),
                 "429s with Retry-After and x-ratelimit headers": f"{with_headers}/{len(refused)}",
                 "server counters (admitted, over_requests_per_min, over_concurrent)":
                     [int(counted[o]) for o in outcomes],
                 "steady median latency alone / during (ms)":
                     f"{statistics.median(alone) * 1000:.0f} / "
                     f"{statistics.median(during) * 1000 if during else float('nan'):.0f}",
                 "steady latency ratio during/alone": None if ratio is None else round(ratio, 2),
                 "steady chats during the flood": len(during),
                 "steady after the flood (ms)": round(recovery * 1000)})


def batch_input(lines: int, steps: int) -> bytes:
    """A batch input file: `lines` image generations, custom ids line-0, line-1, ..."""
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/images/generations",
                               "body": {"model": SD, "prompt": f"harbour {i}", "size": "64x64",
                                        "num_inference_steps": steps, "response_format": "b64_json"}}) + "\n"
                   for i in range(lines)).encode()


def upload(url: str, name: str, data: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/files", headers=auth(), files={"file": (name, data)}, data={"purpose": "batch"},
                      timeout=60)


def create_batch(url: str, input_file_id: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/batches", headers=auth(), timeout=60, json={
        "input_file_id": input_file_id, "endpoint": "/v1/images/generations", "completion_window": "24h"})


def get_batch(url: str, batch_id: str) -> dict:
    return httpx.get(f"{url}/v1/batches/{batch_id}", headers=auth(), timeout=30).json()


def batch_outcome(url: str, batch: dict, lines: int) -> dict:
    """The finished batch's output checked against its input: lines present, duplicated, missing, their statuses."""
    ids, statuses = [], []
    if batch.get("output_file_id"):
        text = httpx.get(f"{url}/v1/files/{batch['output_file_id']}/content", headers=auth(), timeout=60).text
        records = [json.loads(x) for x in text.splitlines()]
        ids = [r["custom_id"] for r in records]
        statuses = [r["response"]["status_code"] for r in records]
    missing = {f"line-{i}" for i in range(lines)} - set(ids)
    duplicated = len(ids) - len(set(ids))
    return {"status": batch["status"], "present": len(ids), "duplicated": duplicated, "missing": len(missing),
            "not_200": sum(1 for s in statuses if s != 200)}


def drill_server_kill(server: Server, restart, data_dir: Path, *, lines: int = 6, steps: int = 10
                      ) -> tuple[Report, Server]:
    """kill -9 the server's process group once a batch of `lines` images has committed a line; restart it on the
    same data directory (`restart()` -> Server) and wait for the batch. Returns the report and the new server."""
    url = server.url
    batch = expect_ok(create_batch(url, expect_ok(upload(url, "in.jsonl", batch_input(lines, steps))).json()["id"]))
    batch = batch.json()
    wait_for(lambda: get_batch(url, batch["id"])["request_counts"]["completed"] >= 1, 300, interval_s=0.02)
    server.kill9()
    killed = time.monotonic()
    committed = _committed_lines(data_dir, batch["id"])  # read from the store itself, between the kill and the restart
    again = restart()
    ready_s = time.monotonic() - killed
    done_s = wait_for(lambda: get_batch(again.url, batch["id"])["status"] in ("completed", "failed", "cancelled"),
                      600, interval_s=0.2)
    out = batch_outcome(again.url, get_batch(again.url, batch["id"]), lines)
    return Report(
        "server", f"kill -9 of the server's process group during a batch of {lines} images "
                  f"({committed} lines committed at the kill), restart on the same --data-dir",
        acknowledged=1 + committed, lost=out["missing"] + out["duplicated"] + out["not_200"], recovery_s=ready_s,
        numbers={"batch status after the restart": out["status"],
                 "lines in the output / duplicated / missing / not 200":
                     f"{out['present']} / {out['duplicated']} / {out['missing']} / {out['not_200']}",
                 "kill -> batch completed (s)": None if done_s is None else round(ready_s + done_s, 2)}), again


def _committed_lines(data_dir: Path, batch_id: str) -> int:
    import sqlite3

    with sqlite3.connect(f"file:{data_dir / 'jobs.sqlite3'}?mode=ro", uri=True) as db:
        return db.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id=?", (batch_id,)).fetchone()[0]


def drill_disk_full(workdir: Path, models: dict[str, Path], *, size_mb: int = 4, file_kb: int = 256,
                    lines: int = 3) -> Report:
    """The job store on a `size_mb` tmpfs: upload `file_kb` files until refused, create a batch of `lines` images on
    the full disk, check what was stored, delete a third of the files, upload again, wait for the batch."""
    done = (f"job store on a {size_mb} MB tmpfs: {file_kb} KB uploads until the disk is full, a batch created on "
            "the full disk, then a third of the files deleted")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {workdir}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return Report("disk", done, skipped=f"no unprivileged tmpfs here: {probe.stderr.strip()}")
    data_dir = workdir / "data"
    data_dir.mkdir()
    config = write_config(workdir, models, data_dir=data_dir, chat_model=False)
    mount = f"mount -t tmpfs -o size={size_mb}m tmpfs {_quote(str(data_dir))}"
    server = Server(workdir, config, data_dir, prefix=mount)
    url = server.url

    def tally(counts: dict[str, int], r: httpx.Response) -> None:
        key = f"{r.status_code} {error_code(r) or ''}".strip()
        counts[key] = counts.get(key, 0) + 1

    try:
        # 1. fill the disk; the batch's input goes first, while there is room
        batch_file = batch_input(lines, 2)
        stored = {expect_ok(upload(url, "in.jsonl", batch_file)).json()["id"]: batch_file}
        refusals: dict[str, int] = {}
        for i in range(4 * size_mb * 1024 // file_kb):
            data = np.random.default_rng(i).bytes(file_kb * 1024)
            r = upload(url, f"f{i}.bin", data)
            if r.status_code == 200:
                stored[r.json()["id"]] = data
            else:
                tally(refusals, r)
                if sum(refusals.values()) >= 3:
                    break
        # 2. on the full disk: a batch, the server's health, every stored file read back
        batch = create_batch(url, next(iter(stored)))
        alive = httpx.get(f"{url}/health", timeout=10).status_code == 200 and server.proc.poll() is None
        intact = sum(1 for fid, data in stored.items() if httpx.get(
            f"{url}/v1/files/{fid}/content", headers=auth(), timeout=60).content == data)
        # 3. free a third of the space (deleted on purpose, so not lost) and upload again
        deleted = list(stored)[1: 1 + max(1, len(stored) // 3)]
        deletes: dict[str, int] = {}
        freed_at = time.monotonic()
        for fid in deleted:
            tally(deletes, httpx.delete(f"{url}/v1/files/{fid}", headers=auth(), timeout=30))
        recovered = wait_for(lambda: upload(url, "again.bin", b"x" * 1024 * file_kb).status_code == 200, 30,
                             interval_s=0.2)
        recovery = None if recovered is None else time.monotonic() - freed_at
        left = set(stored) - set(deleted)
        still = sum(1 for fid in left if httpx.get(f"{url}/v1/files/{fid}/content", headers=auth(),
                                                   timeout=60).content == stored[fid])
        # 4. the batch created on the full disk finishes once there is room, every line once
        out = None
        if batch.status_code == 200:
            wait_for(lambda: get_batch(url, batch.json()["id"])["status"] in ("completed", "failed", "cancelled"),
                     120, interval_s=0.2)
            out = batch_outcome(url, get_batch(url, batch.json()["id"]), lines)
        batch_lost = 0 if out is None else out["missing"] + out["duplicated"] + out["not_200"]
        return Report(
            "disk", done, acknowledged=len(stored) + (batch.status_code == 200),
            lost=(len(stored) - intact) + (len(left) - still) + batch_lost,
            recovery_s=recovery if alive else None,
            numbers={"uploads stored before full": len(stored), "refusals (status code: count)": refusals,
                     "server up while full": alive, "stored files intact while full": f"{intact}/{len(stored)}",
                     "batch created on the full disk": f"{batch.status_code} {error_code(batch) or ''}".strip(),
                     "deletes (status: count)": deletes,
                     "batch after space was freed": out, "listening": server.listening()})
    finally:
        server.stop()


# -- the run ------------------------------------------------------------------------------------------------------

DRILLS = ("media", "llm", "slow", "flood", "server", "disk")


def run(root: Path, *, quick: bool, only: tuple[str, ...] = DRILLS) -> list[Report]:
    """Build the demo models under `root`, run the drills in `only`, print each report; returns them."""
    from pipelines.demo import build_demo_model

    models = {f: build_demo_model(f, root / "models" / f) for f in ("sd", "llama")}
    reports: list[Report] = []
    listening: list[str] = []
    main_drills = [d for d in only if d != "disk"]
    if main_drills:
        workdir = root / "main"
        workdir.mkdir()
        config = write_config(workdir, models, data_dir=workdir / "data")
        server = Server(workdir, config, workdir / "data")
        try:
            listening += server.listening()
            if "media" in only:
                reports.append(drill_media_worker(server, requests=6 if quick else 12, side=768 if quick else 1024))
            if "llm" in only:
                reports.append(drill_llm_abandoned(server))
            if "slow" in only:
                reports.append(drill_slow_consumer(server))
            if "flood" in only:
                reports.append(drill_flood(server, seconds=4 if quick else 10, steady_requests=3 if quick else 5))
            if "server" in only:
                def restart() -> Server:
                    return Server(workdir, config, workdir / "data", log_name="server-2.log")
                report, server = drill_server_kill(server, restart, workdir / "data", lines=4 if quick else 8,
                                                   steps=6 if quick else 10)
                reports.append(report)
                listening += server.listening()
            for r in reports:
                r.print()
        finally:
            server.stop()
    if "disk" in only:
        disk = root / "disk"
        disk.mkdir()
        report = drill_disk_full(disk, models, size_mb=3 if quick else 4, file_kb=256)
        listening += report.numbers.pop("listening", [])
        reports.append(report)
        report.print()
    loopback = bool(listening) and all(a.startswith("127.0.0.1:") for a in listening)
    print(f"\nlistening addresses: {sorted(set(listening))} (all loopback: {loopback})")
    reports.append(Report("loopback", "every listening address of the drill servers is 127.0.0.1",
                          recovery_s=0.0, lost=0 if loopback else 1, numbers={"addresses": sorted(set(listening))}))
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (the tests' form)")
    parser.add_argument("--only", default=",".join(DRILLS), help=f"comma-separated, of {','.join(DRILLS)}")
    parser.add_argument("--keep", type=Path, help="work in this directory (kept: logs, data) instead of a temp one")
    args = parser.parse_args()
    only = tuple(d.strip() for d in args.only.split(",") if d.strip())
    unknown = set(only) - set(DRILLS)
    if unknown:
        parser.error(f"--only: unknown drills {sorted(unknown)}; choose from {list(DRILLS)}")
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        reports = run(args.keep, quick=args.quick, only=only)
    else:
        with tempfile.TemporaryDirectory(prefix="mmserve-drills-") as tmp:
            reports = run(Path(tmp), quick=args.quick, only=only)
    passed = all(r.passed or r.skipped for r in reports)
    print(f"\n{'all drills passed' if passed else 'SOME DRILLS FAILED'}")
    print(json.dumps({"passed": passed, "drills": [asdict(r) for r in reports]}, default=str))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
