"""/v1/models, /health, /ready, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from serve.auth import tenant_of

router = APIRouter()


@router.get("/v1/models", dependencies=[Depends(tenant_of)])
async def list_models(request: Request) -> dict:
    engine = request.app.state.engine
    created = request.app.state.created
    return {"object": "list", "data": [
        {"id": info.id, "object": "model", "created": created, "owned_by": "mmserve",
         "family": info.family, "tasks": list(info.tasks),
         **({"voices": list(info.voices)} if info.voices else {})}  # text-to-speech models
        for info in engine.models.values()]}


@router.get("/health")
async def health() -> dict:
    """Alive: the process answers. Says nothing about models (that is /ready)."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 once every configured model is loaded and warmed; 503 while loading, draining or failed."""
    engine = request.app.state.engine
    if engine.ready:
        return JSONResponse({"ready": True, "models": list(engine.models)})
    body = {"ready": False, "models": list(engine.models)}
    if engine.load_error:
        body["error"] = engine.load_error
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)
