"""The REST surface through a real server process on loopback, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

try:
    from tests.test_serve_support import Server, metric, png_bytes, read_image, wait_for
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_serve_support import Server, metric, png_bytes, read_image, wait_for

MODEL = "sd-demo"
SLASHED = "org/sd-demo"  # config names may hold '/' (as hub ids do): GET /v1/models/{id} must find them
STEPS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory, sd_path):  # sd_path: the session's demo checkpoint (tests/conftest.py)
    workdir = tmp_path_factory.mktemp("serve-api")
    srv = Server(workdir, f"""
[media]
workers = 2

[[models]]
name = "{MODEL}"
path = "{sd_path}"
[models.pools.denoise]
max_batch_size = 8

[[models]]
name = "{SLASHED}"
path = "{sd_path}"
random_weights = false
""")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)


def generate(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": "a lighthouse at dusk", "size": "64x64", "num_inference_steps": STEPS, **fields}
    return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=60)


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if code is not None:
        assert error["code"] == code, error
    return error


# -- the openai client ----------------------------------------------------------------------


def test_models_list_names_tasks(client):
    models = {m.id: m for m in client.models.list()}
    assert MODEL in models
    entry = models[MODEL].model_dump()
    assert entry["object"] == "model" and entry["owned_by"] == "mmserve"
    assert set(entry["tasks"]) == {"text-to-image", "image-to-image", "inpainting", "realtime-video"}


def test_retrieve_model_is_the_list_entry(client):
    listed = {m.id: m.model_dump() for m in client.models.list()}
    for model_id in (MODEL, SLASHED):
        assert client.models.retrieve(model_id).model_dump() == listed[model_id]
    # a demo checkpoint says it has random weights itself; a [[models]] entry may overrule it
    assert listed[MODEL]["random_weights"] is True and listed[SLASHED]["random_weights"] is False
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such/model")
    assert e.value.code == "model_not_found" and e.value.param == "model" and "no-such/model" in e.value.message


def test_generate_with_openai_client(client):
    result = client.images.generate(model=MODEL, prompt="a red fox", size="64x48", n=2, response_format="b64_json",
                                    extra_body={"num_inference_steps": STEPS, "seed": 3})
    assert len(result.data) == 2
    images = [read_image(base64.b64decode(d.b64_json)) for d in result.data]
    assert all(im.format == "PNG" and im.size == (64, 48) for im in images)
    assert result.size == "64x48" and result.output_format == "png"
    assert images[0].tobytes() != images[1].tobytes()  # image i of n draws its own noise


def test_generate_url_and_jpeg(client, server):
    result = client.images.generate(model=MODEL, prompt="a red fox", size="64x64", response_format="url",
                                    output_format="jpeg", extra_body={"num_inference_steps": STEPS})
    url = result.data[0].url
    assert url.startswith(server.url + "/v1/files/images/") and url.endswith(".jpeg")
    fetched = httpx.get(url, timeout=10)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/jpeg"
    assert read_image(fetched.content).format == "JPEG"
    assert_error(httpx.get(f"{server.url}/v1/files/images/img_nope.png"), 404, "name", "file_not_found")


def test_edit_with_openai_client_img2img_and_inpaint(client):
    image = png_bytes(64, 64)
    result = client.images.edit(model=MODEL, image=("in.png", image, "image/png"), prompt="make it blue",
                                extra_body={"num_inference_steps": STEPS, "strength": 0.6, "seed": 1})
    assert read_image(base64.b64decode(result.data[0].b64_json)).size == (64, 64)
    # An OpenAI-style mask: transparent where the model may repaint.
    mask = png_bytes(64, 64, color=(0, 0, 0), mode="RGBA")
    result = client.images.edit(model=MODEL, image=("in.png", image, "image/png"), mask=("m.png", mask, "image/png"),
                                prompt="a window", size="64x64", extra_body={"num_inference_steps": STEPS, "seed": 1})
    assert read_image(base64.b64decode(result.data[0].b64_json)).size == (64, 64)


def test_openai_client_stream(client):
    events = list(client.images.generate(model=MODEL, prompt="a red fox", size="64x64", stream=True, partial_images=1,
                                         extra_body={"num_inference_steps": 3, "seed": 5}))
    types = [e.type for e in events]
    assert types.count("image_generation.partial_image") == 1
    assert types[-1] == "image_generation.completed"
    assert read_image(base64.b64decode(events[-1].b64_json)).size == (64, 64)


def test_preview_every_streams_a_partial_image_every_n_steps(client):
    """The per-step preview extension: past OpenAI's cap of 3, one after every `preview_every` steps but the last."""
    events = list(client.images.generate(model=MODEL, prompt="a red fox", size="64x64", stream=True,
                                         extra_body={"num_inference_steps": 5, "seed": 5, "preview_every": 1}))
    partials = [e for e in events if e.type == "image_generation.partial_image"]
    assert [e.partial_image_index for e in partials] == [0, 1, 2, 3]
    assert len({e.b64_json for e in partials}) == 4 and events[-1].type == "image_generation.completed"
    every_two = list(client.images.generate(model=MODEL, prompt="a red fox", size="64x64", stream=True,
                                            extra_body={"num_inference_steps": 5, "seed": 5, "preview_every": 2}))
    again = [e.b64_json for e in every_two if e.type == "image_generation.partial_image"]
    assert again == [partials[1].b64_json, partials[3].b64_json]  # after steps 2 and 4: the same latents


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.images.generate(model="no-such-model", prompt="x")
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(model=MODEL, prompt="x", size="65x64")
    assert info.value.body["param"] == "size"


