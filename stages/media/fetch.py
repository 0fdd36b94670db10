"""Safe fetching of media sources: `data:` URIs, `http(s)://` URLs and allowed `file://` paths.

Runs in the API process, not in the media workers: it only moves bytes, which still go to a
worker to be decoded. A URL in a request asks us to make a network call from inside our
network (SSRF), so every hop is checked: the host is resolved, every address it resolves to
must be public unless the host is allowlisted, and the socket connects to the very address
that was checked, so a second DNS answer cannot swap in 127.0.0.1 (DNS rebinding). Bodies are
capped while they stream and never decompressed here.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import re
import socket
import ssl
import stat
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

import httpcore
import httpx

from stages.media.address import HOST_NAME, IPAddress, address_block_reason, listed_in, literal_address, split_entry
from stages.media.image import MediaError
from stages.redact import redact_loggers, redact_text, redact_url

_SCHEMES = ("data", "http", "https", "file")
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_MAX_URL_CHARS = 8192  # longer http/file sources are refused unread; data: URIs are capped by max_bytes
# identity: a compressed body would be expanded past the byte cap by whoever decompressed it.
_HEADERS = [(b"Accept", b"*/*"), (b"Accept-Encoding", b"identity"), (b"User-Agent", b"mmserve-media-fetch")]
# httpcore's loggers (its DEBUG trace prints response headers, a redirect's Location included)
_HTTP_TRACE_LOGGERS = ("httpcore.connection", "httpcore.http11", "httpcore.http2", "httpcore.proxy",
                       "httpcore.socks")
_NETWORK_ERRORS = (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError,
                   httpcore.UnsupportedProtocol)


@dataclass(frozen=True)
class FetchPolicy:
    max_bytes: int = 50 * 1024 * 1024  # body size cap, enforced while the body streams
    connect_timeout_s: float = 5.0  # DNS lookup, and TCP + TLS connect per address
    total_timeout_s: float = 30.0  # whole http(s) fetch, redirects included
    max_redirects: int = 3  # redirects followed; one more is refused
    allow_hosts: tuple[str, ...] = ()  # "host", "host:port", "[v6]:port", ".domain", CIDR: skip the address check
    deny_hosts: tuple[str, ...] = ()  # same forms, also matched against resolved addresses; checked first
    file_dirs: tuple[str, ...] = ()  # absolute directories file:// may read from; empty = file:// refused
    schemes: tuple[str, ...] = _SCHEMES  # source kinds accepted
    ca_file: str | None = None  # PEM bundle https trusts instead of certifi's (an internal media server's CA)

    def __post_init__(self):
        for name in ("allow_hosts", "deny_hosts", "file_dirs", "schemes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))  # lists from a config file
        if self.max_bytes <= 0:
            raise ValueError(f"FetchPolicy.max_bytes must be > 0, got {self.max_bytes}")
        if self.connect_timeout_s <= 0 or self.total_timeout_s <= 0:
            raise ValueError(f"FetchPolicy timeouts must be > 0 s, got connect_timeout_s={self.connect_timeout_s}, "
                             f"total_timeout_s={self.total_timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"FetchPolicy.max_redirects must be >= 0, got {self.max_redirects}")
        unknown = [s for s in self.schemes if s not in _SCHEMES]
        if unknown:
            raise ValueError(f"FetchPolicy.schemes has unknown {unknown}; known: {list(_SCHEMES)}")
        for name in ("allow_hosts", "deny_hosts"):
            for entry in getattr(self, name):
                try:
                    split_entry(entry)
                except ValueError:
                    raise ValueError(f"FetchPolicy.{name} entry {entry!r} is not 'host', 'host:port', "
                                     f"'[ipv6]:port', '.domain' or an address/CIDR") from None
        relative = [d for d in self.file_dirs if not os.path.isabs(d)]
        if relative:
            raise ValueError(f"FetchPolicy.file_dirs must be absolute paths, got {relative}")
        if self.ca_file is not None and not os.path.isfile(self.ca_file):
            raise ValueError(f"FetchPolicy.ca_file {self.ca_file!r} is not a file")


@dataclass(frozen=True)
class FetchOutcome:
    """One load_source call, for metrics: the caller counts fetches, bytes and failures by kind."""

    kind: str  # "data", "http", "https", "file", or "other" for a refused scheme
    nbytes: int  # bytes returned; 0 on failure
    seconds: float  # wall time of the call
    error_code: str | None  # MediaError code on failure, None on success


async def load_source(source: str, policy: FetchPolicy, *,
                      observe: Callable[[FetchOutcome], None] | None = None) -> bytes:
    """The bytes a media source names: a data: URI, an http(s):// URL or an allowed file:// URL.

    Raises MediaError "media_fetch" when the source is refused or cannot be read, "media_bytes"
    when it holds more than policy.max_bytes, "media_corrupt" for a malformed data: URI.
    `observe`, if given, is called once with the outcome (success or MediaError).
    """
    redact_loggers(*_HTTP_TRACE_LOGGERS)  # a Location with credentials must not reach a log line either
    start = time.perf_counter()
    scheme = _scheme(source)
    kind = scheme if scheme in _SCHEMES else "other"  # a metric label must not take user text
    try:
        data = await _load(source, scheme, policy)
    except MediaError as exc:
        if observe is not None:
            observe(FetchOutcome(kind, 0, time.perf_counter() - start, exc.code))
        raise
    if observe is not None:
        observe(FetchOutcome(kind, len(data), time.perf_counter() - start, None))
    return data


def load_source_sync(source: str, policy: FetchPolicy, *,
                     observe: Callable[[FetchOutcome], None] | None = None) -> bytes:
    """load_source for code without an event loop (CLI, scripts); not callable inside a running loop."""
    return asyncio.run(load_source(source, policy, observe=observe))


async def _getaddrinfo(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (tests replace this to stay off the network)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]  # the host of an IPv4 or IPv6 sockaddr


async def _checked_addresses(host: str, port: int, policy: FetchPolicy) -> list[IPAddress]:
    """Resolve `host` once and apply deny list, allow list and the address check to every answer."""
    denied = listed_in(policy.deny_hosts, host, port, [])
    if denied:
        raise MediaError("media_fetch", f"host {host} is refused by deny_hosts entry {denied!r}")
    literal = literal_address(host)
    if literal is not None:
        addrs = [literal]
    elif host == "invalid" or host.endswith(".invalid"):  # RFC 6761: never resolves, so never ask DNS
        raise MediaError("media_fetch", f"cannot resolve host {host}: names under .invalid never resolve")
    else:
        try:
            async with asyncio.timeout(policy.connect_timeout_s):
                found = await _getaddrinfo(host, port)
        except socket.gaierror as exc:
            raise MediaError("media_fetch", f"cannot resolve host {host}: {exc.strerror}") from None
        except TimeoutError:
            raise MediaError("media_fetch", f"resolving host {host} timed out after "
                                            f"{policy.connect_timeout_s:g} s") from None
        addrs = list(dict.fromkeys(ipaddress.ip_address(a.split("%")[0]) for a in found))
        if not addrs:
            raise MediaError("media_fetch", f"cannot resolve host {host}: no addresses")
    denied = listed_in(policy.deny_hosts, host, port, addrs)
    if denied:
        raise MediaError("media_fetch", f"host {host} resolves into deny_hosts entry {denied!r}")
    if listed_in(policy.allow_hosts, host, port, [literal] if literal else []):
        return addrs
    for addr in addrs:  # one bad answer refuses the host: we cannot know which one a retry would get
        why = address_block_reason(addr)
        if why:
            said = f"host {host} is {why}" if literal else f"host {host} resolves to {why} {addr}"
            entry = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise MediaError("media_fetch", f"{said}; only public addresses are fetched "
                                            f"(allow_hosts can admit '{entry}')")
    return addrs


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network layer, connecting only to addresses that passed the policy.

    httpcore still sends the URL's host as Host and as TLS SNI and verifies the certificate
    against it; only the socket's destination is pinned to the checked address.
    """

    def __init__(self, policy: FetchPolicy):
        self._policy = policy
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None, socket_options=None) -> httpcore.AsyncNetworkStream:
        failure: Exception | None = None
        for addr in await _checked_addresses(host, port, self._policy):
            try:
                return await self._inner.connect_tcp(str(addr), port, timeout=timeout, local_address=local_address,
                                                     socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc  # try the next checked address, as a resolver-driven client would
        assert failure is not None
        raise failure

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


async def _load(source: str, scheme: str, policy: FetchPolicy) -> bytes:
    if scheme not in policy.schemes:
        shown = f"{scheme}: sources are" if scheme else "sources without a URL scheme are"
        raise MediaError("media_fetch", f"{shown} not accepted; accepted: "
                                        f"{[s + ':' for s in policy.schemes]}")
    if scheme == "data":
        return _decode_data_uri(source, policy.max_bytes)
    if len(source) > _MAX_URL_CHARS:
        raise MediaError("media_fetch", f"URL is {len(source)} characters; the limit is {_MAX_URL_CHARS}")
    if scheme == "file":
        return await asyncio.to_thread(_read_file, source, policy)
    try:
        async with asyncio.timeout(policy.total_timeout_s):
            return await _fetch_http(source, policy)
    except TimeoutError:
        raise MediaError("media_fetch", f"timed out after {policy.total_timeout_s:g} s fetching "
                                        f"{redact_url(source)}") from None


def _scheme(source: str) -> str:
    match = re.match(r"([a-zA-Z][a-zA-Z0-9+.-]*):", source)
    return match.group(1).lower() if match else ""


def _decode_data_uri(source: str, max_bytes: int) -> bytes:
    header, comma, payload = source[len("data:"):].partition(",")
    if not comma:
        raise MediaError("media_corrupt", "data: URI has no ',' before its payload; the form is "
                                          "data:[<type>][;base64],<data>")
    if len(payload) > 4 * max_bytes:  # more than any encoding of max_bytes needs: refuse unread
        raise MediaError("media_bytes", f"data: URI payload is {len(payload)} characters, more than any "
                                        f"encoding of the {max_bytes}-byte limit")
    if header.split(";")[-1].strip().lower() != "base64":
        if len(payload) > 3 * max_bytes:
            raise MediaError("media_bytes", f"data: URI payload is {len(payload)} characters; "
                                            f"the limit is {max_bytes} bytes")
        data = urllib.parse.unquote_to_bytes(payload)  # at most as long as the text: safe to decode
        if len(data) > max_bytes:
            raise MediaError("media_bytes", f"data: URI holds {len(data)} bytes; the limit is {max_bytes} bytes")
        return data
    text = "".join(payload.split())  # MIME-style line breaks
    text = urllib.parse.unquote(text) if "%" in text else text  # base64 escaped once more as a URL
    size = len(text) // 4 * 3 - text[-2:].count("=")  # exact for valid base64
    if size > max_bytes:
        raise MediaError("media_bytes", f"data: URI decodes to {size} bytes; the limit is {max_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError("media_corrupt", f"data: URI payload is not valid base64: {exc}") from None


def _read_file(source: str, policy: FetchPolicy) -> bytes:
    if not policy.file_dirs:
        raise MediaError("media_fetch", "file:// sources are disabled; list the directories they may read "
                                        "in file_dirs")
    parts = urllib.parse.urlsplit(source)
    path = urllib.parse.unquote(parts.path)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment or not path.startswith("/") \
            or "\x00" in path:
        raise MediaError("media_fetch", f"{redact_url(source)} is not a file:///absolute/path URL on this host")
    real = os.path.realpath(path)  # every symlink resolved, so a link cannot lead out of the directory
    if not any(os.path.commonpath([real, root]) == root for root in map(os.path.realpath, policy.file_dirs)):
        raise MediaError("media_fetch", f"{path} is outside the directories file:// may read (file_dirs), "
                                        f"with symlinks resolved")
    try:
        # O_NOFOLLOW: a symlink swapped in after realpath is not followed; O_NONBLOCK: a FIFO cannot hang us.
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise MediaError("media_fetch", f"cannot open {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a directory, or a device such as /dev/zero that never ends
            raise MediaError("media_fetch", f"{path} is not a regular file")
        if info.st_size > policy.max_bytes:
            raise MediaError("media_bytes", f"{path} is {info.st_size} bytes; the limit is {policy.max_bytes} bytes")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(policy.max_bytes + 1)  # the file may have grown since fstat
    except OSError as exc:
        raise MediaError("media_fetch", f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > policy.max_bytes:
        raise MediaError("media_bytes", f"{path} grew past the limit of {policy.max_bytes} bytes while read")
    return data


def _parse_http_url(text: str, policy: FetchPolicy) -> httpx.URL:
    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, ValueError) as exc:
        raise MediaError("media_fetch", f"{redact_url(text)} is not a valid URL: {redact_text(str(exc))}") from None
    if url.scheme not in ("http", "https") or url.scheme not in policy.schemes:
        network = [s for s in policy.schemes if s in _DEFAULT_PORTS]
        raise MediaError("media_fetch", f"{redact_url(text)}: only {network} URLs are fetched over the network")
    if url.userinfo:
        raise MediaError("media_fetch", f"{redact_url(text)} carries credentials (user:password@); not fetched")
    host = url.raw_host.decode("ascii")  # IDNA-encoded, IPv6 without brackets
    if not host or (":" not in host and not HOST_NAME.fullmatch(host)):
        raise MediaError("media_fetch", f"{redact_url(text)} has no valid host name")
    if url.port is not None and not 0 < url.port < 65536:
        raise MediaError("media_fetch", f"{redact_url(text)} has port {url.port}; ports are 1..65535")
    literal_address(host)  # refuses odd numeric hosts before anything is resolved
    return url


async def _fetch_http(text: str, policy: FetchPolicy) -> bytes:
    url = _parse_http_url(text, policy)
    # One pool per fetch: connections never outlive the policy check made for them.
    ssl_context = ssl.create_default_context(cafile=policy.ca_file) if policy.ca_file else None  # None: certifi
    async with httpcore.AsyncConnectionPool(ssl_context=ssl_context, network_backend=_CheckedBackend(policy),
                                            retries=0) as pool:
        for hop in range(policy.max_redirects + 1):
            try:
                result = await _request_once(pool, url, policy)
            except MediaError as exc:
                if hop == 0:
                    raise
                raise MediaError(exc.code, f"after {hop} redirect(s), at {redact_url(str(url))}: "
                                           f"{exc.message}") from None
            if isinstance(result, bytes):
                return result
            url = result
    raise MediaError("media_fetch", f"too many redirects (limit {policy.max_redirects}) from {redact_url(text)}")


async def _request_once(pool: httpcore.AsyncConnectionPool, url: httpx.URL, policy: FetchPolicy) -> bytes | httpx.URL:
    """GET one URL: its body (capped), or the next URL when it redirects."""
    target = httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path)
    timeouts = {"connect": policy.connect_timeout_s, "read": policy.total_timeout_s,
                "write": policy.total_timeout_s, "pool": policy.total_timeout_s}
    try:
        # The context closes the response (and its connection, if unread) on every exit path.
        async with pool.stream(b"GET", target, headers=[(b"Host", url.netloc), *_HEADERS],
                               extensions={"timeout": timeouts}) as response:
            headers = {k.lower(): v for k, v in response.headers}
            if response.status in _REDIRECTS:
                return _redirect_target(url, response.status, headers.get(b"location"), policy)
            if response.status != 200:
                phrase = response.extensions.get("reason_phrase", b"").decode("latin-1")
                raise MediaError("media_fetch", f"{redact_url(str(url))} answered {response.status} {phrase}; "
                                                f"expected 200")
            return await _read_capped(response, headers, url, policy.max_bytes)
    except _NETWORK_ERRORS as exc:
        raise _network_error(exc, url, policy) from None


def _redirect_target(url: httpx.URL, status: int, location: bytes | None, policy: FetchPolicy) -> httpx.URL:
    if not location:
        raise MediaError("media_fetch", f"{redact_url(str(url))} answered {status} without a Location header")
    try:
        target = url.join(location.decode("latin-1"))  # relative Locations resolve against this URL
    except (httpx.InvalidURL, ValueError) as exc:
        raise MediaError("media_fetch", f"{redact_url(str(url))} redirects to an invalid URL: "
                                        f"{redact_text(str(exc))}") from None
    if url.scheme == "https" and target.scheme == "http":
        raise MediaError("media_fetch", f"{redact_url(str(url))} redirects from https to http "
                                        f"({redact_url(str(target))}); downgrades are refused")
    try:
        return _parse_http_url(str(target), policy)
    except MediaError as exc:
        raise MediaError(exc.code, f"{redact_url(str(url))} redirects to {exc.message}") from None


async def _read_capped(response: httpcore.Response, headers: dict[bytes, bytes], url: httpx.URL,
                       max_bytes: int) -> bytes:
    encoding = headers.get(b"content-encoding", b"identity").strip().lower()
    if encoding != b"identity":
        raise MediaError("media_fetch", f"{redact_url(str(url))} sent Content-Encoding {encoding.decode('latin-1')}; "
                                        f"only identity is accepted (nothing is decompressed here)")
    declared = headers.get(b"content-length", b"").strip()
    if declared.isdigit() and int(declared) > max_bytes:  # refuse before reading a byte
        raise MediaError("media_bytes", f"{redact_url(str(url))} declares {int(declared)} bytes; the limit is "
                                        f"{max_bytes} bytes")
    body = bytearray()
    async for chunk in response.aiter_stream():  # counted as it arrives: Content-Length may lie or be absent
        body += chunk
        if len(body) > max_bytes:
            raise MediaError("media_bytes", f"{redact_url(str(url))} sent more than the limit of {max_bytes} bytes")
    return bytes(body)


def _network_error(exc: Exception, url: httpx.URL, policy: FetchPolicy) -> MediaError:
    where = url.netloc.decode("ascii") + ("" if url.port else f":{_DEFAULT_PORTS[url.scheme]}")
    if isinstance(exc, httpcore.ConnectTimeout):
        message = f"connecting to {where} timed out after {policy.connect_timeout_s:g} s"
    elif isinstance(exc, httpcore.TimeoutException):
        message = f"timed out after {policy.total_timeout_s:g} s waiting for {where}"
    elif isinstance(exc, httpcore.ConnectError):
        message = f"cannot connect to {where}: {_root_cause(exc)}"
    elif isinstance(exc, httpcore.RemoteProtocolError):
        message = f"{where} broke the HTTP exchange: {redact_text(str(exc))}"
    else:
        message = f"connection to {where} failed: {_root_cause(exc)}"
    return MediaError("media_fetch", message)


def _root_cause(exc: BaseException) -> str:
    """'connection refused', 'TLS: certificate has expired', ...: the innermost OS or TLS reason."""
    seen: BaseException | None = exc
    for _ in range(8):  # cause chains are short; the bound guards against cycles
        if seen is None:
            break
        if isinstance(seen, ssl.SSLError):
            return f"TLS: {getattr(seen, 'verify_message', None) or seen.reason or seen}"
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno).lower()
        seen = seen.__cause__ or seen.__context__
    return redact_text(str(exc)) or type(exc).__name__
