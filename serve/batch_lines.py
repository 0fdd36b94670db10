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
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

BATCH_ENDPOINTS = ("/v1/images/generations", "/v1/chat/completions", "/v1/embeddings", "/v1/audio/speech",
                   "/v1/completions")


@dataclass(frozen=True)
class BatchLine:
    index: int  # 0-based line number in the input file
    custom_id: str  # the caller's id, echoed on the output line
    url: str  # one of BATCH_ENDPOINTS
    body: dict[str, Any]  # the endpoint's JSON body


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
        raise LineError("invalid_url", f"line {index + 1}: url {url!r} is not a batch endpoint; use one of "
                                       f"{list(BATCH_ENDPOINTS)}", custom_id)
    if endpoint is not None and url != endpoint:
        raise LineError("mismatched_url", f"line {index + 1}: url {url!r} differs from the batch's endpoint "
                                          f"{endpoint!r}", custom_id)
    if item.get("method", "POST") != "POST":
        raise LineError("invalid_method", f"line {index + 1}: method must be POST", custom_id)
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", f"line {index + 1}: body must be a JSON object", custom_id)
    return BatchLine(index, custom_id, url, body)


def error_record(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


async def run_line(client: httpx.AsyncClient, line: BatchLine, headers: dict[str, str] | None = None
                   ) -> tuple[bool, dict[str, Any]]:
    """POST the line's body to its endpoint. Returns (succeeded, output record)."""
    try:
        reply = await client.post(line.url, json=line.body, headers=headers)
    except httpx.HTTPError as e:
        return False, error_record(line.custom_id, "request_failed", f"{type(e).__name__}: {e}")
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
