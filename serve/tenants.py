"""Tenants and their quotas: the tenants file, token buckets, and the `x-ratelimit-*` headers (OpenAI's).

The tenants file is TOML with one table per tenant (unset limits are unlimited):

    [[tenants]]
    name = "alice"
    keys = ["sk-alice-1", "sk-alice-2"]
    requests_per_min = 600
    concurrent = 8                 # HTTP requests in flight plus realtime sessions
    images_per_min = 120           # images asked for (`n`), generations and edits
    video_seconds_per_min = 60     # seconds of video asked for (`seconds`, else num_frames / fps, else 4)
    tokens_per_min = 200000        # chat, completions, embeddings: prompt characters / 4 plus max_tokens (else 256)
    models = ["sd-demo", "llama-demo"]   # unset: every model
    priority = "high"              # "high", "normal" (default) or "low": the order stage queues take items in

The older key file (a mapping key -> tenant, JSON or TOML) keeps working: its tenants have no limits.
"""

from __future__ import annotations

import json
import math
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRIORITY_CLASSES = {"high": 0, "normal": 1, "low": 2}  # class -> rank: lower ranks are taken first
LIMIT_FIELDS = ("requests_per_min", "concurrent", "images_per_min", "video_seconds_per_min", "tokens_per_min")
UNIT_LIMITS = ("images_per_min", "video_seconds_per_min", "tokens_per_min")  # buckets charged by the request's size


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: tuple[str, ...] = ()  # bearer keys that act as this tenant
    requests_per_min: int | None = None  # None: unlimited (as every limit below)
    concurrent: int | None = None  # HTTP requests in flight plus open realtime sessions
    images_per_min: int | None = None
    video_seconds_per_min: int | None = None
    tokens_per_min: int | None = None
    models: tuple[str, ...] | None = None  # the models it may use; None: all
    priority: str = "normal"  # a PRIORITY_CLASSES name

    def __post_init__(self):
        where = f"tenant {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"every tenant needs a non-empty `name`, got {self.name!r}")
        if isinstance(self.keys, str) or not all(isinstance(k, str) and k for k in self.keys):
            raise ValueError(f"{where}: keys must be a list of non-empty strings, got {self.keys!r}")
        object.__setattr__(self, "keys", tuple(self.keys))
        for name in LIMIT_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{where}: {name} must be a whole number >= 1 (or unset: unlimited), got {value!r}")
        if self.models is not None:
            if isinstance(self.models, str) or not all(isinstance(m, str) and m for m in self.models):
                raise ValueError(f"{where}: models must be a list of model names, got {self.models!r}")
            object.__setattr__(self, "models", tuple(self.models))
        if self.priority not in PRIORITY_CLASSES:
            raise ValueError(f"{where}: priority must be one of {list(PRIORITY_CLASSES)}, got {self.priority!r}")

    @property
    def rank(self) -> int:
        """The priority class as stage queues order it (stages/pool.py): 0 first."""
        return PRIORITY_CLASSES[self.priority]

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(frozen=True)
class Tenants:
    """The configured tenants; `keys` maps each bearer key to its tenant's name (serve/auth.py, serve/ws.py)."""

    tenants: dict[str, Tenant] = field(default_factory=dict)

    @property
    def keys(self) -> dict[str, str]:
        return {key: t.name for t in self.tenants.values() for key in t.keys}

    def get(self, name: str) -> Tenant | None:
        return self.tenants.get(name)

    @classmethod
    def from_keys(cls, keys: dict[str, str]) -> Tenants:
        """Tenants without limits from a mapping key -> tenant (the older key file)."""
        grouped: dict[str, list[str]] = {}
        for key, name in keys.items():
            grouped.setdefault(name, []).append(key)
        return cls({name: Tenant(name=name, keys=tuple(k)) for name, k in grouped.items()})


def load_tenants(path: str | Path) -> Tenants:
    """Read a tenants file (TOML `[[tenants]]`) or an older key file (a mapping key -> tenant, JSON or TOML)."""
    path = Path(path)
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"tenants file {path}: cannot parse it ({e}); expected [[tenants]] tables (TOML) or a "
                         f"mapping of key -> tenant") from e
    if isinstance(data, dict) and "tenants" in data and isinstance(data["tenants"], list):
        return _tenant_tables(path, data)
    from serve.auth import load_api_keys  # the older format: its own checks and messages

    return Tenants.from_keys(load_api_keys(path))


