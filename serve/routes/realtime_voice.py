"""WS /v1/realtime?model=<voice model>: realtime voice sessions in the OpenAI Realtime protocol
(realtime/voice*.py). Accept, authenticate (serve/ws.py), pump frames.

The header `OpenAI-Beta: realtime=v1` selects the beta dialect of event names; `?session_id=`
marks a connection that will resume a session.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from realtime.voice.connection import VoiceConnection
from realtime.voice.metrics import VoiceMetrics
from realtime.voice.vad import VadLoader
from serve.ws import StarletteSocket, accept, ensure_reaper

router = APIRouter()


@router.websocket("/v1/realtime")
async def realtime_voice(websocket: WebSocket, model: str | None = None, session_id: str | None = None):
    tenant = await accept(websocket)
    if tenant is None:
        return
    app = websocket.app
    registry, live = app.state.voice_sessions, app.state.engine.metrics.part(VoiceMetrics).sessions
    beta = websocket.headers.get("openai-beta", "").replace(" ", "").startswith("realtime=v1")
    connection = VoiceConnection(StarletteSocket(websocket), app.state.engine, registry, _vad_loader(app),
                                 tenant=tenant, model=model, resume_id=session_id, beta=beta,
                                 on_admit=lambda: ensure_reaper(app, registry, live))
    await connection.run()


def _vad_loader(app) -> VadLoader:
    """One per app: Silero's model is loaded once and copied per session."""
    loader = getattr(app.state, "voice_vad", None)
    if loader is None:
        loader = app.state.voice_vad = VadLoader(app.state.engine.config.realtime.voice.vad)
    return loader
