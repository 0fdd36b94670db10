"""Which network addresses and hosts a media fetch may reach (the SSRF checks of stages/media/fetch.py).

An address is refused when it is loopback, private, link-local, multicast, unspecified, reserved,
shared (carrier-grade NAT) or a cloud metadata service, including IPv6 forms that carry such an
IPv4 address. Hosts written as odd IPv4 notations are refused outright.
"""

from __future__ import annotations

import ipaddress
import re
import socket

from stages.media.image import MediaError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Instance-metadata services. Most are link-local or private anyway; listing them names them in
# the error and catches those that are not (Azure's WireServer is a public address).
_METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle
    "169.254.170.2",  # AWS ECS task credentials
    "100.100.100.200",  # Alibaba Cloud
    "168.63.129.16",  # Azure WireServer
    "fd00:ec2::254",  # AWS over IPv6
    "fd20:ce::254",  # GCP over IPv6
))
_SHARED_V4 = ipaddress.IPv4Network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # well-known NAT64 prefix: the last 32 bits are IPv4
_FLAGS = (("is_loopback", "a loopback address"), ("is_unspecified", "an unspecified address"),
          ("is_link_local", "a link-local address"), ("is_multicast", "a multicast address"),
          ("is_reserved", "a reserved address"), ("is_site_local", "a site-local address"),
          ("is_private", "a private address"))
# Hosts made only of numbers and dots: C resolvers read "2130706433", "0x7f.1" or "017.0.0.1" as IPs.
_NUMERIC_HOST = re.compile(r"(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+))*\.?")
HOST_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")


def address_block_reason(addr: IPAddress | str) -> str | None:
    """Why a connection to `addr` is refused ("a private address", ...), or None for a public one.

    IPv6 forms that carry an IPv4 address (mapped, NAT64, 6to4, Teredo, compatible, translated)
    are judged by the IPv4 address they lead to.
    """
    addr = ipaddress.ip_address(addr) if isinstance(addr, str) else addr
    if addr in _METADATA:
        return "a cloud metadata address"
    if addr.version == 4 and addr in _SHARED_V4:
        return "a shared (carrier-grade NAT) address"
    if addr.version == 6:
        embedded = _embedded_ipv4(addr)
        for form, inner in embedded:
            why = address_block_reason(inner)
            if why:
                return f"{why} ({form} {inner})"
        if embedded and embedded[0][0] in ("IPv4-mapped", "NAT64", "6to4", "Teredo server"):
            return None  # a public IPv4 address reached through a routable IPv6 form
    for flag, why in _FLAGS:
        if getattr(addr, flag, False):
            return why
    return None if addr.is_global else "a non-global address"


def literal_address(host: str) -> IPAddress | None:
    """The address a URL host spells literally, or None for a DNS name.

    IPv4 in any form but dotted decimal ("2130706433", "0x7f.1", "0177.0.0.1", "127.1") is
    refused: resolvers disagree on what it means, which is how filters get bypassed.
    """
    if "%" in host:
        raise MediaError("media_fetch", f"host {host!r} carries an IPv6 zone or escape; not fetched")
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host)
        except ValueError:
            raise MediaError("media_fetch", f"host {host!r} is not a valid IPv6 address") from None
    if not _NUMERIC_HOST.fullmatch(host.lower()):
        return None
    try:
        return ipaddress.IPv4Address(host)
    except ValueError:
        pass
    try:
        meant = f" (C resolvers read it as {socket.inet_ntoa(socket.inet_aton(host.rstrip('.')))})"
    except OSError:
        meant = ""
    raise MediaError("media_fetch", f"host {host!r} is an IPv4 address in non-canonical notation{meant}; "
                                    f"write addresses in dotted decimal")


def _embedded_ipv4(addr: ipaddress.IPv6Address) -> list[tuple[str, ipaddress.IPv4Address]]:
    value = int(addr)
    if addr.ipv4_mapped is not None:
        return [("IPv4-mapped", addr.ipv4_mapped)]
    if addr in _NAT64:
        return [("NAT64", ipaddress.IPv4Address(value & 0xFFFFFFFF))]
    if addr.sixtofour is not None:
        return [("6to4", addr.sixtofour)]
    if addr.teredo is not None:
        server, client = addr.teredo
        return [("Teredo server", server), ("Teredo client", client)]
    if value >> 32 == 0xFFFF0000:  # ::ffff:0:a.b.c.d (SIIT translated)
        return [("IPv4-translated", ipaddress.IPv4Address(value & 0xFFFFFFFF))]
    if value >> 32 == 0 and value > 1:  # ::a.b.c.d (deprecated IPv4-compatible)
        return [("IPv4-compatible", ipaddress.IPv4Address(value))]
    return []


def split_entry(entry: str) -> tuple[str, int | None]:
    """'host', 'host:port', '[v6]:port', '.domain', 'v6' or CIDR -> (lower-case host, port or None)."""
    text, port = entry.strip().lower(), None
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = int(rest.removeprefix(":")) if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        port = int(port_text)
    else:
        host = text
    host = host.rstrip(".") if len(host) > 1 else host
    if not host or host == "." or (port is not None and not 0 < port < 65536):
        raise ValueError(entry)
    return host, port


def listed_in(entries: tuple[str, ...], host: str, port: int, addrs: list[IPAddress]) -> str | None:
    """The first entry matching host:port by name, subdomain or (for address/CIDR entries) address."""
    host = host.lower().rstrip(".")  # "EXAMPLE.com." is example.com: no bypass by spelling
    for entry in entries:
        name, entry_port = split_entry(entry)
        if entry_port is not None and entry_port != port:
            continue
        if host == name or (name.startswith(".") and (host.endswith(name) or host == name[1:])):
            return entry
        try:
            net = ipaddress.ip_network(name, strict=False)
        except ValueError:
            continue
        if any(a.version == net.version and a in net for a in addrs):
            return entry
    return None
