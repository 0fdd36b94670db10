"""Mode img2img: camera frames in, stylised frames out, with StreamDiffusion's techniques on the engine.

* **Stream batch.** Up to `lookahead` frames of a session are in the engine at once. The denoise
  stage batches requests at different timesteps into one forward (DESIGN §5), so one denoiser call
  advances several frames at different steps, as StreamDiffusion's rolling latent buffer does;
  `lookahead` 1 turns it off. Frames of other sessions with the same model and size join the same
  forwards (their batch keys are equal), and leave them alone when late.
* **Conditioning once per prompt**: the prompt-embedding cache; every frame uses the session seed's
  noise (StreamDiffusion's fixed noise), so a frame's output equals a solo image-to-image run.
* **Newest input wins**: one slot; a newer frame replaces the waiting one (`superseded`).
* **Deadlines before GPU work**: a frame older than `frame_deadline_ms` is dropped when it is taken
  from the slot and again right before it is submitted; one that expires in the engine is cancelled
  at its next step boundary; an output is never sent past its deadline (`deadline`).
* **Similarity filter** (optional): an input whose cosine similarity to the last processed input is
  >= the threshold is skipped (`similar`), at most `max_similar_skip` in a row (a deterministic form
  of StreamDiffusion's stochastic filter).
Outputs go out in input order; `chunk.done` follows each with its timings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pipelines.image_request import ImageRequest, RequestError, Task
from realtime.video.models import size_of
from realtime.video.protocol import INPUT_CONTENT_TYPES, MediaHeader
from stages.events import CapacityError, EventKind

if TYPE_CHECKING:
    from realtime.video.session import VideoSession

log = logging.getLogger(__name__)
LATE_SHARE = 0.8  # an output older than this share of its deadline counts as late for the overload ladder


def now_ms() -> float:
    return time.time() * 1000.0


@dataclass
class InputFrame:
    header: MediaHeader
    payload: bytes
    arrived_ms: float  # server wall clock at arrival
    capture_ms: float  # the deadline counts from here (the client's capture time, else the arrival)
    stale_on_arrival: bool  # already past the deadline when it came (the client's lag, not our overload)


@dataclass
class FrameJob:
    """One input frame in the engine."""

    frame: InputFrame
    handle: Any  # RequestHandle
    submitted_ms: float
    times: dict[str, float] = field(default_factory=dict)  # stage name -> when it started; "final" -> end
    outputs: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    expired: bool = False  # cancelled by its deadline
    done: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None  # cancels the request when its deadline passes
    watcher: asyncio.Task | None = None  # reads the request's events


class SimilarityFilter:
    """Skips inputs nearly equal to the last processed one (cosine of [-1, 1] pixels on a coarse grid)."""

    def __init__(self, grid: int = 32):
        self.grid = grid
        self._last: np.ndarray | None = None
        self._run = 0  # consecutive skips

    def skip(self, pixels: np.ndarray, threshold: float | None, max_skip: int) -> bool:
        h, w = pixels.shape[:2]
        coarse = pixels[:: max(1, h // self.grid), :: max(1, w // self.grid)].astype(np.float32) / 127.5 - 1.0
        vector = coarse.ravel()
        if threshold is not None and self._last is not None and self._last.shape == vector.shape:
            norms = float(np.linalg.norm(vector) * np.linalg.norm(self._last))
            cosine = float(vector @ self._last) / norms if norms > 0 else 1.0
            if cosine >= threshold and self._run < max_skip:
                self._run += 1
                return True
        self._last, self._run = vector, 0
        return False


class Img2ImgStream:
    def __init__(self, session: VideoSession):
        self.s = session
        self._slot: InputFrame | None = None
        self._inflight: deque[FrameJob] = deque()  # in input order
        self._wake = asyncio.Event()  # the pump: an input, a free place in flight or a credit may be there
        self._landed = asyncio.Event()  # delivery: a frame entered the engine
        self._filter = SimilarityFilter()
        self._tasks: list[asyncio.Task] = []
        self.outputs = 0  # output frames sent: their block_idx
        self.dropped = 0  # inputs dropped (deadline, superseded) since the last chunk.done
        self.skipped = 0  # inputs skipped as similar since the last chunk.done

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._deliver())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for job in self._inflight:
            job.handle.cancel()
        self._inflight.clear()

    def wake(self) -> None:
        self._wake.set()

    async def offer(self, header: MediaHeader, payload: bytes) -> None:
        """A new input frame takes the slot; the one waiting there (if any) is superseded."""
        arrived = now_ms()
        capture = header.capture_ts_ms if header.capture_ts_ms is not None else arrived
        deadline = self.s.settings.frame_deadline_ms
        frame = InputFrame(header, payload, arrived, capture, arrived - capture > deadline)
        old, self._slot = self._slot, frame
        self.wake()
        if old is not None:
            await self._drop(old, "superseded")

    # -- input side: slot -> checks -> engine ---------------------------------------------------
    async def _pump(self) -> None:
        while True:
            frame = await self._take()
            try:
                await self._submit(frame)
            except Exception as exc:  # a bug must not end the session's stream silently
                log.exception("video session %s: frame %s failed", self.s.id, frame.header.seq)
                await self.s.error("internal_error", f"frame {frame.header.seq}: {type(exc).__name__}",
                                   param="frame", kind="server_error")

    async def _take(self) -> InputFrame:
        """Wait for an input, a free place in flight and a credit for its output."""
        while True:
            self._wake.clear()
            if (self._slot is not None and len(self._inflight) < self.s.settings.lookahead
                    and self.s.credits.try_reserve()):
                frame, self._slot = self._slot, None
                return frame
            await self._wake.wait()

    async def _submit(self, frame: InputFrame) -> None:
        settings, engine = self.s.settings, self.s.engine
        if self._expired(frame):
            return await self._dropped_after_reserve(frame, "deadline")
        try:
            decoded = await engine.run_media("decode_image", frame.payload, engine.config.media.image, param="frame")
        except RequestError as e:
            self.s.credits.refund()
            self.s.count(frame_outcome="invalid")
            return await self.s.error(e.code, f"frame {frame.header.seq}: {e.message}", param="frame")
        if decoded.format != INPUT_CONTENT_TYPES[frame.header.content_type]:
            self.s.credits.refund()
            self.s.count(frame_outcome="invalid")
            return await self.s.error("content_type_mismatch", f"frame {frame.header.seq} is labelled "
                                      f"{frame.header.content_type} but holds {decoded.format}",
                                      param="frame.content_type")
        if self._filter.skip(decoded.pixels, settings.similarity_threshold, settings.max_similar_skip):
            self.skipped += 1
            return await self._dropped_after_reserve(frame, "similar")
        if self._expired(frame):  # the decode took time: check again right before GPU work
            return await self._dropped_after_reserve(frame, "deadline")
        width, height = size_of(settings)
        request = ImageRequest(prompt=settings.prompt, task=Task.IMAGE_TO_IMAGE,
                               negative_prompt=settings.negative_prompt, width=width, height=height,
                               num_inference_steps=settings.steps, guidance_scale=settings.guidance_scale,
                               seed=settings.seed, strength=settings.strength,
                               image=decoded.to_pil(), tenant=self.s.tenant, session=self.s.id)
        try:
            handle = engine.submit_image(settings.model, request)
        except RequestError as e:
            self.s.credits.refund()
            return await self.s.error(e.code, f"frame {frame.header.seq}: {e.message}", param=e.param)
        except CapacityError:  # the engine is full: the frame waits in the slot again (unless a newer one came)
            self.s.credits.refund()
            if self._slot is None:
                self._slot = frame
            await self.s.overloaded(True)
            await asyncio.sleep(0.01)
            return
        job = FrameJob(frame, handle, now_ms())
        remaining_s = (frame.capture_ms + settings.frame_deadline_ms - now_ms()) / 1000
        job.timer = asyncio.get_running_loop().call_later(max(0.0, remaining_s), self._expire, job)
        self._inflight.append(job)
        job.watcher = asyncio.create_task(self._watch(job))
        self._landed.set()

    def _expired(self, frame: InputFrame) -> bool:
        return now_ms() - frame.capture_ms > self.s.settings.frame_deadline_ms

    @staticmethod
    def _expire(job: FrameJob) -> None:
        if not job.done.is_set():
            job.expired = True
            job.handle.cancel()  # leaves the denoise batch at the next step boundary

    @staticmethod
    async def _watch(job: FrameJob) -> None:
        async for event in job.handle:
            if event.kind is EventKind.STAGE_STARTED:
                job.times.setdefault(event.stage, now_ms())
            elif event.kind is EventKind.FINAL:
                job.outputs = event.data["outputs"]
            elif event.kind is EventKind.ERROR:
                job.error = event.data
        job.times["final"] = now_ms()
        job.done.set()

    # -- output side: engine -> encode -> send, in input order ----------------------------------
    async def _deliver(self) -> None:
        while True:
            while not self._inflight:
                self._landed.clear()
                await self._landed.wait()
            job = self._inflight[0]
            await job.done.wait()
            self._inflight.popleft()
            if job.timer is not None:
                job.timer.cancel()
            self.wake()
            await self._finish(job)

    async def _finish(self, job: FrameJob) -> None:
        frame, settings = job.frame, self.s.settings
        if job.error is not None:
            self.s.credits.refund()
            if job.expired or job.error.get("code") in ("cancelled", "deadline_exceeded"):
                return await self._drop(frame, "deadline", late=True)
            self.s.count(frame_outcome="failed")
            return await self.s.error(job.error.get("code", "internal_error"), f"frame {frame.header.seq}: "
                                      f"{job.error.get('message', '')}", param="frame", kind="server_error")
        if self._expired(frame):  # never send an output older than its deadline
            self.s.credits.refund()
            return await self._drop(frame, "deadline", late=True)
        encode_start = now_ms()
        pixels = np.asarray(job.outputs["images"][0].convert("RGB"))
        (message,) = await self.s.output.encode(pixels[None], settings.fps)
        sent_ms = now_ms()
        age = sent_ms - frame.capture_ms
        if age > settings.frame_deadline_ms:
            self.s.credits.refund()
            return await self._drop(frame, "deadline", late=True)
        h = frame.header
        header = {"seq": h.seq, "block_idx": self.outputs, "frame_idx": h.frame_idx, "pts_ms": h.pts_ms,
                  "capture_ts_ms": h.capture_ts_ms, "sent_ts_ms": round(sent_ms, 3), **message.header}
        await self.s.emit_media(header, message.payload)
        self.s.credits.sent()
        late = age > LATE_SHARE * settings.frame_deadline_ms
        times = job.times
        denoise_start = times.get("denoise", job.submitted_ms)
        decode_start = times.get("vae_decode", times["final"])
        await self.s.emit({"type": "chunk.done", "block_idx": self.outputs, "seq": h.seq, "frames": 1,
                           "denoise_ms": round(decode_start - denoise_start, 3),
                           "decode_ms": round(times["final"] - decode_start, 3),
                           "send_ms": round(now_ms() - encode_start, 3),
                           "total_ms": round(now_ms() - frame.capture_ms, 3),
                           "late": late, "dropped_inputs": self.dropped, "skipped_inputs": self.skipped})
        self.dropped = self.skipped = 0
        self.outputs += 1
        self.s.count(frame_outcome="sent", latency_s=age / 1000)
        await self.s.overloaded(late)

    async def _dropped_after_reserve(self, frame: InputFrame, reason: str) -> None:
        self.s.credits.refund()
        await self._drop(frame, reason, late=reason == "deadline" and not frame.stale_on_arrival)

    async def _drop(self, frame: InputFrame, reason: str, *, late: bool = False) -> None:
        if reason != "similar":
            self.dropped += 1
        self.s.count(frame_outcome=reason)
        await self.s.emit({"type": "frame.dropped", "seq": frame.header.seq, "frame_idx": frame.header.frame_idx,
                           "reason": reason})
        if late:
            await self.s.overloaded(True)
