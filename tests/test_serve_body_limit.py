"""serve/body_limit.py in a real FastAPI app with mmserve's error handlers: which limit applies where,
Content-Length refused before the handler runs, chunked bodies counted as they arrive."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from serve.body_limit import BodyLimit
from serve.errors import install_error_handlers

JSON_BYTES, MULTIPART_BYTES = 1000, 5000


def make_client() -> tuple[TestClient, list[str]]:
    app = FastAPI()
    ran: list[str] = []  # handlers that started

    @app.post("/json")
    async def json_route(body: dict):
        ran.append("json")
        return {"keys": len(body)}

    @app.post("/form")
    async def form_route(request: Request):
        ran.append("form")
        form = await request.form()
        return {"bytes": len(await form["file"].read())}

    install_error_handlers(app)
    app.add_middleware(BodyLimit, json_bytes=JSON_BYTES, multipart_bytes=MULTIPART_BYTES)
    return TestClient(app), ran


def assert_413(response, limit: int) -> str:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["param"] is None
    assert f"is {limit} bytes" in error["message"]
    return error["message"]


def test_json_limit_by_content_length_refuses_before_the_handler():
    client, ran = make_client()
    ok = client.post("/json", json={"a": "x" * (JSON_BYTES - 20)})
    assert ok.status_code == 200 and ran == ["json"]
    ran.clear()
    message = assert_413(client.post("/json", json={"a": "x" * JSON_BYTES}), JSON_BYTES)
    assert "server.max_body_bytes" in message and ran == []


def test_chunked_body_is_counted_and_the_handlers_reply_dropped():
    client, ran = make_client()
    chunks = iter([b'{"a": "', b"x" * 600, b"x" * 600, b'"}'])  # no Content-Length: Transfer-Encoding chunked
    response = client.post("/json", content=chunks, headers={"content-type": "application/json"})
    assert "more than" in assert_413(response, JSON_BYTES) and ran == []


def test_multipart_bodies_have_their_own_limit():
    client, ran = make_client()
    ok = client.post("/form", files={"file": ("f.bin", b"x" * (JSON_BYTES * 3), "application/octet-stream")})
    assert ok.status_code == 200 and ok.json() == {"bytes": JSON_BYTES * 3}  # over the JSON limit: an upload
    ran.clear()
    big = client.post("/form", files={"file": ("f.bin", b"x" * MULTIPART_BYTES, "application/octet-stream")})
    assert "multipart" in assert_413(big, MULTIPART_BYTES) and ran == []
