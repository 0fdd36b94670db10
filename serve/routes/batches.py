"""/v1/files and /v1/batches: OpenAI's batch API over the JobStore (serve/jobs.py).

Upload a JSONL file (purpose "batch"), create a batch naming it and an endpoint, poll the batch
(`request_counts`), download `output_file_id` / `error_file_id`: one JSON line per input line
with its `custom_id`. Lines run through the server's own endpoints at low priority
(serve/job_runner.py); malformed lines are reported in the error file and the rest still run.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from serve.auth import tenant_of
from serve.batch_lines import BATCH_ENDPOINTS, split_lines
from serve.errors import ApiError
from serve.files import download_response
from serve.jobs import Job, StoredFile, idempotency_key, request_digest

router = APIRouter()
FILE_PURPOSES = ("batch", "user_data")  # what callers upload; "batch_output" is what the server writes
COMPLETION_WINDOWS = ("24h",)
MAX_FILE_BYTES = 200 * 2**20  # OpenAI's batch input limit
_OPENAI_STATUS = {"queued": "validating"}  # the store's names -> OpenAI's batch statuses


class BatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


# -- files ------------------------------------------------------------------------------------


@router.post("/v1/files")
async def create_file(request: Request, tenant: str = Depends(tenant_of)):
    try:
        form = await request.form(max_files=1, max_fields=8)
    except (MultiPartException, HTTPException) as e:
        detail = getattr(e, "message", None) or getattr(e, "detail", None) or str(e)
        raise ApiError(400, f"malformed multipart body: {detail}; send 'file' and 'purpose'",
                       code="invalid_multipart") from None
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "Missing required parameter: 'file' (a file part)", param="file",
                       code="missing_required_parameter")
    if purpose not in FILE_PURPOSES:
        raise ApiError(400, f"purpose must be one of {list(FILE_PURPOSES)}; got {purpose!r}", param="purpose",
                       code="invalid_value")
    data = await upload.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ApiError(413, f"file is larger than the limit of {MAX_FILE_BYTES} bytes", param="file",
                       code="file_too_large")
    stored = request.app.state.job_store.add_file(tenant, purpose, upload.filename or "upload.jsonl", data)
    return file_object(stored)


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, tenant: str = Depends(tenant_of)):
    files = request.app.state.job_store.list_files(tenant, purpose)
    return {"object": "list", "data": [file_object(f) for f in files], "has_more": False}


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request, tenant: str = Depends(tenant_of)):
    return file_object(_file(request, file_id, tenant))


@router.get("/v1/files/{file_id}/content")
async def get_file_content(file_id: str, request: Request, tenant: str = Depends(tenant_of)):
    stored = _file(request, file_id, tenant)
    gone = ApiError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")  # deleted meanwhile
    return download_response(stored.path, "application/jsonl", gone, filename=stored.filename)


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request, tenant: str = Depends(tenant_of)):
    _file(request, file_id, tenant)
    request.app.state.job_store.delete_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def file_object(f: StoredFile) -> dict[str, Any]:
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": f.created_at, "filename": f.filename,
            "purpose": f.purpose, "status": "processed", "expires_at": f.expires_at, "status_details": None}


def _file(request: Request, file_id: str, tenant: str) -> StoredFile:
    stored = request.app.state.job_store.get_file(file_id, tenant)
    if stored is None:
        raise ApiError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")
    return stored


# -- batches ----------------------------------------------------------------------------------


@router.post("/v1/batches")
async def create_batch(body: BatchBody, request: Request, tenant: str = Depends(tenant_of)):
    state = request.app.state
    if body.endpoint not in BATCH_ENDPOINTS:
        raise ApiError(400, f"endpoint {body.endpoint!r} is not supported for batches; use one of "
                            f"{list(BATCH_ENDPOINTS)}", param="endpoint", code="invalid_value")
    if body.completion_window not in COMPLETION_WINDOWS:
        raise ApiError(400, f"completion_window must be one of {list(COMPLETION_WINDOWS)}",
                       param="completion_window", code="invalid_value")
    source = state.job_store.get_file(body.input_file_id, tenant)
    if source is None:
        raise ApiError(404, f"No such File object: {body.input_file_id}", param="input_file_id",
                       code="file_not_found")
    key = idempotency_key(request.headers)
    digest = request_digest(body.model_dump(mode="json"))  # a reused key must bring the same body (else 422)
    if not key or state.job_store.find_by_key(tenant, "batch", key, digest) is None:
        state.job_runner.check_quota(tenant, "batch")  # a retry never counts against the quota
    total = len(split_lines(source.path.read_bytes()))
    job, created = state.job_store.create_job(
        "batch", tenant, {"input_file_id": body.input_file_id, "endpoint": body.endpoint,
                          "completion_window": body.completion_window, "metadata": body.metadata, "total": total},
        prefix="batch", idempotency_key=key, request_hash=digest)
    if created:
        state.job_runner.schedule(job.id)
    return batch_object(state.job_store, job)


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None,
                       tenant: str = Depends(tenant_of)):
    store = request.app.state.job_store
    jobs = store.list_jobs("batch", tenant, limit=limit + 1, after=after)
    data = [batch_object(store, j) for j in jobs[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(jobs) > limit}


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request, tenant: str = Depends(tenant_of)):
    return batch_object(request.app.state.job_store, _batch(request, batch_id, tenant))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, tenant: str = Depends(tenant_of)):
    state = request.app.state
    _batch(request, batch_id, tenant)
    await state.job_runner.cancel(batch_id)
    return batch_object(state.job_store, state.job_store.get_job(batch_id))


def batch_object(store, job: Job) -> dict[str, Any]:
    r, result = job.request, job.result or {}
    completed, failed = store.line_counts(job.id)
    done = job.completed_at if job.status in ("completed", "failed", "cancelled", "expired") else None
    return {"id": job.id, "object": "batch", "endpoint": r["endpoint"], "errors": None,
            "input_file_id": r["input_file_id"], "completion_window": r["completion_window"],
            "status": _OPENAI_STATUS.get(job.status, job.status),
            "output_file_id": result.get("output_file_id"), "error_file_id": result.get("error_file_id"),
            "created_at": job.created_at, "in_progress_at": job.started_at, "expires_at": job.expires_at,
            "finalizing_at": None, "completed_at": done if job.status == "completed" else None,
            "failed_at": done if job.status == "failed" else None,
            "expired_at": done if job.status == "expired" else None, "cancelling_at": None,
            "cancelled_at": done if job.status == "cancelled" else None,
            "request_counts": {"total": r["total"], "completed": completed, "failed": failed},
            "metadata": r.get("metadata")}


def _batch(request: Request, batch_id: str, tenant: str) -> Job:
    job = request.app.state.job_store.get_job(batch_id, tenant, "batch")
    if job is None:
        raise ApiError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
    return job
