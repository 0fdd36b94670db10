"""/v1/audio/transcriptions and /v1/audio/translations: parse -> check -> decode -> engine.submit_transcription
-> reply.

Multipart as OpenAI defines it: `file` (the audio), `model`, `language` (transcriptions only),
`prompt`, `temperature`, `response_format` (json | text | srt | vtt | verbose_json),
`timestamp_granularities[]` (segment; word timestamps are not produced) and `stream`
(transcriptions, json or text: SSE `transcript.text.delta` / `transcript.text.done`). The audio
is decoded to 16 kHz mono in the media workers, after every cheap check has passed. Errors name
the field: bad or missing audio -> `file`, unknown model -> `model` (404), a model that does
not transcribe or translate -> `model` (400).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import numpy as np
from fastapi import APIRouter, Depends, Request
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from pipelines.asr import (
    SAMPLE_RATE,
    SPEECH_TO_TEXT_TASK,
    TRANSCRIBE,
    TRANSLATE,
    TRANSLATIONS_TASK,
    TranscriptionRequest,
)
from pipelines.image_request import RequestError
from serve.auth import tenant_of
from serve.errors import ApiError
from serve.models import resolve_model
from serve.responses import result_or_cancel
from serve.slow_consumers import stream_response
from serve.transcripts import RESPONSE_FORMATS, TIMED_FORMATS, transcript_events, transcript_response

router = APIRouter()
TEXT_FIELDS = {  # field -> endpoints that take it; list fields arrive as `name[]` from the openai client
    "model": (TRANSCRIBE, TRANSLATE), "prompt": (TRANSCRIBE, TRANSLATE), "temperature": (TRANSCRIBE, TRANSLATE),
    "response_format": (TRANSCRIBE, TRANSLATE), "language": (TRANSCRIBE,), "stream": (TRANSCRIBE,),
    "timestamp_granularities": (TRANSCRIBE,), "include": (TRANSCRIBE,), "chunking_strategy": (TRANSCRIBE,),
}
LIST_FIELDS = ("timestamp_granularities", "include")


@dataclass
class AudioForm:
    data: bytes  # the uploaded file
    fields: dict[str, str] = field(default_factory=dict)  # single-valued text fields
    lists: dict[str, list[str]] = field(default_factory=dict)  # timestamp_granularities[], include[]


@dataclass(frozen=True)
class TranscriptionParams:
    model: str | None
    task: str  # TRANSCRIBE or TRANSLATE
    response_format: str
    temperature: float
    language: str | None
    prompt: str | None
    stream: bool

    @classmethod
    def parse(cls, form: AudioForm, task: str) -> "TranscriptionParams":
        f = form.fields
        response_format = f.get("response_format", "json")
        if response_format not in RESPONSE_FORMATS:
            raise RequestError("response_format", f"response_format must be one of {list(RESPONSE_FORMATS)}; "
                                                  f"got {response_format!r}")
        try:
            temperature = float(f.get("temperature", 0))
        except ValueError:
            raise RequestError("temperature", f"temperature must be a number; got {f['temperature']!r}") from None
        stream = f.get("stream", "false").strip().lower()
        if stream not in ("true", "false", "1", "0"):
            raise RequestError("stream", f"stream must be true or false; got {f['stream']!r}")
        stream_on = stream in ("true", "1")
        if stream_on and response_format not in ("json", "text"):
            raise RequestError("stream", f"stream=true sends text deltas; use response_format json or text "
                                         f"(got {response_format})")
        granularities = form.lists.get("timestamp_granularities", [])
        for g in granularities:
            if g not in ("segment", "word"):
                raise RequestError("timestamp_granularities", f"timestamp_granularities must hold 'segment' or "
                                                              f"'word'; got {g!r}")
        if granularities and response_format != "verbose_json":
            raise RequestError("timestamp_granularities", "response_format must be verbose_json to use "
                                                          "timestamp_granularities")
        if "word" in granularities:
            raise RequestError("timestamp_granularities", "word timestamps are not produced by this server; use "
                                                          "timestamp_granularities[]=segment", code="unsupported_value")
        return cls(model=f.get("model") or None, task=task, response_format=response_format, temperature=temperature,
                   language=f.get("language") or None, prompt=f.get("prompt"), stream=stream_on)

    def request(self, audio: np.ndarray) -> TranscriptionRequest:
        return TranscriptionRequest(audio=audio, task=self.task, language=self.language, prompt=self.prompt,
                                    temperature=self.temperature, timestamps=self.response_format in TIMED_FORMATS,
                                    stream=self.stream)


@router.post("/v1/audio/transcriptions")
async def create_transcription(request: Request, tenant: str = Depends(tenant_of)):
    return await _run(request, TRANSCRIBE)


@router.post("/v1/audio/translations")
async def create_translation(request: Request, tenant: str = Depends(tenant_of)):
    return await _run(request, TRANSLATE)


async def _run(request: Request, task: str):
    engine = request.app.state.engine
    # 1. cheap: the form, its fields, the model, the request's own values against the model
    form = await read_audio_form(request, task, max_file_bytes=request.app.state.max_upload_bytes)
    params = TranscriptionParams.parse(form, task)
    model = resolve_asr_model(engine, params.model, SPEECH_TO_TEXT_TASK if task == TRANSCRIBE else TRANSLATIONS_TASK)
    engine.transcription_model(model).check(params)  # its fields, before the audio is decoded
    # 2. decode (media workers, 16 kHz mono, duration limits), then cut, featurize and run
    decoded = await engine.run_media("decode_audio", form.data, engine.config.media.audio, param="file",
                                     sample_rate=SAMPLE_RATE)
    request_id = f"{'trsc' if task == TRANSCRIBE else 'trsl'}-{uuid.uuid4().hex}"
    handle = await asyncio.to_thread(engine.submit_transcription, model, params.request(decoded.samples),
                                     request_id=request_id)
    headers = {"x-request-id": request_id}
    if params.stream:
        return stream_response(request, transcript_events(handle), media_type="text/event-stream",
                               headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    outputs = await result_or_cancel(request, handle)
    return transcript_response(outputs, params.response_format, task, headers)


def resolve_asr_model(engine, name: str | None, task: str) -> str:
    """The named model (404 if unknown, 400 if it cannot do `task`), or the default for `task` (serve/models.py)."""
    def hint(info) -> str:
        return " (an English-only Whisper model cannot translate)" if SPEECH_TO_TEXT_TASK in info.tasks else ""

    return resolve_model(engine, name, task, does=f"do {task}", kind=f"{task} model", hint=hint)


async def read_audio_form(request: Request, task: str, *, max_file_bytes: int) -> AudioForm:
    """Parse the multipart body; 400 naming the part on anything malformed, 413 on an oversized file."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise ApiError(400, f"{request.url.path} takes multipart/form-data with the audio as the 'file' part; got "
                            f"Content-Type {content_type or 'none'!r}", code="invalid_content_type")
    declared = int(request.headers.get("content-length") or 0)
    if declared > max_file_bytes + 2**20:  # the file plus text fields: refuse before reading a byte
        raise ApiError(413, f"request body is {declared} bytes; the limit is {max_file_bytes} bytes of audio",
                       param="file", code="request_too_large")
    try:
        form = await request.form(max_files=2, max_fields=32)
    except (MultiPartException, HTTPException) as e:
        detail = getattr(e, "message", None) or getattr(e, "detail", None) or str(e)
        raise ApiError(400, f"malformed multipart body: {detail}", code="invalid_multipart") from None
    files, out = [], AudioForm(b"")
    for key, value in form.multi_items():
        name = key.removesuffix("[]")
        if isinstance(value, UploadFile):
            if key != "file":
                raise ApiError(400, f"Unrecognized file part: {key}; send the audio as 'file'", param=key,
                               code="unknown_parameter")
            files.append(value)
        elif key == "file":
            raise ApiError(400, "'file' must be sent as a file part, not a text field", param="file",
                           code="invalid_value")
        elif task not in TEXT_FIELDS.get(name, ()):
            raise ApiError(400, f"Unrecognized request argument supplied: {key}", param=name, code="unknown_parameter")
        elif name in LIST_FIELDS:
            out.lists.setdefault(name, []).append(value)
        elif name in out.fields:
            raise ApiError(400, f"'{name}' was sent more than once", param=name, code="invalid_value")
        else:
            out.fields[name] = value
    if len(files) != 1:
        raise ApiError(400, f"send exactly one 'file' (the audio); got {len(files)}", param="file",
                       code="missing_required_parameter" if not files else "invalid_value")
    out.data = await files[0].read(max_file_bytes + 1)
    await files[0].close()
    if len(out.data) > max_file_bytes:
        raise ApiError(413, f"'file' is larger than the limit of {max_file_bytes} bytes", param="file",
                       code="file_too_large")
    if not out.data:
        raise ApiError(400, "'file' is an empty file", param="file", code="invalid_value")
    return out
