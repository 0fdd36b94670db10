"""The drills (examples/drills.py) in their short form (`--quick`), run as the script is run: each drill's report
must say that nothing acknowledged was lost and that the server recovered, and every address the drill servers
listened on must be loopback.

Two runs: the drills on one server (a media worker killed, an LLM request abandoned, a client that never reads, a
tenant flooding, then the server itself killed during a batch and restarted), and the full disk under the job
store, on a server of its own (marked slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.test_serve_support import ENV, REPO

TIMEOUT_S = 300  # a loaded machine; the two runs take ~50 s and ~30 s on 2 cores


def run_drills(only: str, tmp_path) -> dict[str, dict]:
    """`examples/drills.py --quick --only ONLY`: its reports by drill name, from the JSON last line."""
    proc = subprocess.run([sys.executable, "examples/drills.py", "--quick", "--only", only, "--keep", str(tmp_path)],
                          cwd=REPO, env={**ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    reports = {r["drill"]: r for r in summary["drills"]}
    assert set(only.split(",")) | {"loopback"} == set(reports), proc.stdout[-4000:]
    assert reports["loopback"]["lost"] == 0 and reports["loopback"]["numbers"]["addresses"], reports["loopback"]
    assert all(a.startswith("127.0.0.1:") for a in reports["loopback"]["numbers"]["addresses"])
    return reports


def assert_nothing_lost(report: dict) -> None:
    assert report["skipped"] is None, report
    assert report["acknowledged"] > 0 and report["lost"] == 0, report
    assert report["recovery_s"] is not None and report["recovery_s"] >= 0, report


@pytest.fixture(scope="module")
def on_one_server(tmp_path_factory):
    return run_drills("media,llm,slow,flood,server", tmp_path_factory.mktemp("drills"))


def test_a_killed_media_worker_costs_at_most_its_own_request(on_one_server):
    report = on_one_server["media"]
    assert_nothing_lost(report)
    numbers = report["numbers"]
    assert numbers["worker replaced"] is True, numbers
    # the edit on the killed worker (if one was running) fails as retryable (503), every other is answered 200
    assert set(numbers["edits failed (status code: count)"]) <= {"503 media_worker_lost"}, numbers


def test_an_abandoned_llm_stream_gives_its_kv_blocks_back(on_one_server):
    report = on_one_server["llm"]
    assert_nothing_lost(report)
    assert report["numbers"]["requests counted cancelled"] == 1, report
    before, after = report["numbers"]["KV blocks free before / after"].split(" / ")
    assert before == after, report


def test_a_client_that_never_reads_is_cut_and_its_slot_freed(on_one_server):
    report = on_one_server["slow"]
    assert_nothing_lost(report)
    numbers = report["numbers"]
    assert numbers["cut after (s)"] is not None and numbers["the client saw"] in ("reset", "eof"), numbers
    assert numbers["another chat meanwhile"] == 200
    assert numbers["generation ended before the cut"] is False, numbers  # the cut, not the end, freed the slot


def test_a_flooding_tenant_gets_429s_and_the_other_tenant_is_served(on_one_server):
    report = on_one_server["flood"]
    assert_nothing_lost(report)
    numbers = report["numbers"]
    sent, admitted, refused = (int(x) for x in numbers["flood sent / admitted / 429"].split(" / "))
    assert sent == admitted + refused and refused >= sent // 2, numbers
    assert numbers["429s with Retry-After and x-ratelimit headers"] == f"{refused}/{refused}"
    by_limit = numbers["429s by limit"]
    assert sum(by_limit.values()) == refused and set(by_limit) <= {"concurrent", "requests_per_min"}, numbers
    counters = numbers["server counters (admitted, over_requests_per_min, over_concurrent)"]
    assert counters == [admitted, by_limit.get("requests_per_min", 0), by_limit.get("concurrent", 0)], numbers


def test_a_server_killed_during_a_batch_finishes_it_after_a_restart_every_line_once(on_one_server):
    report = on_one_server["server"]
    assert_nothing_lost(report)
    assert report["numbers"]["batch status after the restart"] == "completed", report


@pytest.mark.slow
def test_a_full_disk_under_the_job_store_answers_507_and_loses_nothing(tmp_path):
    disk = run_drills("disk", tmp_path)["disk"]
    if disk["skipped"]:  # no unprivileged user and mount namespaces on this machine
        pytest.skip(disk["skipped"])
    assert_nothing_lost(disk)
    numbers = disk["numbers"]
    assert set(numbers["refusals (status code: count)"]) == {"507 insufficient_storage"}, numbers
    assert numbers["server up while full"] is True
    assert set(numbers["deletes (status: count)"]) == {"200"}, numbers
    batch = numbers["batch after space was freed"]  # None: the batch was refused (507) on the full disk
    assert batch is None or (batch["status"], batch["missing"], batch["duplicated"]) == ("completed", 0, 0), numbers


# -- the job store on a full disk, in process --------------------------------------------------------------------


def test_a_write_that_does_not_fit_is_a_507_and_leaves_no_partial_file(tmp_path, monkeypatch):
    import errno
    import os

    from serve.jobs import StorageFull, write_atomic

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StorageFull) as e:
        write_atomic(tmp_path / "files" / "f", b"x" * 4096)
    assert (e.value.status, e.value.code, e.value.retry_after_s) == (507, "insufficient_storage", 30)
    assert list((tmp_path / "files").iterdir()) == []  # neither the file nor its temporary


def test_a_row_that_does_not_fit_is_a_507_and_its_file_is_removed(tmp_path):
    from serve.jobs import JobStore, StorageFull

    store = JobStore(tmp_path)
    kept = store.add_file("t", "batch", "kept.jsonl", b"{}\n")
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # the database may not grow: SQLITE_FULL
    with pytest.raises(StorageFull):
        for i in range(10_000):  # until a page more is needed
            store.add_file("t", "batch", f"f{i}.jsonl", b"{}\n")
    named = {f.path.name for f in store.list_files("t")}
    assert {p.name for p in store.files_dir.iterdir()} == named  # no file without its row
    assert store.get_file(kept.id).path.read_bytes() == b"{}\n"
    store.close()
