"""Without espeak-ng the real-speech tests skip; under CI=true that must fail `make test` instead of staying green.

Both guards run here with espeak-ng hidden from PATH (and apt-get, so nothing gets installed): the Makefile's
speech-tools target, and tests/conftest.py turning such a skip into a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_serve_support import ENV, REPO

HIDDEN = ("espeak-ng", "apt-get")
REAL_SPEECH_TEST = "tests/test_media_audio.py::test_real_speech_from_espeak_decodes"  # skipif espeak-ng is missing


@pytest.fixture(scope="module")
def path_without_espeak(tmp_path_factory) -> str:
    """A PATH with every command of this one except espeak-ng and apt-get (one folder of links)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            target, link = Path(folder) / name, bin_dir / name
            if name in HIDDEN or link.exists() or not os.access(target, os.X_OK) or target.is_dir():
                continue
            link.symlink_to(target)
    assert shutil.which("espeak-ng", path=str(bin_dir)) is None
    return str(bin_dir)


def env(path: str, ci: str | None) -> dict[str, str]:
    out = {k: v for k, v in ENV.items() if k != "CI"}
    out["PATH"] = path
    if ci is not None:
        out["CI"] = ci
    return out


def speech_tools(path: str, ci: str | None) -> subprocess.CompletedProcess:
    make = shutil.which("make")
    assert make, "make is needed (the README's commands are make targets)"
    return subprocess.run([make, "-s", "speech-tools"], cwd=REPO, env=env(path, ci), capture_output=True, text=True,
                          timeout=60)


def test_speech_tools_fails_under_ci_when_espeak_ng_is_missing(path_without_espeak):
    run = speech_tools(path_without_espeak, "true")
    assert run.returncode != 0
    assert "espeak-ng is missing" in run.stderr
    local = speech_tools(path_without_espeak, None)  # outside CI: a warning, and the tests skip
    assert local.returncode == 0, local.stderr
    assert "real-speech tests will be skipped" in local.stdout


def test_speech_tools_passes_under_ci_when_espeak_ng_is_there(path_without_espeak, tmp_path):
    fake = tmp_path / "espeak-ng"  # only found, never run, by the target
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    run = speech_tools(f"{tmp_path}{os.pathsep}{path_without_espeak}", "true")
    assert run.returncode == 0, run.stderr
    assert run.stdout == run.stderr == ""


def pytest_run(path: str, ci: str | None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", REAL_SPEECH_TEST],
                          cwd=REPO, env=env(path, ci), capture_output=True, text=True, timeout=300)


def test_a_real_speech_skip_fails_under_ci(path_without_espeak):
    run = pytest_run(path_without_espeak, "true")
    assert run.returncode == 1, run.stdout[-3000:]
    # a skip at set-up (skipif) reports as an error, one in the test's body as a failure: either fails the run
    assert re.search(r"\b1 (failed|error)\b", run.stdout) and "CI=true: this test would skip" in run.stdout, \
        run.stdout[-3000:]
    local = pytest_run(path_without_espeak, None)
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout[-3000:]
