"""examples/bench_realtime_voice.py in its tiny mode: two scripted turns (one barge-in) against a server it starts."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from tests.test_serve_support import ENV, REPO


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng for the scripted speech")
def test_realtime_voice_benchmark_prints_latencies():
    run = subprocess.run([sys.executable, "examples/bench_realtime_voice.py", "--turns", "2"], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    for label in ("last voiced chunk sent -> delta received", "speech_stopped -> first delta sent",
                  "ASR final", "LLM time to first token", "TTS first chunk", "barge-in detected -> last delta sent"):
        assert re.search(re.escape(label) + r".*p50 +[-\d.]+ ms +p99 +[-\d.]+ ms", out), out
    assert "interrupted replies cancelled (turn_detected): 1/1" in out, out
    # The 100 ms verdict is the client's figure (first sample of the interrupting speech -> last old delta
    # received), not the server's near-zero one: its p99 is the client row's.
    client = re.search(r"first voiced chunk sent -> last delta received +p50 +[-\d.]+ ms +p99 +([-\d.]+) ms", out)
    verdict = re.search(r"interruption -> silence at the client p99 ([-\d.]+) ms: (within|OVER) the 100 ms budget",
                        out)
    assert client and verdict, out
    assert verdict.group(1) == client.group(1)
    assert (verdict.group(2) == "within") == (float(verdict.group(1)) <= 100)
