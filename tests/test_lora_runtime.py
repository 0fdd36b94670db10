"""LoRA adapters loaded and unloaded while the server runs (pipelines/adapters.py, serve/routes/loras.py): from
the model's lora_dirs only, with the admin key; requests already running finish with the adapter they started
with; a byte budget keeps an LRU of resident adapters and reloads evicted ones on demand. Every image is checked
against diffusers with the same adapter file, every completion against peft's generate()."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipelines.config import LoraSpec
from pipelines.demo.lora import build_diffusion_lora, build_llm_lora
from pipelines.image_request import ImageRequest, RequestError
from stages.events import CapacityError
from tests.helpers import demo_path, running_engine, seeded
from tests.test_lora import peft_greedy

ATOL = 1e-5


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    return demo_path(tmp_path_factory, "sd")


@pytest.fixture(scope="module")
def lora_dir(sd, tmp_path_factory):
    """A lora_dirs folder with two adapters of the demo SD (a: UNet and text encoder; b: UNet only) and a file
    that is not a LoRA."""
    root = tmp_path_factory.mktemp("lora-dir")
    build_diffusion_lora(sd, root / "a", 1, {
        "unet": dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
        "text_encoder": dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "out_proj"])})
    build_diffusion_lora(sd, root / "b", 2, {"unet": dict(r=2, lora_alpha=2, target_modules=["to_k", "to_v"])})
    (root / "junk.safetensors").write_bytes(b"not a safetensors file")
    return root


def reference(sd: str, path: str | None, weight: float, prompt: str, seed: int, steps: int = 3):
    """diffusers with the adapter file at `path` active at `weight` (None: the base model)."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(sd)
    pipe.set_progress_bar_config(disable=True)
    if path is not None:
        pipe.load_lora_weights(path, adapter_name="x")
        pipe.set_adapters(["x"], [weight])
    return pipe(prompt, num_inference_steps=steps, guidance_scale=6.0, generator=seeded(seed),
                output_type="np").images


def image(engine, lora, prompt="a red bicycle", seed=3, steps=3):
    return engine.submit_image("sd", ImageRequest(prompt=prompt, num_inference_steps=steps, guidance_scale=6.0,
                                                  seed=seed, lora=lora))


def weights_in_unet(engine, name: str) -> bool:
    unet = engine.family("sd").pipe.unet
    return any(name in getattr(m, "lora_A", {}) for m in unet.modules())


