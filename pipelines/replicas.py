"""The stage objects of a model's pools: shared by the replicas, or (a placed pool) one per replica on its device.

A placed replica gets its own copy of the weights: the served model is loaded once more for each (device, copy)
slot a placed pool names, with that device as the model's device, and the replica runs that load's stage. The
first load (the model's own device) also answers the model's checks and warm-up. Every slot loads the whole
checkpoint (a denoise replica's copy holds a text encoder it never runs): loading one stage's components alone
is not done yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pipelines.config import ModelSpec
from stages.pool import PoolConfig
from stages.stage import Stage


def placed_stages(spec: ModelSpec, served: Any, load: Callable[[ModelSpec], Any]
                  ) -> list[tuple[str, Stage | list[Stage], PoolConfig]]:
    """(pool name, stage or one stage per replica, pool config) of every pool of `served`; `load(spec)` loads
    the model again on `spec.device` (only for placed pools)."""
    slots: dict[tuple[str, int], Any] = {}

    def copy_on(device: str, n: int) -> Any:
        if (device, n) not in slots:
            slots[(device, n)] = load(dataclasses.replace(spec, device=device))
        return slots[(device, n)]

    pools: list[tuple[str, Stage | list[Stage], PoolConfig]] = []
    for i, (kind, stage, default) in enumerate(served.stages()):
        config = spec.pool(kind, default)
        if not config.devices:
            pools.append((f"{spec.name}/{kind}", stage, config))
            continue
        stages: list[Stage] = []
        for r, device in enumerate(config.devices):
            n = config.devices[:r].count(device)  # the n-th replica on this device gets the n-th copy there
            stages.append(copy_on(device, n).stages()[i][1])
        pools.append((f"{spec.name}/{kind}", stages, config))
    return pools
