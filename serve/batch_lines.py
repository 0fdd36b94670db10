"""One batch input line -> one output (or error) line, through the server's own HTTP endpoints.

A line is OpenAI's batch request: {"custom_id": "...", "method": "POST", "url": "/v1/...", "body": {...}}.
It runs through an httpx client: in the server (and in `mmserve batch run` without --server)
the client is bound to the ASGI app in-process, so a batch line takes exactly the path an
interactive request takes (parse -> engine.submit_* -> encode) with no second copy of any
endpoint; with --server it is a real HTTP client.

Output line: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}.
A line that fails before it reaches an endpoint (not JSON, no custom_id, wrong url) has
"response": null and "error": {"code", "message"}. Binary bodies (speech audio) are sent as
{"content_type", "b64"}.

Audio endpoints (/v1/audio/transcriptions, /v1/audio/translations) take multipart uploads, which an
OpenAI batch line cannot carry. As an extension, such a line's body is the form's fields as JSON
with the audio as a base64 `data:` URI in `file` (optionally `filename`):
    {"custom_id": "a1", "url": "/v1/audio/transcriptions",
     "body": {"model": "whisper-demo", "file": "data:audio/wav;base64,UklGR...", "response_format": "json"}}
The runner posts it as the multipart request the endpoint expects (`file` a file part, list fields
such as timestamp_granularities as `name[]`, booleans as true/false), so the output line's body is the
endpoint's own reply (the transcription JSON, or {"content_type", "b64"} for text/srt/vtt). Only
`data:` URIs are taken (no URLs: a batch line never makes the server fetch anything).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from stages.redact import redact_url

BATCH_ENDPOINTS = ("/v1/images/generations", "/v1/chat/completions", "/v1/embeddings", "/v1/audio/speech",
                   "/v1/completions", "/v1/audio/transcriptions", "/v1/audio/translations")
MULTIPART_ENDPOINTS = ("/v1/audio/transcriptions", "/v1/audio/translations")  # `file` a data: URI (see above)


@dataclass(frozen=True)
class BatchLine:
    index: int  # 0-based line number in the input file
    custom_id: str  # the caller's id, echoed on the output line
    url: str  # one of BATCH_ENDPOINTS
    body: dict[str, Any]  # the endpoint's JSON body (multipart endpoints: the form fields, less `file`)
    upload: tuple[str, bytes, str] | None = None  # multipart endpoints: (filename, data, content type) of `file`


class LineError(ValueError):
    """A malformed input line: reported on its own error line, the other lines still run."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.custom_id = custom_id


def split_lines(data: bytes) -> list[str]:
    """The non-blank lines of a JSONL file (blank lines are not requests)."""
    return [line for line in data.decode("utf-8", errors="replace").splitlines() if line.strip()]


def parse_line(text: str, index: int, endpoint: str | None) -> BatchLine:
    """Validate one line; `endpoint` (the batch's) must match the line's url when given. Raises LineError."""
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError("invalid_json", f"line {index + 1} is not valid JSON: {e}") from None
    if not isinstance(item, dict):
        raise LineError("invalid_request", f"line {index + 1} must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", f"line {index + 1} has no custom_id (a non-empty string)")
    url = item.get("url", endpoint)
    if url not in BATCH_ENDPOINTS:
        shown = redact_url(url) if isinstance(url, str) else url  # a query may hold a token (stages/redact.py)
        raise LineError("invalid_url", f"line {index + 1}: url {shown!r} is not a batch endpoint; use one of "
                                       f"{list(BATCH_ENDPOINTS)}", custom_id)
    if endpoint is not None and url != endpoint:
        raise LineError("mismatched_url", f"line {index + 1}: url {url!r} differs from the batch's endpoint "
                                          f"{endpoint!r}", custom_id)
    if item.get("method", "POST") != "POST":
        raise LineError("invalid_method", f"line {index + 1}: method must be POST", custom_id)
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", f"line {index + 1}: body must be a JSON object", custom_id)
    if url in MULTIPART_ENDPOINTS:
        body, upload = _split_upload(body, index, custom_id)
        return BatchLine(index, custom_id, url, body, upload)
    return BatchLine(index, custom_id, url, body)


