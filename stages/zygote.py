"""A zygote: one helper process that has imported the heavy modules once and forks the worker processes asked of it.

A worker started as a fresh interpreter pays for its imports (torch, diffusers, transformers and a model family's
classes: ~7 s of CPU on 2 cores) every time, and a parallel replica starts its ranks again after losing one. The
zygote imports them once; each later worker is a `fork()` of it, ready in milliseconds. It never runs a torch op
itself, so it holds no OpenMP or CUDA state that a fork would copy half-made.

The caller's side (`Zygote.launch`) sends a request line (the function to run by module and name, its one string
argument, the modules to have imported first, the caller's environment and directory) and reads back the child's
pid. The child is the zygote's, not the caller's: the caller holds it through a pidfd (`Forked`), which polls,
waits and signals it without the pid-reuse race, and the zygote reaps it. The zygote ends when the caller's end of
its pipe closes (the caller exited, however it ended); its children live on until they finish, as workers started
by Popen would.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from typing import TextIO


class Forked:
    """A process the zygote forked, held by a pidfd: the subset of `subprocess.Popen` that workers are managed by
    (pid, poll, wait, kill). Its exit status stays with the zygote: `poll()` and `wait()` give -1 once it ended."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # it ended, and was reaped, before the reply reached us
            self._fd = None

    def poll(self) -> int | None:
        return self.wait(0) if self._ended(0) else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        self.returncode = -1
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self._fd is not None:
            try:
                signal.pidfd_send_signal(self._fd, sig)
            except ProcessLookupError:  # it has ended already
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self, timeout: float | None) -> bool:
        if self._fd is None:
            return True
        readable, _, _ = select.select([self._fd], [], [], timeout)  # a pidfd reads ready once the process ends
        return bool(readable)

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


class Zygote:
    """The caller's side: starts the zygote process on the first launch (and again if it died)."""

    def __init__(self, preload: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.preload = preload  # imported when the zygote starts, before the first request
        self.env = env  # the zygote's own environment, what its imports see (None: this process's)
        self._proc: subprocess.Popen | None = None
        self._replies: TextIO | None = None
        self._lock = threading.Lock()

    def launch(self, target: str, argument: str, preload: tuple[str, ...] = (), env: dict[str, str] | None = None,
               cwd: str | None = None) -> Forked:
        """Fork a child that runs `target` ("package.module:function") with `argument`, after the zygote has
        imported `preload`; the child's environment and working directory are `env` and `cwd`, by default this
        process's now."""
        request = json.dumps({"target": target, "argument": argument, "preload": list(preload),
                              "env": dict(os.environ if env is None else env), "cwd": str(cwd or os.getcwd())})
        with self._lock:
            line = self._ask(request) or self._ask(request)  # a zygote that died: once more
        if not line:
            raise RuntimeError("the zygote process ended before it forked the worker")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the zygote could not fork {target}: {reply['error']}")
        return Forked(reply["pid"])

    def close(self) -> None:
        with self._lock:
            self._close()

    def _ask(self, request: str) -> str:
        """One request line to the zygote (started first if it is not running); its reply line, "" if it died."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None and self._replies is not None
        try:
            self._proc.stdin.write(request + "\n")
            self._proc.stdin.flush()
            line = self._replies.readline()
        except OSError:  # BrokenPipeError: it died
            line = ""
        if not line:
            self._close()
        return line

    def _start(self) -> None:
        self._close()
        read, write = os.pipe()
        # torch.cuda.is_available() by NVML, not by starting CUDA's driver: a driver started here fails in a fork
        env = {**(os.environ if self.env is None else self.env), "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "stages.zygote", str(write), *self.preload],
                                          stdin=subprocess.PIPE, pass_fds=(write,), text=True, env=env)
        finally:
            os.close(write)
        self._replies = os.fdopen(read, "r")

    def _close(self) -> None:
        if self._proc is not None:
            try:
                if self._proc.stdin is not None:
                    self._proc.stdin.close()  # the zygote reads EOF and exits; its children live on
            except OSError:
                pass
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            self._proc = None
        if self._replies is not None:
            self._replies.close()
            self._replies = None


def _reap(signum, frame) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _child(request: dict, reply_fd: int) -> None:
    """In the forked child: the caller's environment and directory, stdin from /dev/null, then the target."""
    code = 0
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(reply_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        module, _, function = request["target"].partition(":")
        getattr(importlib.import_module(module), function)(request["argument"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(reply_fd: int, preload: list[str]) -> None:
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the caller's to act on
    for module in preload:
        importlib.import_module(module)
    replies = os.fdopen(reply_fd, "w")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            for module in request["preload"]:
                importlib.import_module(module)
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                raise RuntimeError("an import started CUDA in the zygote, and a forked child cannot use it")
            pid = os.fork()
        except Exception as e:
            replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        else:
            if pid == 0:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                _child(request, reply_fd)
            replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
