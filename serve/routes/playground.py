"""The playground: a page at `/` and `/playground`, made of the static HTML, CSS and JS modules in
serve/static/playground (no build step). Everything it loads comes from this server, so it works offline;
it talks to mmserve only through the public API (/v1/..., /metrics), with the caller's own key.

The routes stay out of the OpenAPI schema: they are a page, not part of the API.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from serve.errors import ApiError

STATIC_DIR = Path(__file__).resolve().parents[1] / "static" / "playground"
# What the page is made of; module scripts need a JavaScript media type, whatever the system's mime table says.
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
               ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
# The files are small and change with the package: the browser asks again (an ETag answers 304) instead of caching.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter(include_in_schema=False)


@cache
def assets() -> dict[str, Path]:
    """The page's files by their path under STATIC_DIR: only these are served, so no path can climb out of it."""
    return {path.relative_to(STATIC_DIR).as_posix(): path for path in sorted(STATIC_DIR.rglob("*"))
            if path.is_file() and path.suffix in MEDIA_TYPES}


def _file(name: str) -> FileResponse:
    path = assets().get(name)
    if path is None:
        raise ApiError(404, f"The playground has no file '{name}'.", code="not_found")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)


@router.get("/")
@router.get("/playground")
async def playground() -> FileResponse:
    """The page itself (200 at both addresses, no redirect)."""
    return _file("index.html")


@router.get("/playground/{name:path}")
async def playground_asset(name: str) -> FileResponse:
    """A script, style sheet or icon of the page."""
    return _file(name)
