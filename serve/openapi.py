"""The published API schema (/openapi.json), made to say what the server really answers.

FastAPI's own schema knows only what the route signatures declare: it documents every error as a
422 validation error (this server answers 400 with OpenAI's error object instead), `/metrics` as
JSON, and nothing of the bodies that routes read themselves (multipart uploads, JSON parsed by
hand) or of what they answer. `OPERATIONS` below is the truth per (method, path): the error
statuses, the 200 reply's media types and schemas, and the bodies read by hand; `build_schema`
lays it over FastAPI's schema. A route with no entry fails tests/test_openapi.py, so routes added
later stay described. 401 and the bearer security requirement come from the route itself (it
depends on `tenant_of`), 413 from its taking a body (serve/body_limit.py); 500 can come from any route.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute, iter_route_contexts
from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import models_json_schema

from serve import openapi_models as m
from serve.auth import tenant_of
from serve.routes.loras import admin
from serve.routes.speech import CONTENT_TYPES as SPEECH_TYPES
from serve.routes.videos import VideoBody

REF = "#/components/schemas/{model}"
BINARY = {"type": "string", "format": "binary"}
TEXT = {"type": "string"}
JSON = "application/json"
SSE = "text/event-stream"
Body = Union[type[BaseModel], tuple[type[BaseModel], ...], dict[str, Any]]  # a model, any of several, a schema

ERROR_DESCRIPTIONS = {
    400: "Malformed request: a field missing, unknown, of the wrong type or out of range (`param` names it), "
         "a malformed body, or a model that does not do this task",
    401: "Missing or incorrect API key (only when the server is started with --api-keys)",
    403: "With --api-keys: an image link without its signature, with a changed one, or past its expiry; admin "
         "routes: the server has no admin key, or a LoRA path outside the model's lora_dirs",
    404: "Unknown model (`model_not_found`) or no object with this id",
    409: "The object is not in a state that allows this (a video not completed yet, a LoRA name already taken)",
    413: "Request body, uploaded file or fetched media over its limit (the message names the limit)",
    422: "An Idempotency-Key reused with a different request body (`idempotency_key_reused`)",
    429: "Queue full or quota reached; retry after `Retry-After` seconds",
    500: "Internal error (logged; details kept out of the reply)",
    503: "Models still loading or the server is draining; retry after `Retry-After` seconds",
    504: "The request passed its deadline",
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}}
IDEMPOTENCY_KEY = {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"},
                   "description": "A retried request with the same key and body returns the same object"}
IMAGE_LINK = ({"name": "expires", "in": "query", "required": False, "schema": {"type": "integer"},
               "description": "Unix time the link stops working (signed links, with --api-keys)"},
              {"name": "sig", "in": "query", "required": False, "schema": {"type": "string"},
               "description": "The link's signature, as the server returned it (with --api-keys)"})


@dataclass(frozen=True)
class Operation:
    """What one route answers and reads, beyond what its signature tells FastAPI."""

    errors: tuple[int, ...]  # statuses answered with the Error object (401 and 500 are added where they apply)
    ok: dict[str, Body]  # the 200 reply: media type -> its schema (for text/event-stream: one event)
    json_body: Body | None = None  # a JSON body the route reads itself (request.json())
    form_body: type[BaseModel] | None = None  # a multipart/form-data body
    other: dict[int, tuple[str, dict[str, Body]]] = field(default_factory=dict)  # non-error replies besides 200
    parameters: tuple[dict[str, Any], ...] = ()  # headers and query parameters the route reads itself
    key_opens: bool = False  # an API key is accepted (not required) without the route depending on tenant_of


ENGINE = (400, 404, 413, 429, 503, 504)  # a request run by the engine: malformed, unknown model, limits, capacity
IMAGE_TYPES = {f"image/{fmt}": BINARY for fmt in ("png", "jpeg", "webp")}

OPERATIONS: dict[tuple[str, str], Operation] = {
    # -- system ---------------------------------------------------------------------------------
    ("GET", "/health"): Operation((), {JSON: m.Health}),
    ("GET", "/ready"): Operation((), {JSON: m.Ready}, other={503: ("Not ready: loading, draining or failed (see "
                                                                    "`error`)", {JSON: m.Ready})}),
    ("GET", "/metrics"): Operation((), {"text/plain": TEXT}),  # Prometheus text exposition format
    ("GET", "/v1/models"): Operation((), {JSON: m.ModelList}),
    ("GET", "/v1/models/{model_id}"): Operation((404, 503), {JSON: m.Model}),
    # admin (MMSERVE_ADMIN_KEY as the bearer token): LoRA adapters loaded and unloaded at run time
    ("GET", "/v1/loras"): Operation((401, 403), {JSON: m.LoraList}),
    ("POST", "/v1/loras"): Operation((400, 401, 403, 404, 409), {JSON: m.Lora}),
    ("DELETE", "/v1/loras/{name}"): Operation((400, 401, 403, 404), {JSON: m.LoraDeleted}),
    # -- text -----------------------------------------------------------------------------------
    ("POST", "/v1/chat/completions"): Operation(ENGINE, {JSON: m.ChatCompletion, SSE: m.ServerSentEvent}),
    ("POST", "/v1/completions"): Operation(ENGINE, {JSON: m.Completion, SSE: m.ServerSentEvent}),
    ("POST", "/v1/embeddings"): Operation(ENGINE, {JSON: m.EmbeddingList}),
    # -- images ---------------------------------------------------------------------------------
    ("POST", "/v1/images/generations"): Operation(ENGINE, {JSON: m.ImagesResponse, SSE: m.ServerSentEvent}),
    ("POST", "/v1/images/edits"): Operation(ENGINE, {JSON: m.ImagesResponse, SSE: m.ServerSentEvent},
                                            json_body=m.ImageEditJson, form_body=m.ImageEditForm),
    # 403: with API keys, an unsigned, changed or expired link; the owner's key opens it too (serve/signed_urls.py)
    ("GET", "/v1/files/images/{name}"): Operation((403, 404), IMAGE_TYPES, parameters=IMAGE_LINK, key_opens=True),
    # -- audio ----------------------------------------------------------------------------------
    ("POST", "/v1/audio/speech"): Operation(ENGINE, {**{t: BINARY for t in SPEECH_TYPES.values()},
                                                     SSE: m.ServerSentEvent}),
    ("GET", "/v1/audio/voices"): Operation((400, 404, 503), {JSON: m.VoiceList}),
    ("POST", "/v1/audio/transcriptions"): Operation(
        ENGINE, {JSON: (m.Transcription, m.TranscriptionVerbose), "text/plain": TEXT, "text/vtt": TEXT,
                 SSE: m.ServerSentEvent}, form_body=m.TranscriptionForm),
    ("POST", "/v1/audio/translations"): Operation(
        ENGINE, {JSON: (m.Transcription, m.TranscriptionVerbose), "text/plain": TEXT, "text/vtt": TEXT},
        form_body=m.TranslationForm),
    # -- videos (asynchronous jobs) -------------------------------------------------------------
    ("POST", "/v1/videos"): Operation((400, 404, 413, 422, 429, 503), {JSON: m.Video}, json_body=VideoBody,
                                      form_body=m.VideoForm, parameters=(IDEMPOTENCY_KEY,)),
    ("GET", "/v1/videos"): Operation((400,), {JSON: m.VideoList}),
    ("GET", "/v1/videos/{video_id}"): Operation((404,), {JSON: m.Video}),
    ("DELETE", "/v1/videos/{video_id}"): Operation((404,), {JSON: (m.Video, m.VideoDeleted)}),
    ("GET", "/v1/videos/{video_id}/content"): Operation((400, 404, 409), {"video/mp4": BINARY, "image/jpeg": BINARY}),
    # -- files and batches ----------------------------------------------------------------------
    ("POST", "/v1/files"): Operation((400, 413), {JSON: m.FileObject}, form_body=m.FileForm),
    ("GET", "/v1/files"): Operation((), {JSON: m.FileList}),
    ("GET", "/v1/files/{file_id}"): Operation((404,), {JSON: m.FileObject}),
    ("DELETE", "/v1/files/{file_id}"): Operation((404,), {JSON: m.FileDeleted}),
    ("GET", "/v1/files/{file_id}/content"): Operation((404,), {"application/jsonl": BINARY}),
    ("POST", "/v1/batches"): Operation((400, 404, 413, 422, 429), {JSON: m.Batch}, parameters=(IDEMPOTENCY_KEY,)),
    ("GET", "/v1/batches"): Operation((400,), {JSON: m.BatchList}),
    ("GET", "/v1/batches/{batch_id}"): Operation((404,), {JSON: m.Batch}),
    ("POST", "/v1/batches/{batch_id}/cancel"): Operation((404,), {JSON: m.Batch}),
}


# Request fields their models take as Any (the route checks them by hand, so errors name `messages[i]`):
# (component, property) -> the type the route accepts.
FIELD_TYPES: dict[tuple[str, str], Any] = {
    ("ChatCompletionRequest", "messages"): m.ChatMessages,
    ("CompletionRequest", "prompt"): m.Prompt,
    ("EmbeddingsBody", "input"): m.EmbeddingInput,
}


def install_openapi(app: FastAPI) -> None:
    """Serve `build_schema(app)` as /openapi.json (built once, on first request)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app)
        return app.openapi_schema

    app.openapi = openapi