# -- extensions over raw HTTP -----------------------------------------------------------------


def test_seed_reproduces_bytes(server):
    first, again, other = (generate(server, seed=s).json() for s in (42, 42, 43))
    assert first["seed"] == 42
    assert first["data"][0]["b64_json"] == again["data"][0]["b64_json"]
    assert first["data"][0]["b64_json"] != other["data"][0]["b64_json"]
    assert isinstance(generate(server).json()["seed"], int)  # an unseeded request reports the seed it drew


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    events = []
    for block in text.strip().split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        events.append((name, "\n".join(data)))
    return events


def test_sse_progress_per_step_then_image(server):
    steps = 4
    body = {"model": MODEL, "prompt": "a lighthouse at dusk", "size": "64x64", "num_inference_steps": steps, "seed": 9,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/images/generations", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        request_id = r.headers["x-request-id"]
        events = parse_sse(r.read().decode())
    assert events[-1] == (None, "[DONE]")
    payloads = [(name, json.loads(data)) for name, data in events[:-1]]
    progress = [p for name, p in payloads if name == "image_generation.progress"]
    assert [(p["step"], p["total"]) for p in progress] == [(i, steps) for i in range(1, steps + 1)]
    assert all(p["request_id"] == request_id and p["type"] == "image_generation.progress" for p in progress)
    completed = [p for name, p in payloads if name == "image_generation.completed"]
    assert len(completed) == 1 and completed[0]["request_id"] == request_id
    solo = generate(server, seed=9, num_inference_steps=steps).json()["data"][0]["b64_json"]
    assert completed[0]["b64_json"] == solo  # streaming changes the delivery, not the image


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, status, param, code", [
    ({"model": "no-such-model"}, 404, "model", "model_not_found"),
    ({"size": "65x64"}, 400, "size", "unsupported_size"),
    ({"size": "big"}, 400, "size", "invalid_value"),
    ({"size": "4096x4096"}, 400, "size", "unsupported_size"),
    ({"n": 0}, 400, "n", "invalid_value"),
    ({"n": 11}, 400, "n", "invalid_value"),
    ({"num_inference_steps": 1000}, 400, "num_inference_steps", "invalid_value"),
    ({"guidance_scale": 500}, 400, "guidance_scale", "invalid_value"),
    ({"prompt": ""}, 400, "prompt", "invalid_value"),
    ({"prompt": "   "}, 400, "prompt", "invalid_value"),
    ({"response_format": "gif"}, 400, "response_format", "invalid_value"),
    ({"partial_images": 4}, 400, "partial_images", "invalid_value"),
    ({"preview_every": 0}, 400, "preview_every", "invalid_value"),
    ({"stream": True, "preview_every": 2, "partial_images": 1}, 400, "preview_every", "invalid_value"),
    ({"background": "transparent"}, 400, "background", "invalid_value"),
    ({"frobnicate": True}, 400, "frobnicate", "unknown_parameter"),
])
def test_generation_errors_name_the_field(server, fields, status, param, code):
    assert_error(generate(server, **fields), status, param, code)


