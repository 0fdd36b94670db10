"""A finished transcript in OpenAI's response formats: json, text, srt, vtt, verbose_json; and its SSE stream."""

from __future__ import annotations

import math
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from serve.responses import event_stream
from stages.request_state import RequestHandle

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
TIMED_FORMATS = ("srt", "vtt", "verbose_json")  # need segment times: decoded with timestamp tokens


def language_name(code: str) -> str:
    """"en" -> "english", as verbose_json names languages."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES.get(code, code)


def usage_duration(outputs: dict[str, Any]) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(outputs["duration"])}


def clock(seconds: float, separator: str) -> str:
    """3725.5 -> "01:02:05,500" (srt, separator ",") or "01:02:05.500" (vtt, ".")."""
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def srt(segments) -> str:
    return "".join(f"{i}\n{clock(s.start, ',')} --> {clock(s.end, ',')}\n{s.text.strip()}\n\n"
                   for i, s in enumerate(segments, start=1))


def vtt(segments) -> str:
    return "WEBVTT\n\n" + "".join(f"{clock(s.start, '.')} --> {clock(s.end, '.')}\n{s.text.strip()}\n\n"
                                  for s in segments)


def verbose_json(outputs: dict[str, Any], task: str) -> dict[str, Any]:
    segments = [{"id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text, "tokens": list(s.tokens),
                 "temperature": s.temperature, "avg_logprob": s.avg_logprob, "compression_ratio": s.compression_ratio,
                 "no_speech_prob": s.no_speech_prob} for s in outputs["segments"]]
    return {"task": task, "language": language_name(outputs["language"]), "duration": round(outputs["duration"], 3),
            "text": outputs["text"], "segments": segments, "usage": usage_duration(outputs)}


def transcript_response(outputs: dict[str, Any], response_format: str, task: str, headers: dict[str, str]) -> Response:
    """The reply body for one finished request in `response_format`."""
    if response_format == "text":
        return PlainTextResponse(outputs["text"] + "\n", headers=headers)
    if response_format == "srt":
        return PlainTextResponse(srt(outputs["segments"]), headers=headers)
    if response_format == "vtt":
        return Response(vtt(outputs["segments"]), media_type="text/vtt; charset=utf-8", headers=headers)
    if response_format == "verbose_json":
        return JSONResponse(verbose_json(outputs, task), headers=headers)
    return JSONResponse({"text": outputs["text"], "usage": usage_duration(outputs)}, headers=headers)


def transcript_events(handle: RequestHandle) -> AsyncIterator[str]:
    """OpenAI's transcription stream: `transcript.text.delta` per piece of text, then `transcript.text.done`.

    The deltas concatenate to the done event's text.
    """
    def done(outputs: dict[str, Any]) -> list[dict[str, Any]]:
        output_tokens = sum(len(s.tokens) for s in outputs["segments"])
        return [{"type": "transcript.text.done", "text": outputs["text"],
                 "usage": {"type": "tokens", "input_tokens": 0, "output_tokens": output_tokens,
                           "total_tokens": output_tokens}}]

    return event_stream(handle, lambda d: [{"type": "transcript.text.delta", "delta": d["text"]}], done)
