"""/v1/embeddings: parse -> cheap checks -> fetch + decode images -> engine.submit_embeddings -> encode the reply.

`input` takes OpenAI's forms (a string, a list of strings, a list of token ids, a list of
token-id lists) and, for CLIP models, image parts `{"type": "image_url", "image_url": {"url": ...}}`
as items of the list (an extension; `{"type": "text", "text": ...}` parts are accepted beside
them). `encoding_format: "base64"` sends each vector as the base64 of its little-endian float32
bytes, which the openai client decodes (and requests by default).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pipelines.embeddings import EMBEDDINGS_TASK, IMAGE_EMBEDDINGS_TASK, EmbeddingRequest, ImageInput
from pipelines.image_request import RequestError
from serve.auth import tenant_of
from serve.models import resolve_model
from serve.responses import result_or_cancel

router = APIRouter()


class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    input: Any  # required; its forms are checked by parse_input so that errors name input[i]
    model: str | None = None  # None: the first embedding model
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # upper bound: the model's width (checked by the model)
    user: str | None = None  # accepted; never a metric label


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingsBody, request: Request, tenant: str = Depends(tenant_of)):
    engine = request.app.state.engine
    task = IMAGE_EMBEDDINGS_TASK if _has_images(body.input) else EMBEDDINGS_TASK
    model = resolve_embedding_model(engine, body.model, task)
    embedder = engine.embedding_model(model)
    # 1. cheap: the input's shape, counts, sizes and `dimensions`, before anything is fetched or decoded
    inputs, single = parse_input(body.input, max_inputs=embedder.limits.max_inputs)
    job = EmbeddingRequest(inputs, dimensions=body.dimensions, tenant=tenant, single=single)
    embedder.check(job)
    # 2. images: fetched (safely) and decoded in the media workers, concurrently
    await decode_images(engine, job)
    # 3. tokenize (off the event loop) and run
    request_id = f"emb-{uuid.uuid4().hex}"
    handle = await asyncio.to_thread(engine.submit_embeddings, model, job, request_id=request_id)
    outputs = await result_or_cancel(request, handle)
    return JSONResponse(reply(outputs, model, body.encoding_format), headers={"x-request-id": request_id})


def resolve_embedding_model(engine, name: str | None, task: str = EMBEDDINGS_TASK) -> str:
    """The named model (404 if unknown, 400 if it does not embed), or the default for `task` (serve/models.py):
    EMBEDDINGS_TASK, or IMAGE_EMBEDDINGS_TASK when the input holds images."""
    return resolve_model(engine, name, task, does="make embeddings", kind="embedding model",
                         accepts=(EMBEDDINGS_TASK,))


def _has_images(value: Any) -> bool:
    """Whether `input` holds an image part (then the default model is one that embeds images)."""
    return isinstance(value, list) and any(isinstance(v, dict) and v.get("type") == "image_url" for v in value)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_input(value: Any, *, max_inputs: int) -> tuple[list[str | list[int] | ImageInput], bool]:
    """OpenAI's `input` forms -> (items in order, whether it was one input rather than a list). Raises RequestError."""
    if isinstance(value, str):
        return [value], True
    if not isinstance(value, list):
        raise RequestError("input", "input must be a string, a list of strings, a list of token ids or a list of "
                                    "token-id lists (or image parts for image models)")
    if not value:
        raise RequestError("input", "input is an empty list; send at least one item")
    if all(_is_token(t) for t in value):
        return [list(value)], True  # one input, given as token ids
    if len(value) > max_inputs:
        raise RequestError("input", f"input holds {len(value)} items; the limit is {max_inputs} per request",
                           code="too_many_inputs")
    return [_item(v, f"input[{i}]") for i, v in enumerate(value)], False


def _item(value: Any, param: str) -> str | list[int] | ImageInput:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if not value or not all(_is_token(t) for t in value):
            raise RequestError(param, f"{param} must be a non-empty list of integer token ids")
        return value
    if isinstance(value, dict):
        kind = value.get("type")
        if kind == "text" and isinstance(value.get("text"), str):
            return value["text"]
        if kind == "image_url":
            url = value.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if isinstance(url, str) and url:
                return ImageInput(url)
            raise RequestError(param, f"{param}.image_url must be {{\"url\": \"<data:, http(s):// or file:// URL>\"}}")
        raise RequestError(param, f"{param} has type {kind!r}; parts must be {{\"type\": \"text\", \"text\": ...}} or "
                                  "{\"type\": \"image_url\", \"image_url\": {\"url\": ...}}")
    raise RequestError(param, f"{param} must be a string, a list of token ids or an image part; "
                              f"got {type(value).__name__}")


async def decode_images(engine, job: EmbeddingRequest) -> None:
    """Fetch and decode every image input of `job` in place (errors name the input)."""
    async def decode(i: int, item: ImageInput) -> None:
        data = await engine.load_source(item.source, param=job.param(i))
        item.image = await asyncio.to_thread(engine.decode_image, data, param=job.param(i))

    await asyncio.gather(*(decode(i, x) for i, x in enumerate(job.inputs) if isinstance(x, ImageInput)))


def reply(outputs: dict[str, Any], model: str, encoding_format: str) -> dict[str, Any]:
    """OpenAI's list of embedding objects, vectors as floats or base64 of little-endian float32."""
    vectors: np.ndarray = outputs["embeddings"]
    if encoding_format == "base64":
        encoded = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        encoded = vectors.tolist()
    tokens = outputs["prompt_tokens"]
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
