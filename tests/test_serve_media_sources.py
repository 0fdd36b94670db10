"""Images referenced by URL in /v1/images/edits: data: URIs, allowlisted http, allowed file://, and
every refusal answered with a 4xx naming the field (the fetcher's own tests cover the SSRF cases)."""

from __future__ import annotations

import base64
import http.server
import threading

import httpx
import pytest

from tests.test_serve_support import Server, metric, png_bytes

PNG = png_bytes(64, 64)


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
