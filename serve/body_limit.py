"""Request body limits, enforced in one place before a handler parses (or tokenizes) anything.

A body whose Content-Length is over its limit is answered 413 before a byte of it is read; a body
without one (chunked) is counted as it arrives and answered 413 the moment it passes the limit.
Either way the reply is OpenAI's error object with code `request_too_large` naming the limit.

Which limit applies:

* multipart/form-data (uploads: images/edits, audio, /v1/files, /v1/videos input references):
  `multipart_bytes`, large enough for the biggest upload any route admits; each upload route still
  applies its own per-file limit (`max_upload_bytes`, 200 MiB for /v1/files) with its own param.
* every other body (JSON): `json_bytes` ([server] max_body_bytes).

A plain ASGI middleware (as serve.metrics.RequestCounter): messages other than body chunks, client
disconnects included, pass through untouched.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.errors import error_response

CODE = "request_too_large"


class BodyTooLarge(HTTPException):
    """Raised to the handler that reads past the limit (the 413 is already sent: its own reply is dropped)."""

    def __init__(self, message: str):
        super().__init__(status_code=413, detail=message)


class BodyLimit:
    def __init__(self, app: ASGIApp, *, json_bytes: int, multipart_bytes: int):
        if json_bytes < 1 or multipart_bytes < 1:
            raise ValueError(f"body limits must be >= 1 byte, got {json_bytes} and {multipart_bytes}")
        self.app = app
        self.json_bytes = json_bytes
        self.multipart_bytes = multipart_bytes

    def limit(self, headers: Headers) -> tuple[int, str]:
        """The byte limit for this request's body and its name in the error message."""
        if headers.get("content-type", "").lower().startswith("multipart/form-data"):
            return self.multipart_bytes, "multipart (upload) bodies"
        return self.json_bytes, "request bodies (server.max_body_bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limit, what = self.limit(headers)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(int(declared), limit, what)(scope, receive, send)  # the body is never read
            return
        received = 0
        answered = False  # the 413 went out: the handler's own reply is dropped

        async def counted_receive() -> Message:
            nonlocal received, answered
            if answered:
                return {"type": "http.disconnect"}  # the exchange is over for the client
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    answered = True
                    reply = _too_large(received, limit, what, at_least=True)
                    await reply(scope, receive, send)
                    raise BodyTooLarge(reply.body.decode())
            return message

        async def guarded_send(message: Message) -> None:
            if not answered:
                await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except BodyTooLarge:
            if not answered:
                raise


def _too_large(size: int, limit: int, what: str, *, at_least: bool = False):
    size_text = f"more than {limit} bytes" if at_least else f"{size} bytes"
    return error_response(413, f"the request body is {size_text}; the limit for {what} is {limit} bytes", code=CODE)