def test_missing_prompt_and_malformed_json(server):
    url = f"{server.url}/v1/images/generations"
    assert_error(httpx.post(url, json={"model": MODEL}), 400, "prompt", "missing_required_parameter")
    assert_error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}),
                 400, None, "invalid_json")
    assert_error(httpx.post(url, json=["a", "list"]), 400, None, "invalid_json")
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404, None)


JSON_ROUTES = [("/v1/images/generations", "prompt"), ("/v1/videos", "prompt"), ("/v1/chat/completions", "messages"),
               ("/v1/embeddings", "input"), ("/v1/batches", "input_file_id"), ("/v1/audio/speech", "input")]


@pytest.mark.parametrize("route,required", JSON_ROUTES)
def test_empty_body_names_the_missing_field(server, route, required):
    url = f"{server.url}{route}"
    assert_error(httpx.post(url, json={}), 400, required, "missing_required_parameter")
    for absent in (httpx.post(url), httpx.post(url, content=b"", headers={"content-type": "application/json"})):
        error = assert_error(absent, 400, required, "missing_required_parameter")
        assert "None" not in error["message"] and required in error["message"]


@pytest.mark.parametrize("route,required", JSON_ROUTES + [("/v1/images/edits", "images")])
def test_json_sent_as_another_content_type_says_so(server, route, required):
    url = f"{server.url}{route}"
    for sent in ("text/plain", "application/x-www-form-urlencoded"):
        error = assert_error(httpx.post(url, content=b'{"prompt": "a fox"}', headers={"content-type": sent}),
                             400, None, "invalid_content_type")
        assert "application/json" in error["message"] and sent in error["message"], error
    error = assert_error(httpx.post(url, content=b"null", headers={"content-type": "application/json"}),
                         400, None, "invalid_json")
    assert error["message"] == "the request body must be a JSON object; got null"


def edit(server, files, **fields) -> httpx.Response:
    data = {"model": MODEL, "prompt": "repaint", "num_inference_steps": str(STEPS), **fields}
    return httpx.post(f"{server.url}/v1/images/edits", data=data, files=files, timeout=60)


def test_edit_errors_name_the_field(server):
    image = ("in.png", png_bytes(64, 64), "image/png")
    assert_error(edit(server, {"image": image, "mask": ("m.png", png_bytes(32, 32), "image/png")}), 400, "mask")
    assert_error(edit(server, {"image": ("in.png", b"definitely not a png", "image/png")}), 400, "image",
                 "media_corrupt")
    assert_error(edit(server, {"mask": image}), 400, "image", "missing_required_parameter")
    assert_error(edit(server, {"image": image}, strength="1.5"), 400, "strength")
    assert_error(edit(server, {"image": image}, num_inference_steps="1000"), 400, "num_inference_steps")
    assert_error(edit(server, {"image": image}, bogus="1"), 400, "bogus", "unknown_parameter")
    assert_error(edit(server, {"image": ("huge.png", huge_png(), "image/png")}), 413, "image", "media_pixels")
    malformed = httpx.post(f"{server.url}/v1/images/edits", content=b"--xyz\r\nnot a part\r\n",
                           headers={"content-type": "multipart/form-data"})
    assert_error(malformed, 400, None, "invalid_multipart")
    as_json = httpx.post(f"{server.url}/v1/images/edits", json={"prompt": "x"})  # JSON edits reference images
    assert_error(as_json, 400, "images", "invalid_value")
    as_text = httpx.post(f"{server.url}/v1/images/edits", content=b"prompt=x", headers={"content-type": "text/plain"})
    assert_error(as_text, 400, None, "invalid_content_type")