def schema_routes(app: FastAPI) -> list[tuple[str, str, Any]]:
    """(method, path, route) of every operation the schema publishes (WebSocket routes are not in OpenAPI).
    The route is FastAPI's view of an APIRoute as included (its path with the router's prefix)."""
    return [(method, route.path_format, route) for route in iter_route_contexts(app.routes)
            if isinstance(route.original_route, APIRoute) and route.include_in_schema
            for method in sorted(route.methods)]


def build_schema(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})["bearerAuth"] = {
        "type": "http", "scheme": "bearer", "description": "An API key, when the server has --api-keys"}
    schemas = components.setdefault("schemas", {})
    for method, path, route in schema_routes(app):
        entry = OPERATIONS.get((method, path))
        if entry is None:  # tests/test_openapi.py fails on this; the schema still says what is sure
            entry = Operation((400,), {JSON: {}})
        admin_only = _depends_on(route, admin)
        _describe(schema["paths"][path][method.lower()], entry, needs_key=admin_only or _depends_on(route, tenant_of),
                  schemas=schemas)
        if admin_only:  # the admin key, always
            schema["paths"][path][method.lower()]["security"] = [{"bearerAuth": []}]
    for (component, name), annotation in FIELD_TYPES.items():
        properties = schemas.get(component, {}).get("properties", {})
        if name not in properties:
            raise ValueError(f"serve/openapi.py FIELD_TYPES names {component}.{name}, which the schema does not have")
        properties[name] = {**_type_schema(annotation, schemas), "title": properties[name].get("title", name)}
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body: this server never sends it
        schemas.pop(unused, None)
    return schema


