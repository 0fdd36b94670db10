"""Images referenced by URL in /v1/images/edits: data: URIs, allowlisted http, allowed file://, and
every refusal answered with a 4xx naming the field (the fetcher's own tests cover the SSRF cases)."""

from __future__ import annotations

import base64
import http.server
import logging
import threading

import httpx
import pytest

from tests.test_serve_support import Server, metric, png_bytes, wait_for

PNG = png_bytes(64, 64)
PASSWORD = "hunter2-pw"  # never to be echoed in a reply or a log line
TOKENS = ("sig-SECRET-1", "tok-SECRET-2", "amz-SECRET-3")


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path == "/in.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path == "/to-private":
            self.send_response(302)
            self.send_header("Location", "http://10.0.0.1/in.png")
            self.end_headers()
        elif self.path == "/to-credentials":
            self.send_response(302)
            self.send_header("Location", f"http://bob:{PASSWORD}@10.0.0.1/in.png?sig={TOKENS[0]}")
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory, sd_path, media_host):
    workdir = tmp_path_factory.mktemp("sources")
    (workdir / "files").mkdir()
    (workdir / "files" / "in.png").write_bytes(PNG)
    (workdir / "outside.png").write_bytes(PNG)
    srv = Server(workdir, f"""
[media.fetch]
allow_hosts = ["{media_host}"]
file_dirs = ["{workdir / 'files'}"]
max_bytes = 200000

[[models]]
name = "sd"
path = "{sd_path}"
""")
    srv.workdir = workdir
    yield srv
    srv.stop()


def edit(server, image_url, **extra) -> httpx.Response:
    body = {"model": "sd", "prompt": "a harbour", "num_inference_steps": 2, "images": [{"image_url": image_url}],
            **extra}
    return httpx.post(f"{server.url}/v1/images/edits", json=body, timeout=60)


def test_data_uri(server):
    reply = edit(server, "data:image/png;base64," + base64.b64encode(PNG).decode())
    assert reply.status_code == 200, reply.text
    assert base64.b64decode(reply.json()["data"][0]["b64_json"])[:4] == b"\x89PNG"


def test_allowlisted_http_url_and_mask(server, media_host):
    reply = edit(server, f"http://{media_host}/in.png", mask={"image_url": f"http://{media_host}/in.png"})
    assert reply.status_code == 200, reply.text
    assert metric(server.url, "mmserve_media_fetch_total", kind="http", outcome="ok") >= 2


def test_file_url_inside_allowed_dir(server):
    assert edit(server, f"file://{server.workdir / 'files' / 'in.png'}").status_code == 200


@pytest.mark.parametrize("source,code,status", [
    ("file://{workdir}/outside.png", "media_fetch", 400),
    ("http://{host}/to-private", "media_fetch", 400),
    ("http://127.0.0.1:9/in.png", "media_fetch", 400),  # loopback, not allowlisted
    ("http://{host}/missing.png", "media_fetch", 400),
    ("data:image/png;base64,!!!not-base64", "media_corrupt", 400),
    ("data:image/png;base64," + "A" * 400_000, "media_bytes", 413),
    ("data:text/plain;base64," + base64.b64encode(b"not an image").decode(), "media_corrupt", 400),
])
def test_refusals_name_the_field(server, media_host, source, code, status):
    reply = edit(server, source.format(workdir=server.workdir, host=media_host))
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["param"] == "images"


def test_malformed_references(server):
    body = {"model": "sd", "prompt": "x", "images": [{"file_id": "abc"}]}
    reply = httpx.post(f"{server.url}/v1/images/edits", json=body, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "images"
    body = {"model": "sd", "prompt": "x", "images": []}
    assert httpx.post(f"{server.url}/v1/images/edits", json=body, timeout=30).status_code == 400


# -- secrets in URLs never come back, nor reach a log (stages/redact.py) ------------------------------


@pytest.fixture(scope="module")
def local_server(sd_path, media_host):
    """The app in this process (so caplog sees every log line, uvicorn's access log included) on loopback."""
    import uvicorn

    from pipelines.config import EngineConfig, MediaConfig, ModelSpec
    from pipelines.engine import Engine
    from serve.app import create_app
    from stages.media.fetch import FetchPolicy
    from tests.test_serve_support import free_port

    engine = Engine(EngineConfig(models=(ModelSpec("sd", sd_path),),
                                 media=MediaConfig(fetch=FetchPolicy(allow_hosts=(media_host,)))))
    engine.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_config=None,
                                           log_level="debug"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started, timeout_s=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()


def test_url_credentials_and_tokens_never_come_back_or_reach_the_logs(local_server, media_host, caplog):
    caplog.set_level(logging.DEBUG)

    def image(url: str) -> dict:
        return {"model": "sd", "prompt": "x", "num_inference_steps": 2, "images": [{"image_url": url}]}

    cases = [
        ("/v1/images/edits", image(f"http://alice:{PASSWORD}@{media_host}/in.png"), "images", "credentials"),
        ("/v1/images/edits", image(f"http://{media_host}/missing.png?size=64&token={TOKENS[1]}"
                                   f"&X-Amz-Signature={TOKENS[2]}"), "images", "404"),
        ("/v1/images/edits", image(f"http://{media_host}/to-credentials"), "images", "credentials"),
        ("/v1/videos", {"prompt": "a boat", "input_reference": {
            "image_url": f"https://alice:{PASSWORD}@example.com/in.png?access_token={TOKENS[1]}"}},
         "input_reference", "credentials"),
    ]
    for route, body, param, says in cases:
        reply = httpx.post(f"{local_server}{route}", json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and error["code"] == "media_fetch" and says in error["message"], error
        assert "***" in error["message"], error  # it shows where a secret was, not the secret
        assert PASSWORD not in reply.text and "alice" not in reply.text and "bob" not in reply.text, reply.text
        assert not any(token in reply.text for token in TOKENS), reply.text
    # a request line whose own query holds a key is masked in uvicorn's access log
    assert httpx.get(f"{local_server}/v1/models?api_key={TOKENS[1]}", timeout=30).status_code == 200
    # the server's records: this thread is the test's httpx client, which logs the URLs it was given
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records
                       if r.thread != threading.get_ident())
    assert "/v1/models?api_key=*** HTTP/1.1" in logged, logged[-2000:]  # the access log was captured, masked
    assert PASSWORD not in logged and not any(token in logged for token in TOKENS), logged[-2000:]
