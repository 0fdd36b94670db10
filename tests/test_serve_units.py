"""Pieces of serve/ that need no server: schemas, the error mapping, the URL image store, API-key files."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pipelines.image_request import RequestError, Task
from serve.auth import load_api_keys
from serve.errors import error_body, validation_error_parts
from serve.files import ImageStore
from serve.schemas import ImageEditRequest, ImageGenerationRequest, parse_size


def test_parse_size():
    assert parse_size("512x768") == (512, 768)
    assert parse_size(" 64 X 32 ") == (64, 32)
    assert parse_size("auto") is None and parse_size(None) is None
    for bad in ("512", "axb", "0x64", "-1x5", "512x512x3"):
        with pytest.raises(RequestError) as info:
            parse_size(bad)
        assert info.value.param == "size"


def test_openai_knobs_are_accepted_and_unknown_fields_refused():
    body = ImageGenerationRequest.model_validate(dict(
        model="m", prompt="p", quality="hd", style="vivid", moderation="low", background="auto", user="u",
        output_compression=80, output_format="webp", stream=True, partial_images=2, seed=1))
    request = body.image_request(task=Task.TEXT_TO_IMAGE, tenant="t")
    assert (request.previews, request.seed, request.tenant, request.width) == (2, 1, "t", None)
    assert ImageGenerationRequest(prompt="p", partial_images=2).image_request(
        task=Task.TEXT_TO_IMAGE, tenant="t").previews == 0  # previews cost decodes: only on a stream
    with pytest.raises(ValidationError) as info:
        ImageGenerationRequest.model_validate({"prompt": "p", "nonsense": 1})
    parts = validation_error_parts(info.value.errors())
    assert parts["param"] == "nonsense" and parts["code"] == "unknown_parameter"
    assert "Unrecognized request argument" in parts["message"]


def test_edit_fields_from_multipart_strings():
    params = ImageEditRequest.model_validate({"prompt": "p", "n": "2", "strength": "0.5", "stream": "true",
                                              "size": "64x64"})
    assert (params.n, params.strength, params.stream) == (2, 0.5, True)
    request = params.image_request(task=Task.IMAGE_TO_IMAGE, tenant="t", strength=params.strength,
                                   default_size=(32, 32))
    assert (request.width, request.height, request.strength) == (64, 64, 0.5)
    auto = ImageEditRequest(prompt="p").image_request(task=Task.IMAGE_TO_IMAGE, tenant="t", default_size=(32, 16))
    assert (auto.width, auto.height, auto.strength) == (32, 16, 0.8)


def test_validation_errors_name_the_field():
    with pytest.raises(ValidationError) as info:
        ImageGenerationRequest.model_validate({"prompt": "p", "n": 0, "size": "huge"})
    parts = validation_error_parts(info.value.errors())
    assert parts["status"] == 400 and parts["param"] == "n"
    assert "'size'" in parts["message"]  # later errors are still reported in the message
    assert validation_error_parts([{"type": "missing", "loc": ("body", "prompt")}])["param"] == "prompt"
    body = error_body(429, "busy", code="queue_full")
    assert body == {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "queue_full"}}
    assert error_body(500, "x")["error"]["type"] == "server_error"
    assert error_body(413, "x")["error"]["type"] == "invalid_request_error"


def test_image_store_is_bounded_and_expires(monkeypatch):
    store = ImageStore(max_items=2, max_bytes=10, ttl_s=60)
    a = store.put(b"aaa", "png")
    b = store.put(b"bbb", "jpeg")
    assert store.get(a).data == b"aaa" and store.get(b).media_type == "image/jpeg"
    assert store.get(a.replace(".png", ".jpeg")) is None  # the extension is part of the name
    c = store.put(b"ccc", "png")  # a third item pushes out the oldest
    assert store.get(a) is None and store.get(c) is not None
    x = store.put(b"x" * 8, "png")  # over the byte budget: oldest leave until it fits
    assert len(store) == 1 and store.get(x) is not None
    import serve.files

    now = serve.files.time.monotonic()
    monkeypatch.setattr(serve.files.time, "monotonic", lambda: now + 61)
    assert store.get(x) is None and len(store) == 0


def test_api_key_files(tmp_path):
    as_json = tmp_path / "keys.json"
    as_json.write_text(json.dumps({"sk-1": "alice"}))
    as_toml = tmp_path / "keys.toml"
    as_toml.write_text('"sk-2" = "bob"\n')
    assert load_api_keys(as_json) == {"sk-1": "alice"}
    assert load_api_keys(as_toml) == {"sk-2": "bob"}
    as_json.write_text(json.dumps({"sk-1": 3}))
    with pytest.raises(ValueError, match="tenant"):
        load_api_keys(as_json)
    as_json.write_text("{")
    with pytest.raises(ValueError, match="cannot parse"):
        load_api_keys(as_json)


def test_batch_line_errors_mask_a_token_in_the_url():
    from serve.batch_lines import LineError, parse_line

    line = json.dumps({"custom_id": "a", "url": "https://x.example/v1/chat?api_key=sk-SECRET", "body": {}})
    with pytest.raises(LineError) as e:
        parse_line(line, 0, None)
    assert "api_key=***" in e.value.message and "sk-SECRET" not in e.value.message


def test_a_download_survives_its_file_being_deleted_and_a_gone_file_is_the_given_404(tmp_path):
    import asyncio

    from serve.errors import ApiError
    from serve.files import download_response

    path = tmp_path / "video.mp4"
    data = bytes(range(256)) * 1000  # several read chunks
    path.write_bytes(data)
    gone = ApiError(404, "gone", param="video_id", code="video_expired")
    response = download_response(path, "video/mp4", gone, filename="clip ü.mp4")
    path.unlink()  # a DELETE that lands after the reply was made, before its body is sent

    async def body() -> bytes:
        return b"".join([chunk async for chunk in response.body_iterator])

    assert asyncio.run(body()) == data
    assert response.headers["content-length"] == str(len(data))
    assert response.headers["content-disposition"] == "attachment; filename*=utf-8''clip%20%C3%BC.mp4"
    with pytest.raises(ApiError) as e:
        download_response(path, "video/mp4", gone)
    assert e.value is gone
