"""WS /v1/realtime/video: realtime video sessions (realtime/video*.py). Accept, authenticate (serve/ws.py),
pump frames."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from realtime.video.connection import VideoConnection
from realtime.video.metrics import VideoMetrics
from serve.ws import StarletteSocket, accept, ensure_reaper

router = APIRouter()


@router.websocket("/v1/realtime/video")
async def realtime_video(websocket: WebSocket, model: str | None = None):
    tenant = await accept(websocket)
    if tenant is None:
        return
    app = websocket.app
    registry, live = app.state.video_sessions, app.state.engine.metrics.part(VideoMetrics).sessions
    connection = VideoConnection(StarletteSocket(websocket), app.state.engine, registry, tenant=tenant, model=model,
                                 on_admit=lambda: ensure_reaper(app, registry, live))
    await connection.run()
