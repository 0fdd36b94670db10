"""/v1/chat/completions and /v1/completions: parse -> engine.submit_chat -> encode the reply.

Errors are mapped in serve/errors.py. A client that goes away cancels its request: the JSON path
watches for the disconnect while it waits (serve.responses.result_or_cancel), the SSE path cancels
when Starlette cancels or closes its generator; the llm stage drops the request at its next step.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from pipelines.chat import ChatRequest
from pipelines.served import SPOKEN_CHAT_TASK
from serve.auth import tenant_of
from serve.models import adapter_id, resolve_model
from serve.responses import event_stream, result_or_cancel
from serve.routes.speech import _encode_file
from serve.schemas_chat import (
    SPOKEN_FORMATS,
    ChatCompletionRequest,
    ChatReply,
    CompletionReply,
    CompletionRequest,
    SpokenChatReply,
    TextReply,
)
from serve.slow_consumers import stream_response
from stages.request_state import RequestHandle

router = APIRouter()
CHAT_TASK = "chat"  # ModelInfo.tasks of a causal LM
AUDIO_TTL_S = 3600  # message.audio.expires_at: we keep no audio for follow-up turns; the client holds it


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request, tenant: str = Depends(tenant_of)):
    engine = request.app.state.engine
    model, adapter = resolve_chat_model(engine, body.model)
    speech = body.speech_output(model, SPOKEN_CHAT_TASK in engine.models[model].tasks)
    params = body.sampling_params()  # the model checks its token ids against the vocabulary, once
    audio = {"id": f"audio_{uuid.uuid4().hex}", "expires_at": int(time.time()) + AUDIO_TTL_S}
    spoken_stream = speech is not None and body.stream
    tools = body.tool_spec()
    reply = (SpokenChatReply if spoken_stream else ChatReply)(
        f"chatcmpl-{uuid.uuid4().hex}", body.model or model, engine.chat_model(model).token_texts(), params,
        include_usage=body.include_usage, tools=tools,
        **({"audio_id": audio["id"], "expires_at": audio["expires_at"]} if spoken_stream else {}))
    # Image and video parts are fetched and decoded (media workers) before the request is admitted.
    handle = await engine.asubmit_chat(model, ChatRequest(messages=body.messages, params=params, tenant=tenant,
                                                          speech=speech, lora=body.lora_entries(adapter), tools=tools,
                                                          stream=body.stream or speech is not None),
                                       request_id=reply.id)
    if speech is None or body.stream:
        return await respond(request, handle, reply, stream=body.stream)
    outputs = await result_or_cancel(request, handle)
    data = await asyncio.to_thread(_encode_file, engine, outputs["audio"].numpy(), outputs["sample_rate"],
                                   SPOKEN_FORMATS[body.audio_format])
    payload = reply.body(outputs)
    message = payload["choices"][0]["message"]
    # OpenAI's shape: the words are the audio's transcript, the content null.
    message["audio"] = {**audio, "data": base64.b64encode(data).decode(), "transcript": message["content"]}
    message["content"] = None
    return JSONResponse(payload, headers={"x-request-id": handle.request_id})


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, tenant: str = Depends(tenant_of)):
    engine = request.app.state.engine
    prompt = body.prompt_fields()  # one prompt, or a list: they run together, choice k * n + j is prompt k's
    model, adapter = resolve_chat_model(engine, body.model)
    params = body.sampling_params()
    reply = CompletionReply(f"cmpl-{uuid.uuid4().hex}", body.model or model, engine.chat_model(model).token_texts(),
                            params, include_usage=body.include_usage)
    handle = engine.submit_chat(model, ChatRequest(**prompt, params=params, tenant=tenant,
                                                   lora=body.lora_entries(adapter), stream=body.stream),
                                request_id=reply.id)
    return await respond(request, handle, reply, stream=body.stream)


def resolve_chat_model(engine, name: str | None) -> tuple[str, str | None]:
    """(the model, the LoRA adapter its id names): the named model (404 if unknown, 400 if it does not chat; a
    "base:adapter" id names the base and one of its adapters), or the default chat model (serve/models.py)."""
    named = adapter_id(engine, name)
    if named is not None:
        return resolve_model(engine, named[0], CHAT_TASK, does="chat", kind="chat model"), named[1]
    return resolve_model(engine, name, CHAT_TASK, does="chat", kind="chat model"), None


async def respond(request: Request, handle: RequestHandle, reply: TextReply, *, stream: bool):
    """SSE chunks when `stream`, else one JSON object."""
    headers = {"x-request-id": handle.request_id}
    if stream:
        return stream_response(request, _sse(handle, reply), media_type="text/event-stream",
                               headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    outputs = await result_or_cancel(request, handle)
    return JSONResponse(reply.body(outputs), headers=headers)


def _sse(handle: RequestHandle, reply: TextReply) -> AsyncIterator[str]:
    """OpenAI's chunk stream: opening chunks, one per text delta, finish chunks, usage; then `data: [DONE]`."""
    def delta(data: dict[str, Any]) -> list[dict[str, Any]]:
        chunk = reply.delta(data)
        return [] if chunk is None else [chunk]

    return event_stream(handle, delta, reply.closing, reply.opening())
