"""examples/bench_realtime_video.py in its tiny mode: a real `mmserve serve` process, img2img sessions over the
WebSocket, stream batch on and off; it prints fps, latency percentiles and the on/off ratio per session count."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.test_serve_support import ENV, REPO, mmserve_left_in, scratch_tmpdir


def test_realtime_video_benchmark_runs_tiny(tmp_path):
    scratch = scratch_tmpdir(tmp_path)  # the server's config and job store: a temporary directory, gone at the end
    env = {**ENV, "HOME": str(tmp_path), "TMPDIR": str(scratch)}  # the demo checkpoint builds under this HOME
    run = subprocess.run([sys.executable, "examples/bench_realtime_video.py", "--tiny"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for n in (1, 2):
        for label in ("on ", "off"):
            assert re.search(rf"sessions {n}  stream batch {label}: +\d+\.\d+ fps/session +\d+\.\d+ fps total  "
                             rf"latency p50 +\d+\.\d+ ms  p99 +\d+\.\d+ ms", run.stdout), run.stdout
        assert re.search(rf"sessions {n}  stream batch on/off: ratio \d+\.\d+x", run.stdout), run.stdout
    assert "(tiny VAE)" in run.stdout
    assert mmserve_left_in(scratch) == []
