"""Helpers for the serve tests: a real `mmserve serve` process on loopback, metrics reading, tiny images.

No tests here; the serve test modules import from this file.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from stages.zygote import Zygote

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false"}
# Test servers are forks of one process that imported the server's modules once (~7 s of a fresh interpreter's
# start on 2 cores): the same `mmserve serve` main, run in a process of its own.
SERVERS = Zygote(preload=("serve.cli", "serve.app"), env=ENV)


def scratch_tmpdir(tmp_path: Path) -> Path:
    """A folder to give a subprocess as its TMPDIR, so a test can see what it leaves behind (`mmserve_left_in`)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    return scratch


def mmserve_left_in(scratch: Path) -> list[str]:
    """The names of what mmserve left in a scratch TMPDIR (its job stores and benchmark folders: mmserve-*)."""
    return sorted(p.name for p in scratch.iterdir() if p.name.startswith("mmserve-"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log_tail=lambda: "") -> None:
    """Polls `url`/ready until it answers 200. RuntimeError when `proc` exits first, TimeoutError past
    `timeout_s`; both end with `log_tail()` (the server's last output)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not ready within {timeout_s}s:\n{log_tail()}")


def serve_in_child(argument: str) -> None:
    """A forked test server's body (Server): its output to its log, then `mmserve serve`'s main."""
    spec = json.loads(argument)
    log = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    from serve.cli import main

    sys.exit(main(spec["argv"]))


class Server:
    """`mmserve serve --config FILE` (`python -m serve.cli`'s main) in a process of its own, forked from SERVERS;
    `url` once /ready answers 200. Its exit status is not kept (proc.wait() gives -1): a test that checks it
    starts its server with Popen."""

    def __init__(self, workdir: Path, config_toml: str, *, extra_args: tuple[str, ...] = (),
                 ready_timeout_s: float = 120, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "mmserve.toml"
        config.write_text(config_toml)
        self.log_path = workdir / "server.log"
        self._log = open(self.log_path, "wb")
        argv = ["--log-level", "warning", "serve", "--port", str(self.port), "--config", str(config), *extra_args]
        env = {**ENV, **(env or {})}
        try:
            self.proc = SERVERS.launch("tests.test_serve_support:serve_in_child",
                                       json.dumps({"log": str(self.log_path), "argv": argv}), env=env, cwd=str(REPO))
        except RuntimeError:  # the zygote cannot fork here (CUDA started in it): a fresh interpreter
            self.proc = subprocess.Popen([sys.executable, "-m", "serve.cli", *argv], cwd=REPO, env=env,
                                         stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        try:
            wait_ready(self.url, self.proc, timeout_s, self.log_tail)
        except TimeoutError:
            self.stop()
            raise

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 when none)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def png_bytes(width: int, height: int, color=(200, 30, 30), mode: str = "RGB") -> bytes:
    from PIL import Image

    fill = color if mode != "RGBA" else (*color, 255)
    out = io.BytesIO()
    Image.new(mode, (width, height), fill).save(out, format="PNG")
    return out.getvalue()


def read_image(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data))
