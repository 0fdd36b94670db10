"""`mmserve batch run INPUT.jsonl -o OUTPUT.jsonl`: run a batch file through a server or in-process.

Each input line (OpenAI's batch format) gives one output line, written as soon as it finishes
(appended, flushed and fsynced): successes and failures alike, each with its `custom_id`. Rerun
with the same output path and the lines whose `custom_id` is already there are skipped (failed
ones too: delete a line from the output to run it again); a half-written last line (the process
was killed mid-write) is dropped first. A malformed line without a custom_id is recorded as
"#line<N>". Progress and ETA go to stderr. The exit status is 0 when the output holds a success
for every input line, 1 when any line failed (in this run or an earlier one), 2 for a usage error.

Without --server the models load in this process (the demo models, or --config/--model) and
lines go through the same endpoint code the server runs (serve/batch_lines.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from serve.batch_lines import BATCH_ENDPOINTS, LineError, error_record, parse_line, run_line, split_lines


def add_batch_parser(sub) -> None:
    b = sub.add_parser("batch", help="run batch files (OpenAI batch JSONL)")
    bsub = b.add_subparsers(dest="batch_command", required=True)
    r = bsub.add_parser("run", help="run INPUT.jsonl into OUTPUT.jsonl (resumable)",
                        description=__doc__.split("\n\n")[1])
    r.add_argument("input", type=Path)
    r.add_argument("-o", "--output", type=Path, required=True, help="output JSONL; rerun with it to resume")
    r.add_argument("--endpoint", choices=BATCH_ENDPOINTS, help="the endpoint of lines without a url "
                                                               "(and the only one allowed when given)")
    r.add_argument("--server", help="base URL of a running mmserve (default: run in this process)")
    r.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' to --server")
    r.add_argument("--concurrency", type=int, default=4, help="lines in flight at once (default 4)")
    r.add_argument("--config", type=Path, help="in-process: TOML config naming the models")
    r.add_argument("--model", action="append", default=[], metavar="NAME=PATH_OR_ID", help="in-process: a model")
    r.add_argument("--demo-dir", type=Path, help="in-process: where demo checkpoints are built")
    r.set_defaults(run=run_batch_command)


def run_batch_command(args) -> int:
    from serve.cli import UsageError

    if not args.input.is_file():
        raise UsageError(f"{args.input}: no such file")
    if args.concurrency < 1:
        raise UsageError("--concurrency must be >= 1")
    if args.server:
        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        client = httpx.AsyncClient(base_url=args.server.rstrip("/"), headers=headers, timeout=None)
        return asyncio.run(run_file(client, args.input, args.output, args.endpoint, args.concurrency))
    with tempfile.TemporaryDirectory(prefix="mmserve-batch-") as data_dir:  # the in-process server's job store
        return _run_in_process(args, data_dir)


def _run_in_process(args, data_dir: str) -> int:
    from pipelines.engine import Engine
    from serve.app import create_app
    from serve.cli import _load_config, _usage
    from serve.config import demo_specs, engine_config

    loaded = _load_config(args.config, args.model)
    config = loaded.engine
    if config is None:
        config = _usage(lambda: engine_config(demo_specs(args.demo_dir or loaded.server.demo_dir), loaded.raw_engine))
    engine = Engine(config)
    engine.start()
    try:
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine, data_dir=data_dir),
                                                                 raise_app_exceptions=False),
                                   base_url="http://batch", timeout=None)
        return asyncio.run(run_file(client, args.input, args.output, args.endpoint, args.concurrency))
    finally:
        engine.shutdown()


async def run_file(client: httpx.AsyncClient, input_path: Path, output_path: Path, endpoint: str | None,
                   concurrency: int) -> int:
    """Run every line of `input_path` not yet in `output_path`. Returns 0 when every input line has a success
    in the output, else 1: a rerun that skips an earlier failure still reports it."""
    lines = split_lines(input_path.read_bytes())
    done = _completed_ids(output_path)
    ids = [_line_id(text, i) for i, text in enumerate(lines)]
    todo = [(i, text) for i, text in enumerate(lines) if ids[i] not in done]
    failed_before = sum(1 for i in ids if done.get(i) is False)
    total, skipped, failed = len(lines), len(lines) - len(todo), 0
    start = time.monotonic()
    finished = 0
    slots = asyncio.Semaphore(concurrency)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "a") as out:
        async def one(index: int, text: str) -> None:
            nonlocal finished, failed
            try:
                line = parse_line(text, index, endpoint)
            except LineError as e:
                ok, record = False, error_record(e.custom_id or f"#line{index + 1}", e.code, e.message)
            else:
                async with slots:
                    ok, record = await run_line(client, line, retries=3)  # 429/503: after Retry-After
            out.write(json.dumps(record, separators=(",", ":")) + "\n")  # one write per line: no interleaving
            out.flush()
            os.fsync(out.fileno())
            finished += 1
            failed += not ok
            _progress(skipped + finished, total, finished, len(todo), start)

        async with client:
            await asyncio.gather(*(one(i, text) for i, text in todo))
    print(f"\n{output_path}: {finished} line(s) run ({failed} failed), {skipped} already done "
          f"({failed_before} of them failed), {total} in all", file=sys.stderr)
    return 1 if failed or failed_before else 0


def _line_id(text: str, index: int) -> str:
    try:
        item = json.loads(text)
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
    except json.JSONDecodeError:
        custom_id = None
    return custom_id if isinstance(custom_id, str) and custom_id else f"#line{index + 1}"


def _completed_ids(path: Path) -> dict[str, bool]:
    """custom_id -> whether it succeeded, for the lines already in the output; a torn last line (no newline)
    is cut off first."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        with open(path, "r+b") as f:
            f.truncate(len(data))
    ids: dict[str, bool] = {}
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
            ids[record["custom_id"]] = _succeeded(record)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # not one of our records: rerunning its line is the safe choice
    return ids


def _succeeded(record: dict) -> bool:
    """An output record is a success when it has no error and its response's status is 2xx (as run_line says)."""
    response = record.get("response")
    status = response.get("status_code") if isinstance(response, dict) else None
    return record.get("error") is None and isinstance(status, int) and 200 <= status < 300


def _progress(done: int, total: int, ran: int, to_run: int, start: float) -> None:
    elapsed = time.monotonic() - start
    eta = elapsed / ran * (to_run - ran) if ran else 0.0
    width = 30
    filled = int(width * done / max(1, total))
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} lines, {elapsed:.0f}s elapsed, "
          f"ETA {eta:.0f}s", end="", file=sys.stderr, flush=True)
