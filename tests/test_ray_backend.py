"""The ray backend on a two-node Ray cluster on loopback: placement by a custom resource, an image equal to the
local backend's, progress step by step, cancel within a step, a chat model equal to generate(), and kill -9 of a
replica's process.

Ray must not bind anything but loopback here (../shared/notes/distributed.md), so this module's tests run in a
fresh network and PID namespace: the test that pytest collects outside (`test_on_ray[case]`) runs this same file
again under `unshare --net --pid --fork --mount-proc`, where only `lo` exists and every process Ray starts dies
with the namespace; there a module fixture starts the head and a second node (with the resource `node_b`), which
end with the namespace when that pytest exits. Skips when ray is not installed or the
namespace is not permitted, except under CI=true.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

INSIDE = os.environ.get("MMSERVE_RAY_NETNS") == "1"
CASES = ["test_cluster_is_on_loopback", "test_a_parallel_replica_runs_its_ranks_in_its_actor",
         "test_image_equals_local_and_progress_streams", "test_spans_carry_what_the_replicas_measured",
         "test_cancel_within_a_step",
         "test_two_replicas_share_the_load", "test_a_realtime_video_session_stays_on_one_replica",
         "test_chat_greedy_equals_generate_token_by_token", "test_kill_9_mid_chat_leaves_no_kv_blocks",
         "test_kill_9_fails_only_in_flight_items", "test_a_batch_across_a_killed_replica_finishes_every_line_once",
         "test_startup_errors_name_the_key"]
INNER_TIMEOUT_S = 300
PORT = 6390


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def _cannot_run() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install -e '.[ray]'; make test installs it)"
    try:
        ok = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                            timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return None if ok else "a network namespace is not permitted here (unshare --net --pid failed)"


if not INSIDE:
    @pytest.fixture(scope="module")
    def inner_results(tmp_path_factory):
        """Run this file inside the namespace once; {test name: (outcome, message)} from its JUnit report."""
        reason = _cannot_run()
        if reason is not None:
            if _in_ci():
                pytest.fail(f"CI=true: the Ray tests must run, but {reason}")
            pytest.skip(reason)
        out = tmp_path_factory.mktemp("ray")
        report = out / "junit.xml"
        script = 'ip link set lo up && "$@"'
        cmd = ["unshare", "--net", "--pid", "--fork", "--mount-proc", "bash", "-c", script, "_", sys.executable,
               "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "--durations=20", f"--junitxml={report}", __file__]
        env = {**os.environ, "MMSERVE_RAY_NETNS": "1", "MMSERVE_RAY_TMP": str(out)}
        proc = subprocess.Popen(cmd, cwd=Path(__file__).parent.parent, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=INNER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the namespace's first process: everything in it ends with it
            output, _ = proc.communicate()
            pytest.fail(f"the Ray tests ran past {INNER_TIMEOUT_S} s:\n{output[-4000:]}")
        print(output[-3000:])
        if not report.exists():
            pytest.fail(f"the Ray tests wrote no report (exit {proc.returncode}):\n{output[-4000:]}")
        results = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            failed = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            outcome = "failed" if failed is not None else "skipped" if skipped is not None else "passed"
            node = failed if failed is not None else skipped
            results[case.get("name")] = (outcome, "" if node is None else (node.get("message", "") + "\n" +
                                                                           (node.text or ""))[-4000:])
        return results

    @pytest.mark.parametrize("case", CASES)
    def test_on_ray(inner_results, case):
        outcome, message = inner_results.get(case, ("missing", "did not run (an earlier case failed: -x)"))
        assert outcome == "passed", f"{case} {outcome}:\n{message}"

    def test_bench_distributed_runs(tmp_path):
        """examples/bench_distributed.py as a user runs it (it enters a namespace of its own), tiny and once."""
        reason = _cannot_run()
        if reason is not None:
            if _in_ci():
                pytest.fail(f"CI=true: the Ray benchmark must run, but {reason}")
            pytest.skip(reason)
        cmd = [sys.executable, "examples/bench_distributed.py", "--repeats", "1", "--steps", "2", "--tokens", "4",
               "--frames", "2", "--frame-steps", "2"]
        proc = subprocess.Popen(cmd, cwd=Path(__file__).parent.parent, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        assert proc.returncode == 0, output[-4000:]
        for line in ("ray nodes: ['127.0.0.1']", "ratio", "added per token", "img2img frame: local",
                     "8 concurrent images: two 1-thread replicas"):
            assert line in output, output

else:
    import numpy as np
    import ray

    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine
    from pipelines.image_request import ImageRequest
    from stages.events import ErrorKind, EventKind, StageError
    from stages.pool import PoolConfig

    ADDRESS = f"127.0.0.1:{PORT}"
    RAY = str(Path(sys.executable).with_name("ray"))

    def _ray(*args: str) -> None:
        # No idle workers started ahead: on 2 cores they only slow the actors' start.
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_prestart_worker_first_driver": "0",
               "RAY_enable_worker_prestart": "0"}
        subprocess.run([RAY, *args], check=True, capture_output=True, timeout=120, env=env)

    @pytest.fixture(scope="module")
    def cluster():
        """A head (resource node_a) and a second node (node_b), 4 logical CPUs each, a small object store."""
        temp = Path(os.environ.get("MMSERVE_RAY_TMP", "/tmp")) / "r"
        common = ["--num-cpus=4", "--object-store-memory=150000000", "--disable-usage-stats"]
        try:
            _ray("start", "--head", f"--port={PORT}", "--include-dashboard=false", f"--temp-dir={temp}",
                 '--resources={"node_a": 100}', *common)
            _ray("start", f"--address={ADDRESS}", '--resources={"node_b": 100}', *common)
            ray.init(address=ADDRESS, namespace="mmserve-test", log_to_driver=False)
            yield ray.nodes()
        finally:
            # No `ray stop` (~10 s): the head and the node end with the namespace, when its first process (the bash
            # running this pytest) exits after it.
            if ray.is_initialized():
                ray.shutdown()

    @pytest.fixture(scope="module")
    def sd_path(tmp_path_factory):
        from pipelines.demo import build_demo_model

        return str(build_demo_model("sd", tmp_path_factory.mktemp("sd-demo") / "sd"))

    def _node_with(nodes, resource: str) -> str:
        return next(n["NodeID"] for n in nodes if resource in n["Resources"])

    # text encoder and VAE on the head, the denoiser's two replicas on the second node.
    SD_POOLS = {"text_encode": PoolConfig(resources={"node_a": 1}),
                "denoise": PoolConfig(replicas=2, max_batch_size=2, resources={"node_b": 1}),
                "vae_decode": PoolConfig(resources={"node_a": 1})}

    @pytest.fixture(scope="module")
    def sd_ray(cluster, sd_path):
        engine = Engine(EngineConfig(models=(ModelSpec("m", sd_path, pools=SD_POOLS),), backend="ray",
                                     ray_address=ADDRESS))
        engine.start()
        try:
            yield engine
        finally:
            began = time.monotonic()
            engine.shutdown()
            print(f"sd engine shutdown {time.monotonic() - began:.1f} s", file=sys.stderr)

    def _image(engine, seed: int, steps: int = 4, size: int = 64):
        request = ImageRequest(prompt="a red cube", width=size, height=size, num_inference_steps=steps, seed=seed)
        return engine.submit_image("m", request)

    def test_cluster_is_on_loopback(cluster):
        alive = [n for n in cluster if n["Alive"]]
        assert len(alive) == 2
        assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in alive), [n["NodeManagerAddress"] for n in alive]
        assert sum("node_b" in n["Resources"] for n in alive) == 1

    def test_a_parallel_replica_runs_its_ranks_in_its_actor(cluster, sd_path):
        """[models.parallel] cfg = 2 on the ray backend: the denoise replica's actor (on node_b, asking Ray for both
        ranks' CPUs) runs rank 1 as its child process; the image equals the local one-device image within float
        rounding (tests/test_parallel.py), and the ranks' series reach this process's /metrics."""
        from pipelines.config import ParallelConfig
        from tests.helpers import running_engine

        pools = {"denoise": PoolConfig(threads=1, resources={"node_b": 1})}
        spec = ModelSpec("m", sd_path, pools=pools, parallel=ParallelConfig(cfg=2))
        engine = Engine(EngineConfig(models=(spec,), backend="ray", ray_address=ADDRESS))
        engine.start()
        try:
            pool = engine.executor.pools["m/denoise"]
            assert [i.node_id for i in pool.nodes] == [_node_with(cluster, "node_b")]
            got = _image(engine, seed=7, steps=4).result(timeout=120)["pixels"]
            sample = engine.metrics.registry.get_sample_value
            deadline = time.monotonic() + 10
            while (sample("mmserve_parallel_step_seconds_count", {"model": "m", "rank": "1"}) or 0) < 5:
                assert time.monotonic() < deadline, "rank 1's steps (the warm-up's and these 4) did not arrive"
                time.sleep(0.05)
        finally:
            engine.shutdown()
        # The actor closed its ranks before Ray killed it: their rendezvous directory (whose rank file names this
        # test's checkpoint) is gone, not left in the temp folder.
        left = [d for d in Path(tempfile.gettempdir()).glob("mmserve-ranks-*")
                if sd_path.encode() in _read(d / "rank1.pickle")]
        assert left == [], left
        with running_engine(sd_path, pools={"denoise": PoolConfig(threads=1)}) as local:
            want = _image(local, seed=7, steps=4).result(timeout=120)["pixels"]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)

    def _read(path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError:  # another run's directory, removed meanwhile
            return b""

    def test_image_equals_local_and_progress_streams(cluster, sd_ray, sd_path):
        pools = sd_ray.executor.pools
        node_b, head = _node_with(cluster, "node_b"), _node_with(cluster, "node_a")
        assert [i.node_id for i in pools["m/denoise"].nodes] == [node_b, node_b]
        assert pools["m/text_encode"].nodes[0].node_id == head and pools["m/vae_decode"].nodes[0].node_id == head
        assert all(i.node_ip == "127.0.0.1" for p in ("m/text_encode", "m/denoise") for i in pools[p].nodes)
        handle = _image(sd_ray, seed=7, steps=5)
        progress, arrived = [], []
        for event in handle.events(timeout=120):
            if event.kind is EventKind.PROGRESS:
                progress.append(event.data["step"])
                arrived.append(time.monotonic())
            if event.kind is EventKind.FINAL:
                got = event.data["outputs"]["pixels"]
        assert progress == [1, 2, 3, 4, 5]
        assert arrived[-1] - arrived[0] > 0  # one event per step, as the steps ran (not all at the end)
        from tests.helpers import running_engine

        # The local backend with the same torch threads per denoise worker (two replicas share the cores there).
        with running_engine(sd_path, pools={"denoise": PoolConfig(threads=1)}) as local:
            want = _image(local, seed=7, steps=5).result(timeout=120)["pixels"]
        np.testing.assert_array_equal(got, want)  # bit for bit on the CPU

    def test_spans_carry_what_the_replicas_measured(sd_ray):
        """Tracing on: each node's span has the queue wait seen here and the run time, steps, batch size, batch id
        and cache lookups its replica measured (the replica gathers them, this process exports the span)."""
        from stages.tracing import Tracing

        tracing = Tracing.from_mode("memory")
        assert tracing is not None
        sd_ray.executor.tracing = tracing
        try:
            _image(sd_ray, seed=3, steps=3).result(timeout=120)
        finally:
            sd_ray.executor.tracing = None
        spans = {s.name: s.attributes for s in tracing.exporter.get_finished_spans()}
        denoise, encode = spans["denoise"], spans["text_encode"]
        assert denoise["mmserve.calls"] == 3 and denoise["mmserve.run_time_s"] > 0
        assert denoise["mmserve.batch_size"] >= 1
        assert denoise["mmserve.batch_id"].startswith("m/denoise-") and "@replica" in denoise["mmserve.batch_id"]
        assert denoise["mmserve.queue_wait_s"] > 0 and spans["vae_decode"]["mmserve.run_time_s"] > 0
        assert encode["mmserve.cache_hits"] + encode["mmserve.cache_misses"] >= 1

    def test_cancel_within_a_step(sd_ray):
        from tests.helpers import cancel_mid_loop

        handle = _image(sd_ray, seed=1, steps=200)
        took, step_s = cancel_mid_loop(handle, sd_ray.executor.pools["m/denoise"])  # dropped at the actor's boundary
        with pytest.raises(StageError) as info:
            handle.result(timeout=5)
        assert info.value.kind is ErrorKind.CANCELLED
        assert took < 2 * step_s + 0.05, (took, step_s)  # the step in flight, its stop message, and no more
        assert sd_ray.executor.idle()

    def test_two_replicas_share_the_load(cluster, sd_ray):
        from stages.replica_metrics import ReplicaMetrics

        pool = sd_ray.executor.pools["m/denoise"]
        series = sd_ray.metrics.part(ReplicaMetrics)
        node_b = _node_with(cluster, "node_b")

        def items(r, what="items"):
            labels = dict(stage="m/denoise", model="m", replica=str(r), device="cpu", node=node_b)
            return getattr(series, what).labels(**labels)._value.get()

        before = [items(r) for r in (0, 1)]
        sent = [items(r, "transfer_bytes") for r in (0, 1)]
        for handle in [_image(sd_ray, seed=s, steps=2) for s in range(6)]:
            handle.result(timeout=120)
        spread = [items(r) - before[r] for r in (0, 1)]
        assert min(spread) >= 1 and sum(spread) == 6, spread  # least loaded: both actors took some
        # The edge: each image's text embeddings (at least 77 x 32 float32 in the demo) went to its actor.
        moved = [items(r, "transfer_bytes") - sent[r] for r in (0, 1)]
        assert all(m >= spread[r] * 77 * 32 * 4 for r, m in enumerate(moved)), (moved, spread)
        assert sd_ray.metrics.stage.max_batch_size("m/denoise", "m") >= 1 and pool.idle

    def test_a_realtime_video_session_stays_on_one_replica(cluster, sd_ray):
        """WS /v1/realtime/video img2img over the two denoise actors: a session's frames, two in the engine at once,
        all run on one actor (sticky routing); least loaded would spread them."""
        from stages.replica_metrics import ReplicaMetrics
        from tests.test_realtime_video_support import img2img_session_spreads

        series, node_b = sd_ray.metrics.part(ReplicaMetrics), _node_with(cluster, "node_b")

        def items(r):
            return series.items.labels(stage="m/denoise", model="m", replica=str(r), device="cpu",
                                       node=node_b)._value.get()

        for spread, frames in img2img_session_spreads(sd_ray, items, frames=8):
            assert frames >= 2 and sorted(spread)[0] == 0 and sum(spread) >= frames, spread

    CHAT_PROMPT = list(range(5, 25))

    @pytest.fixture(scope="module")
    def llm_ray(cluster, tmp_path_factory):
        """The demo Llama with two replicas of its llm stage on node_b (and its path)."""
        from pipelines.chat import LLMConfig
        from pipelines.demo import build_demo_model

        path = str(build_demo_model("llama", tmp_path_factory.mktemp("llama") / "llama"))
        pools = {"llm": PoolConfig(replicas=2, max_batch_size=4096, max_queue=256, resources={"node_b": 1})}
        config = EngineConfig(models=(ModelSpec("m", path, family="causal-lm", llm=LLMConfig(kv_cache_mb=8),
                                                pools=pools),), backend="ray", ray_address=ADDRESS)
        engine = Engine(config)
        engine.start()
        try:
            yield engine, path
        finally:
            engine.shutdown()

    def _chat(engine, prompt, tokens: int):
        from pipelines.chat import ChatRequest
        from stages.llm.params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        return engine.submit_chat("m", ChatRequest(prompt=prompt, params=params))

    def test_chat_greedy_equals_generate_token_by_token(llm_ray):
        import torch
        from transformers import AutoModelForCausalLM

        engine, path = llm_ray
        sample = engine.metrics.registry.get_sample_value
        deadline = time.monotonic() + 10
        while sample("mmserve_llm_generated_tokens_total", {"model": "m"}) is None:  # the warm-up's
            assert time.monotonic() < deadline, "the warm-up's series did not arrive"
            time.sleep(0.05)
        time.sleep(0.6)  # and its last report
        tokens_before = sample("mmserve_llm_generated_tokens_total", {"model": "m"})
        ttft_before = sample("mmserve_llm_time_to_first_token_seconds_count", {"model": "m"})
        handles = [_chat(engine, CHAT_PROMPT, 8) for _ in range(8)]
        outputs = []
        for handle in handles:
            deltas = [e for e in handle.events(timeout=120) if e.kind is EventKind.DELTA]
            outputs.append((deltas, handle.result(timeout=5)["choices"][0]["token_ids"]))
        assert engine.executor.idle()
        assert engine.metrics.stage.max_batch_size("m/llm", "m") > 1  # the 8 requests shared steps in the actor
        # The llm stage's own series, written in the actors, reach this process's /metrics (every 0.5 s).
        deadline = time.monotonic() + 10
        while (sample("mmserve_llm_generated_tokens_total", {"model": "m"}) or 0) - tokens_before < 64:
            assert time.monotonic() < deadline, "the actors' token counts did not arrive"
            time.sleep(0.05)
        time.sleep(0.6)  # one more report: nothing is counted twice
        assert sample("mmserve_llm_generated_tokens_total", {"model": "m"}) - tokens_before == 64
        assert sample("mmserve_llm_time_to_first_token_seconds_count", {"model": "m"}) - ttft_before == 8
        model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            ref = model.generate(torch.tensor([CHAT_PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        want = ref[0, len(CHAT_PROMPT):].tolist()
        for deltas, ids in outputs:
            assert ids == want
            assert len(deltas) == 8  # one delta a token, streamed

    def _kill_a_busy_replica(pool) -> int:
        """SIGKILL the process of one of the pool's two replicas once it has items in flight (their stage_started
        came back); its index."""
        victim = None
        while victim is None:
            with pool._cond:
                victim = next((r for r in range(2) if pool._running & set(pool._sent[r])), None)
            time.sleep(0.005)
        os.kill(pool.replica_pid(victim), signal.SIGKILL)
        return victim

    def _outcomes(handles, ok) -> list:
        """Each request's outcome: ok(its result), or "lost" for the retryable replica_lost (any other error fails)."""
        outcomes = []
        for handle in handles:
            try:
                outcomes.append(ok(handle.result(timeout=120)))
            except StageError as exc:
                assert exc.kind is ErrorKind.UNAVAILABLE and exc.code == "replica_lost", (exc.kind, exc.code)
                outcomes.append("lost")
        return outcomes

    def _wait_until_back(pool, check=lambda: None) -> None:
        """Until the killed replica is restarted, its stage loaded again and warmed (`check` runs meanwhile)."""
        deadline = time.monotonic() + 120
        while pool.live_replicas() < 2:
            check()
            assert time.monotonic() < deadline, "the killed replica did not come back"
            time.sleep(0.1)

    def test_kill_9_mid_chat_leaves_no_kv_blocks(llm_ray):
        """20 streamed chats over two llm actors, one killed mid-run: only the chats it was running fail (retryable),
        the rest finish whole, the actor comes back, and neither replica holds a KV block or a sequence after."""
        engine, _ = llm_ray
        pool = engine.executor.pools["m/llm"]
        baseline = [pool.usage(r) for r in (0, 1)]
        assert all(u["kv_blocks_used"] == 0 and u["sequences"] == 0 for u in baseline), baseline
        prompts = [[5 + (i * 11 + j) % 300 for j in range(20)] for i in range(20)]  # a first KV block of its own
        handles = [_chat(engine, p, 48) for p in prompts]
        victim = _kill_a_busy_replica(pool)
        outcomes = _outcomes(handles, lambda result: len(result["choices"][0]["token_ids"]))
        lost = outcomes.count("lost")
        assert 1 <= lost <= pool._capacity and outcomes.count(48) == 20 - lost, outcomes
        _wait_until_back(pool)
        assert engine.executor.idle() and pool.idle
        survivor = 1 - victim
        after = [pool.usage(r) for r in (0, 1)]
        assert all(u["kv_blocks_used"] == 0 and u["sequences"] == 0 and u["items"] == 0 for u in after), after
        assert after[survivor]["kv_blocks_free"] == baseline[survivor]["kv_blocks_free"], (baseline, after)
        assert len(_chat(engine, CHAT_PROMPT, 4).result(timeout=120)["choices"][0]["token_ids"]) == 4

    def test_kill_9_fails_only_in_flight_items(sd_ray):
        pool = sd_ray.executor.pools["m/denoise"]
        assert sd_ray.health() == {"m": "ok"}
        handles = [_image(sd_ray, seed=s, steps=6) for s in range(20)]
        victim = _kill_a_busy_replica(pool)
        outcomes = _outcomes(handles, lambda result: "ok")
        lost = outcomes.count("lost")
        assert 1 <= lost <= pool._capacity and outcomes.count("ok") == 20 - lost, outcomes
        def degraded():
            assert sd_ray.health()["m"] == "degraded"

        _wait_until_back(pool, degraded)
        assert sd_ray.health() == {"m": "ok"}
        assert pool.replica_pid(victim) not in (None,) and all(_image(sd_ray, seed=s).result(timeout=120)
                                                               for s in range(2))
        assert sd_ray.executor.idle() and pool.idle

    def test_a_batch_across_a_killed_replica_finishes_every_line_once(sd_ray, tmp_path):
        """A batch of image lines on the ray backend while a denoise replica is killed: the lines it was running
        answer 503 (replica_lost), run again after Retry-After, and the batch completes with one result a line."""
        import asyncio
        import json

        import httpx

        from serve.app import create_app
        from serve.job_runner import JobPolicy
        from serve.metrics import HttpMetrics

        pool = sd_ray.executor.pools["m/denoise"]
        body = {"model": "m", "prompt": "a red cube", "size": "64x64", "num_inference_steps": 6}
        lines = [{"custom_id": f"img-{i}", "url": "/v1/images/generations", "body": {**body, "seed": i}}
                 for i in range(8)]
        lost = sd_ray.metrics.part(HttpMetrics).requests.labels(route="/v1/images/generations", status="503")
        lost_before = lost._value.get()

        async def main():
            app = create_app(sd_ray, data_dir=tmp_path, job_policy=JobPolicy(batch_line_concurrency=4,
                                                                             ready_poll_s=0.01))
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://ray-test", timeout=60) as c:
                    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
                    f = (await c.post("/v1/files", data={"purpose": "batch"},
                                      files={"file": ("in.jsonl", data)})).json()
                    batch = (await c.post("/v1/batches", json={"input_file_id": f["id"], "completion_window": "24h",
                                                               "endpoint": "/v1/images/generations"})).json()
                    victim = None
                    while victim is None:  # a replica is running one of the batch's lines
                        with pool._cond:
                            victim = next((r for r in range(2) if pool._running & set(pool._sent[r])), None)
                        await asyncio.sleep(0.005)
                    os.kill(pool.replica_pid(victim), signal.SIGKILL)
                    deadline = time.monotonic() + 150
                    while (batch := (await c.get(f"/v1/batches/{batch['id']}")).json())["status"] not in (
                            "completed", "failed", "cancelled"):
                        assert time.monotonic() < deadline, batch
                        await asyncio.sleep(0.1)
                    out = (await c.get(f"/v1/files/{batch['output_file_id']}/content")).text
                    return batch, [json.loads(x) for x in out.splitlines()]

        batch, records = asyncio.run(main())
        assert batch["status"] == "completed" and batch["error_file_id"] is None, batch
        assert batch["request_counts"] == {"total": 8, "completed": 8, "failed": 0}, batch
        assert sorted(r["custom_id"] for r in records) == sorted(x["custom_id"] for x in lines)  # once each
        assert all(r["response"]["status_code"] == 200 for r in records)
        assert lost._value.get() - lost_before >= 1  # a line met the lost replica and ran again
        _wait_until_back(pool)
        assert sd_ray.executor.idle() and pool.idle

    def test_startup_errors_name_the_key(cluster, sd_path):
        def start(**engine) -> str:
            with pytest.raises(ValueError) as info:
                Engine(EngineConfig(models=(ModelSpec("m", "/nowhere", family="sd", pools=engine.pop("pools", {})),),
                                    backend="ray", **engine)).start()
            return str(info.value)

        assert "engine.ray_address: nothing answers at 127.0.0.1:1" in start(ray_address="127.0.0.1:1")
        message = start(ray_address=ADDRESS, pools={"denoise": PoolConfig(resources={"node_z": 1})})
        assert "pools.denoise.resources: no Ray node has a resource 'node_z'" in message and "node_b" in message
        message = start(ray_address=ADDRESS, pools={"denoise": PoolConfig(num_gpus=1)})
        assert "pools.denoise.num_gpus" in message
