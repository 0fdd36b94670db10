"""`mmserve batch run`'s exit status, as the README documents it: 0 only when the output holds a success for
every input line; 1 when any line failed, in this run or in an earlier one that a rerun skips."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipelines.demo import build_demo_model
from tests.test_serve_support import ENV, REPO

GOOD = {"model": "llama-demo", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}
BAD = {**GOOD, "max_tokens": -1}  # a 400 from the endpoint: invalid_value naming max_tokens


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_demo_model("llama", tmp_path_factory.mktemp("demo") / "llama")


def batch_run(llama, src, out) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "serve.cli", "--log-level", "warning", "batch", "run", str(src), "-o", str(out),
           "--endpoint", "/v1/chat/completions", "--model", f"llama-demo={llama}"]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)


def write_lines(path, bodies: dict) -> None:
    path.write_text("".join(json.dumps({"custom_id": k, "body": v}) + "\n" for k, v in bodies.items()))


def test_a_failed_line_makes_the_exit_status_1_also_on_a_rerun(llama, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, {"ok": GOOD, "bad": BAD})
    run = batch_run(llama, src, out)
    assert run.returncode == 1 and out.is_file(), run.stderr
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["ok"]["response"]["status_code"] == 200
    assert records["bad"]["response"]["status_code"] == 400
    assert records["bad"]["response"]["body"]["error"]["param"] == "max_tokens"
    rerun = batch_run(llama, src, out)  # both lines are in the output: nothing runs, the failure still counts
    assert rerun.returncode == 1, rerun.stderr
    assert "0 line(s) run" in rerun.stderr and "(1 of them failed)" in rerun.stderr
    # Deleting the failed record from the output runs that line again; fixed, the batch succeeds.
    out.write_text(json.dumps(records["ok"]) + "\n")
    write_lines(src, {"ok": GOOD, "bad": GOOD})
    fixed = batch_run(llama, src, out)
    assert fixed.returncode == 0, fixed.stderr
    assert "1 line(s) run (0 failed)" in fixed.stderr