def _describe(op: dict[str, Any], entry: Operation, *, needs_key: bool, schemas: dict[str, Any]) -> None:
    def ref(body: Body) -> dict[str, Any]:
        return _schema_ref(body, schemas)

    takes_body = entry.json_body is not None or entry.form_body is not None or "requestBody" in op
    # 401: the route asks for the tenant; 413: serve/body_limit.py refuses any body over its limit; 500: anywhere
    errors = sorted({*entry.errors, 500, *((401,) if needs_key else ()), *((413,) if takes_body else ())})
    responses: dict[str, Any] = {"200": {"description": "Success",
                                         "content": {t: {"schema": ref(b)} for t, b in entry.ok.items()}}}
    for status, (description, content) in entry.other.items():
        responses[str(status)] = {"description": description,
                                  "content": {t: {"schema": ref(b)} for t, b in content.items()}}
    for status in errors:
        responses[str(status)] = {"description": ERROR_DESCRIPTIONS[status],
                                  "content": {JSON: {"schema": ref(m.Error)}},
                                  **({"headers": RETRY_AFTER} if status in (429, 503) else {})}
    op["responses"] = responses
    if needs_key or entry.key_opens:
        op["security"] = [{"bearerAuth": []}, {}]  # {}: a server without --api-keys (or a signed link) needs none
    if entry.parameters:
        op["parameters"] = [*op.get("parameters", ()), *entry.parameters]
    content = {}
    if entry.json_body is not None:
        content[JSON] = {"schema": ref(entry.json_body)}
    if entry.form_body is not None:
        content["multipart/form-data"] = {"schema": ref(entry.form_body)}
    if content:
        op["requestBody"] = {"required": True, "content": content}


def _schema_ref(body: Body, schemas: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema for `body`; pydantic models land in components.schemas (with what they reference)."""
    if isinstance(body, dict):
        return body
    models = body if isinstance(body, tuple) else (body,)
    keys = [(model, "validation") for model in models]
    refs, top = models_json_schema(keys, ref_template=REF)
    for name, definition in top.get("$defs", {}).items():
        schemas.setdefault(name, definition)
    return refs[keys[0]] if len(keys) == 1 else {"anyOf": [refs[key] for key in keys]}


def _type_schema(annotation: Any, schemas: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a type; the models it names land in components.schemas."""
    schema = TypeAdapter(annotation).json_schema(ref_template=REF)
    for name, definition in schema.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    return schema


def _depends_on(route, dependency) -> bool:
    """Whether `dependency` is anywhere in the route's dependency tree."""
    pending = list(route.dependant.dependencies)
    while pending:
        dep = pending.pop()
        if dep.call is dependency:
            return True
        pending.extend(dep.dependencies)
    return False
