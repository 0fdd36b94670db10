"""The default-model rule: which served model runs a request that names none.

    Among the served models that do the request's task, the first in configuration order whose
    weights are real; a random-weight model (a demo or test checkpoint: real code path, noise out)
    only when no real-weight model does the task.

ModelInfo.random_weights carries what the demo builders (pipelines/demo/__init__.py) or the config say. The
REST routes (serve/models.py) and the realtime video sessions (realtime/video/models.py) all pick
their defaults here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def default_model(models: Mapping[str, Any], task: str) -> str | None:
    """The rule over ModelInfos in configuration order: the first real-weight model that does `task`, else the
    first random-weight one; None when no model does it."""
    doing = [info for info in models.values() if task in info.tasks]
    real = [info for info in doing if not info.random_weights]
    return (real or doing)[0].id if doing else None
