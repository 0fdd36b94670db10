"""The README's code blocks run as written, and what it states about the code is what the code does.

Each fenced block is extracted and run: python blocks with this interpreter (the venv's), bash blocks with
`bash -e -o pipefail` and the venv's bin first on PATH. They run in a scratch copy of the repository root
(a folder of links to its entries, so relative paths such as `.venv/bin/mmserve` resolve and what a block
writes stays out of the checkout) with a scratch HOME, so `~/.cache/mmserve/demo` is built fresh, as on a
new machine. A block whose first line is `# not run by the README test: <why>` is skipped (visibly, with
its reason); a skipped python block must still compile.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SKIP_MARKER = "# not run by the README test:"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
BLOCK_TIMEOUT_S = 240
# Files the blocks say they write (relative to the root): after a block that names one, it must be there.
OUTPUTS = ("lighthouse.png", "bicycle.png", "results.jsonl", "whisper-tiny-en/model.safetensors")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def skip_reason(self) -> str | None:
        first = self.code.lstrip("\n").splitlines()[0].strip() if self.code.strip() else ""
        return first[len(SKIP_MARKER):].strip() if first.startswith(SKIP_MARKER) else None


def readme_blocks(text: str) -> list[Block]:
    out = []
    for m in FENCE.finditer(text):
        indent = m.group("indent")
        code = textwrap.dedent(m.group("body")) if indent else m.group("body")
        out.append(Block(text.count("\n", 0, m.start()) + 1, m.group("lang").strip(), code))
    return out


BLOCKS = readme_blocks(README.read_text())


def test_the_readme_has_blocks_and_each_is_python_or_bash():
    assert len(BLOCKS) >= 6
    assert {b.lang for b in BLOCKS} <= {"python", "bash"}, [(b.line, b.lang) for b in BLOCKS]
    for b in BLOCKS:
        if SKIP_MARKER in b.code:
            assert b.skip_reason, f"README line {b.line}: the skip marker must be the block's first line, with a reason"


def test_skipped_python_blocks_still_compile():
    for b in BLOCKS:
        if b.lang == "python" and b.skip_reason:
            compile(b.code, f"README.md:{b.line}", "exec")  # a top-level await or a typo fails here


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(a scratch copy of the repository root, the environment the blocks run in)."""
    root = tmp_path_factory.mktemp("clone")
    for entry in REPO.iterdir():
        if entry.name != ".git":
            (root / entry.name).symlink_to(entry)
    home = tmp_path_factory.mktemp("home")
    venv_bin = Path(sys.executable).parent
    env = {**os.environ, "HOME": str(home), "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # the blocks import mmserve as the install left it, not as pytest set it up
    return root, env


def _param(b: Block):
    marks = [pytest.mark.skip(reason=f"README line {b.line}: {b.skip_reason}")] if b.skip_reason else []
    return pytest.param(b, id=f"line{b.line}-{b.lang}", marks=marks)


def _run_bounded(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Runs `cmd` in its own process group; past BLOCK_TIMEOUT_S the whole group (a server a block started
    too) is killed and the test fails with what it printed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running after {BLOCK_TIMEOUT_S} s: {cmd}\n--- stdout\n{out[-2000:]}"
                    f"\n--- stderr\n{err[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the block left running in its group
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_readme_block_runs_as_written(block: Block, scratch, tmp_path):
    root, env = scratch
    script = tmp_path / ("block.py" if block.lang == "python" else "block.sh")
    script.write_text(block.code)
    cmd = [sys.executable, str(script)] if block.lang == "python" else ["bash", "-e", "-o", "pipefail", str(script)]
    run = _run_bounded(cmd, cwd=root, env=env)
    assert run.returncode == 0, f"README line {block.line}:\n{block.code}\n--- stdout\n{run.stdout[-2000:]}\n" \
                                f"--- stderr\n{run.stderr[-4000:]}"
    for name in OUTPUTS:
        if name.split("/")[0] in block.code:
            assert (root / name).is_file(), f"README line {block.line} should have written {name}"


# -- what the README says about the code -----------------------------------------------------------------


def test_paths_the_readme_names_exist():
    """Every repository path in backticks or a link (with a slash and a source suffix) is in the repository."""
    text = README.read_text()
    named = set(re.findall(r"`((?:\.\./|\./)?[\w.-]+(?:/[\w.-]+)+\.(?:py|md|sh|toml))`", text))
    named |= {p for p in re.findall(r"\]\(([^)#\s]+)\)", text) if "://" not in p}
    assert named, "the README names no paths: this test's patterns are stale"
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"README names paths that are not in the repository: {missing}"


def test_the_401_rows_name_the_codes_the_server_answers():
    from starlette.applications import Starlette
    from starlette.requests import Request

    from serve.auth import tenant_of
    from serve.errors import ApiError

    app = Starlette()
    app.state.api_keys = {"sk-known": "alice"}

    def code_for(headers: list[tuple[bytes, bytes]]) -> str:
        request = Request({"type": "http", "app": app, "headers": headers, "method": "GET", "path": "/"})
        with pytest.raises(ApiError) as e:
            tenant_of(request)
        assert e.value.status == 401
        return e.value.code

    rows = [line for line in README.read_text().splitlines() if line.startswith("| 401 |")]
    codes = {("no" if "no `Authorization" in row else "unknown"): re.findall(r"`(\w+)` \|$", row)[0] for row in rows}
    assert codes == {"no": code_for([]), "unknown": code_for([(b"authorization", b"Bearer sk-other")])}
    assert codes == {"no": "missing_api_key", "unknown": "invalid_api_key"}
