"""/v1/videos: asynchronous video jobs. parse -> store a queued job -> JobRunner runs engine.submit_video.

POST takes JSON or multipart (with `input_reference`, the image for image-to-video) and answers
the job object at once; GET polls it (`progress` 0-100 from denoise steps); /content is the MP4
(`variant=thumbnail`: a JPEG of the first frame); DELETE cancels. An `Idempotency-Key` header
makes a retried POST with the same body return the same job; the same key with another body is a 422
`idempotency_key_reused`. Jobs persist in the JobStore (serve/jobs.py).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from pipelines.image_request import RequestError
from pipelines.video import VideoRequest, VideoTask
from serve.auth import tenant_of
from serve.bodies import read_json_object
from serve.errors import ApiError
from serve.files import download_response
from serve.jobs import VIDEO_REQUEST_FIELDS, Job, idempotency_key, request_digest, write_atomic
from serve.models import resolve_model
from serve.schemas import StepCacheBody, json_object, parse_size

router = APIRouter()
VIDEO_TASKS = tuple(t.value for t in VideoTask)  # ModelInfo.tasks of a model /v1/videos runs


class VideoBody(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    prompt: str = Field(min_length=1)
    model: str | None = None  # None: the default model for the task (serve/models.py)
    negative_prompt: str | None = None
    size: str | None = None  # "WxH"; None: the model's default
    seconds: float | None = Field(None, gt=0)  # OpenAI's duration; num_frames from it (pipelines.video.VideoRequest)
    num_frames: int | None = Field(None, ge=1)
    fps: float | None = Field(None, gt=0, le=120)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0)
    true_cfg_scale: float | None = Field(None, ge=0, description=(
        "HunyuanVideo: true classifier-free guidance, applied when above 1 and a negative_prompt is given "
        "(default 1, off); other video families refuse it"))
    seed: int | None = None
    # JSON only: a data: URI or URL of the image, or {"image_url": "<data: URI or URL>"} (also {"image_url":
    # {"url": ...}}) as the chat/Responses APIs spell an image; multipart sends it as a file part instead
    input_reference: str | dict[str, Any] | None = None
    step_cache: StepCacheBody | None = None  # extension: approximate step caching (the model must allow it)

    _step_cache_json = field_validator("step_cache", mode="before")(json_object)

    def reference_source(self) -> str | None:
        """The input_reference as one data: URI or URL string (None: none given). Raises RequestError."""
        ref = self.input_reference
        if ref is None or isinstance(ref, str):
            return ref or None
        url = ref.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str) or not url or set(ref) - {"image_url"}:
            raise RequestError("input_reference", 'input_reference must be a data: URI or URL string, or '
                                                  '{"image_url": "<data: URI or URL>"}')
        return url

    def video_fields(self, model: str) -> dict[str, Any]:
        """The stored request: VideoRequest's fields plus model and size for the job object."""
        width, height = parse_size(self.size) or (None, None)
        return dict(model=model, prompt=self.prompt, negative_prompt=self.negative_prompt, width=width,
                    height=height, num_frames=self.num_frames, fps=self.fps,
                    num_inference_steps=self.num_inference_steps,
                    guidance_scale=self.guidance_scale, true_cfg_scale=self.true_cfg_scale, seed=self.seed,
                    size=self.size, seconds=self.seconds,
                    step_cache=self.step_cache.params() if self.step_cache is not None else None)


@router.post("/v1/videos")
async def create_video(request: Request, tenant: str = Depends(tenant_of)):
    state = request.app.state
    engine, store, runner = state.engine, state.job_store, state.job_runner
    body, image, uploaded = await _read(request)
    key = idempotency_key(request.headers)
    # The body as sent (an uploaded image by its bytes; a URL or data: URI is in the body): a reused key must bring it.
    digest = request_digest(body.model_dump(mode="json"), *([image] if uploaded else []))
    retried = store.find_by_key(tenant, "video", key, digest) if key else None  # 422 if the body differs
    if retried is not None:  # the same job; a retry never counts against the quota
        return video_object(retried)
    model = resolve_video_model(engine, body.model, image_to_video=image is not None)
    fields = body.video_fields(model)
    decoded = None
    if image is not None:  # bad images, sizes, frame counts and fps are refused now, not as a failed job later
        decoded = await asyncio.to_thread(engine.decode_image, image, param="input_reference")
        fields["has_input_reference"] = True
    checked = precheck(engine, model, fields, decoded, tenant)
    fields.update(num_frames=checked.num_frames, fps=checked.fps)  # what will run, so the job says its seconds
    runner.check_quota(tenant, "video")
    job, created = store.create_job("video", tenant, fields, prefix="video", idempotency_key=key,
                                    request_hash=digest, ttl_s=None)
    if created:
        if image is not None:
            write_atomic(store.results_dir / f"{job.id}.input", image)
        runner.schedule(job.id)
    return video_object(job)


# The polled replies are rendered as they are: video_object() holds JSON types only, so FastAPI's jsonable_encoder
# walk would return them unchanged, and it was a third of a 17-job list request (1.52 -> 1.14 ms in-process). A
# client polls these while its videos run, on the same cores.
@router.get("/v1/videos")
async def list_videos(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None,
                      tenant: str = Depends(tenant_of)):
    jobs = request.app.state.job_store.list_jobs("video", tenant, limit=limit + 1, after=after)
    data = [video_object(j) for j in jobs[:limit]]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": len(jobs) > limit})