def test_edit_pixel_bomb_names_our_limit_and_its_size(server):
    import struct
    import zlib

    png = bytearray(png_bytes(1, 1))  # a valid PNG whose header is patched to declare 50000x50000 (CRC redone)
    png[16:24] = struct.pack(">II", 50_000, 50_000)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    error = assert_error(edit(server, {"image": ("bomb.png", bytes(png), "image/png")}), 413, "image", "media_pixels")
    assert "50000x50000 = 2500000000 pixels" in error["message"] and str(4096 * 4096) in error["message"]
    assert "decompression bomb" not in error["message"] and "178956970" not in error["message"], error


def huge_png() -> bytes:
    """A 1-bit 4100x4100 PNG: a few KB on the wire, over the decoder's 4096x4096 pixel limit."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (4100, 4100)).save(out, format="PNG")
    return out.getvalue()


def test_edit_stream_events(server):
    files = {"image": ("in.png", png_bytes(64, 64), "image/png")}
    data = {"model": MODEL, "prompt": "repaint", "num_inference_steps": "2", "stream": "true", "partial_images": "1"}
    with httpx.stream("POST", f"{server.url}/v1/images/edits", data=data, files=files, timeout=60) as r:
        assert r.status_code == 200, r.read()
        names = [name for name, _ in parse_sse(r.read().decode())]
    # strength 0.8 of 2 steps runs 1 denoise step (as diffusers' img2img does)
    assert "image_edit.progress" in names and names[-2:] == ["image_edit.completed", None]


def test_bad_requests_do_not_disturb_a_concurrent_one(server):
    solo = generate(server, seed=11, num_inference_steps=12).json()["data"][0]["b64_json"]
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(generate, server, seed=11, num_inference_steps=12)
        bad = [generate(server, size="65x64"), generate(server, n=0), generate(server, model="nope"),
               edit(server, {"image": ("x.png", b"junk", "image/png")})]
        assert [r.status_code for r in bad] == [400, 400, 404, 400]
        response = good.result()
    assert response.status_code == 200
    assert response.json()["data"][0]["b64_json"] == solo


# -- operations ---------------------------------------------------------------------------------


def test_health_ready_metrics(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    generate(server, seed=1)
    generate(server, model="no-such-model")
    denoise = {"stage": f"{MODEL}/denoise", "model": MODEL}
    assert metric(server.url, "mmserve_stage_queue_age_seconds_count", **denoise) >= 1
    assert metric(server.url, "mmserve_stage_batch_size_count", **denoise) >= 1
    assert metric(server.url, "mmserve_stage_run_seconds_count", **denoise) >= 1
    route = "/v1/images/generations"
    assert metric(server.url, "mmserve_requests_total", route=route, status="200") >= 1
    assert metric(server.url, "mmserve_requests_total", route=route, status="404") >= 1
    text = httpx.get(f"{server.url}/metrics").text
    assert "mmserve_cache_hits_total" in text or "mmserve_cache_misses_total" in text
    assert "tenant" not in text and "req_" not in text  # labels never carry a tenant or request id


def cancelled(server) -> float:
    return metric(server.url, "mmserve_graph_requests_total", model=MODEL, outcome="cancelled")


def test_disconnect_cancels_json_request(server):
    before = cancelled(server)
    body = {"model": MODEL, "prompt": "a long one", "size": "512x512", "n": 2, "num_inference_steps": 200}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=httpx.Timeout(30, read=1.0))
    assert wait_for(lambda: cancelled(server) == before + 1, timeout_s=60), server.log_tail()
    # the denoise pool lets go of it at the next step boundary
    idle = lambda: metric(server.url, "mmserve_stage_active_items", stage=f"{MODEL}/denoise") == 0  # noqa: E731
    assert wait_for(idle, timeout_s=60)


def test_disconnect_cancels_stream(server):
    before = cancelled(server)
    body = {"model": MODEL, "prompt": "a long stream", "size": "512x512", "num_inference_steps": 200, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/images/generations", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("event:")) == "event: image_generation.progress"
    assert wait_for(lambda: cancelled(server) == before + 1, timeout_s=60), server.log_tail()
    # the server is still healthy and serves the next request
    assert generate(server, seed=2).status_code == 200
