"""Tenants and quotas (serve/tenants.py, serve/quota.py) on a real `mmserve serve` process, and the stage queues'
priority with aging (stages/pool.py): a tenant flooding at 10x its request limit gets 429s with OpenAI's rate-limit
headers while another tenant is served, the per-tenant counters match the answers, a model outside a tenant's list
is refused naming `model`, and the older key file still loads."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import openai
import pytest
import websockets

from serve.tenants import TenantLimiter, Tenants, TokenBucket, load_tenants
from stages.executor import GraphExecutor
from stages.graph import StageGraph
from stages.pool import PoolConfig, submit_priority
from stages.stage import Stage, WorkItem
from stages.thread_budget import ThreadBudget
from tests.helpers import demo_path
from tests.test_serve_support import Server, metric

FREE_LIMIT = 3  # the flooding tenant's requests_per_min
TENANTS = f"""
[[tenants]]
name = "free"
keys = ["sk-free-1"]
requests_per_min = {FREE_LIMIT}
models = ["sd-demo"]
priority = "low"

[[tenants]]
name = "paid"
keys = ["sk-paid-1", "sk-paid-2"]
requests_per_min = 600
images_per_min = 60
concurrent = 4
priority = "high"

[[tenants]]
name = "rt"
keys = ["sk-rt-1"]
concurrent = 1
"""
RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sd = demo_path(tmp_path_factory, "sd")
    workdir = tmp_path_factory.mktemp("serve-tenants")
    (workdir / "tenants.toml").write_text(TENANTS)
    # The same checkpoint served twice: "sd-premium" is a real model the free tenant may not use.
    srv = Server(workdir, f"""
[server]
api_keys_file = "tenants.toml"

[[models]]
name = "sd-demo"
path = "{sd}"