@router.get("/v1/videos/{video_id}")
async def get_video(video_id: str, request: Request, tenant: str = Depends(tenant_of)):
    return JSONResponse(video_object(_job(request, video_id, tenant)))


@router.get("/v1/videos/{video_id}/content")
async def get_video_content(video_id: str, request: Request, variant: Literal["video", "thumbnail"] = "video",
                            tenant: str = Depends(tenant_of)):
    job = _job(request, video_id, tenant)
    if job.status != "completed":
        raise ApiError(409 if job.status != "expired" else 404,
                       f"video {video_id} is {job.status}; its content is available once it is completed",
                       param="video_id", code="video_not_ready")
    suffix, media_type = (".jpg", "image/jpeg") if variant == "thumbnail" else (".mp4", "video/mp4")
    path = request.app.state.job_store.results_dir / f"{video_id}{suffix}"
    # Gone: expired a moment ago (the sweep has not marked it yet) or deleted by a concurrent DELETE.
    gone = ApiError(404, f"the content of video {video_id} has expired", param="video_id", code="video_expired")
    return download_response(path, media_type, gone)


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, request: Request, tenant: str = Depends(tenant_of)):
    """Cancels a queued or running job (a running one stops within a denoise step; the reply is the job,
    status cancelled); a finished job is deleted with its files ({"id", "object", "deleted": true})."""
    state = request.app.state
    job = _job(request, video_id, tenant)
    if job.status in ("queued", "in_progress", "finalizing", "cancelling"):
        await state.job_runner.cancel(video_id)
        return video_object(state.job_store.get_job(video_id))
    state.job_store.delete_job(video_id)
    return {"id": video_id, "object": "video.deleted", "deleted": True}


def video_object(job: Job) -> dict[str, Any]:
    r = job.request
    seconds = r.get("seconds")
    if seconds is None and r.get("num_frames") and r.get("fps"):
        seconds = max(0, r["num_frames"] - 1) / r["fps"]
    return {"id": job.id, "object": "video", "model": r.get("model"), "status": job.status,
            "progress": job.progress, "created_at": job.created_at, "completed_at": job.completed_at,
            "expires_at": job.expires_at, "size": r.get("size"),
            "seconds": None if seconds is None else f"{seconds:g}", "error": job.error}


def precheck(engine, model: str, fields: dict[str, Any], image, tenant: str) -> VideoRequest:
    """The model's own validation (size and frame factors, limits, task) of the request the job will run;
    returns it with the defaults filled (num_frames, fps). Raises RequestError naming the field."""
    request = VideoRequest(**{k: fields[k] for k in VIDEO_REQUEST_FIELDS}, image=image, tenant=tenant)
    return engine.check_video(model, request)


def resolve_video_model(engine, name: str | None, *, image_to_video: bool) -> str:
    """The named model (404 if unknown, 400 unsupported_task if it makes no videos: an image model), or the
    default model for the task (serve/models.py): image-to-video with an input_reference, else text-to-video."""
    task = VideoTask.IMAGE_TO_VIDEO if image_to_video else VideoTask.TEXT_TO_VIDEO
    return resolve_model(engine, name, task.value, does="make videos (use /v1/images for images)",
                         kind=f"{task.value} model", accepts=VIDEO_TASKS)


def _job(request: Request, video_id: str, tenant: str) -> Job:
    job = request.app.state.job_store.get_job(video_id, tenant, "video")
    if job is None:
        raise ApiError(404, f"No video found with id '{video_id}'", param="video_id", code="video_not_found")
    return job


async def _read(request: Request) -> tuple[VideoBody, bytes | None, bool]:
    """The body (JSON or multipart), the input_reference image bytes, if any, and whether they were uploaded
    (a multipart file part) rather than named in the body (a URL or data: URI)."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        limit = request.app.state.max_upload_bytes
        try:
            form = await request.form(max_files=1, max_fields=32)
        except (MultiPartException, HTTPException) as e:
            detail = getattr(e, "message", None) or getattr(e, "detail", None) or str(e)
            raise ApiError(400, f"malformed multipart body: {detail}", code="invalid_multipart") from None
        fields, image = {}, None
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key != "input_reference":
                    raise ApiError(400, f"Unrecognized file part: {key}", param=key, code="unknown_parameter")
                image = await value.read(limit + 1)
                if len(image) > limit:
                    raise ApiError(413, f"input_reference is larger than the limit of {limit} bytes",
                                   param="input_reference", code="file_too_large")
            else:
                fields[key] = value
        return VideoBody.model_validate(fields), image, image is not None
    data = await read_json_object(request, accepted="application/json (or multipart/form-data)")
    body = VideoBody.model_validate(data)
    image = None
    source = body.reference_source()
    if source:  # the engine's safe fetch (data: URIs, allowed URLs; size and redirect limits), as serve/uploads.py
        image = await request.app.state.engine.load_source(source, param="input_reference")
    return body, image, False
