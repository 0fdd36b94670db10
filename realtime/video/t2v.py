"""Mode t2v: chunk-by-chunk generation on the video pipelines, streamed as each chunk is decoded.

Our video families are not causal, so a **chunk** is one video generation of `chunk_frames` frames
(block_idx k, seed + k). With `continuation` i2v (models that do image-to-video, e.g. LTX) chunk
k > 0 starts from chunk k-1's last frame (its first frame re-creates that frame, so it is not sent
again); with `none` chunks are independent text-to-video runs. The stream state (epoch, next
block, last frame, the output clock) lives here, per session: `block_idx` 0 starts a new epoch,
a later block without state is `session_state_lost` (SGLang's rule: a fresh state must never pass
for a continued one).

Overlap: chunk k's VAE decode is its own stage, so the next chunk's denoise may run meanwhile.
Without continuation the next chunk is submitted as soon as chunk k leaves the denoise stage;
with i2v it needs chunk k's last frame, so it is submitted when chunk k is decoded and its denoise
overlaps chunk k's encode, pacing and send instead. `lookahead` bounds the chunks in flight or
waiting to be sent. Output is paced at `fps` (frame j of the epoch is due at t0 + j / fps); a chunk
ready after its first frame was due is `late`, and the clock re-anchors rather than bursting.
Controls (prompt changes) apply from the next chunk not yet submitted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from pipelines.image_request import RequestError
from pipelines.video import VideoRequest
from realtime.video.models import size_of
from realtime.video.protocol import Control, ProtocolError, VideoSettings
from stages.events import CapacityError, EventKind

if TYPE_CHECKING:
    from realtime.video.session import VideoSession

log = logging.getLogger(__name__)


@dataclass
class ChunkState:
    """What continues a stream. Kept per session in this process: a restart loses it."""

    epoch: int  # advances at every block_idx 0
    next_block: int = 0  # the next block to submit
    sent_blocks: int = 0  # blocks sent: where a client that continues picks up
    last_frame: np.ndarray | None = None  # uint8 [H, W, 3]: chunk next_block - 1's last frame (i2v)
    frames_sent: int = 0  # frames of this epoch sent: the pacing clock and the output timeline
    clock0: float | None = None  # monotonic time frame 0 of the epoch was due


@dataclass
class ChunkJob:
    block_idx: int
    epoch: int
    handle: Any  # RequestHandle
    settings: VideoSettings  # what this chunk runs with
    controls: list[Control]  # controls applied from this chunk
    credits: int  # credits reserved for its messages
    submitted: float = field(default_factory=time.monotonic)
    times: dict[str, float] = field(default_factory=dict)  # stage -> start; "final" -> end (monotonic)
    frames: np.ndarray | None = None  # uint8 [T, H, W, 3]
    error: dict[str, Any] | None = None
    denoised: asyncio.Event = field(default_factory=asyncio.Event)  # left the denoise stage (or ended)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    watcher: asyncio.Task | None = None


class ChunkStream:
    def __init__(self, session: VideoSession):
        self.s = session
        self.state: ChunkState | None = None
        self._epochs = 0
        self._jobs: deque[ChunkJob] = deque()  # submitted, not yet sent; in block order
        self._pending: list[Control] = []  # controls for the next chunk
        self._produced_all = False  # the producer stopped: max_chunks reached, or a chunk failed
        self._failed = False  # a chunk failed: a continued stream cannot skip it, only block_idx 0 restarts
        self._room = asyncio.Event()  # the producer: a place in flight freed up, or the settings changed
        self._queued = asyncio.Event()  # the consumer: a chunk was submitted, or production ended
        self._tasks: list[asyncio.Task] = []
        self._out_seq = 0  # output messages of the session

    def start(self) -> None:
        self._epochs += 1
        self.state = ChunkState(epoch=self._epochs)
        self._produced_all = self._failed = False
        self.s.output.restart()
        self._tasks = [asyncio.create_task(self._produce()), asyncio.create_task(self._consume())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for job in self._jobs:
            job.handle.cancel()
            self.s.credits.refund(job.credits)
        self._jobs.clear()

    async def restart(self) -> None:
        """block_idx 0: a new epoch. Chunks of the old one are cancelled and never sent."""
        await self.stop()
        self.start()

    def check_continue(self, block_idx: int) -> None:
        """A client continuing at `block_idx` > 0 must find the state of the block before it."""
        if self.state is None:
            raise ProtocolError("session_state_lost", f"no stream state for block {block_idx - 1}: this session "
                                                      "never streamed it (or the server restarted); start again "
                                                      "at block_idx 0", "session.block_idx")
        if block_idx != self.state.sent_blocks:
            raise ProtocolError("block_idx_mismatch", f"the stream continues at block {self.state.sent_blocks}, "
                                                      f"not {block_idx}", "session.block_idx")

    def control(self, control: Control) -> int:
        """Queue a control for the next chunk not yet submitted; returns that chunk's block_idx."""
        self._pending.append(control)
        return self.state.next_block

    def wake(self) -> None:
        """Settings or credits changed. A stream that ended at max_chunks goes on if the limit was raised."""
        self._room.set()
        self._queued.set()
        state, settings = self.state, self.s.settings
        if (state is not None and self._tasks and self._tasks[0].done() and not self._failed
                and (settings.max_chunks is None or settings.max_chunks > state.next_block)):
            self._produced_all = False
            self._tasks[0] = asyncio.create_task(self._produce())

    # -- producer: submit chunks in order ----------------------------------------------------------
    async def _produce(self) -> None:
        state = self.state
        while True:
            settings = self.s.settings
            if settings.max_chunks is not None and state.next_block >= settings.max_chunks:
                break
            while len(self._jobs) >= self.s.settings.lookahead:
                self._room.clear()
                await self._room.wait()
            continuing = self._continues(self.s.settings, state.next_block)
            credits = self.s.output.messages_for(self.s.settings.chunk_frames - continuing)
            await self.s.credits.reserve(credits)
            try:
                job = self._submit(state, credits)  # settings and controls read here, with no await in between
            except RequestError as e:  # resolve() checked these settings: the engine refused something else
                self.s.credits.refund(credits)
                await self.s.error(e.code, f"chunk {state.next_block}: {e.message}", param=e.param)
                self._failed = True
                break
            if job is None:
                await asyncio.sleep(0.05)  # the engine was full
                continue
            self._jobs.append(job)
            self._queued.set()
            await (job.done if job.settings.continuation == "i2v" else job.denoised).wait()
            if job.error is not None:
                self._failed = True  # the consumer reports it; a continued stream cannot skip a chunk
                break
            if job.settings.continuation == "i2v":
                state.last_frame = job.frames[-1]
        self._produced_all = True
        self._queued.set()

    @staticmethod
    def _continues(settings: VideoSettings, block_idx: int) -> int:
        """1 when the chunk starts from the previous chunk's last frame (which is then not sent again)."""
        return int(settings.continuation == "i2v" and block_idx > 0)

    def _submit(self, state: ChunkState, credits: int) -> ChunkJob | None:
        settings, block = self.s.settings, state.next_block
        controls, self._pending = self._pending, []
        width, height = size_of(settings)
        image = Image.fromarray(state.last_frame) if self._continues(settings, block) else None
        request = VideoRequest(prompt=settings.prompt, negative_prompt=settings.negative_prompt, width=width,
                               height=height, num_frames=settings.chunk_frames, fps=settings.fps,
                               num_inference_steps=settings.steps, guidance_scale=settings.guidance_scale,
                               seed=(settings.seed + block) % 2**63, image=image, tenant=self.s.tenant,
                               session=self.s.id)
        try:
            handle = self.s.engine.submit_video(settings.model, request)
        except CapacityError:
            self._pending = controls + self._pending
            self.s.credits.refund(credits)
            return None
        except RequestError:
            self._pending = controls + self._pending
            raise
        state.next_block += 1
        job = ChunkJob(block, state.epoch, handle, settings, controls, credits)
        job.watcher = asyncio.create_task(self._watch(job))
        return job

    @staticmethod
    async def _watch(job: ChunkJob) -> None:
        async for event in job.handle:
            if event.kind is EventKind.STAGE_STARTED:
                job.times.setdefault(event.stage, time.monotonic())
                if event.stage == "vae_decode":
                    job.denoised.set()
            elif event.kind is EventKind.FINAL:
                job.frames = event.data["outputs"]["frames"]
            elif event.kind is EventKind.ERROR:
                job.error = event.data
        job.times["final"] = time.monotonic()
        job.denoised.set()
        job.done.set()

    # -- consumer: encode, pace and send chunks in order ---------------------------------------------
    async def _consume(self) -> None:
        state, announced = self.state, False
        while True:
            while not self._jobs:
                if self._produced_all and not announced:  # once per end of production
                    await self.s.emit({"type": "stream.done", "epoch": state.epoch, "blocks": state.sent_blocks})
                    announced = True
                self._queued.clear()
                await self._queued.wait()
            announced = False
            job = self._jobs[0]
            await job.done.wait()
            self._jobs.popleft()
            self._room.set()
            if job.error is not None:
                self.s.credits.refund(job.credits)
                self.s.count(frame_outcome="failed")
                await self.s.error(job.error.get("code", "internal_error"), f"chunk {job.block_idx}: "
                                   f"{job.error.get('message', '')}", param="block_idx", kind="server_error")
                continue
            await self._send(state, job)

    async def _send(self, state: ChunkState, job: ChunkJob) -> None:
        ready = time.monotonic()
        frames = job.frames[self._continues(job.settings, job.block_idx):]
        fps = job.settings.fps
        messages = await self.s.output.encode(frames, fps)
        if len(messages) != job.credits:  # the output format changed since the reservation
            if len(messages) > job.credits:
                await self.s.credits.reserve(len(messages) - job.credits)
            else:
                self.s.credits.refund(job.credits - len(messages))
        if state.clock0 is None:
            state.clock0 = ready
        due = state.clock0 + state.frames_sent / fps
        late = ready > due
        if late:  # re-anchor: the rest of the stream is due from now, not in a burst
            state.clock0 = ready - state.frames_sent / fps
        first_frame, waited, send_start = state.frames_sent, 0.0, time.monotonic()
        for message in messages:
            wait = state.clock0 + state.frames_sent / fps - time.monotonic()
            if wait > 0:
                waited += wait
                await asyncio.sleep(wait)
            header = {"seq": self._out_seq, "block_idx": job.block_idx, "epoch": job.epoch,
                      "frame_idx": state.frames_sent, "pts_ms": round(state.frames_sent * 1000 / fps, 3),
                      "capture_ts_ms": None, **message.header}
            await self.s.emit_media(header, message.payload)
            self.s.credits.sent()
            self._out_seq += 1
            state.frames_sent += message.header.get("frames", 1)
        state.sent_blocks = job.block_idx + 1
        times = job.times
        denoise_start = times.get("denoise", job.submitted)
        decode_start = times.get("vae_decode", times["final"])
        ids = [c.event_id for c in job.controls if c.event_id is not None]
        await self.s.emit({"type": "chunk.done", "block_idx": job.block_idx, "epoch": job.epoch,
                           "event_id": ids[-1] if ids else None, "control_event_ids": ids,
                           "frames": len(frames), "first_frame_idx": first_frame,
                           "denoise_ms": _ms(decode_start - denoise_start),
                           "decode_ms": _ms(times["final"] - decode_start),
                           "send_ms": _ms(time.monotonic() - send_start - waited), "pace_wait_ms": _ms(waited),
                           "total_ms": _ms(time.monotonic() - job.submitted), "late": late,
                           "dropped_inputs": 0, "skipped_inputs": 0})
        self.s.count(frame_outcome="sent", frames=len(frames), latency_s=time.monotonic() - job.submitted)
        await self.s.overloaded(late)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)

