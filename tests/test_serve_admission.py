"""API keys -> tenants, and a full queue -> 429 with Retry-After, on a server configured for both."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

try:
    from tests.test_serve_support import Server, metric
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_serve_support import Server, metric

MODEL = "sd-demo"
KEYS = {"sk-alice-0001": "alice", "sk-bob-0002": "bob"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, sd_path):  # sd_path: the session's demo checkpoint (tests/conftest.py)
    workdir = tmp_path_factory.mktemp("serve-admission")
    (workdir / "keys.json").write_text(json.dumps(KEYS))
    # Two requests of the model in flight at most: a burst of requests must overflow it.
    srv = Server(workdir, f"""
[server]
api_keys_file = "keys.json"

[[models]]
name = "{MODEL}"
path = "{sd_path}"
max_inflight = 2
""")
    yield srv
    srv.stop()


def post(server, key: str | None, **fields) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "prompt": "a quiet harbour", "size": "64x64", "num_inference_steps": 2, **fields}
    return httpx.post(f"{server.url}/v1/images/generations", json=body, headers=headers, timeout=60)


def test_missing_or_unknown_key_is_401(server):
    for key, code in ((None, "missing_api_key"), ("sk-wrong", "invalid_api_key")):
        r = post(server, key)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key


def test_known_key_is_served_and_the_tenant_isolates_caches(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-alice-0001", max_retries=0)
    assert MODEL in [m.id for m in client.models.list()]

    def counts():
        return (metric(server.url, "mmserve_cache_hits_total", cache="prompt_embedding"),
                metric(server.url, "mmserve_cache_misses_total", cache="prompt_embedding"))

    prompt = "a prompt only this test uses"
    hits0, misses0 = counts()
    assert post(server, "sk-alice-0001", prompt=prompt).status_code == 200
    hits1, misses1 = counts()
    assert misses1 > misses0
    assert post(server, "sk-alice-0001", prompt=prompt).status_code == 200
    hits2, misses2 = counts()
    assert hits2 > hits1 and misses2 == misses1  # alice's repeat is served from her cache entry
    assert post(server, "sk-bob-0002", prompt=prompt).status_code == 200
    hits3, misses3 = counts()
    assert misses3 > misses2 and hits3 == hits2  # bob never hits alice's entry


def test_full_queue_answers_429_with_retry_after(server):
    async def burst() -> list[httpx.Response]:
        headers = {"Authorization": "Bearer sk-alice-0001"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as client:
            # Distinct prompts: no prompt-cache hit shortens the text encoder's work.
            return await asyncio.gather(*(
                client.post("/v1/images/generations", json={"model": MODEL, "prompt": f"burst {i}", "size": "64x64",
                                                            "num_inference_steps": 10})
                for i in range(32)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert 200 in statuses and 429 in statuses, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
    assert metric(server.url, "mmserve_requests_total", route="/v1/images/generations", status="429") >= 1


# -- response_format=url links while keys are on (serve/signed_urls.py) ------------------------------


def _get(url: str, key: str | None = None) -> httpx.Response:
    return httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)


def _code(response: httpx.Response) -> str | None:
    return response.json()["error"]["code"]


def test_image_links_are_signed_expiring_and_bound_to_their_tenant(server):
    alice = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-alice-0001", max_retries=0)
    url = alice.images.generate(model=MODEL, prompt="a lighthouse", size="64x64", response_format="url",
                                extra_body={"num_inference_steps": 2}).data[0].url
    link = httpx.URL(url)
    assert set(link.params) == {"expires", "sig"}
    assert 3500 < int(link.params["expires"]) - time.time() <= 3600  # as long as the image is kept
    # as returned, it opens with no key at all: a browser, an <img> tag, curl
    opened = _get(url)
    assert opened.status_code == 200 and opened.content[:4] == b"\x89PNG", opened.text
    bare = str(link.copy_with(query=None))
    assert _get(bare).status_code == 403 and _code(_get(bare)) == "unsigned_url"
    assert _get(bare, "sk-alice-0001").status_code == 200  # the owner's key opens the bare link
    assert _get(bare, "sk-bob-0002").status_code == 404  # another tenant's key: as if it did not exist
    assert _code(_get(bare, "sk-bob-0002")) == "file_not_found"
    # a changed signature, a later expiry, or a signature moved to another name: refused
    sig, expires = link.params["sig"], int(link.params["expires"])
    forged_sig = sig[:-1] + ("0" if sig[-1] != "0" else "1")
    for params in ({"expires": str(expires), "sig": forged_sig}, {"expires": str(expires + 3600), "sig": sig},
                   {"expires": str(expires), "sig": ""}):
        refused = _get(str(link.copy_with(params=params)))
        assert refused.status_code == 403 and _code(refused) == "invalid_signature", refused.text
    other = httpx.URL(alice.images.generate(model=MODEL, prompt="a boat", size="64x64", response_format="url",
                                            extra_body={"num_inference_steps": 2}).data[0].url)
    moved = other.copy_with(params={"expires": str(expires), "sig": sig})
    assert _get(str(moved)).status_code == 403
    assert _get(str(moved), "sk-bob-0002").status_code == 404


def test_link_signatures_expire_and_name_the_tenant():
    from serve.signed_urls import UrlSigner

    signer = UrlSigner(b"k" * 32)
    params = signer.sign("img_a.png", "alice", 60, now=1000.0)
    assert params["expires"] == "1060"
    assert signer.refusal("img_a.png", "alice", params["expires"], params["sig"], now=1059.0) is None
    assert signer.refusal("img_a.png", "alice", params["expires"], params["sig"], now=1061.0) == "expired"
    assert signer.refusal("img_a.png", "bob", params["expires"], params["sig"], now=1000.0) == "invalid"
    assert signer.refusal("img_b.png", "alice", params["expires"], params["sig"], now=1000.0) == "invalid"
    assert signer.refusal("img_a.png", "alice", None, None) == "unsigned"
    assert UrlSigner(b"j" * 32).refusal("img_a.png", "alice", params["expires"], params["sig"], now=1000.0) == "invalid"
