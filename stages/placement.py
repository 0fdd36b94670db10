"""Replicas on devices: which devices exist, moving a work item's tensors to its replica's device, and which replica
an item goes to (least loaded, sticky for a session, prefix-affine for the LLM).

A placed pool (`PoolConfig.devices`) has one stage object per replica, each holding its own copy of the weights on
its own device. Tensors cross devices only at a node's edge: the worker that takes an item moves its inputs first.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Hashable, Sequence
from typing import Any

import torch


def check_device(device: str, key: str) -> torch.device:
    """A device that exists on this machine, or a ValueError naming the config key."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{key}: {device!r} is not a device name (cpu, cuda:0, ...): {exc}") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count or count == 0:
            raise ValueError(f"{key}: {device!r} does not exist here ({count} CUDA device(s) visible)")
        return dev
    if dev.type == "mps" and torch.backends.mps.is_available():
        return dev
    raise ValueError(f"{key}: {device!r} does not exist here (devices: cpu, and {torch.cuda.device_count()} CUDA)")


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in `value` (walked as `to_device` walks it): their copy to the meta device moves
    no data and counts them."""
    return to_device(value, torch.device("meta"))[1]


def to_device(value: Any, device: torch.device) -> tuple[Any, int]:
    """`value` with every tensor in it on `device` (dicts, lists, tuples and dataclasses are walked), and the bytes
    that moved. Objects already there are returned as they are (no copy)."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value, 0
        return value.to(device), value.numel() * value.element_size()
    if isinstance(value, dict):
        moved, total = {}, 0
        for k, v in value.items():
            moved[k], n = to_device(v, device)
            total += n
        return (moved, total) if total else (value, 0)
    if isinstance(value, (list, tuple)) and not isinstance(value, str):
        parts = [to_device(v, device) for v in value]
        total = sum(n for _, n in parts)
        if not total:
            return value, 0
        items = [v for v, _ in parts]
        if isinstance(value, list):
            return items, total
        return (type(value)(*items) if hasattr(value, "_fields") else tuple(items)), total
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes, total = {}, 0
        for f in dataclasses.fields(value):
            if not f.init:
                continue
            moved, n = to_device(getattr(value, f.name), device)
            if n:
                changes[f.name], total = moved, total + n
        return (dataclasses.replace(value, **changes), total) if changes else (value, 0)
    return value, 0


class Router:
    """Which replica an item goes to. Policy only: it sees loads and keys, never tensors.

    * no key: the least loaded replica (queued plus running items);
    * a sticky key (a realtime session): the replica it went to the first time, always (its state lives there);
    * a prefix key (the LLM's first prompt block): the replica that saw it last (its KV blocks are cached there),
      unless that one holds `slack` more items than the least loaded; then the key moves.
    """

    def __init__(self, replicas: int, *, slack: int = 4, remember: int = 4096):
        self.replicas = replicas
        self.slack = slack
        self.remember = remember  # keys kept (oldest forgotten first)
        self._homes: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    def pick(self, loads: Sequence[int], key: Hashable | None = None, *, sticky: bool = False) -> int:
        least = min(range(self.replicas), key=lambda r: (loads[r], r))
        if key is None:
            return least
        with self._lock:
            home = self._homes.get(key)
            if home is None or not sticky and loads[home] > loads[least] + self.slack:
                home = least
            self._homes[key] = home
            self._homes.move_to_end(key)
            while len(self._homes) > self.remember:
                self._homes.popitem(last=False)
            return home


@dataclasses.dataclass(frozen=True)
class Affinity:
    """Where an item would rather run among a placed pool's replicas (Stage.affinity)."""

    key: Hashable  # items with equal keys go to the same replica
    sticky: bool  # True: always (state lives there: a session); False: a preference (a cached prefix)
