"""JSON request bodies: the content type, the empty body and the object check, worded the same on every route.

FastAPI parses the bodies of routes that declare a pydantic model and serve/errors.py words its
refusals; the routes that read their body themselves (videos and image edits, which also take
multipart) call `read_json_object`, which words them the same way.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from serve.errors import JSON_TYPE, ApiError, is_json_type, not_an_object_message, wrong_content_type_message


async def read_json_object(request: Request, *, accepted: str = JSON_TYPE) -> dict[str, Any]:
    """The body as a dict. An empty body reads as {} (so the schema names the missing fields); a body sent
    with another content type, invalid JSON or a JSON value other than an object is a 400 saying which."""
    content_type = request.headers.get("content-type")
    raw = await request.body()
    if not raw.strip():
        return {}
    if content_type is not None and not is_json_type(content_type):
        raise ApiError(400, wrong_content_type_message(content_type, accepted=accepted), code="invalid_content_type")
    try:
        body = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, not_an_object_message(body), code="invalid_json")
    return body
