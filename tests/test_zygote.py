"""stages/zygote.py: a forked child runs its target with the caller's environment and directory as they are at the
launch, is held by its pid (poll, wait, kill) though it is the zygote's child, is reaped (no zombie is left), and a
zygote that died is started again at the next launch; an import the zygote cannot do is an error naming it."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from stages.zygote import Zygote

TARGET = "tests.test_zygote"


def write_facts(path: str) -> None:
    """A child's target: what it sees, written to `path`."""
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
                   "env": os.environ.get("MMSERVE_ZYGOTE_TEST"), "stdin": os.read(0, 10).decode()}, f)
    os.replace(path + ".tmp", path)


def sleep_until_killed(path: str) -> None:
    open(path, "w").close()
    time.sleep(600)


def _gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def zygote():
    z = Zygote(preload=("json",))
    yield z
    z.close()


def test_a_child_runs_with_the_callers_environment_and_directory_and_is_reaped(zygote, tmp_path, monkeypatch):
    first = zygote.launch(f"{TARGET}:write_facts", str(tmp_path / "a.json"))
    assert first.wait(30) == -1
    monkeypatch.setenv("MMSERVE_ZYGOTE_TEST", "set after the zygote started")
    monkeypatch.chdir(tmp_path)
    child = zygote.launch(f"{TARGET}:write_facts", str(tmp_path / "b.json"))
    child.wait(30)
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a["pid"] == first.pid and b["pid"] == child.pid and a["pid"] != b["pid"]
    assert a["ppid"] == b["ppid"] == zygote._proc.pid != os.getpid()  # the zygote's children, not ours
    assert a["env"] is None and b["env"] == "set after the zygote started"
    assert b["cwd"] == str(tmp_path) and a["cwd"] != str(tmp_path)
    assert b["stdin"] == ""  # /dev/null, not the zygote's request pipe
    assert _gone(first.pid) and _gone(child.pid)  # reaped by the zygote: no zombie left


def test_poll_wait_and_kill_a_running_child(zygote, tmp_path):
    started = tmp_path / "started"
    child = zygote.launch(f"{TARGET}:sleep_until_killed", str(started))
    deadline = time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline, "the child never ran its target"
        time.sleep(0.02)
    assert child.poll() is None
    with pytest.raises(Exception) as info:
        child.wait(0.1)
    assert type(info.value).__name__ == "TimeoutExpired"
    child.kill()
    assert child.wait(10) == -1 and child.poll() == -1
    child.kill()  # an ended child: nothing to do, no error
    assert _gone(child.pid)


def test_a_dead_zygote_is_started_again_and_a_bad_preload_names_the_module(zygote, tmp_path):
    zygote.launch(f"{TARGET}:write_facts", str(tmp_path / "a.json")).wait(30)
    old = zygote._proc.pid
    os.kill(old, signal.SIGKILL)
    zygote._proc.wait(10)
    child = zygote.launch(f"{TARGET}:write_facts", str(tmp_path / "b.json"))
    child.wait(30)
    assert zygote._proc.pid != old and json.loads((tmp_path / "b.json").read_text())["ppid"] == zygote._proc.pid
    with pytest.raises(RuntimeError, match="no_such_module_here"):
        zygote.launch(f"{TARGET}:write_facts", str(tmp_path / "c.json"), preload=("no_such_module_here",))
    assert zygote.launch(f"{TARGET}:write_facts", str(tmp_path / "d.json")).wait(30) == -1  # it still serves


def test_the_zygote_ends_with_its_callers_pipe(tmp_path):
    z = Zygote()
    z.launch(f"{TARGET}:write_facts", str(tmp_path / "a.json")).wait(30)
    proc = z._proc
    z.close()
    assert proc.poll() is not None