[[models]]
name = "sd-premium"
path = "{sd}"
""")
    yield srv
    srv.stop()


def image_body(**fields: Any) -> dict[str, Any]:
    return {"model": "sd-demo", "prompt": "a quiet harbour", "size": "64x64", "num_inference_steps": 2, **fields}


def test_a_flooding_tenant_gets_429s_and_the_other_is_served(server):
    def counts() -> dict[str, float]:
        return {o: metric(server.url, "mmserve_tenant_requests_total", tenant="free", outcome=o)
                for o in ("admitted", "over_requests_per_min")}

    before = counts()

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     headers={"Authorization": "Bearer sk-free-1"}) as client:
            return await asyncio.gather(*(client.post("/v1/images/generations", json=image_body())
                                          for _ in range(10 * FREE_LIMIT)))

    replies = asyncio.run(flood())
    ok = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    assert len(ok) + len(refused) == len(replies), [r.text for r in replies]
    # The bucket holds one minute's worth; refilling one request takes 20 s, far longer than the flood.
    assert 1 <= len(ok) <= FREE_LIMIT + 1 and len(refused) >= 10 * FREE_LIMIT - FREE_LIMIT - 1
    for r in refused:
        error = r.json()["error"]
        assert (error["code"], error["param"], error["type"]) == ("rate_limit_exceeded", "requests_per_min",
                                                                  "rate_limit_error")
        assert "requests per min" in error["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-limit-requests"] == str(FREE_LIMIT)
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    assert all(h in r.headers for r in ok for h in RATE_HEADERS)  # successful answers carry them too
    after = counts()
    assert after["admitted"] - before["admitted"] == len(ok)
    assert after["over_requests_per_min"] - before["over_requests_per_min"] == len(refused)

    # The other tenant, through the official client, right after the flood: served, with its own headers.
    paid = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-paid-2", max_retries=0)
    raw = paid.images.with_raw_response.generate(model="sd-demo", prompt="a lighthouse", size="64x64",  # type: ignore
                                                 extra_body={"num_inference_steps": 2})
    assert raw.http_response.status_code == 200 and raw.parse().data
    assert raw.headers["x-ratelimit-limit-requests"] == "600"
    # its own bucket, less this request: 599, or 600 again when the answer took over 0.1 s (600 a minute refill 10
    # a second, and the headers tell the bucket as the answer starts); the flooded tenant's bucket reads 0
    assert 599 <= int(raw.headers["x-ratelimit-remaining-requests"]) <= 600
    # The flooding tenant, through the official client: a RateLimitError that carries the same headers.
    free = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-free-1", max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused_error:
        free.models.list()
    assert refused_error.value.response.headers["retry-after"]


def test_images_per_min_counts_the_images_asked_for(server):
    r = httpx.post(f"{server.url}/v1/images/generations", json=image_body(n=61), timeout=60,
                   headers={"Authorization": "Bearer sk-paid-1"})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["param"] == "images_per_min" and "61" in r.json()["error"]["message"]
    assert metric(server.url, "mmserve_tenant_requests_total", tenant="paid", outcome="over_images_per_min") >= 1


def test_a_model_outside_the_tenants_list_is_404_naming_model(server):
    free = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-free-1", max_retries=0)
    with pytest.raises((openai.NotFoundError, openai.RateLimitError)) as refused:  # the flood may have spent it
        free.models.retrieve("sd-premium")
    if isinstance(refused.value, openai.NotFoundError):
        assert refused.value.code == "model_not_found" and refused.value.param == "model"
    r = httpx.post(f"{server.url}/v1/images/generations", json=image_body(model="sd-premium"), timeout=60,
                   headers={"Authorization": "Bearer sk-free-1"})
    assert r.status_code == 404, r.text  # checked before the rate limit: a refused model spends nothing
    assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": "model",
                                                   "code": "model_not_found"}
    assert "sd-premium" in r.json()["error"]["message"]
    assert metric(server.url, "mmserve_tenant_requests_total", tenant="free", outcome="model_not_allowed") >= 1
    paid = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-paid-1", max_retries=0)
    assert {m.id for m in paid.models.list()} >= {"sd-demo", "sd-premium"}  # no list: every model


def test_a_realtime_session_holds_a_concurrent_place(server):
    async def main() -> None:
        auth = {"Authorization": "Bearer sk-rt-1"}
        url = server.url.replace("http", "ws") + "/v1/realtime/video"
        ws = await websockets.connect(url, additional_headers=auth, ping_interval=None)
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=30) as client:
            r = await client.get("/v1/models")
            assert r.status_code == 429 and r.json()["error"]["param"] == "concurrent", r.text
            with pytest.raises(websockets.InvalidStatus):  # a second session: refused at the handshake
                await websockets.connect(url, additional_headers=auth, ping_interval=None)
            await ws.close()
            for _ in range(200):  # the place is given back once the socket's call ends
                if (r := await client.get("/v1/models")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            assert r.status_code == 200, r.text

    asyncio.run(main())


def test_the_older_key_file_still_loads(tmp_path):
    (tmp_path / "keys.json").write_text(json.dumps({"sk-a": "alice", "sk-a2": "alice", "sk-b": "bob"}))
    (tmp_path / "keys.toml").write_text('"sk-a" = "alice"\n')
    tenants = load_tenants(tmp_path / "keys.json")
    assert tenants.keys == {"sk-a": "alice", "sk-a2": "alice", "sk-b": "bob"}
    alice = tenants.get("alice")
    assert alice is not None and alice.requests_per_min is None and alice.models is None  # no limits
    assert load_tenants(tmp_path / "keys.toml").keys == {"sk-a": "alice"}
    (tmp_path / "bad.toml").write_text('[[tenants]]\nname = "x"\nkeys = ["k"]\nrequests_per_minute = 5\n')
    with pytest.raises(ValueError, match="requests_per_minute"):
        load_tenants(tmp_path / "bad.toml")
    (tmp_path / "bad2.toml").write_text('[[tenants]]\nname = "x"\nkeys = ["k"]\npriority = "urgent"\n')
    with pytest.raises(ValueError, match="priority"):
        load_tenants(tmp_path / "bad2.toml")


def test_a_bucket_refills_and_refuses_all_or_nothing():
    now = [0.0]
    bucket = TokenBucket(60, clock=lambda: now[0])  # one a second
    assert bucket.take(60) and not bucket.take(1)
    assert bucket.wait_s(2) == pytest.approx(2.0)
    now[0] += 2
    assert bucket.remaining() == 2 and bucket.take(2)
    tenants = load_tenants_text("requests_per_min = 10\ntokens_per_min = 100\nconcurrent = 1")
    limiter = TenantLimiter(tenants.tenants["t"], clock=lambda: now[0])
    refusal = limiter.admit({"tokens_per_min": 101})
    assert refusal is not None and refusal.limit == "tokens_per_min"
    assert limiter.buckets["requests_per_min"].remaining() == 10  # the refused request took nothing
    assert limiter.admit({"tokens_per_min": 50}) is None
    refusal = limiter.admit({})
    assert refusal is not None and refusal.limit == "concurrent"
    limiter.release()
    assert limiter.admit({}) is None


def load_tenants_text(limits: str) -> Tenants:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.toml"
        path.write_text(f'[[tenants]]\nname = "t"\nkeys = ["k"]\n{limits}\n')
        return load_tenants(path)


# -- stage queues: priority with aging ------------------------------------------------------


class Gate(Stage):
    """Holds its first batch until released, then records the order items run in."""

    def __init__(self):
        self.order: list[str] = []
        self.inside = threading.Event()
        self.release = threading.Event()

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        self.inside.set()
        assert self.release.wait(30), "the test never released the stage"
        self.order += [item.inputs["name"] for item in items]
        return [{} for _ in items]


def submit(ex: GraphExecutor, name: str, rank: int):
    token = submit_priority.set(rank)
    try:
        return ex.submit(StageGraph.chain(("only", "p")), {"name": name})
    finally:
        submit_priority.reset(token)


def test_the_pool_takes_higher_priority_first_and_aging_lifts_the_rest():
    ex = GraphExecutor(budget=ThreadBudget(2))
    stage = Gate()
    ex.add_pool("p", stage, PoolConfig(priority_aging_s=5.0))
    ex.start()
    try:
        handles = [submit(ex, "first", 1)]
        assert stage.inside.wait(30)  # the worker is busy: the rest queue up
        handles += [submit(ex, "low", 2), submit(ex, "normal", 1), submit(ex, "high", 0), submit(ex, "high2", 0),
                    submit(ex, "old-low", 2)]
        pool = ex.pools["p"]
        with pool._cond:  # "old-low" has waited 20 s: four classes lifted, ahead of the fresh high ones
            next(i for i in pool._queue if i.inputs["name"] == "old-low").enqueued_at -= 20
        stage.release.set()
        for handle in handles:
            handle.result(timeout=30)
    finally:
        ex.shutdown()
    assert stage.order == ["first", "old-low", "high", "high2", "normal", "low"]
