"""/v1/audio/speech and /v1/audio/voices: parse -> engine.submit_speech -> encode the audio.

Three ways back, as the request's `stream_format` says:
* absent — the whole file, once synthesised, encoded in a media worker process (complete
  headers: WAV and FLAC lengths, MP3 gapless info).
* "audio" — the encoded stream over chunked transfer: each phrase is encoded as it arrives
  (AudioStreamEncoder, in this process: it keeps codec state between chunks). Lengths a
  muxer would write at the end are absent (a streamed WAV declares an unknown length).
* "sse" — OpenAI's events: `speech.audio.delta` ({"audio": base64 of the encoded bytes}) per
  chunk, then `speech.audio.done` with usage.

`pcm` is raw s16le mono at 24 kHz, as OpenAI sends it (the model's audio is resampled); every
other format carries the model's own sample rate in its header. The rate is also sent as the
`x-sample-rate` header. Extensions: `seed` (default 0: the same request gives the same audio).
A streamed request whose synthesis fails before any audio answers with an HTTP error; after
audio has gone out, an "audio" stream just ends and an SSE stream sends an `error` event.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from pipelines.image_request import RequestError
from pipelines.tts import SPEECH_TASK, SpeechRequest
from serve.auth import tenant_of
from serve.errors import error_body, stage_error_parts
from serve.models import resolve_model
from serve.responses import result_or_cancel, sse
from serve.slow_consumers import stream_response
from stages.events import ErrorKind, Event, EventKind, StageError
from stages.media.audio_encode import ENCODE_FORMATS, AudioStreamEncoder
from stages.media.image import MediaError
from stages.request_state import RequestHandle

log = logging.getLogger(__name__)
router = APIRouter()

PCM_RATE = 24_000  # OpenAI's pcm: 24 kHz, 16-bit signed little-endian, mono, no header
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
                 "wav": "audio/wav", "pcm": "audio/pcm"}
assert set(CONTENT_TYPES) == set(ENCODE_FORMATS)
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class VoiceRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str  # OpenAI's custom-voice form {"id": ...}: here, one of the model's voice names


class SpeechBody(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    input: str  # 1..4096 characters (checked by the model, so the error names the limit)
    model: str | None = None  # None: the first text-to-speech model
    voice: str | VoiceRef | None = None  # None: the model's first voice
    response_format: str = "mp3"  # one of CONTENT_TYPES (checked here, so the error lists them)
    speed: float = 1.0  # 0.25..4.0
    stream_format: Literal["audio", "sse"] | None = None  # None: the whole file at once
    instructions: str | None = None  # accepted and ignored: no served model takes style instructions
    seed: int = 0  # extension: seeds sampling (VITS noise, SpeechT5 prenet dropout)


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechBody, request: Request, tenant: str = Depends(tenant_of)):
    engine = request.app.state.engine
    model = resolve_speech_model(engine, body.model)
    speech = engine.speech_model(model)
    fmt = body.response_format
    if fmt not in CONTENT_TYPES:
        raise RequestError("response_format", f"response_format {fmt!r} is not supported; use one of "
                                              f"{list(CONTENT_TYPES)}", code="unsupported_format")
    voice = body.voice.id if isinstance(body.voice, VoiceRef) else body.voice
    rate = PCM_RATE if fmt == "pcm" else speech.sample_rate
    job = SpeechRequest(body.input, voice=voice, speed=body.speed, seed=body.seed, tenant=tenant,
                        sample_rate=rate if rate != speech.sample_rate else None)
    request_id = f"speech-{uuid.uuid4().hex}"
    # Splitting and tokenizing 4096 characters is cheap but not free: off the event loop.
    handle = await asyncio.to_thread(engine.submit_speech, model, job, request_id=request_id)
    headers = {"x-request-id": request_id, "x-sample-rate": str(rate)}
    if body.stream_format is None:
        outputs = await result_or_cancel(request, handle)
        data = await asyncio.to_thread(_encode_file, engine, outputs["audio"], rate, fmt)
        return Response(data, media_type=CONTENT_TYPES[fmt], headers=headers)
    events = handle.__aiter__()
    first = await _first_output(request, handle, events)  # an error before any audio is still an HTTP error
    if body.stream_format == "sse":
        return stream_response(request, _sse(handle, events, first, fmt, rate), media_type="text/event-stream",
                               headers=headers | _STREAM_HEADERS)
    return stream_response(request, _audio(handle, events, first, fmt, rate), media_type=CONTENT_TYPES[fmt],
                           headers=headers | _STREAM_HEADERS)


@router.get("/v1/audio/voices")
async def list_voices(request: Request, model: str | None = None, tenant: str = Depends(tenant_of)) -> dict:
    """The voices of one text-to-speech model (`?model=`), or of all of them."""
    engine = request.app.state.engine
    names = [resolve_speech_model(engine, model)] if model is not None else \
        [m for m, info in engine.models.items() if SPEECH_TASK in info.tasks]
    return {"object": "list", "data": [{"id": voice, "object": "voice", "model": name}
                                       for name in names for voice in engine.models[name].voices]}


def resolve_speech_model(engine, name: str | None) -> str:
    """The named model (404 if unknown, 400 if it does not speak), or the default text-to-speech model
    (serve/models.py)."""
    return resolve_model(engine, name, SPEECH_TASK, does="make speech", kind="text-to-speech model")


def _encode_file(engine, audio, rate: int, fmt: str) -> bytes:
    """The whole output as one file, encoded in a media worker process."""
    try:
        return engine.media().run("encode_audio", audio, rate, fmt)
    except MediaError as exc:  # the format was checked: a failure here is ours, not the caller's
        raise StageError("internal_error", f"encoding the audio as {fmt} failed: {exc.message}") from exc


async def _first_output(request: Request, handle: RequestHandle, events: AsyncIterator[Event]) -> Event:
    """The first audio, final or error event (raised as StageError); cancels if the client leaves first."""
    async def wait() -> Event:
        async for event in events:
            if event.kind in (EventKind.DELTA, EventKind.FINAL, EventKind.ERROR):
                return event
        raise StageError("internal_error", f"request {handle.request_id} ended without a result")

    async def disconnected() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.1)

    waiter, watcher = asyncio.ensure_future(wait()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not waiter.done():
        waiter.cancel()
        handle.cancel()
        raise StageError("cancelled", "the client disconnected", kind=ErrorKind.CANCELLED)
    event = waiter.result()
    if event.kind is EventKind.ERROR:
        raise StageError.from_event(event)
    return event


async def _outputs(events: AsyncIterator[Event], first: Event) -> AsyncIterator[Event]:
    """`first`, then the rest of the stream's DELTA / FINAL / ERROR events."""
    yield first
    if first.kind is EventKind.DELTA:
        async for event in events:
            if event.kind in (EventKind.DELTA, EventKind.FINAL, EventKind.ERROR):
                yield event