def _tenant_tables(path: Path, data: dict[str, Any]) -> Tenants:
    extra = sorted(set(data) - {"tenants"})
    if extra:
        raise ValueError(f"tenants file {path}: unknown top-level keys {extra}; only [[tenants]] tables belong here")
    allowed = {"name", "keys", "models", "priority", *LIMIT_FIELDS}
    tenants: dict[str, Tenant] = {}
    seen_keys: set[str] = set()
    for i, table in enumerate(data["tenants"]):
        unknown = sorted(set(table) - allowed)
        if unknown:
            raise ValueError(f"tenants file {path}: [[tenants]] #{i + 1} has unknown keys {unknown}; "
                             f"allowed: {sorted(allowed)}")
        try:
            tenant = Tenant(**table)
        except (TypeError, ValueError) as e:
            raise ValueError(f"tenants file {path}: [[tenants]] #{i + 1}: {e}") from None
        if tenant.name in tenants:
            raise ValueError(f"tenants file {path}: tenant {tenant.name!r} is listed twice")
        if not tenant.keys:
            raise ValueError(f"tenants file {path}: tenant {tenant.name!r} needs at least one key in `keys`")
        if seen_keys & set(tenant.keys):
            raise ValueError(f"tenants file {path}: tenant {tenant.name!r} reuses a key of another tenant")
        seen_keys.update(tenant.keys)
        tenants[tenant.name] = tenant
    if not tenants:
        raise ValueError(f"tenants file {path}: no [[tenants]] tables")
    return Tenants(tenants)


class TokenBucket:
    """`per_min` units a minute, refilled continuously, holding at most `per_min` (a burst of one minute's worth)."""

    def __init__(self, per_min: int, clock: Callable[[], float] = time.monotonic):
        self.capacity = float(per_min)
        self.rate = per_min / 60.0  # units per second
        self.clock = clock
        self._level = self.capacity
        self._at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now

    def take(self, units: float) -> bool:
        """Take `units` if the bucket holds them; a request larger than the whole bucket can never pass."""
        self._refill()
        if units <= self._level:
            self._level -= units
            return True
        return False

    def remaining(self) -> int:
        self._refill()
        return math.floor(self._level)

    def wait_s(self, units: float) -> float:
        """Seconds until `units` are in the bucket (inf when more than it holds)."""
        self._refill()
        if units > self.capacity:
            return math.inf
        return max(0.0, (units - self._level) / self.rate)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's `x-ratelimit-reset-*`)."""
        return self.wait_s(self.capacity)


def duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1s", "6m0s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    return f"{whole // 60}m{whole % 60}s" if whole >= 60 else f"{whole}s"


@dataclass
class Refusal:
    """Why a request may not be admitted now."""

    limit: str  # the exceeded quota (requests_per_min, concurrent, images_per_min, ...)
    message: str
    retry_after_s: float


class TenantLimiter:
    """One tenant's buckets and its count of requests in flight; thread-safe (batch lines call in from the loop,
    tests from threads)."""

    def __init__(self, tenant: Tenant, clock: Callable[[], float] = time.monotonic):
        self.tenant = tenant
        self.buckets = {name: TokenBucket(getattr(tenant, name), clock) for name in
                        ("requests_per_min", *UNIT_LIMITS) if getattr(tenant, name) is not None}
        self.in_flight = 0
        self._lock = threading.Lock()

    def admit(self, units: dict[str, float]) -> Refusal | None:
        """Take one request (and its `units`, bucket name -> amount) or say which limit refuses it; all or nothing."""
        wanted = {"requests_per_min": 1.0, **units}
        with self._lock:
            limit = self.tenant.concurrent
            if limit is not None and self.in_flight >= limit:
                return Refusal("concurrent", f"tenant {self.tenant.name!r} has {limit} requests in flight (its "
                                             f"concurrent limit); retry when one finishes", 1.0)
            for name, amount in wanted.items():
                bucket = self.buckets.get(name)
                if bucket is not None and bucket.wait_s(amount) > 0:
                    return self._over(name, bucket, amount)
            for name, amount in wanted.items():
                if name in self.buckets:
                    self.buckets[name].take(amount)
            self.in_flight += 1
            return None

    def _over(self, name: str, bucket: TokenBucket, amount: float) -> Refusal:
        wait = bucket.wait_s(amount)
        what = name.removesuffix("_per_min").replace("_", " ")
        if math.isinf(wait):
            return Refusal(name, f"this request asks for {amount:g} {what}, more than tenant {self.tenant.name!r} "
                                 f"may use in a minute ({name} = {bucket.capacity:g}); ask for less", 60.0)
        return Refusal(name, f"Rate limit reached for tenant {self.tenant.name!r} on {what} per min: limit "
                             f"{bucket.capacity:g}, remaining {bucket.remaining()}, requested {amount:g}; retry in "
                             f"{duration(wait)}", wait)

    def release(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def headers(self, tokens: bool) -> list[tuple[bytes, bytes]]:
        """`x-ratelimit-{limit,remaining,reset}-requests` (and `-tokens` when `tokens`), for the limits it has."""
        out: list[tuple[bytes, bytes]] = []
        with self._lock:
            for suffix, name in (("requests", "requests_per_min"), ("tokens", "tokens_per_min")):
                bucket = self.buckets.get(name)
                if bucket is None or (suffix == "tokens" and not tokens):
                    continue
                for header, value in (("limit", f"{bucket.capacity:g}"), ("remaining", str(bucket.remaining())),
                                      ("reset", duration(bucket.reset_s()))):
                    out.append((f"x-ratelimit-{header}-{suffix}".encode(), value.encode()))
        return out