def wait_until(check, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_load_and_unload_while_requests_run(sd, lora_dir):
    """A load at run time equals diffusers with the file; unloading while a request uses the adapter lets that
    request finish with it, refuses new ones at once and drops the weights when it ends; the name loaded again from
    another file never meets the old file's cached prompt embeddings (same prompt, same seed)."""
    with running_engine(sd, name="sd", max_batch_size=8, lora_dirs=(lora_dir,)) as eng:
        assert eng.models["sd"].adapters == ()
        eng.load_lora("sd", LoraSpec("a", "a", scale=0.7))  # relative to the lora_dirs entry
        assert eng.models["sd"].adapters == ("a",)
        first = image(eng, (("a", None),)).result(timeout=120)["pixels"]
        np.testing.assert_allclose(first, reference(sd, str(lora_dir / "a"), 0.7, "a red bicycle", 3), atol=ATOL)

        running = image(eng, (("a", 1.0),), prompt="a blue car", seed=4, steps=6)
        assert eng.unload_lora("sd", "a") is False  # in use: its weights stay until the request ends
        assert eng.models["sd"].adapters == ()
        with pytest.raises(RequestError) as info:
            image(eng, (("a", None),))
        assert info.value.param == "lora[0].name" and info.value.code == "unknown_lora"
        with pytest.raises(RequestError, match="still unloading|is loaded"):
            eng.load_lora("sd", LoraSpec("a", "b"))  # the name is taken until its last request ends
        got = running.result(timeout=120)["pixels"]
        np.testing.assert_allclose(got, reference(sd, str(lora_dir / "a"), 1.0, "a blue car", 4, steps=6), atol=ATOL)
        wait_until(lambda: not weights_in_unet(eng, "a"))

        eng.load_lora("sd", LoraSpec("a", str(lora_dir / "b"), scale=0.7))  # absolute, inside the dir
        again = image(eng, (("a", None),)).result(timeout=120)["pixels"]
        np.testing.assert_allclose(again, reference(sd, str(lora_dir / "b"), 0.7, "a red bicycle", 3), atol=ATOL)
        assert np.abs(again - first).max() > 1e-3

        for path, param in (("../outside", "path"), ("/etc/hostname", "path"), ("junk.safetensors", "path")):
            with pytest.raises(RequestError) as info:
                eng.load_lora("sd", LoraSpec("c", path))
            assert info.value.param == param, path
        assert eng.models["sd"].adapters == ("a",)
        assert eng.unload_lora("sd", "a") is True  # no request holds it: gone now
        assert not weights_in_unet(eng, "a")


def test_a_byte_budget_keeps_an_lru_and_reloads_on_demand(sd, lora_dir):
    """A budget that holds one adapter: loading the second evicts the first; a request naming the evicted one has
    it reloaded (and the other evicted) and still equals diffusers; two requests that would hold both at once: the
    second is refused with a retryable 429 until the first ends."""
    with running_engine(sd, name="sd", max_batch_size=8, lora_dirs=(lora_dir,)) as probe:
        probe.load_lora("sd", LoraSpec("a", "a"))
        probe.load_lora("sd", LoraSpec("b", "b"))
        sizes = {e["name"]: e["bytes"] for e in probe.loras_of("sd").describe()}
    budget_mb = (max(sizes.values()) + 1) / 2**20
    assert sum(sizes.values()) > max(sizes.values()) + 1
    with running_engine(sd, name="sd", max_batch_size=8, lora_dirs=(lora_dir,), lora_budget_mb=budget_mb) as eng:
        loras = eng.loras_of("sd")
        eng.load_lora("sd", LoraSpec("a", "a"))
        eng.load_lora("sd", LoraSpec("b", "b"))
        resident = {e["name"]: e["resident"] for e in loras.describe()}
        assert resident == {"a": False, "b": True} and loras.loads == 2
        assert not weights_in_unet(eng, "a") and loras.resident_bytes <= budget_mb * 2**20

        got = image(eng, (("a", 0.9),)).result(timeout=120)["pixels"]  # a comes back; b goes
        np.testing.assert_allclose(got, reference(sd, str(lora_dir / "a"), 0.9, "a red bicycle", 3), atol=ATOL)
        assert loras.loads == 3 and {e["name"]: e["resident"] for e in loras.describe()} == {"a": True, "b": False}

        running = image(eng, (("a", 0.9),), steps=5)
        with pytest.raises(CapacityError):
            image(eng, (("b", 1.0),))
        running.result(timeout=120)
        got = image(eng, (("b", 1.0),), seed=5).result(timeout=120)["pixels"]
        np.testing.assert_allclose(got, reference(sd, str(lora_dir / "b"), 1.0, "a red bicycle", 5), atol=ATOL)
        assert loras.resident_bytes <= budget_mb * 2**20


def test_the_admin_routes_through_a_server(sd, lora_dir, tmp_path, tmp_path_factory):
    """POST/GET/DELETE /v1/loras on a real server: the admin key, the lora_dirs, a 409 for a taken name, a 400 for
    a file that is not a LoRA, and then the adapter through the openai client (images, and a language model's
    "base:adapter" completions equal to peft's generate())."""
    import base64
    import io

    import httpx
    import openai
    from PIL import Image
    from transformers import AutoTokenizer

    from tests.test_serve_support import Server

    llama = demo_path(tmp_path_factory, "llama")
    llm_dir = tmp_path / "llm-loras"
    build_llm_lora(llama, llm_dir / "x", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    config = f"""
[[models]]
name = "sd"
path = "{sd}"
lora_dirs = ["{lora_dir}"]

[[models]]
name = "lm"
path = "{llama}"
family = "causal-lm"
lora_dirs = ["{llm_dir}"]
"""
    server = Server(tmp_path, config, env={"MMSERVE_ADMIN_KEY": "admin-secret"})
    admin = {"Authorization": "Bearer admin-secret"}
    try:
        url = f"{server.url}/v1/loras"
        body = {"model": "sd", "name": "a", "path": "a", "scale": 0.7}
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=30).status_code == 401
        for bad, status, param in (({**body, "path": "../x"}, 403, "path"), ({**body, "path": "junk.safetensors"},
                                   400, "path"), ({**body, "name": "a.b"}, 400, "name"),
                                   ({**body, "model": "nope"}, 404, "model"), ({**body, "scale": 9}, 400, "scale")):
            reply = httpx.post(url, json=bad, headers=admin, timeout=60)
            assert (reply.status_code, reply.json()["error"]["param"]) == (status, param), reply.text
        reply = httpx.post(url, json=body, headers=admin, timeout=60)
        assert reply.status_code == 200 and reply.json()["id"] == "a" and reply.json()["resident"] is True
        assert httpx.post(url, json=body, headers=admin, timeout=60).status_code == 409
        assert httpx.post(url, json={"model": "lm", "name": "x", "path": "x"}, headers=admin,
                          timeout=60).status_code == 200
        listed = {(e["model"], e["id"]) for e in httpx.get(url, headers=admin, timeout=30).json()["data"]}
        assert listed == {("sd", "a"), ("lm", "x")}
        models = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]}
        assert models["sd"]["adapters"] == ["a"] and models["lm:x"]["parent"] == "lm"

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        reply = client.images.generate(model="sd", prompt="a red bicycle", size="64x64", extra_body={
            "num_inference_steps": 3, "guidance_scale": 6.0, "seed": 3, "lora": [{"name": "a"}]})
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json))).convert("RGB"))
        want = reference(sd, str(lora_dir / "a"), 0.7, "a red bicycle", 3)[0]
        assert np.abs(got.astype(float) - np.round(want * 255)).max() <= 1
        prompt = [1, 7, 17, 42]
        completion = client.completions.create(model="lm:x", prompt=prompt, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
        want = AutoTokenizer.from_pretrained(llama).decode(peft_greedy(llama, str(llm_dir / "x"), prompt, 6))
        assert completion.choices[0].text == want

        reply = httpx.delete(f"{url}/a", headers=admin, timeout=60)
        assert reply.status_code == 200 and reply.json() == {"object": "lora", "id": "a", "model": "sd",
                                                             "deleted": True, "unloaded": True}
        assert httpx.delete(f"{url}/a", headers=admin, timeout=60).status_code == 404
        assert httpx.delete(f"{url}/lm:x", headers=admin, timeout=60).status_code == 200
        with pytest.raises(openai.BadRequestError) as info:
            client.images.generate(model="sd", prompt="x", size="64x64",
                                   extra_body={"num_inference_steps": 2, "lora": [{"name": "a"}]})
        assert info.value.body["param"] == "lora[0].name"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="lm:x", prompt=prompt, max_tokens=2)
    finally:
        server.stop()


def test_admin_routes_are_off_without_an_admin_key(sd):
    from fastapi.testclient import TestClient

    from serve.app import create_app

    with running_engine(sd, name="sd") as eng:
        client = TestClient(create_app(eng))
        reply = client.get("/v1/loras", headers={"Authorization": "Bearer anything"})
        assert reply.status_code == 403 and "MMSERVE_ADMIN_KEY" in reply.json()["error"]["message"]
