"""Signed, expiring links to `response_format=url` images, for servers with API keys.

Without API keys (demo mode) an image link is `/v1/files/images/<name>`: the unguessable name is
the capability, as before. With keys, every link carries `?expires=<unix time>&sig=<HMAC>`, as
OpenAI's own image links do: it works as given (a browser, an `<img>` tag, curl) with no API key,
until it expires; a link without a valid signature is refused. The signature is an HMAC-SHA256,
under a secret drawn when the server starts, of the image name, its owner's tenant and the expiry,
so neither the name nor the time can be changed and a link only opens what its tenant made. The
owner's API key (`Authorization: Bearer ...`) opens the bare link as well; another tenant's key
opens nothing (the image "does not exist" for it).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from fastapi import Request

from serve.auth import bearer_token, tenant_for_key
from serve.errors import ApiError

EXPIRES_PARAM = "expires"  # unix time after which the link stops working
SIG_PARAM = "sig"  # hex HMAC-SHA256 (first 128 bits) of name, tenant and expiry; masked in logs (stages/redact.py)


class UrlSigner:
    """Signs and checks (name, tenant, expiry) with one per-server secret."""

    def __init__(self, secret: bytes | None = None):
        self._secret = secrets.token_bytes(32) if secret is None else secret
        if len(self._secret) < 16:
            raise ValueError(f"UrlSigner needs a secret of at least 16 bytes, got {len(self._secret)}")

    def signature(self, name: str, tenant: str, expires: int) -> str:
        message = f"{name}\n{tenant}\n{expires}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:32]

    def sign(self, name: str, tenant: str, ttl_s: float, *, now: float | None = None) -> dict[str, str]:
        """The query parameters of a link to `name` for `tenant`, valid for `ttl_s` seconds."""
        expires = int((time.time() if now is None else now) + ttl_s)
        return {EXPIRES_PARAM: str(expires), SIG_PARAM: self.signature(name, tenant, expires)}

    def refusal(self, name: str, tenant: str, expires: str | None, sig: str | None, *,
                now: float | None = None) -> str | None:
        """None when the link is valid; else why not: "unsigned", "invalid" or "expired"."""
        if not expires and not sig:
            return "unsigned"
        if not expires or not expires.isdigit() or not sig:
            return "invalid"
        if not hmac.compare_digest(self.signature(name, tenant, int(expires)).encode(), sig.encode()):
            return "invalid"  # checked before the time: a changed expiry is a bad signature, not an early one
        return "expired" if int(expires) < (time.time() if now is None else now) else None


def image_not_found(name: str, ttl_s: float) -> ApiError:
    return ApiError(404, f"image {name!r} does not exist or has expired (images are kept for {int(ttl_s)} s)",
                    param="name", code="file_not_found")


def check_image_access(request: Request, name: str, owner: str) -> None:
    """Raises the refusal for a GET of image `name` (owned by `owner`) when API keys are on; no-op without keys."""
    keys: dict[str, str] = request.app.state.api_keys
    if not keys:
        return
    signer: UrlSigner = request.app.state.image_store.signer
    why = signer.refusal(name, owner, request.query_params.get(EXPIRES_PARAM), request.query_params.get(SIG_PARAM))
    if why is None:
        return
    token = bearer_token(request)
    caller = tenant_for_key(keys, token) if token else None
    if caller == owner:
        return
    if caller is not None:  # another tenant's key: the answer is the one for a name that does not exist
        raise image_not_found(name, request.app.state.image_store.ttl_s)
    if why == "expired":
        raise ApiError(403, f"this image link expired at {request.query_params.get(EXPIRES_PARAM)} (unix time); "
                            f"links last {int(request.app.state.image_store.ttl_s)} s", code="url_expired")
    if why == "invalid":
        raise ApiError(403, f"this image link's signature does not match ({EXPIRES_PARAM} and {SIG_PARAM} must be "
                            f"exactly as the server returned them)", code="invalid_signature")
    raise ApiError(403, f"image links need the {EXPIRES_PARAM} and {SIG_PARAM} query parameters the server returned "
                        f"with them, or the owner's API key", code="unsigned_url")

