"""/v1/images/*: parse -> engine.submit_image -> encode the reply. Errors are mapped in serve/errors.py."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pipelines.image_request import Task
from serve.auth import tenant_of
from serve.models import resolve_model
from serve.responses import respond
from serve.schemas import ImageEditRequest, ImageGenerationRequest
from serve.signed_urls import check_image_access, image_not_found
from serve.uploads import fetch_sources, read_edit_form, read_edit_json

router = APIRouter()


@router.post("/v1/images/generations")
async def create_image(body: ImageGenerationRequest, request: Request, tenant: str = Depends(tenant_of)):
    engine = request.app.state.engine
    model = resolve_image_model(engine, body.model, Task.TEXT_TO_IMAGE)
    handle = engine.submit_image(model, body.image_request(task=Task.TEXT_TO_IMAGE, tenant=tenant))
    return await respond(request, handle, body, "image_generation")


@router.post("/v1/images/edits")
async def edit_image(request: Request, tenant: str = Depends(tenant_of)):
    engine = request.app.state.engine
    # 1. cheap: the form (or JSON with image references), its text fields, the model, every numeric field
    max_images = engine.config.limits.max_images  # the models that edit several take up to this many
    if request.headers.get("content-type", "").startswith("application/json"):
        upload = await read_edit_json(request, max_images=max_images)
    else:
        upload = await read_edit_form(request, max_file_bytes=request.app.state.max_upload_bytes,
                                      max_images=max_images)
    params = ImageEditRequest.model_validate(upload.fields)
    task = Task.INPAINTING if upload.mask is not None else Task.IMAGE_TO_IMAGE
    model = resolve_image_model(engine, params.model, task)
    edit = params.image_request(task=task, tenant=tenant, strength=params.strength)
    edit.uploaded_images = len(upload.image) if isinstance(upload.image, tuple) else 1
    engine.check_image(model, edit)  # every field, before any fetch or decode
    # 2. fetch referenced images (safely); the graph decodes them (media_decode), edits and encodes
    edit.source = await fetch_sources(engine, upload)
    handle = engine.submit_image(model, edit)
    return await respond(request, handle, params, "image_edit", settled_after="media_decode")


@router.get("/v1/files/images/{name}", name="get_image_file")
async def get_image_file(name: str, request: Request) -> Response:
    """Images returned with response_format=url. Without API keys the unguessable name is the capability;
    with keys the link must carry its signature (or the owner's key): serve/signed_urls.py."""
    item = request.app.state.image_store.get(name)
    if item is None:
        raise image_not_found(name, request.app.state.image_store.ttl_s)
    check_image_access(request, name, item.tenant)
    return Response(item.data, media_type=item.media_type, headers={"Cache-Control": "private, max-age=3600"})


def resolve_image_model(engine, name: str | None, task: Task) -> str:
    """The named model (404 if unknown, 400 if it cannot do `task`), or the default for `task` (serve/models.py)."""
    return resolve_model(engine, name, task.value, does=f"do {task.value}", kind=f"{task.value} model")
