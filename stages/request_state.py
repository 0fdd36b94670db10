"""Per-request bookkeeping owned by the executor, and the handle a caller holds."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, AsyncIterator, Iterator

from stages.events import Event, EventKind, StageError


class RequestState:
    """Everything the runtime knows about one in-flight request.

    The event buffer is written from worker threads and read from either a thread
    (`iter_events`) or an asyncio loop (`aiter_events`); both read the same buffer.
    """

    def __init__(self, request_id: str, *, deadline: float | None, model: str = "",
                 fence: Callable[[], bool] | None = None):
        self.request_id = request_id
        self.model = model  # metric label only
        self.deadline = deadline  # time.monotonic() value, or None
        self.fence = fence  # False once the caller's epoch has passed (a voice session's barge-in): every node stops
        self.created_at = time.monotonic()
        self.outputs: dict[str, dict[str, Any]] = {}  # node name -> outputs, freed on close
        self._events: list[Event] = []
        self._closed = False
        self._cancel_requested = threading.Event()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []  # woken by every event
        # woken by the terminal event only: a caller that wants the result is not woken once per token
        self._final_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._finished = threading.Event()
        self._on_close: list = []  # callbacks run exactly once when the request closes
        self._observers: list[Callable[[Event], None]] = []  # see every event as it is written (streaming edges)

    # -- state flags read by workers at batch/step boundaries --------------------------
    @property
    def cancelled(self) -> bool:
        return self._cancel_requested.is_set()

    @property
    def closed(self) -> bool:
        return self._closed

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (now or time.monotonic()) > self.deadline

    def fenced(self) -> bool:
        """The caller's epoch has passed: nothing more of this request may run or reach the caller."""
        return self.fence is not None and not self.fence()

    def should_stop(self) -> bool:
        """True when a worker must drop this request's work at the next boundary."""
        return self._closed or self.cancelled or self.expired() or self.fenced()

    # -- writing ----------------------------------------------------------------------
    def emit(self, kind: EventKind, *, stage: str | None = None, **data) -> bool:
        """Append an event. Dropped (returns False) once the request is closed (a terminal event came), and,
        short of the terminal one, once it is fenced."""
        if kind not in (EventKind.FINAL, EventKind.ERROR) and self.fenced():
            return False
        with self._cond:
            if self._closed:
                return False
            event = Event(kind, self.request_id, len(self._events), stage, data)
            self._events.append(event)
            if event.terminal:
                self._closed = True
                self._finished.set()
            self._cond.notify_all()
            waiters, observers = list(self._waiters), list(self._observers)
            if event.terminal:
                waiters += self._final_waiters
        for observe in observers:  # in the writer's thread, outside the lock (an observer may emit)
            observe(event)
        for loop, flag in waiters:
            try:
                loop.call_soon_threadsafe(flag.set)
            except RuntimeError:  # the caller's loop has gone away
                pass
        if event.terminal:
            self._run_close_callbacks()
        return True

    def fail(self, error: StageError) -> bool:
        return self.emit(EventKind.ERROR, code=error.code, message=error.message, param=error.param,
                         error_kind=error.kind.value)

    def request_cancel(self) -> None:
        self._cancel_requested.set()

    def observe(self, callback: Callable[[Event], None]) -> None:
        """Call `callback(event)` for every event written from now on, in the writing thread."""
        with self._cond:
            self._observers.append(callback)

    def on_close(self, callback) -> None:
        with self._cond:
            if not self._closed:
                self._on_close.append(callback)
                return
        callback()

    def _run_close_callbacks(self) -> None:
        with self._cond:
            callbacks, self._on_close = self._on_close, []
            self.outputs, self._observers = {}, []
        for callback in callbacks:
            callback()

    # -- reading ----------------------------------------------------------------------
    def iter_events(self, timeout: float | None = None) -> Iterator[Event]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._events):
                    if self._closed:
                        return
                    if not self._cond.wait(timeout):
                        raise TimeoutError(f"no event from request {self.request_id} within {timeout}s")
                event = self._events[i]
            i += 1
            yield event
            if event.terminal:
                return

    def final_event(self, timeout: float | None = None) -> Event:
        """The terminal event, once it is written (TimeoutError after `timeout` seconds)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not end within {timeout}s")
        return self._events[-1]

    async def afinal_event(self) -> Event:
        """The terminal event, awaited; the loop is woken once, by it (not by every delta before it)."""
        loop = asyncio.get_running_loop()
        flag = asyncio.Event()
        with self._cond:
            if self._closed:
                return self._events[-1]
            self._final_waiters.append((loop, flag))
        try:
            await flag.wait()
            return self._events[-1]
        finally:
            with self._cond:
                self._final_waiters.remove((loop, flag))

    async def aiter_events(self) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        flag = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, flag))
        try:
            i = 0
            while True:
                with self._cond:
                    ready = self._events[i:]
                    closed = self._closed
                    flag.clear()
                for event in ready:
                    i += 1
                    yield event
                    if event.terminal:
                        return
                if closed and not ready:
                    return
                if not ready:
                    await flag.wait()
        finally:
            with self._cond:
                self._waiters.remove((loop, flag))


class RequestHandle:
    """What `GraphExecutor.submit` returns: the ordered event stream, the result, cancel()."""

    def __init__(self, state: RequestState, executor):
        self._state = state
        self._executor = executor

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def done(self) -> bool:
        return self._state.closed

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        return self._state.iter_events(timeout)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._state.aiter_events()

    def cancel(self) -> None:
        self._executor.cancel(self._state.request_id)

    def on_close(self, callback) -> None:
        """Call `callback` once the request has ended (now, if it has)."""
        self._state.on_close(callback)

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the request ends (at most `timeout` seconds); return the final outputs or raise its
        StageError."""
        return _outputs_of(self._state.final_event(timeout), self.request_id)

    async def aresult(self) -> dict[str, Any]:
        return _outputs_of(await self._state.afinal_event(), self.request_id)


def _outputs_of(event: Event | None, request_id: str) -> dict[str, Any]:
    if event is None:
        raise StageError("internal_error", f"request {request_id} ended without a terminal event")
    if event.kind is EventKind.ERROR:
        raise StageError.from_event(event)
    return event.data["outputs"]


async def settled(handle: RequestHandle, node: str) -> None:
    """Wait until the request has left `node` (a later node started, or it ended); its error there is raised
    here (the request is over then). A handle's iteration starts from its first event: readers after this one
    still see every event."""
    async for event in handle:
        if event.kind is EventKind.ERROR:
            raise StageError.from_event(event)
        if event.terminal or (event.kind is EventKind.STAGE_STARTED and event.stage != node):
            return
