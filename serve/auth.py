"""API keys -> tenants. The tenant enters every cache identity and quota (DESIGN §7, §10)."""

from __future__ import annotations

import hmac
import json
import tomllib
from pathlib import Path

from fastapi import Request

from serve.errors import ApiError

DEFAULT_TENANT = "default"  # without configured keys (demo mode) everyone shares this namespace


def load_api_keys(path: str | Path) -> dict[str, str]:
    """Read an API-keys file: a mapping of key -> tenant, as TOML (`*.toml`) or JSON (anything else).

    JSON: {"sk-alice-123": "alice", "sk-bob-456": "bob"}
    TOML: "sk-alice-123" = "alice"
    """
    path = Path(path)
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"API keys file {path}: cannot parse it ({e}); expected a mapping of key -> tenant") from e
    if not isinstance(data, dict) or not data:
        raise ValueError(f"API keys file {path}: expected a non-empty mapping of key -> tenant")
    for key, tenant in data.items():
        if not isinstance(tenant, str) or not tenant or not key:
            raise ValueError(f"API keys file {path}: every entry must map a non-empty key to a non-empty tenant name; "
                             f"got {key!r} -> {tenant!r}")
    return dict(data)


def tenant_of(request: Request) -> str:
    """FastAPI dependency: the caller's tenant, or 401 when keys are configured and this one is not among them."""
    keys: dict[str, str] | None = request.app.state.api_keys
    if not keys:
        return DEFAULT_TENANT
    token = bearer_token(request)
    if not token:
        raise ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                       code="missing_api_key")
    tenant = tenant_for_key(keys, token)
    if tenant is None:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    return tenant


def bearer_token(request: Request) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def tenant_for_key(keys: dict[str, str], token: str) -> str | None:
    """The tenant `token` belongs to, or None."""
    for key, tenant in keys.items():
        if hmac.compare_digest(key.encode(), token.encode()):  # constant time: no key-guessing side channel
            return tenant
    return None