def _split_upload(body: dict[str, Any], index: int, custom_id: str) -> tuple[dict[str, Any], tuple[str, bytes, str]]:
    """The form fields and the decoded `file` (a base64 data: URI) of an audio line. Raises LineError."""
    fields = dict(body)
    uri = fields.pop("file", None)
    filename = fields.pop("filename", None) or "audio"
    where = f"line {index + 1}"
    if not isinstance(uri, str) or not uri.startswith("data:") or "," not in uri:
        raise LineError("invalid_file", f"{where}: body.file must be the audio as a data: URI "
                                        f"(data:audio/wav;base64,...); batch lines cannot upload files", custom_id)
    header, payload = uri[5:].split(",", 1)
    parts = header.split(";")
    if "base64" not in parts[1:]:
        raise LineError("invalid_file", f"{where}: body.file must be a base64 data: URI", custom_id)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise LineError("invalid_file", f"{where}: body.file is not valid base64", custom_id) from None
    if not data:
        raise LineError("invalid_file", f"{where}: body.file is empty", custom_id)
    if not isinstance(filename, str):
        raise LineError("invalid_body", f"{where}: body.filename must be a string", custom_id)
    return fields, (filename, data, parts[0] or "application/octet-stream")


def _form_fields(body: dict[str, Any]) -> dict[str, list[str]]:
    """JSON values as multipart text fields: lists as repeated `name[]`, booleans true/false, objects as JSON."""
    out: dict[str, list[str]] = {}
    for key, value in body.items():
        values, name = (value, f"{key}[]") if isinstance(value, list) else ([value], key)
        for v in values:
            if v is None:
                continue
            if isinstance(v, bool):
                v = "true" if v else "false"
            elif isinstance(v, (dict, list)):
                v = json.dumps(v)
            out.setdefault(name, []).append(str(v))
    return out


def error_record(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


RETRIED_STATUSES = (429, 503)  # busy, unavailable (a replica lost, the server starting or stopping): try again
MAX_RETRY_WAIT_S = 30.0


async def run_line(client: httpx.AsyncClient, line: BatchLine, headers: dict[str, str] | None = None, *,
                   retries: int = 0, retry_delay_s: float = 1.0) -> tuple[bool, dict[str, Any]]:
    """POST the line's body to its endpoint. Returns (succeeded, output record). A reply of 429 or 503 is sent
    again after its Retry-After (else `retry_delay_s`), at most `retries` times; the record is the last reply's."""
    for attempt in range(retries + 1):
        try:
            reply = await _post(client, line, headers)
        except httpx.HTTPError as e:
            return False, error_record(line.custom_id, "request_failed", f"{type(e).__name__}: {e}")
        if reply.status_code not in RETRIED_STATUSES or attempt == retries:
            break
        await asyncio.sleep(_retry_wait(reply, retry_delay_s))
    ctype = reply.headers.get("content-type", "")
    if ctype.startswith("application/json"):
        body: Any = reply.json()
    else:
        body = {"content_type": ctype, "b64": base64.b64encode(reply.content).decode("ascii")}
    record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
              "response": {"status_code": reply.status_code, "request_id": reply.headers.get("x-request-id"),
                           "body": body},
              "error": None}
    return reply.is_success, record


async def _post(client: httpx.AsyncClient, line: BatchLine, headers: dict[str, str] | None) -> httpx.Response:
    if line.upload is not None:  # the multipart request the endpoint expects
        return await client.post(line.url, data=_form_fields(line.body), files={"file": line.upload},
                                 headers=headers)
    return await client.post(line.url, json=line.body, headers=headers)


def _retry_wait(reply: httpx.Response, default_s: float) -> float:
    try:
        hint = float(reply.headers.get("retry-after", ""))
    except ValueError:  # absent, or an HTTP date: the default
        hint = default_s
    return min(MAX_RETRY_WAIT_S, max(0.0, hint))
