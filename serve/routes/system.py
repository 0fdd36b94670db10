"""/v1/models, /health, /ready, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from serve.auth import tenant_of
from serve.errors import ApiError
from serve.models import adapter_objects, model_object
from stages.events import ErrorKind, StageError

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request, tenant: str = Depends(tenant_of)) -> dict:
    """The models the caller's tenant may use (a tenants file's `models`; all without one)."""
    created = request.app.state.created
    allowed = request.app.state.tenants.get(tenant)
    models = [info for name, info in request.app.state.engine.models.items()
              if allowed is None or allowed.may_use(name)]
    return {"object": "list", "data": [model_object(info, created) for info in models]
            + adapter_objects(models, created, "chat")}


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(tenant_of)])
async def retrieve_model(model_id: str, request: Request) -> dict:
    """The model object of the list; `model_id` may hold '/' (config names such as "org/model" are allowed)."""
    engine = request.app.state.engine
    info = engine.models.get(model_id)
    if info is None:
        configured = {spec.name for spec in (*engine.config.models, *engine.config.voices)}
        if not engine.ready and model_id in configured:
            raise StageError("model_loading", f"model '{model_id}' is not loaded yet (the server is still loading "
                                              f"models); retry shortly", param="model", kind=ErrorKind.UNAVAILABLE)
        raise ApiError(404, f"The model '{model_id}' does not exist; available models: {sorted(engine.models)}",
                       param="model", code="model_not_found")
    return model_object(info, request.app.state.created)


@router.get("/health")
async def health() -> dict:
    """Alive: the process answers. Says nothing about models (that is /ready)."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 once every configured model is loaded and warmed; 503 while loading, draining or failed. On the ray
    backend, while a replica is lost and restarting: 200 with status "degraded" as long as every model keeps a live
    replica of each stage, 503 with status "down" (naming the models) when one has none. Draining (SIGTERM,
    serve/drain.py): 503 with status "draining" at once."""
    engine = request.app.state.engine
    drain = request.app.state.drain
    if drain.draining:
        return JSONResponse({"ready": False, "status": "draining", "models": list(engine.models)}, status_code=503,
                            headers={"Retry-After": str(round(drain.retry_after_s()))})
    if engine.ready:
        health = engine.health()
        down = sorted(name for name, state in health.items() if state == "down")
        if down:
            return JSONResponse({"ready": False, "status": "down", "down": down, "models": list(engine.models)},
                                status_code=503, headers={"Retry-After": "5"})
        status = "degraded" if "degraded" in health.values() else "ok"
        return JSONResponse({"ready": True, "status": status, "models": list(engine.models)})
    body = {"ready": False, "models": list(engine.models)}
    if engine.load_error:
        body["error"] = engine.load_error
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)
