"""Safe media fetching against a local HTTP server on 127.0.0.1; no test touches another address.

Host names go through a fake resolver and every socket is checked to be loopback (the autouse
`fake_dns` fixture), so no DNS query or connection leaves the machine.
"""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpcore
import httpx
import numpy as np
import pytest
from PIL import Image

from stages.media import fetch as media_fetch
from stages.media.fetch import (
    FetchOutcome,
    FetchPolicy,
    address_block_reason,
    literal_address,
    load_source,
    load_source_sync,
)
from stages.media.image import MediaError


def _png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)).save(out, format="PNG")
    return out.getvalue()


PNG = _png()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _stream(self, total: int, chunked: bool) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding" if chunked else "Connection", "chunked" if chunked else "close")
        self.end_headers()
        chunk = b"x" * 65536
        try:
            for _ in range(total // len(chunk)):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
        except OSError:  # the client hung up once it had enough: that is the point
            pass
        self.close_connection = True

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = self.path
        if path == "/ok.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        elif path == "/echo-host":
            self._send(200, self.headers["Host"].encode())
        elif path == "/redirect-private":
            self._send(302, headers={"Location": "http://10.0.0.1/x"})
        elif path == "/redirect-loop":
            self._send(302, headers={"Location": "/redirect-loop"})
        elif path.startswith("/redirect-chain/"):
            left = int(path.rsplit("/", 1)[1])
            self._send(302, headers={"Location": f"/redirect-chain/{left - 1}" if left > 1 else "/ok.png"})
        elif path == "/relative-redirect":
            self._send(301, headers={"Location": "ok.png"})
        elif path.startswith("/redirect-to?"):
            self._send(307, headers={"Location": path.split("?", 1)[1]})
        elif path == "/slow":
            time.sleep(3)
            try:
                self._send(200, PNG)
            except OSError:
                pass
        elif path == "/big":
            self._stream(8 * 1024 * 1024, chunked=True)
        elif path == "/big-close":
            self._stream(8 * 1024 * 1024, chunked=False)
        elif path == "/lying-length":  # declares 10 GB, sends a few bytes
            self._send(200, b"tiny", {"Content-Length": str(10 * 1024**3)})
            self.close_connection = True
        elif path == "/short-body":  # declares 1000 bytes, sends 10, hangs up
            self._send(200, b"0123456789", {"Content-Length": "1000"})
            self.close_connection = True
        elif path == "/gzip":
            self._send(200, b"\x1f\x8b fake", {"Content-Encoding": "gzip"})
        elif path == "/huge-digits":
            self._send(200, b"x", {"Content-Length": "9" * 5000})
        else:
            self._send(404, b"no such route")


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a /slow handler still sleeping must not hold up teardown

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # clients here hang up mid-response on purpose
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def server():
    httpd = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """HTTPS on 127.0.0.1 with a self-signed certificate for the name media.test: (port, cert file)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = str(tmp / "cert.pem"), str(tmp / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-subj", "/CN=media.test", "-addext", "subjectAltName=DNS:media.test",
                    "-days", "2"], check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1], cert
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def allowed(server):
    return FetchPolicy(allow_hosts=(server,), total_timeout_s=5, max_bytes=1024 * 1024)


def _fails(source: str, policy: FetchPolicy, code: str = "media_fetch") -> str:
    with pytest.raises(MediaError) as info:
        load_source_sync(source, policy)
    assert info.value.code == code, info.value
    return info.value.message


@pytest.fixture(autouse=True)
def fake_dns(monkeypatch):
    """A resolver table in place of DNS (unknown names fail like NXDOMAIN), and a guard that every
    socket the fetcher opens goes to loopback: no test can reach the network even by mistake."""
    table: dict[str, list[str]] = {}

    async def getaddrinfo(host: str, port: int) -> list[str]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]

    real_connect = httpcore.AnyIOBackend.connect_tcp

    async def loopback_only(self, host, port, *args, **kwargs):
        assert ipaddress.ip_address(host).is_loopback, f"test tried to connect to {host}"
        return await real_connect(self, host, port, *args, **kwargs)

    monkeypatch.setattr(media_fetch, "_getaddrinfo", getaddrinfo)
    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", loopback_only)
    return table


# -- address classification (no network) --

@pytest.mark.parametrize("addr, expected", [
    ("10.0.0.5", "private"), ("10.255.255.255", "private"), ("172.16.0.1", "private"),
    ("172.31.255.254", "private"), ("192.168.1.1", "private"), ("127.0.0.1", "loopback"),
    ("127.8.9.10", "loopback"), ("0.0.0.0", "unspecified"), ("169.254.169.254", "metadata"),
    ("169.254.1.1", "link-local"), ("100.64.0.1", "shared"), ("100.127.255.254", "shared"),
    ("100.100.100.200", "metadata"), ("168.63.129.16", "metadata"), ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"), ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"),
    ("::1", "loopback"), ("::", "unspecified"), ("fe80::1", "link-local"), ("fc00::1", "private"),
    ("fd12:3456::1", "private"), ("fd00:ec2::254", "metadata"), ("ff02::1", "multicast"),
    ("fec0::1", "site-local"), ("::ffff:127.0.0.1", "loopback address (IPv4-mapped 127.0.0.1)"),
    ("::ffff:10.0.0.1", "private address (IPv4-mapped 10.0.0.1)"),
    ("::ffff:169.254.169.254", "metadata address (IPv4-mapped 169.254.169.254)"),
    ("::127.0.0.1", "loopback address (IPv4-compatible"), ("::ffff:0:10.0.0.1", "private address (IPv4-translated"),
    ("64:ff9b::10.0.0.1", "private address (NAT64 10.0.0.1)"),
    ("64:ff9b::7f00:1", "loopback address (NAT64 127.0.0.1)"),
    ("2002:a00:1::1", "private address (6to4 10.0.0.1)"), ("2002:7f00:1::", "loopback address (6to4 127.0.0.1)"),
    # Teredo: server 65.54.227.120 (public), client obfuscated -> 192.168.1.1
    ("2001:0:4136:e378:8000:63bf:3f57:fefe", "private address (Teredo client 192.168.1.1)"),
    ("2001:db8::1", "private"), ("::8.8.8.8", "reserved"),
])
def test_blocked_addresses(addr, expected):
    why = address_block_reason(addr)
    assert why is not None and expected in why, (addr, why)


@pytest.mark.parametrize("addr", ["8.8.8.8", "1.1.1.1", "172.32.0.1", "100.128.0.1", "2606:4700:4700::1111",
                                  "2a00:1450:4001:80b::200e", "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1"])
def test_public_addresses_pass(addr):
    assert address_block_reason(addr) is None


@pytest.mark.parametrize("host, meant", [("2130706433", "127.0.0.1"), ("0x7f000001", "127.0.0.1"),
                                         ("0177.0.0.1", "127.0.0.1"), ("0x7f.1", "127.0.0.1"),
                                         ("127.1", "127.0.0.1"), ("012.0.0.1", "10.0.0.1"),
                                         ("167772161", "10.0.0.1"), ("127.0.0.1.", "127.0.0.1"),
                                         ("0", "0.0.0.0"), ("134744072", "8.8.8.8")])
def test_odd_ipv4_notations_refused(host, meant):
    with pytest.raises(MediaError) as info:
        literal_address(host)
    assert info.value.code == "media_fetch" and meant in info.value.message and "non-canonical" in info.value.message


def test_literal_addresses_parse():
    assert str(literal_address("10.0.0.1")) == "10.0.0.1"
    assert str(literal_address("::ffff:127.0.0.1")) == "::ffff:7f00:1"
    assert literal_address("example.com") is None and literal_address("1e100.net") is None


@pytest.mark.parametrize("url, fragment", [
    ("http://2130706433/x.png", "127.0.0.1"), ("http://0x7f.0.0.1/", "non-canonical"),
    ("http://10.0.0.1/x.png", "private"), ("http://169.254.169.254/latest/meta-data/", "metadata"),
    ("http://[::ffff:127.0.0.1]/x", "IPv4-mapped"), ("http://[fe80::1%25eth0]/", "zone"),
    ("https://[64:ff9b::a00:1]/x", "NAT64"), ("http://user:pw@example.com/x", "credentials"),
    ("ftp://example.com/x", "not accepted"), ("gopher://127.0.0.1:70/", "not accepted"),
    ("/etc/passwd", "without a URL scheme"), ("http://ex%20ample.com/", "no valid host"),
    ("http://example.com:99999/", "port"),
])
def test_urls_refused_before_any_connection(url, fragment):
    assert fragment in _fails(url, FetchPolicy())


# -- http(s) against the loopback server --

def test_default_policy_refuses_loopback(server):
    message = _fails(f"http://{server}/ok.png", FetchPolicy())
    assert "loopback" in message and "allow_hosts" in message


def test_allowlisted_loopback_fetch(server, allowed):
    outcomes: list[FetchOutcome] = []
    assert load_source_sync(f"http://{server}/ok.png", allowed, observe=outcomes.append) == PNG
    assert outcomes[0].kind == "http" and outcomes[0].nbytes == len(PNG) and outcomes[0].error_code is None


def test_async_api_gathers_fetches(server, allowed):
    async def both():
        return await asyncio.gather(*(load_source(f"http://{server}/ok.png", allowed) for _ in range(4)))
    assert asyncio.run(both()) == [PNG] * 4


def test_allowlist_port_must_match(server):
    host, port = server.split(":")
    policy = FetchPolicy(allow_hosts=(f"{host}:{int(port) + 1}",))
    assert "loopback" in _fails(f"http://{server}/ok.png", policy)


def test_deny_beats_allow(server):
    policy = FetchPolicy(allow_hosts=(server,), deny_hosts=("127.0.0.0/8",))
    assert "deny_hosts" in _fails(f"http://{server}/ok.png", policy)


def test_redirect_to_private_refused_even_from_allowlisted_host(server, allowed):
    message = _fails(f"http://{server}/redirect-private", allowed)
    assert "after 1 redirect" in message and "10.0.0.1" in message and "private" in message


def test_relative_redirect_and_chain_within_limit(server, allowed):
    assert load_source_sync(f"http://{server}/relative-redirect", allowed) == PNG
    assert load_source_sync(f"http://{server}/redirect-chain/3", allowed) == PNG


def test_redirect_chain_over_limit_and_loop(server, allowed):
    assert "too many redirects (limit 3)" in _fails(f"http://{server}/redirect-chain/4", allowed)
    assert "too many redirects (limit 3)" in _fails(f"http://{server}/redirect-loop", allowed)
    no_redirects = FetchPolicy(allow_hosts=allowed.allow_hosts, max_redirects=0)
    assert "too many redirects (limit 0)" in _fails(f"http://{server}/relative-redirect", no_redirects)


@pytest.mark.parametrize("location, fragment", [("file:///etc/passwd", "only"), ("data:,hello", "only"),
                                                ("http://2130706433/", "non-canonical"),
                                                ("http://169.254.169.254/", "metadata")])
def test_redirect_to_other_schemes_and_addresses_refused(server, allowed, location, fragment):
    assert fragment in _fails(f"http://{server}/redirect-to?{location}", allowed)


def test_https_to_http_downgrade_refused():
    with pytest.raises(MediaError, match="downgrades are refused"):
        media_fetch._redirect_target(httpx.URL("https://example.com/a"), 302, b"http://example.com/b", FetchPolicy())
    same = media_fetch._redirect_target(httpx.URL("https://example.com/a/b"), 302, b"../c?d=1", FetchPolicy())
    assert str(same) == "https://example.com/c?d=1"


def test_slow_response_times_out_quickly(server):
    policy = FetchPolicy(allow_hosts=(server,), total_timeout_s=0.5)
    start = time.monotonic()
    assert "timed out after 0.5 s" in _fails(f"http://{server}/slow", policy)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("route", ["big", "big-close"])
def test_oversized_body_stops_at_the_cap(server, allowed, route):
    start = time.monotonic()
    assert "more than the limit of 1048576 bytes" in _fails(f"http://{server}/{route}", allowed, "media_bytes")
    assert time.monotonic() - start < 3.0


def test_declared_length_over_cap_refused_unread(server, allowed):
    assert "declares 10737418240 bytes" in _fails(f"http://{server}/lying-length", allowed, "media_bytes")


def test_short_body_and_bad_responses(server, allowed):
    assert "broke the HTTP exchange" in _fails(f"http://{server}/short-body", allowed)
    assert "Content-Encoding gzip" in _fails(f"http://{server}/gzip", allowed)
    assert "404" in _fails(f"http://{server}/missing.png", allowed)
    assert _fails(f"http://{server}/huge-digits", allowed)


def _open_client_sockets(port: int) -> int:
    """Sockets of this process still open towards `port` (closed ones show inode 0 in /proc/net/tcp)."""
    count = 0
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        count += int(fields[2].split(":")[1], 16) == port and int(fields[9]) != 0
    return count


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_no_connection_left_open_after_failures(server):
    policy = FetchPolicy(allow_hosts=(server,), total_timeout_s=0.3, max_bytes=1024 * 1024)
    outcomes: list[FetchOutcome] = []
    for route in ("big", "big-close", "lying-length", "short-body", "gzip", "redirect-private", "slow", "ok.png"):
        try:
            load_source_sync(f"http://{server}/{route}", policy, observe=outcomes.append)
        except MediaError:
            pass
    assert _open_client_sockets(int(server.split(":")[1])) == 0
    assert [o.error_code for o in outcomes] == ["media_bytes"] * 3 + ["media_fetch"] * 4 + [None]


def test_closed_port_is_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with-block ends: nothing listens there
    message = _fails(f"http://127.0.0.1:{port}/x", FetchPolicy(allow_hosts=(f"127.0.0.1:{port}",)))
    assert "connection refused" in message


def test_unresolvable_names(fake_dns):
    assert "cannot resolve host nonexistent.invalid" in _fails("http://nonexistent.invalid/x.png", FetchPolicy())
    assert "cannot resolve host nowhere.test" in _fails("http://nowhere.test/x.png", FetchPolicy())


def test_names_resolving_to_private_addresses(fake_dns):
    fake_dns["internal.test"] = ["10.0.0.5"]
    fake_dns["mixed.test"] = ["8.8.8.8", "192.168.0.7"]  # one bad answer refuses the name, unconnected
    assert "internal.test resolves to a private address 10.0.0.5" in _fails("http://internal.test/", FetchPolicy())
    assert "192.168.0.7" in _fails("https://mixed.test/", FetchPolicy())
    assert "deny_hosts entry '.test'" in _fails("http://mixed.test/", FetchPolicy(deny_hosts=(".test",)))
    assert "deny_hosts entry 'mixed.test'" in _fails("http://MIXED.test./", FetchPolicy(deny_hosts=("mixed.test",)))
    assert "deny_hosts entry '192.168.0.0/16'" in _fails("http://mixed.test/",
                                                         FetchPolicy(deny_hosts=("192.168.0.0/16",)))


def test_name_connects_to_checked_address_and_keeps_host_header(server, fake_dns):
    port = server.split(":")[1]
    fake_dns["media.test"] = ["127.0.0.1"]
    assert "loopback" in _fails(f"http://media.test:{port}/echo-host", FetchPolicy())
    policy = FetchPolicy(allow_hosts=(".test",))
    assert load_source_sync(f"http://media.test:{port}/echo-host", policy) == f"media.test:{port}".encode()


def test_https_pins_the_address_but_verifies_the_name(tls_server, fake_dns):
    port, cert = tls_server
    fake_dns["media.test"] = fake_dns["other.test"] = ["127.0.0.1"]
    policy = FetchPolicy(allow_hosts=(".test",), ca_file=cert)
    # SNI, certificate check and Host header all use the name, while the socket goes to the checked address.
    assert load_source_sync(f"https://media.test:{port}/echo-host", policy) == f"media.test:{port}".encode()
    assert "TLS" in _fails(f"https://other.test:{port}/ok.png", policy)  # certificate is for media.test only
    assert "TLS" in _fails(f"https://media.test:{port}/ok.png", FetchPolicy(allow_hosts=(".test",)))  # untrusted
    downgrade = f"https://media.test:{port}/redirect-to?http://media.test:{port}/ok.png"
    assert "downgrades are refused" in _fails(downgrade, policy)


# -- data: URIs --

def test_data_uris():
    b64 = base64.b64encode(PNG).decode()
    assert load_source_sync(f"data:image/png;base64,{b64}", FetchPolicy()) == PNG
    wrapped = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
    assert load_source_sync(f"data:image/png;base64,{wrapped}", FetchPolicy()) == PNG
    assert load_source_sync("data:text/plain,hello%20world%00", FetchPolicy()) == b"hello world\x00"
    assert load_source_sync("data:,", FetchPolicy()) == b""


def test_bad_data_uris():
    assert "not valid base64" in _fails("data:image/png;base64,@@@@", FetchPolicy(), "media_corrupt")
    assert "not valid base64" in _fails("data:image/png;base64,abcde", FetchPolicy(), "media_corrupt")
    assert "no ','" in _fails("data:image/png;base64", FetchPolicy(), "media_corrupt")


def test_oversized_data_uris_refused_before_decoding():
    policy = FetchPolicy(max_bytes=1000)
    assert "decodes to 1002 bytes" in _fails("data:;base64," + "A" * 1336, policy, "media_bytes")
    assert "characters" in _fails("data:;base64," + "A" * 5000, policy, "media_bytes")
    assert "1001 bytes" in _fails("data:," + "a" * 1001, policy, "media_bytes")
    assert len(load_source_sync("data:;base64," + "A" * 1332, policy)) == 999


# -- file:// --

@pytest.fixture
def media_dir(tmp_path):
    inside, outside = tmp_path / "media", tmp_path / "secret"
    inside.mkdir()
    outside.mkdir()
    (inside / "ok.png").write_bytes(PNG)
    (inside / "big.bin").write_bytes(b"x" * 2048)
    (outside / "key.png").write_bytes(b"secret")
    (inside / "escape.png").symlink_to(outside / "key.png")
    (inside / "alias.png").symlink_to(inside / "ok.png")
    os.mkfifo(inside / "pipe")
    return inside, outside


def test_file_urls(media_dir):
    inside, outside = media_dir
    policy = FetchPolicy(file_dirs=(str(inside),), max_bytes=1024)
    assert load_source_sync(f"file://{inside}/ok.png", policy) == PNG
    assert load_source_sync(f"file://localhost{inside}/alias.png", policy) == PNG
    assert "outside" in _fails(f"file://{outside}/key.png", policy)
    assert "outside" in _fails(f"file://{inside}/escape.png", policy)  # symlink leading out
    assert "outside" in _fails(f"file://{inside}/../secret/key.png", policy)
    assert "2048 bytes" in _fails(f"file://{inside}/big.bin", policy, "media_bytes")
    assert "regular file" in _fails(f"file://{inside}/pipe", policy)  # returns at once: no hang on a FIFO
    assert "regular file" in _fails(f"file://{inside}", policy)
    assert "cannot open" in _fails(f"file://{inside}/missing.png", policy)
    assert "on this host" in _fails(f"file://otherhost{inside}/ok.png", policy)


def test_file_urls_disabled_by_default(media_dir):
    inside, _ = media_dir
    assert "disabled" in _fails(f"file://{inside}/ok.png", FetchPolicy())
    assert "not accepted" in _fails(f"file://{inside}/ok.png", FetchPolicy(file_dirs=(str(inside),),
                                                                           schemes=("http", "https")))


def test_policy_validation():
    with pytest.raises(ValueError, match="allow_hosts"):
        FetchPolicy(allow_hosts=("host:notaport",))
    with pytest.raises(ValueError, match="schemes"):
        FetchPolicy(schemes=("ftp",))
    with pytest.raises(ValueError, match="absolute"):
        FetchPolicy(file_dirs=("media",))
    assert FetchPolicy(deny_hosts=["10.0.0.0/8", "[::1]:80", ".example.com"]).deny_hosts[2] == ".example.com"


def test_redaction_masks_userinfo_secret_parameters_and_fragments():
    from stages.redact import redact_text, redact_url

    url = "https://user:p@ss@cdn.example/a.png?size=64&token=T1&X-Amz-Signature=T2&sig=T3&design=2#access_token=T4"
    assert redact_url(url) == "https://***@cdn.example/a.png?size=64&token=***&X-Amz-Signature=***&sig=***&design=2"
    line = '127.0.0.1 - "GET /v1/files/images/img_1.png?expires=9&sig=T5 HTTP/1.1" from ftp://me:pw@h/x?api_key=T6'
    assert redact_text(line) == ('127.0.0.1 - "GET /v1/files/images/img_1.png?expires=9&sig=*** HTTP/1.1" '
                                 'from ftp://***@h/x?api_key=***')
    assert redact_url("https://example.com/x?" + "a" * 300).endswith("...") and len(redact_url("x" * 300)) == 160
