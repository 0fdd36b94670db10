"""The one place where exceptions become HTTP errors, in OpenAI's error shape.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Classes (DESIGN §10): malformed input 400/404/413/422 and a bad API key 401 (as OpenAI answers
it) -> invalid_request_error; capacity 429/503 -> rate_limit_error/service_unavailable_error with
a Retry-After header; anything else -> server_error 500 (logged, details kept out of the reply).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from stages.events import ErrorKind, StageError

log = logging.getLogger(__name__)

JSON_TYPE = "application/json"
_TYPES = {429: "rate_limit_error", 499: "cancelled_error", 503: "service_unavailable_error", 504: "timeout_error"}
_DEFAULT_RETRY_AFTER_S = {429: 1.0, 503: 5.0}


class ApiError(Exception):
    """An HTTP-level refusal raised by serve/ itself (auth, multipart, upload size, file not found)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   retry_after_s: float | None = None) -> JSONResponse:
    headers = {}
    retry = retry_after_s if retry_after_s is not None else _DEFAULT_RETRY_AFTER_S.get(status)
    if retry is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry)))  # whole seconds, as HTTP asks
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status, headers=headers)


# The HTTP answer to each kind of engine error (499 is nginx's "client closed request").
HTTP_STATUS = {ErrorKind.INVALID: 400, ErrorKind.NOT_FOUND: 404, ErrorKind.TOO_LARGE: 413, ErrorKind.BUSY: 429,
               ErrorKind.CANCELLED: 499, ErrorKind.INTERNAL: 500, ErrorKind.UNAVAILABLE: 503,
               ErrorKind.DEADLINE: 504}


def http_status(error: StageError | ErrorKind | str) -> int:
    """The HTTP status an engine error (or its kind, as an event carries it) is answered with."""
    kind = error.kind if isinstance(error, StageError) else ErrorKind(error)
    return HTTP_STATUS[kind]


def stage_error_parts(exc: StageError) -> dict[str, Any]:
    """The fields of an engine error, for JSON replies and for SSE `error` events alike."""
    return dict(status=http_status(exc), message=exc.message, param=exc.param, code=exc.code)


def is_json_type(content_type: str | None) -> bool:
    """application/json or any application/*+json, parameters (charset) ignored."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == JSON_TYPE or (media.startswith("application/") and media.endswith("+json"))


def wrong_content_type_message(content_type: str | None, *, accepted: str = JSON_TYPE) -> str:
    sent = repr(content_type) if content_type else "no Content-Type header"
    return f"the request body must be sent with Content-Type: {accepted}; got {sent}"


def not_an_object_message(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
             type(None): "null"}
    return f"the request body must be a JSON object; got {kinds.get(type(value), type(value).__name__)}"


def body_error_parts(err: dict[str, Any], *, content_type: str | None, body_model: Any = None) -> dict[str, Any] | None:
    """An error about the body as a whole (pydantic loc == ("body",)), worded for what was wrong with it:
    no body (the schema's missing fields named, as for `{}`), a body FastAPI left unparsed because its
    content type is not JSON, or a JSON value other than an object. None: not such an error."""
    if tuple(err.get("loc", ())) != ("body",):
        return None
    kind = err.get("type", "")
    if kind == "missing":  # no body at all: name what `{}` would be missing
        missing = _missing_fields(body_model)
        if missing:
            return validation_error_parts(missing)
        return dict(status=400, message="the request body is empty; send a JSON object with Content-Type: "
                    f"{JSON_TYPE}", param=None, code="missing_required_parameter")
    if isinstance(err.get("input"), (bytes, bytearray)):  # FastAPI parses JSON only when the content type says so
        return dict(status=400, message=wrong_content_type_message(content_type), param=None,
                    code="invalid_content_type")
    if kind in ("model_attributes_type", "dict_type", "model_type"):
        return dict(status=400, message=not_an_object_message(err.get("input")), param=None, code="invalid_json")
    return None


def _missing_fields(body_model: Any) -> list[dict[str, Any]]:
    """The `missing` errors validating {} against `body_model` gives (none if it is not a pydantic model)."""
    if not (isinstance(body_model, type) and issubclass(body_model, BaseModel)):
        return []
    try:
        body_model.model_validate({})
    except ValidationError as e:
        return [err for err in e.errors() if err.get("type") == "missing"]
    return []


def _route_body_model(request: Request) -> Any:
    """The pydantic model the matched route declares as its body, if any."""
    field = getattr(request.scope.get("route"), "body_field", None)
    return getattr(getattr(field, "field_info", None), "annotation", None)


def request_validation_parts(request: Request, errors: list[dict[str, Any]]) -> dict[str, Any]:
    """FastAPI's validation errors for `request` -> one OpenAI error (see validation_error_parts)."""
    if errors:
        whole = body_error_parts(errors[0], content_type=request.headers.get("content-type"),
                                 body_model=_route_body_model(request))
        if whole is not None:
            return whole
    return validation_error_parts(errors)


def validation_error_parts(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Pydantic's error list -> one OpenAI error naming the first offending field (the rest in the message)."""
    messages, first_param, first_code = [], None, "invalid_value"
    for i, err in enumerate(errors):
        loc = [str(part) for part in err.get("loc", ()) if part not in ("body", "form")]
        param = ".".join(loc) or None
        kind = err.get("type", "")
        if kind == "json_invalid":
            param, code = None, "invalid_json"
            msg = "the request body is not valid JSON; send a JSON object with Content-Type: application/json"
        elif kind == "extra_forbidden":
            code, msg = "unknown_parameter", f"Unrecognized request argument supplied: {param}"
        elif kind == "missing":
            code, msg = "missing_required_parameter", f"Missing required parameter: '{param}'"
        elif kind in ("model_attributes_type", "dict_type", "model_type") and param is None:
            code, msg = "invalid_json", not_an_object_message(err.get("input"))
        else:
            code = "invalid_value"
            detail = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            msg = f"Invalid value for '{param}': {detail}"
        messages.append(msg)
        if i == 0:
            first_param, first_code = param, code
    return dict(status=400, message="; ".join(messages), param=first_param, code=first_code)


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the shapes above. Route handlers never build error replies themselves."""

    @app.exception_handler(StageError)  # RequestError and CapacityError included
    async def _stage(request: Request, exc: StageError) -> JSONResponse:
        if http_status(exc) >= 500:
            log.warning("%s %s failed: %s (%s)", request.method, request.url.path, exc.message, exc.code)
        return error_response(**stage_error_parts(exc), retry_after_s=getattr(exc, "retry_after_s", None))

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, retry_after_s=exc.retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(**request_validation_parts(request, list(exc.errors())))

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(**validation_error_parts(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, code=None)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, "The server had an error while processing your request; it has been logged.",
                              code="internal_error")
