"""create_app: the FastAPI application around one Engine. It neither loads nor stops the engine.

Whoever owns the engine (the CLI, a test) calls `engine.start()` (possibly in a background
thread, so /health answers while models load) and `engine.shutdown()`.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from realtime.sessions import registry_for
from realtime.video.metrics import VideoMetrics
from realtime.voice.metrics import VoiceMetrics
from serve.body_limit import BodyLimit
from serve.drain import DEFAULT_GRACE_S, Drain, DrainGate, DrainMetrics
from serve.errors import install_error_handlers
from serve.files import ImageStore
from serve.job_runner import JobPolicy, JobRunner
from serve.jobs import JobStore
from serve.metrics import HttpMetrics, RequestCounter
from serve.openapi import install_openapi
from serve.quota import QuotaGate, TenantMetrics
from serve.routes import (
    batches,
    chat,
    embeddings,
    images,
    loras,
    playground,
    realtime_video,
    realtime_voice,
    speech,
    system,
    transcriptions,
    videos,
)
from serve.slow_consumers import DEFAULT_GRACE_S as DEFAULT_SLOW_CONSUMER_GRACE_S
from serve.slow_consumers import DEFAULT_OUTBOX_BYTES, SlowConsumerMetrics, SlowConsumers
from serve.tenants import Tenants
from serve.tracing import LOG_FORMATS, RequestObserver
from stages.redact import redact_loggers
from stages.tracing import Tracing

DEFAULT_MAX_UPLOAD_BYTES = 32 * 2**20  # per uploaded image; the media decoder applies its own pixel limits
DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # a JSON (non-multipart) request body; [server] max_body_bytes
FORM_FIELDS_BYTES = 2**20  # a multipart body's text fields and part headers, beside its files


def create_app(engine, *, api_keys: dict[str, str] | None = None, image_store: ImageStore | None = None,
               max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES, data_dir: str | Path | None = None,
               job_policy: JobPolicy | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               admin_key: str | None = None, tenants: Tenants | None = None,
               drain_grace_s: float = DEFAULT_GRACE_S, tracing: Tracing | None = None,
               log_format: str = "text", slow_consumer_grace_s: float = DEFAULT_SLOW_CONSUMER_GRACE_S,
               slow_consumer_outbox_bytes: int = DEFAULT_OUTBOX_BYTES) -> FastAPI:
    """The HTTP app. `api_keys` maps key -> tenant; None or empty: no auth, every caller is tenant "default".
    `tenants` (serve/tenants.py) instead: the keys with each tenant's quotas, models and priority (serve/quota.py).
    `drain_grace_s`: how long a SIGTERM drain lets requests in flight finish (serve/drain.py).
    `slow_consumer_grace_s`, `slow_consumer_outbox_bytes`: a streaming client (SSE, streamed audio, realtime
    WebSocket) that takes no data for that long is cut and its request cancelled; what a stream buffers for it
    (serve/slow_consumers.py).
    `max_body_bytes` caps JSON bodies; multipart bodies may hold the largest upload a route admits (an image
    edit's image and mask, a /v1/files upload) plus FORM_FIELDS_BYTES (serve/body_limit.py).
    `data_dir` holds the job store (videos, files, batches); None: a fresh temporary directory (nothing persists),
    removed when the app is collected or the process exits.
    `admin_key` opens the admin routes (/v1/loras) to callers sending it; None: they answer 403.
    `tracing` (stages/tracing.py): spans per request and per stage; None: off. `log_format` "json": one JSON log
    line per request (serve/tracing.py); "text": none beyond uvicorn's access lines. Every response carries its
    `x-request-id`, which a client may send (serve/tracing.py says which are accepted)."""
    if max_upload_bytes < 1:
        raise ValueError(f"max_upload_bytes must be >= 1, got {max_upload_bytes}")
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await app.state.job_runner.start()  # resumes stored jobs once the engine is ready
        try:
            yield
        finally:
            await app.state.job_runner.stop()
            await app.state.video_sessions.close_all()
            await app.state.voice_sessions.close_all()

    app = FastAPI(title="mmserve", version="0.1.0", lifespan=lifespan,
                  description="Multimodal and diffusion pipeline server with OpenAI-compatible endpoints.")
    app.state.engine = engine
    if tenants is None:  # plain keys: tenants without limits
        tenants = Tenants.from_keys(api_keys or {})
    elif api_keys:
        raise ValueError("pass either api_keys or tenants, not both")
    app.state.tenants = tenants
    app.state.api_keys = tenants.keys
    app.state.drain = Drain(drain_grace_s, engine.metrics.part(DrainMetrics))
    app.state.slow_consumers = SlowConsumers(slow_consumer_grace_s, slow_consumer_outbox_bytes,
                                             engine.metrics.part(SlowConsumerMetrics))
    app.state.admin_key = admin_key
    app.state.image_store = image_store or ImageStore()
    app.state.max_upload_bytes = max_upload_bytes
    app.state.created = int(time.time())  # the `created` of every model object
    if data_dir is None:  # TemporaryDirectory: its finalizer removes it
        app.state.scratch_dir = tempfile.TemporaryDirectory(prefix="mmserve-jobs-")
        data_dir = app.state.scratch_dir.name
    app.state.job_store = JobStore(data_dir)
    app.state.job_runner = JobRunner(app.state.job_store, engine, app, job_policy or JobPolicy())
    app.state.video_sessions = registry_for("video", engine.config.realtime)
    app.state.voice_sessions = registry_for("voice", engine.config.realtime)
    app.include_router(chat.router)
    app.include_router(embeddings.router)
    app.include_router(images.router)
    app.include_router(speech.router)
    app.include_router(transcriptions.router)
    app.include_router(system.router)
    app.include_router(loras.router)
    app.include_router(videos.router)
    app.include_router(batches.router)
    app.include_router(realtime_video.router)
    app.include_router(realtime_voice.router)
    app.include_router(playground.router)  # the page at / (serve/static/playground)
    install_error_handlers(app)
    # Request lines carry query strings (signed image links), and uvicorn's own handlers print them: masked.
    redact_loggers("uvicorn.access", "uvicorn.error")
    install_openapi(app)  # /openapi.json says what the routes answer (serve/openapi.py)
    # Inside BodyLimit (the body it reads is bounded), outside the routes: quotas apply before any admission.
    # Its per-tenant series exist only with configured keys: their names come from the operator's file, a bounded set
    # (DESIGN §10 keeps tenants out of every other series' labels).
    app.add_middleware(QuotaGate, tenants=tenants, metrics=engine.metrics.part(TenantMetrics) if tenants.keys else None)
    app.add_middleware(BodyLimit, json_bytes=max_body_bytes,  # inside RequestCounter: its 413s are counted
                       multipart_bytes=max(2 * max_upload_bytes, batches.MAX_FILE_BYTES) + FORM_FIELDS_BYTES)
    # The series of the layers above stages/ join the engine's registry now, so /metrics lists them from the start.
    engine.metrics.part(VideoMetrics)
    engine.metrics.part(VoiceMetrics)
    app.add_middleware(DrainGate, drain=app.state.drain)  # a draining server's 503s spend no tenant's quota
    # Inside RequestCounter (its 400s for a bad x-request-id are counted), outside everything else: the request's
    # span and id cover the quota and drain answers too. The executor parents its node spans on the request span
    # (the last app made over an engine decides; an engine without an executor, a test's stand-in, has no node spans).
    executor = getattr(engine, "executor", None)
    if executor is not None:
        executor.tracing = tracing
    app.add_middleware(RequestObserver, keys=tenants.keys, tracing=tracing, log_json=log_format == "json")
    app.add_middleware(RequestCounter, counter=engine.metrics.part(HttpMetrics).requests)
    return app
