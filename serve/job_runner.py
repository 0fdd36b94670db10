"""JobRunner: runs the store's video and batch jobs in the server's event loop, and resumes them on start.

Policy (DESIGN §10, issue 7):
* Recovery: on start (once the engine is ready) queued jobs run; in_progress videos restart from
  the beginning; batches resume after the lines that already have a result row.
* Priority: batch work runs at lower priority than interactive requests. At most
  `batch_line_concurrency` batch lines are in flight across all batches (default 2), so a large
  batch adds a bounded, small load to the engine's queues while interactive requests take the
  rest of each step's batch; videos run at most `video_concurrency` at once.
* Bursts: video jobs created in a burst start together (a start window of at most `video_start_window_s`), so they
  share the text-encode batch and every denoise step; a job started alone would run its own text encode and steps
  while the rest of its burst waits a batch behind, and they all finish later.
* Limits: a tenant holds at most `max_jobs_per_tenant` unfinished jobs of each kind; more answer 429.
* Retries: a video whose run fails with a retryable error (ErrorKind BUSY or UNAVAILABLE: a full queue, a replica
  lost with its process) runs again from the beginning, and a batch line answered 429 or 503 is sent again after
  its Retry-After, up to `retries` times; only the last try is recorded, so each job completes once and each line
  has one result, whatever crashed meanwhile.

Results are written atomically (serve/jobs.py) before the row that marks a job completed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from serve.batch_lines import LineError, error_record, parse_line, run_line, split_lines
from serve.jobs import VIDEO_REQUEST_FIELDS, JobStore, StorageFull, write_atomic
from stages.events import ErrorKind, EventKind, StageError

log = logging.getLogger(__name__)
# What a job that failed on an unexpected exception says: the details go to the log, never to the client (as a 500).
MAX_RETRY_DELAY_S = 30.0  # the longest a retry waits, whatever Retry-After says
INTERNAL_JOB_ERROR = {"code": "internal_error",
                      "message": "the job failed inside the server; the error has been logged"}


@dataclass(frozen=True)
class JobPolicy:
    batch_line_concurrency: int = 2  # batch lines in flight across all batches
    video_concurrency: int = 2  # video jobs running at once
    max_jobs_per_tenant: int = 8  # unfinished jobs per tenant and kind; more answer 429
    result_ttl_s: int = 7 * 86400  # completed results stay downloadable this long
    ready_poll_s: float = 0.2  # how often recovery checks whether the engine is ready
    # The longest a video job waits for the jobs created right after it, to reach the engine with them (a quarter of
    # this without a new job ends the wait sooner); 0: each starts at once. Once past it a job waits only for a slot.
    video_start_window_s: float = 0.02
    expiry_sweep_s: float = 600.0  # how often expired results are deleted
    retries: int = 3  # tries again after a retryable failure, per video job and per batch line
    retry_delay_s: float = 1.0  # the wait before one when the error names none (a reply's Retry-After does)
    storage_retry_s: float = 5.0  # a batch that found the job store's disk full tries again this much later

    def __post_init__(self):
        for name in ("batch_line_concurrency", "video_concurrency", "max_jobs_per_tenant", "result_ttl_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"jobs.{name} must be >= 1, got {getattr(self, name)}")
        if self.retries < 0 or not 0 <= self.retry_delay_s <= MAX_RETRY_DELAY_S:
            raise ValueError(f"jobs.retries must be >= 0 (got {self.retries}) and jobs.retry_delay_s in "
                             f"[0, {MAX_RETRY_DELAY_S}] seconds (got {self.retry_delay_s})")
        if not 0 <= self.video_start_window_s <= 1:
            raise ValueError(f"jobs.video_start_window_s must be in [0, 1] seconds, got {self.video_start_window_s}")


class _StartWindow:
    """The video jobs that start together: it closes once no job has joined it for a quarter of its length (a
    burst's POSTs arrive ~2 ms apart), or its length after it opened (a steady stream of jobs does not hold it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, length_s: float):
        self._loop = loop
        self._length_s = length_s
        self._opened = loop.time()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self.join()

    def join(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        close_at = min(self._opened + self._length_s, self._loop.time() + self._length_s / 4)
        self._timer = self._loop.call_at(close_at, self._close)

    def _close(self) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class JobRunner:
    """Owns the asyncio tasks that run jobs; the store owns their state."""

    def __init__(self, store: JobStore, engine, app, policy: JobPolicy = JobPolicy()):
        self.store = store
        self.engine = engine
        self.app = app  # batch lines run through the app's own endpoints (serve/batch_lines.py)
        self.policy = policy
        self._tasks: dict[str, asyncio.Task] = {}
        self._handles: dict[str, Any] = {}  # video job id -> the engine's RequestHandle while it runs
        self._batch_slots: asyncio.Semaphore | None = None
        self._video_slots: asyncio.Semaphore | None = None
        self._start_window: _StartWindow | None = None  # the last start window (closed or open)
        self._recovery: asyncio.Task | None = None
        self._recovered = False  # until then, recovery (not schedule) starts every stored job

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._batch_slots = asyncio.Semaphore(self.policy.batch_line_concurrency)
        self._video_slots = asyncio.Semaphore(self.policy.video_concurrency)
        self._recovery = asyncio.create_task(self._recover())

    async def stop(self) -> None:
        tasks = [t for t in [self._recovery, *self._tasks.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _recover(self) -> None:
        while not getattr(self.engine, "ready", False):
            await asyncio.sleep(self.policy.ready_poll_s)
        self.store.expire()
        for job in self.store.jobs_with_status("in_progress", "finalizing"):
            if job.kind == "video":
                self.store.update_job(job.id, status="queued", progress=0)  # restarts from the beginning
        for job in self.store.jobs_with_status("cancelling"):
            self.store.finish_job(job.id, "cancelled")
        self._recovered = True
        for job in self.store.jobs_with_status("queued", "in_progress", "finalizing"):
            self._spawn(job.id)
        while True:  # then drop expired results now and then
            await asyncio.sleep(self.policy.expiry_sweep_s)
            self.store.expire()

    def schedule(self, job_id: str) -> None:
        """Run a queued job (no-op while the engine is still loading: recovery picks it up)."""
        if self._recovered:
            self._spawn(job_id)

    def _spawn(self, job_id: str) -> None:
        if job_id in self._tasks:
            return
        job = self.store.get_job(job_id)
        run = self._run_video if job.kind == "video" else self._run_batch
        task = asyncio.create_task(run(job_id))
        self._tasks[job_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(job_id, None))

    def check_quota(self, tenant: str, kind: str) -> None:
        if self.store.count_active(tenant, kind) >= self.policy.max_jobs_per_tenant:
            raise StageError("too_many_jobs", f"this tenant already has {self.policy.max_jobs_per_tenant} unfinished "
                                              f"{kind} jobs (the per-tenant limit); wait for one to finish",
                             kind=ErrorKind.BUSY)

    # -- cancel ---------------------------------------------------------------------------
    async def cancel(self, job_id: str) -> None:
        """Cancel a queued or running job; a running video stops within a denoise step."""
        job = self.store.get_job(job_id)
        if job is None or job.status in ("completed", "failed", "cancelled", "expired"):
            return
        self.store.update_job(job_id, status="cancelling")
        handle = self._handles.get(job_id)
        if handle is not None:
            handle.cancel()
        task = self._tasks.get(job_id)
        if task is not None and job.kind == "batch":
            task.cancel()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        if self.store.get_job(job_id).status == "cancelling":
            self.store.finish_job(job_id, "cancelled")

    # -- video ----------------------------------------------------------------------------
    async def _run_video(self, job_id: str) -> None:
        await self._burst()
        async with self._video_slots:
            job = self.store.get_job(job_id)
            if job.status != "queued":
                return
            # Not fsynced (durable=False): recovery restarts an in_progress or finalizing video from the beginning.
            self.store.update_job(job_id, status="in_progress", started_at=int(time.time()), progress=0,
                                  durable=False)
            try:
                outputs = await self._video_outputs(job_id, job)
                self.store.update_job(job_id, status="finalizing", durable=False)
                await self._write_results(job_id, outputs)
                self.store.finish_job(job_id, "completed", result={"seed": outputs.get("seed"),
                                                                    "fps": outputs["fps"]},
                                      ttl_s=self.policy.result_ttl_s)
            except StageError as e:
                if self.store.get_job(job_id).status == "cancelling":
                    self.store.finish_job(job_id, "cancelled")
                else:
                    self.store.finish_job(job_id, "failed", error={"code": e.code, "message": e.message})
            except asyncio.CancelledError:
                raise  # the server is stopping: the job stays in_progress and restarts on the next start
            except Exception:  # a failed job is recorded, never silently lost
                log.exception("video job %s failed", job_id)
                self.store.finish_job(job_id, "failed", error=INTERNAL_JOB_ERROR)

    async def _video_outputs(self, job_id: str, job) -> dict[str, Any]:
        """The video's outputs; a retryable failure (a full queue, a lost replica) runs it again from the beginning,
        at most `retries` times."""
        for attempt in range(self.policy.retries + 1):
            try:
                return await self._video_attempt(job_id, job)
            except StageError as e:
                if not e.kind.retryable or attempt == self.policy.retries:
                    raise
                log.warning("video job %s: %s (%s); it runs again (retry %d of %d)", job_id, e.code, e.message,
                            attempt + 1, self.policy.retries)
                self.store.update_job(job_id, progress=0, durable=False)
                if not await self._wait_unless_cancelled(job_id, getattr(e, "retry_after_s", None)):
                    raise StageError("cancelled", "the job was cancelled", kind=ErrorKind.CANCELLED) from e
        raise AssertionError("unreachable")

    async def _video_attempt(self, job_id: str, job) -> dict[str, Any]:
        from pipelines.video import VideoRequest

        r = dict(job.request)
        image = None
        ref = self.store.results_dir / f"{job_id}.input"
        if r.pop("has_input_reference", False):
            image = await asyncio.to_thread(self.engine.decode_image, ref.read_bytes(), param="input_reference")
            if self.store.get_job(job_id).status == "cancelling":  # cancel() found no handle to cancel
                raise StageError("cancelled", "the job was cancelled", kind=ErrorKind.CANCELLED)
        fields = {k: r[k] for k in VIDEO_REQUEST_FIELDS if k in r}
        handle = self.engine.submit_video(r["model"], VideoRequest(**fields, image=image, tenant=job.tenant))
        self._handles[job_id] = handle
        try:
            outputs = None
            progress = 0
            async for event in handle:
                if event.kind is EventKind.PROGRESS:
                    now = min(99, int(100 * event.data["step"] / max(1, event.data["total"])))
                    if now > progress:  # monotonic
                        progress = now
                        self.store.update_job(job_id, progress=progress, durable=False)
                elif event.kind is EventKind.FINAL:
                    outputs = event.data["outputs"]
                elif event.kind is EventKind.ERROR:
                    raise StageError.from_event(event)
            if outputs is None:
                raise StageError("cancelled", "the job was cancelled", kind=ErrorKind.CANCELLED)
            return outputs
        finally:
            self._handles.pop(job_id, None)
            if not handle.done:
                handle.cancel()

    async def _wait_unless_cancelled(self, job_id: str, hint_s: float | None) -> bool:
        """Wait before a retry (the hint, else retry_delay_s); False when the job was cancelled meanwhile."""
        delay = min(MAX_RETRY_DELAY_S, self.policy.retry_delay_s if hint_s is None else hint_s)
        end = time.monotonic() + delay
        while self.store.get_job(job_id).status != "cancelling":
            if time.monotonic() >= end:
                return True
            await asyncio.sleep(min(0.05, max(0.0, end - time.monotonic())))
        return False

    async def _burst(self) -> None:
        """Wait until the start window closes, opening one if none is open, else joining it (see _StartWindow).
        The jobs it held then take their video slots and submit in one go, none awaiting between its slot and its
        submit (unless it has an input_reference to decode), so the engine's text-encode pool batches them."""
        length_s = self.policy.video_start_window_s
        if length_s <= 0:
            return
        loop = asyncio.get_running_loop()
        if self._start_window is None or self._start_window.closed.done():
            self._start_window = _StartWindow(loop, length_s)
        else:
            self._start_window.join()
        await asyncio.shield(self._start_window.closed)  # a job cancelled meanwhile leaves it open for the rest

    async def _write_results(self, job_id: str, outputs: dict[str, Any]) -> None:
        """The MP4 and the thumbnail (a JPEG of the first frame), encoded at once in the media workers and each
        written, off the event loop, as soon as it is encoded. Both have ended when this returns; it raises the
        first error, the MP4's before the thumbnail's."""
        frames = outputs["frames"]

        def mp4() -> bytes:  # with the model's soundtrack, when it makes one (LTX-2)
            sound = {"audio": outputs["audio"], "sample_rate": outputs["sample_rate"]} if "audio" in outputs else {}
            return self.engine.media().run("encode_video", frames, outputs["fps"], "mp4", **sound)

        def thumbnail() -> bytes:
            return self.engine.encode_images([_first_frame(frames)], "jpeg")[0]

        async def write(suffix: str, encode) -> None:
            data = await asyncio.to_thread(encode)
            await asyncio.to_thread(write_atomic, self.store.results_dir / f"{job_id}{suffix}", data)

        ended = await asyncio.gather(write(".mp4", mp4), write(".jpg", thumbnail), return_exceptions=True)
        for result in ended:
            if isinstance(result, BaseException):
                raise result

    # -- batch ----------------------------------------------------------------------------
    async def _run_batch(self, job_id: str) -> None:
        """Run the batch's lines without a result. A full disk pauses it: the lines committed stay, and the rest run
        once a try finds room (the batch stays in_progress meanwhile, as after a restart)."""
        while True:
            try:
                return await self._run_batch_once(job_id)
            except StorageFull as e:
                log.warning("batch %s paused: %s; trying again in %.0f s", job_id, e.message,
                            self.policy.storage_retry_s)
                await asyncio.sleep(self.policy.storage_retry_s)

    async def _run_batch_once(self, job_id: str) -> None:
        job = self.store.get_job(job_id)
        if job.status == "queued":
            self.store.update_job(job_id, status="in_progress", started_at=int(time.time()))
        request = job.request
        source = self.store.get_file(request["input_file_id"])
        try:
            if source is None:
                raise FileNotFoundError(request["input_file_id"])
            lines = split_lines(source.path.read_bytes())
            done = self.store.done_lines(job_id)
            headers = _auth_headers(self.app.state.api_keys, job.tenant)
            transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)  # a 500 is a line result
            async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
                await asyncio.gather(*(self._batch_line(client, job_id, i, text, request["endpoint"], headers)
                                       for i, text in enumerate(lines) if i not in done))
            await self._finish_batch(job_id, "completed")
        except asyncio.CancelledError:
            if self.store.get_job(job_id).status == "cancelling":
                await self._finish_batch(job_id, "cancelled")  # partial results stay downloadable
            raise
        except StorageFull:
            raise
        except Exception:
            log.exception("batch %s failed", job_id)
            self.store.finish_job(job_id, "failed", error=INTERNAL_JOB_ERROR)

    async def _batch_line(self, client: httpx.AsyncClient, job_id: str, index: int, text: str, endpoint: str,
                          headers: dict[str, str]) -> None:
        try:
            line = parse_line(text, index, endpoint)
        except LineError as e:
            self.store.put_line(job_id, index, e.custom_id, False, error_record(e.custom_id, e.code, e.message))
            return
        async with self._batch_slots:  # the low-priority lane: a bounded number of batch lines in flight
            ok, record = await run_line(client, line, headers, retries=self.policy.retries,
                                        retry_delay_s=self.policy.retry_delay_s)
        self.store.put_line(job_id, index, line.custom_id, ok, record)

    async def _finish_batch(self, job_id: str, status: str) -> None:
        """Compose the output and error files from the line rows (one line per input line), then finish."""
        self.store.update_job(job_id, status="finalizing" if status == "completed" else "cancelling")
        job = self.store.get_job(job_id)
        result = {}
        for ok, key in ((True, "output_file_id"), (False, "error_file_id")):
            records = self.store.lines(job_id, ok)
            if records:
                data = "".join(json_line(r) for r in records).encode()
                stored = self.store.add_file(job.tenant, "batch_output", f"{job_id}_{key[:-8]}.jsonl", data,
                                             ttl_s=self.policy.result_ttl_s)
                result[key] = stored.id
        self.store.finish_job(job_id, status, result=result, ttl_s=self.policy.result_ttl_s)


def json_line(record: dict) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


def _first_frame(frames):
    from PIL import Image

    return Image.fromarray(frames[0])  # [H, W, 3] uint8


def _auth_headers(api_keys: dict[str, str], tenant: str) -> dict[str, str]:
    """A key of the batch's tenant, so its lines run as that tenant (none needed without keys)."""
    for key, who in api_keys.items():
        if who == tenant:
            return {"authorization": f"Bearer {key}"}
    return {}
