"""A bounded, expiring in-memory store for `response_format=url` images.

Each image records the tenant that made it. Without API keys the unguessable id is the capability,
so GET needs no key; with keys the links are signed and expire (serve/signed_urls.py, with the
store's `signer`). Entries leave oldest-first when the count or byte budget is exceeded, and after `ttl_s`.
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
import time
from dataclasses import dataclass
from urllib.parse import quote

from starlette.responses import StreamingResponse

from serve.auth import DEFAULT_TENANT
from serve.signed_urls import UrlSigner

MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


@dataclass(frozen=True)
class StoredImage:
    data: bytes
    ext: str  # png | jpeg | webp
    expires_at: float  # time.monotonic() value
    tenant: str  # who made it: a signed link names this tenant

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.ext]


class ImageStore:
    def __init__(self, *, max_items: int = 512, max_bytes: int = 256 * 2**20, ttl_s: float = 3600.0,
                 signer: UrlSigner | None = None):
        if max_items < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError("ImageStore needs max_items >= 1, max_bytes >= 1 and ttl_s > 0")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.signer = signer or UrlSigner()  # signs the links to this store's images (a fresh secret per server)
        self._items: collections.OrderedDict[str, StoredImage] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes, ext: str, tenant: str = DEFAULT_TENANT) -> str:
        """Store one encoded image made by `tenant`; returns its file name `<id>.<ext>`."""
        if ext not in MEDIA_TYPES:
            raise ValueError(f"unknown image extension {ext!r}; expected one of {sorted(MEDIA_TYPES)}")
        image_id = f"img_{secrets.token_urlsafe(18)}"
        with self._lock:
            self._items[image_id] = StoredImage(data, ext, time.monotonic() + self.ttl_s, tenant)
            self._bytes += len(data)
            self._evict()
        return f"{image_id}.{ext}"

    def get(self, name: str) -> StoredImage | None:
        image_id, _, ext = name.rpartition(".")
        with self._lock:
            self._evict()
            item = self._items.get(image_id)
        if item is None or item.ext != ext:
            return None
        return item

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _evict(self) -> None:
        now = time.monotonic()
        while self._items:
            oldest_id, oldest = next(iter(self._items.items()))
            over = len(self._items) > self.max_items or self._bytes > self.max_bytes
            if not over and oldest.expires_at > now:
                break
            del self._items[oldest_id]
            self._bytes -= len(oldest.data)


def download_response(path, media_type: str, gone: Exception, *, filename: str | None = None) -> StreamingResponse:
    """A stored result file as a streamed reply, read from a handle opened now: a DELETE (or an expiry sweep) that
    unlinks the file while the reply is sent cannot break it (POSIX keeps an open file readable). `gone` (an
    ApiError, 404) is raised when the file is no longer there to open."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise gone from None
    headers = {"content-length": str(os.fstat(handle.fileno()).st_size)}
    if filename is not None:
        quoted = quote(filename)
        headers["content-disposition"] = (f'attachment; filename="{filename}"' if quoted == filename
                                          else f"attachment; filename*=utf-8''{quoted}")

    def chunks():
        with handle:
            while chunk := handle.read(1 << 16):
                yield chunk

    return StreamingResponse(chunks(), media_type=media_type, headers=headers)
