"""/v1/loras: LoRA adapters loaded and unloaded while the server runs. Admin only (`MMSERVE_ADMIN_KEY`): a load
reads files on the server, and only from the model's `lora_dirs`. Loading and unloading wait for the model's
running forwards, so they run off the event loop."""

from __future__ import annotations

import asyncio
import hmac

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from pipelines.adapters import AdapterConflict, PathRefused
from pipelines.config import MAX_LORA_SCALE, LoraSpec
from serve.auth import bearer_token
from serve.errors import ApiError

router = APIRouter()
ADMIN_KEY_ENV = "MMSERVE_ADMIN_KEY"


def admin(request: Request) -> None:
    """FastAPI dependency: the caller sends the admin key (403 when the server has none: the routes are off)."""
    key = request.app.state.admin_key
    if not key:
        raise ApiError(403, f"admin endpoints are off: start the server with {ADMIN_KEY_ENV} set to an admin key",
                       code="admin_disabled")
    token = bearer_token(request)
    if token is None:
        raise ApiError(401, "You didn't provide the admin key. Send it as 'Authorization: Bearer <key>'.",
                       code="missing_api_key")
    if not hmac.compare_digest(token.encode(), key.encode()):
        raise ApiError(401, "Incorrect admin key provided.", code="invalid_admin_key")


class LoadLora(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(min_length=1)  # the base model
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    path: str = Field(min_length=1, max_length=4096)  # inside one of the model's lora_dirs (or relative to one)
    scale: float = Field(1.0, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)  # the weight of a request naming no scale


def _lora_object(model: str, entry: dict) -> dict:
    return {"object": "lora", "id": entry["name"], "model": model, **{k: v for k, v in entry.items() if k != "name"}}


@router.get("/v1/loras", dependencies=[Depends(admin)])
async def list_loras(request: Request) -> dict:
    engine = request.app.state.engine
    return {"object": "list", "data": [_lora_object(model, entry) for model, loras in engine.lora_models().items()
                                       for entry in loras.describe()]}


@router.post("/v1/loras", dependencies=[Depends(admin)])
async def load_lora(body: LoadLora, request: Request) -> dict:
    engine = request.app.state.engine
    try:
        await asyncio.to_thread(engine.load_lora, body.model, LoraSpec(body.name, body.path, body.scale))
    except AdapterConflict as exc:
        raise ApiError(409, exc.message, param=exc.param, code=exc.code) from exc
    except PathRefused as exc:
        raise ApiError(403, exc.message, param=exc.param, code=exc.code) from exc
    entry = next(e for e in engine.loras_of(body.model).describe() if e["name"] == body.name)
    return _lora_object(body.model, entry)


@router.delete("/v1/loras/{name:path}", dependencies=[Depends(admin)])
async def unload_lora(name: str, request: Request, model: str | None = None) -> dict:
    """`name`, or "base:name"; `?model=` picks the base where several models serve that name. Requests already
    running with it finish with it; new ones no longer find it."""
    engine = request.app.state.engine
    if model is None and ":" in name:
        model, name = name.rsplit(":", 1)
    if model is None:
        serving = sorted(m for m, loras in engine.lora_models().items() if name in loras.names())
        if not serving:
            raise ApiError(404, f"no model serves a LoRA named {name!r}", param="name", code="unknown_lora")
        if len(serving) > 1:
            raise ApiError(400, f"models {serving} each serve a LoRA named {name!r}: name one with ?model=",
                           param="model", code="ambiguous_lora")
        model = serving[0]
    unloaded = await asyncio.to_thread(engine.unload_lora, model, name)
    return {"object": "lora", "id": name, "model": model, "deleted": True, "unloaded": unloaded}
