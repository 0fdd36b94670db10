"""Which model a request runs on: the one it names, or the default for its task; and the model object.

The default rule (pipelines/model_default.py; one rule for every route, and the README says the same):

    A request that names no `model` runs on the first served model, in configuration order, that
    does the request's task and has real weights. A random-weight model (a demo or test checkpoint:
    real code path, noise out) is the default only when no real-weight model does the task.

Random weights are data on the model (ModelInfo.random_weights): the demo builders say it of their
checkpoints (pipelines/demo/__init__.py), a `[[models]]` entry may say it with `random_weights = true`, and
`/v1/models` shows it. A named model is used as named: 404 `model_not_found` when it is not served,
400 `unsupported_task` when it does not do the task. While models are loading, a request that names
none, or names one not loaded yet, gets 503 `model_loading` (a default picked then could be a
random-weight model whose real-weight sibling is still loading).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipelines.image_request import ModelNotFound, RequestError
from pipelines.model_default import default_model
from stages.events import ErrorKind, StageError


def resolve_model(engine, name: str | None, task: str, *, does: str, kind: str, accepts: tuple[str, ...] = (),
                  hint: Callable[[Any], str] | None = None) -> str:
    """The model id a request runs on. `task`: what the request does (picks the default); `accepts`: the tasks a
    named model may have instead (default: `task` alone); `does`/`kind` word the errors ("make speech",
    "text-to-speech model"); `hint(info)` adds to the unsupported_task message. Raises RequestError/StageError."""
    models = engine.models
    if (name is None or name not in models) and not engine.ready:
        message = ("models are still loading; retry shortly" if name is None else
                   f"model '{name}' is not loaded yet (the server is still loading models); retry shortly")
        raise StageError("model_loading", message, param="model", kind=ErrorKind.UNAVAILABLE)
    if name is None:
        name = default_model(models, task)
        if name is None:
            raise ModelNotFound(f"no {kind} is loaded (no model does {task}); models: {sorted(models)}")
        return name
    info = models.get(name)
    if info is None:
        raise ModelNotFound(f"The model '{name}' does not exist; available models: {sorted(models)}")
    if not set(accepts or (task,)) & set(info.tasks):
        extra = hint(info) if hint is not None else ""
        raise RequestError("model", f"model '{name}' does not {does}{extra}; it does {list(info.tasks)}",
                           code="unsupported_task")
    return name


def model_object(info, created: int) -> dict[str, Any]:
    """One entry of /v1/models, and GET /v1/models/{id}: OpenAI's model object plus family, tasks,
    random_weights, execution ("stage-graph", or "pipeline": a diffusers pipeline's own __call__), (text-to-speech and
    voice models) voices, (models serving LoRAs) adapters and (diffusion models) quantization and resident_bytes."""
    return {"id": info.id, "object": "model", "created": created, "owned_by": "mmserve", "family": info.family,
            "tasks": list(info.tasks), "random_weights": info.random_weights, "execution": info.execution,
            **({"voices": list(info.voices)} if info.voices else {}),
            **({"adapters": list(info.adapters)} if info.adapters else {}),
            **({"quantization": dict(info.quantization)} if info.quantization else {}),
            **({"resident_bytes": info.resident_bytes} if info.resident_bytes is not None else {})}


def adapter_id(engine, name: str | None) -> tuple[str, str] | None:
    """(base model, adapter) when `name` is "base:adapter" (vLLM's convention) for a served model with that LoRA
    adapter and no model of that very name; else None."""
    if name is None or name in engine.models or ":" not in name:
        return None
    base, adapter = name.rsplit(":", 1)
    info = engine.models.get(base)
    return (base, adapter) if info is not None and adapter in info.adapters else None


def adapter_objects(models, created: int, task: str) -> list[dict[str, Any]]:
    """The "base:adapter" model ids of the models doing `task` with LoRA adapters, each naming its `parent`."""
    return [{**model_object(info, created), "id": f"{info.id}:{adapter}", "parent": info.id}
            for info in models if task in info.tasks for adapter in info.adapters]