async def _encoded(events: AsyncIterator[Event], first: Event, fmt: str,
                   rate: int) -> AsyncIterator[tuple[bytes, Event]]:
    """Each output event with the bytes it adds to the stream: a DELTA's audio encoded, the encoder's
    tail with FINAL (codec look-ahead), nothing with ERROR. Bytes may be empty."""
    encoder = AudioStreamEncoder(fmt, rate)
    async for event in _outputs(events, first):
        if event.kind is EventKind.DELTA:
            yield await asyncio.to_thread(encoder.write, event.data["audio"]), event
        elif event.kind is EventKind.FINAL:
            yield await asyncio.to_thread(encoder.close), event
        else:
            yield b"", event


async def _audio(handle: RequestHandle, events, first: Event, fmt: str, rate: int) -> AsyncIterator[bytes]:
    try:
        async for data, event in _encoded(events, first, fmt, rate):
            if event.kind is EventKind.ERROR:  # the status line has gone out: all an audio stream can do is end
                log.warning("speech %s failed mid-stream: %s", handle.request_id, event.data.get("message"))
                return
            if data:
                yield data
    finally:
        if not handle.done:  # the client went away mid-stream (or the server is stopping)
            handle.cancel()


async def _sse(handle: RequestHandle, events, first: Event, fmt: str, rate: int) -> AsyncIterator[str]:
    try:
        async for data, event in _encoded(events, first, fmt, rate):
            if event.kind is EventKind.ERROR:
                yield sse("error", {"type": "error", **error_body(**stage_error_parts(StageError.from_event(event)))})
                return
            if data:
                yield sse("speech.audio.delta", {"type": "speech.audio.delta",
                                                 "audio": base64.b64encode(data).decode("ascii")})
            if event.kind is EventKind.FINAL:
                tokens = event.data["outputs"]["input_tokens"]
                yield sse("speech.audio.done", {"type": "speech.audio.done", "usage": _usage(tokens)})
    finally:
        if not handle.done:  # the client went away mid-stream (or the server is stopping)
            handle.cancel()


def _usage(input_tokens: int) -> dict[str, Any]:
    # No audio tokens here: output_tokens counts what the model generated as tokens (none).
    return {"input_tokens": input_tokens, "output_tokens": 0, "total_tokens": input_tokens}
