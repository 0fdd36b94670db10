"""From a running request to what goes on the wire: JSON image lists or server-sent events.

A client that goes away cancels its request: the JSON path watches for the disconnect while it
waits, the SSE path cancels when its generator is closed or cancelled (Starlette does either
when the socket drops; serve/slow_consumers.py does when the client stops reading).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from serve.auth import tenant_of
from serve.errors import error_body, http_status, stage_error_parts
from serve.files import ImageStore
from serve.schemas import ImageParams, size_string
from serve.slow_consumers import stream_response
from stages.events import EventKind, StageError
from stages.request_state import RequestHandle, settled

_DISCONNECT_POLL_S = 0.1
_NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
             "output_tokens": 0, "total_tokens": 0}  # no token accounting for diffusion models


async def respond(request: Request, handle: RequestHandle, params: ImageParams, event_prefix: str,
                  settled_after: str | None = None):
    """The reply to an admitted image request: SSE when `stream`, else one JSON body.

    `settled_after`: a graph node whose failure is still the request's (a decode error answers 4xx, not a
    stream with an error in it): a stream starts once the request has passed it."""
    headers = {"x-request-id": handle.request_id}
    if params.stream:
        if settled_after is not None:
            await _passed(request, handle, settled_after)
        return stream_response(request, _sse(request, handle, params, event_prefix), media_type="text/event-stream",
                               headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    outputs = await result_or_cancel(request, handle)
    images, encoded = outputs["images"], outputs["encoded"]  # the graph's media_encode node
    body = {
        "created": int(time.time()),
        "data": [_image_entry(request, data, params) for data in encoded],
        "output_format": params.output_format,
        "size": size_string(images[0]),
        "seed": outputs["seed"],  # extension: the seed that reproduces this reply
    }
    return JSONResponse(body, headers=headers)


async def result_or_cancel(request: Request, handle: RequestHandle) -> dict[str, Any]:
    """The request's outputs; cancels it if the client disconnects (or this task is cancelled) first."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
    try:
        return await handle.aresult()
    finally:
        watcher.cancel()
        if not handle.done:
            handle.cancel()


async def _passed(request: Request, handle: RequestHandle, node: str) -> None:
    """Wait until the request has left `node` (a later node started, or it ended); its error there raises."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
    try:
        await settled(handle, node)
    except BaseException:
        if not handle.done:
            handle.cancel()
        raise
    finally:
        watcher.cancel()


async def _cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
    handle.cancel()


async def encode(request: Request, images: list, params: ImageParams) -> list[bytes]:
    """Stream previews (partial images), encoded in the media workers as they come."""
    encoding = params.encoding
    return await asyncio.to_thread(request.app.state.engine.encode_images, images, encoding.format,
                                   encoding.quality)


def _image_entry(request: Request, data: bytes, params: ImageParams) -> dict[str, str]:
    if not params.wants_url:
        return {"b64_json": base64.b64encode(data).decode("ascii")}
    store: ImageStore = request.app.state.image_store
    tenant = tenant_of(request)  # the route has authenticated the caller already
    name = store.put(data, params.output_format, tenant)
    url = request.url_for("get_image_file", name=name)
    if request.app.state.api_keys:  # a signed, expiring link bound to the tenant (serve/signed_urls.py)
        url = url.include_query_params(**store.signer.sign(name, tenant, store.ttl_s))
    return {"url": str(url)}


def sse(event: str, data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"event: {event}\ndata: {payload}\n\n"


async def _sse(request: Request, handle: RequestHandle, params: ImageParams, prefix: str) -> AsyncIterator[str]:
    """OpenAI's image stream (`<prefix>.partial_image`, `<prefix>.completed`) plus `<prefix>.progress`.

    prefix is "image_generation" or "image_edit". The stream ends with `data: [DONE]`.
    """
    common = {"background": params.background or "auto", "quality": params.quality or "auto",
              "output_format": params.output_format}
    partial_index = 0
    try:
        async for event in handle:
            now = int(time.time())
            if event.kind is EventKind.PROGRESS:
                yield sse(f"{prefix}.progress", {"type": f"{prefix}.progress", "request_id": handle.request_id,
                                                 "step": event.data["step"], "total": event.data["total"],
                                                 "created_at": now})
                preview = event.data.get("preview")
                if preview is not None:
                    [data] = await encode(request, [preview], params)
                    yield sse(f"{prefix}.partial_image", {
                        "type": f"{prefix}.partial_image", "b64_json": base64.b64encode(data).decode("ascii"),
                        "partial_image_index": partial_index, "size": size_string(preview), "created_at": now,
                        "request_id": handle.request_id, **common})
                    partial_index += 1
            elif event.kind is EventKind.FINAL:
                outputs = event.data["outputs"]
                for i, (image, data) in enumerate(zip(outputs["images"], outputs["encoded"], strict=True)):
                    yield sse(f"{prefix}.completed", {
                        "type": f"{prefix}.completed", "b64_json": base64.b64encode(data).decode("ascii"),
                        "size": size_string(image), "created_at": now, "usage": _NO_USAGE,
                        "request_id": handle.request_id, "image_index": i, "seed": outputs["seed"], **common})
            elif event.kind is EventKind.ERROR:
                error = StageError.from_event(event)
                yield sse("error", {"type": "error", **error_body(**stage_error_parts(error))})
        yield "data: [DONE]\n\n"
    finally:
        if not handle.done:  # the client went away mid-stream (or the server is stopping)
            handle.cancel()


def data_line(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def event_stream(handle: RequestHandle, on_delta, on_final, opening=()) -> AsyncIterator[str]:
    """The SSE body of one request: `opening` payloads, then on_delta(event data) and on_final(outputs)
    payloads as the engine streams, an engine error as `{"error": ...}` (the openai client raises it),
    and `data: [DONE]`. A client that goes away mid-stream cancels the request."""
    try:
        for payload in opening:
            yield data_line(payload)
        async for event in handle:
            if event.kind is EventKind.DELTA:
                payloads = on_delta(event.data)
            elif event.kind is EventKind.FINAL:
                payloads = on_final(event.data["outputs"])
            elif event.kind is EventKind.ERROR:
                d = event.data
                payloads = [error_body(http_status(d.get("error_kind", "internal")), d.get("message", ""),
                                       param=d.get("param"), code=d.get("code", "internal_error"))]
            else:
                continue
            for payload in payloads:
                yield data_line(payload)
        yield "data: [DONE]\n\n"
    finally:
        if not handle.done:  # the client went away mid-stream (or the server is stopping)
            handle.cancel()
