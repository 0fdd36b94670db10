"""One response of a voice session: the turn's graph (ASR -> LLM ⇢ TTS, one engine request; or an omni model's
thinker -> talker -> token2wav), then paced audio.

The engine runs the cascade as one graph with a streaming edge (pipelines/voice_turn.py): when the
response starts at the end of the user's turn, its graph's asr node makes the final decode of the
utterance (taken over from the session's ASR lane, which announces the transcript as its own) and the
LLM starts on that stable text in the same graph; the LLM's
text is cut into phrases while it is written and each phrase is spoken by the TTS, its audio in
order in the same event stream. Two loops run per response, both fenced by the session's epoch
(book ch.21): the reader of the turn's events (text deltas out; audio to the sender) and the sender
(audio cut into `delta_ms` pieces and paced so the client holds at most `max_lead_ms` unplayed).
The graph carries the fence too: its workers stop at their next boundary once the epoch passes.
Each loop checks `current()` before it emits; the session's audio sink checks the epoch again under
the outbox lock, so no audio of an old epoch leaves after the bump. On a bump the session cancels
the engine request (every node of it) and the sender, and the queue dies with this object.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pipelines.chat import ChatRequest
from pipelines.omni import SpeechOutput
from pipelines.tts import SpeechRequest
from pipelines.voice_turn import HeardSpeech, VoiceTurnRequest
from realtime.voice.audio_codec import AudioFormat
from realtime.voice.items import Item, Phrase
from realtime.voice.protocol import ResponseParams, event_name
from stages.events import EventKind, StageError
from stages.llm.params import SamplingParams
from stages.request_state import RequestHandle
from stages.speech.audio_dsp import resample

if TYPE_CHECKING:
    from realtime.voice.asr import Claim
    from realtime.voice.session import VoiceSession

log = logging.getLogger(__name__)

class StaleResponse(Exception):
    """The response's epoch has passed: stop quietly."""


@dataclass
class Timings:
    """Clock readings (session clock, seconds) along one response; None until reached."""

    start: float  # the turn's end: speech_stopped, commit, or response.create
    asr_final: float | None = None  # every user transcript of the context is final
    llm_submit: float | None = None
    llm_first: float | None = None  # first text from the LLM
    tts_submit: float | None = None  # first phrase handed to the TTS
    tts_first: float | None = None  # its first audio
    first_audio: float | None = None  # first audio delta sent
    last_audio: float | None = None  # last audio delta sent
    interrupt: float | None = None  # barge-in (or cancel) seen
    silent: float | None = None  # by then no audio of this response could be sent any more

    def report(self) -> dict[str, float | None]:
        def ms(a, b):
            return None if a is None or b is None else round((b - a) * 1000, 1)

        return {"ttfa_ms": ms(self.start, self.first_audio), "asr_final_ms": ms(self.start, self.asr_final),
                "llm_ttft_ms": ms(self.llm_submit, self.llm_first),
                "tts_first_chunk_ms": ms(self.tts_submit, self.tts_first),
                "interrupt_to_silence_ms": ms(self.interrupt, self.silent)}


@dataclass
class Response:
    id: str
    epoch: int  # the session epoch it belongs to
    params: ResponseParams
    item: Item  # the assistant item it writes
    voice: str
    speed: float
    output_format: AudioFormat  # of the audio it sends
    timings: Timings
    handles: list = field(default_factory=list)  # the engine request (the turn graph) to cancel on a bump
    tasks: list[asyncio.Task] = field(default_factory=list)  # the sender task (no engine call in flight)
    task: asyncio.Task | None = None  # the runner
    item_opened: bool = False  # output_item.added has gone out (the item is in the conversation)
    stopped: bool = False
    finished: bool = False  # its response.done has been (or is being) emitted
    generated_ms: float = 0.0  # audio laid out on the item so far (sent or about to be)
    usage: dict[str, int] = field(default_factory=dict)
    late_deltas: int = 0  # audio deltas sent after the interruption was seen (must stay 0)
    claim: Claim | None = None  # its claim on the final decode of the utterance that ended the turn
    calls: list[Item] = field(default_factory=list)  # the function_call items it made (output after its message)
    holding: bool = False  # tools: the LLM's text is held until the reply is known not to be a call
    speculated: bool = False  # its graph is a speculation it adopted (started before the turn ended)

    @property
    def output_rate(self) -> int:
        return self.output_format.rate

    @property
    def audio(self) -> bool:
        return "audio" in self.params.output_modalities

    def stop(self) -> None:
        """Cancel what runs for this response (the epoch has been bumped already)."""
        self.stopped = True
        if self.claim is not None:
            self.claim.release()
        for handle in self.handles:
            handle.cancel()
        for task in self.tasks:
            task.cancel()


@dataclass(frozen=True)
class OutputChunk:
    """A piece of response audio on its way to the client, at the response's output rate."""

    response_id: str
    item_id: str
    samples: np.ndarray  # float32 [n]


class ResponseRunner:
    def __init__(self, session: VoiceSession, response: Response):
        self.s = session
        self.r = response

    def current(self) -> bool:
        return self.r.epoch == self.s.epoch and not self.r.stopped

    async def run(self) -> None:
        s, r = self.s, self.r
        status, reason, error = "completed", None, None
        try:
            messages, heard = await s.turn_context(r)  # waits for final transcripts: the LLM starts on stable text
            if not self.current():
                return
            if heard is None:  # every transcript is final already (or the lane decodes the last one after all)
                if r.claim is not None:
                    r.claim.release()
                await self._open()
            finish = await self._generate(messages, heard)
            if finish == "length":
                status, reason = "incomplete", "max_output_tokens"
        except StaleResponse:
            return
        except asyncio.CancelledError:
            if self.current():
                raise
            return
        except StageError as exc:
            status, error = "failed", {"type": "invalid_request_error" if exc.kind.caller_fault else "server_error",
                                       "code": exc.code, "message": exc.message}
        except Exception as exc:  # the response fails; the session goes on
            log.exception("voice response %s failed", r.id)
            status, error = "failed", {"type": "server_error", "code": "internal_error", "message": str(exc)}
        finally:
            if r.claim is not None:
                r.claim.release()
            s.drop_speculation()  # its turn's speculation, unless its graph adopted it
        if self.current():
            await s.complete_response(r, status, reason, error)

    async def _open(self) -> None:
        """Every user transcript is final: the assistant item opens (its events follow the transcript's), unless the
        reply may be a function call: then it opens once the reply is known not to be one (`_release`)."""
        self.r.timings.asr_final = self.s.clock()
        if not self.r.holding:
            await self.s.open_output_item(self.r)

    async def _release(self, name: str) -> None:
        """The held reply is not a call: its message item opens and its text goes out as one delta."""
        s, r = self.s, self.r
        r.holding = False
        await s.open_output_item(r)
        if r.item.text:
            await s.emit({"type": event_name(name, s.config.beta), "response_id": r.id, "item_id": r.item.id,
                          "output_index": 0, "content_index": 0, "delta": r.item.text}, guard=self.current)

    async def _heard(self, text: str) -> None:
        """The graph's asr node is done: the lane announces its transcript; then the answer's item opens (the
        llm node has been dispatched already; its deltas wait in the request's stream meanwhile)."""
        s, r = self.s, self.r
        assert r.claim is not None
        r.timings.llm_submit = s.clock()
        r.claim.handover.result().give_back(text)
        await asyncio.shield(s.asr.final(r.claim.item_id))
        if not self.current():
            raise StaleResponse
        await self._open()

    async def _generate(self, messages: list[dict[str, Any]], heard: HeardSpeech | None) -> str | None:
        r = self.r
        audio: asyncio.Queue | None = asyncio.Queue() if r.audio else None
        if audio is not None:
            r.tasks = [asyncio.create_task(self._send(audio), name=f"send-{r.id}")]
        try:
            finish = await self._turn(messages, heard, audio)
        except BaseException:
            for task in r.tasks:
                task.cancel()
            raise
        results = await asyncio.gather(*r.tasks, return_exceptions=True)
        if not self.current():
            raise StaleResponse
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return finish

    async def _submit(self, submitting: Awaitable[RequestHandle]) -> RequestHandle:
        """An engine call (tokenizing is off the event loop); its handle is cancelled with the response."""
        submitted = asyncio.ensure_future(submitting)
        try:
            handle = await asyncio.shield(submitted)
        except asyncio.CancelledError:  # the session is closing: the request must not run on unseen
            submitted.add_done_callback(lambda f: f.exception() is None and f.result().cancel())
            raise
        if not self.current():
            handle.cancel()
            raise StaleResponse
        self.r.handles.append(handle)
        return handle

    async def _turn(self, messages: list[dict[str, Any]], heard: HeardSpeech | None,
                    audio: asyncio.Queue | None) -> str | None:
        """The turn's one graph: a cascade's [asr ->] llm ⇢ tts (pipelines/voice_turn.py), or an omni model's
        [media_decode -> audio_encode ->] llm [-> talker -> token2wav]. The transcript goes back to the lane, text
        deltas go out as transcript (or text) deltas, audio, in order, to the sender. Returns the LLM's finish
        reason."""
        s, r = self.s, self.r
        r.timings.llm_submit = s.clock()
        if s.spec.omni:
            params = turn_sampling(s, r.params)
            speech = SpeechOutput(r.voice, secrets.randbits(31) if s.spec.seed is None else s.spec.seed, stream=True)
            chat = ChatRequest(messages=messages, params=params, tenant=s.tenant, speech=speech if r.audio else None)
            handle = await self._submit(s.engine.asubmit_chat(s.spec.omni, chat, fence=self.current))
        else:
            request = voice_turn_request(s, r.params, messages, heard, voice=r.voice, speed=r.speed,
                                         rate=r.output_rate)
            handle = s.adopt_speculation(request, self.current) if heard is None else None
            if handle is not None:  # its events so far wait in the stream: what it made goes out at once
                r.speculated = True
                r.handles.append(handle)
            else:
                handle = await self._submit(asyncio.to_thread(s.engine.submit_voice_turn, s.spec.name, request,
                                                              fence=self.current))
        finish = None
        name = "response.output_audio_transcript.delta" if r.audio else "response.output_text.delta"
        spoken = 0  # an omni reply: the characters of its text that went with its audio chunks so far
        try:
            async for event in handle:
                if not self.current():
                    raise StaleResponse
                if event.kind is EventKind.OUTPUTS and event.stage == "asr":
                    await self._heard(event.data["outputs"].get("text", ""))
                elif event.kind is EventKind.DELTA and event.stage == "llm":
                    text, finish = event.data.get("text", ""), event.data.get("finish_reason") or finish
                    if not text:
                        continue
                    if r.timings.llm_first is None:
                        r.timings.llm_first = s.clock()
                    r.item.text += text
                    if r.holding:  # it may be a call: nothing of it goes out yet
                        continue
                    await s.emit({"type": event_name(name, s.config.beta), "response_id": r.id,
                                  "item_id": r.item.id, "output_index": 0, "content_index": 0, "delta": text},
                                 guard=self.current)
                elif event.kind is EventKind.STAGE_STARTED and event.stage in ("tts", "talker"):
                    r.timings.tts_submit = s.clock()  # the first phrase (or the reply) was handed to the speech
                elif event.kind is EventKind.DELTA and event.stage == "tts" and audio is not None:
                    if r.holding:  # the graph speaks it: not a call
                        await self._release(name)
                    if r.timings.tts_first is None:
                        r.timings.tts_first = s.clock()
                    # a phrase's text goes with its first chunk (a phrase the TTS split further: later ones "")
                    await audio.put((event.data.get("text", ""), np.asarray(event.data["audio"], np.float32)))
                elif event.kind is EventKind.DELTA and event.stage == "vocoder" and audio is not None:
                    if r.timings.tts_first is None:
                        r.timings.tts_first = s.clock()
                    # an omni reply's chunk: the talker does not align words to codes, so a chunk carries the
                    # words written since the chunk before it (the thinker is ahead of its speech)
                    words, spoken = r.item.text[spoken:], len(r.item.text)
                    samples = np.asarray(event.data["audio"], np.float32)
                    await audio.put((words, resample(samples, event.data["sample_rate"], r.output_rate)))
                elif event.kind is EventKind.ERROR:
                    raise StageError.from_event(event)
                elif event.kind is EventKind.FINAL:
                    outputs = event.data["outputs"]
                    llm = outputs["llm"] if "llm" in outputs else outputs
                    r.usage = dict(llm.get("usage") or {})
                    choice = (llm.get("choices") or [{}])[0]
                    finish = choice.get("finish_reason") or finish
                    if choice.get("tool_calls"):
                        await s.open_calls(r, choice["tool_calls"], self.current)
                    elif r.holding:
                        await self._release(name)
                    if audio is not None and r.item.text[spoken:] and "audio" in outputs:  # an omni reply's last
                        await audio.put((r.item.text[spoken:], np.zeros(0, np.float32)))  # words: on its last chunk
        finally:
            if audio is not None:
                audio.put_nowait(None)  # the sender ends too (after what it has), whatever happened here
        return finish

    async def _send(self, audio: asyncio.Queue) -> None:
        """Cut into delta_ms pieces; wait while the client holds max_lead_ms unplayed; hand to the sink."""
        s, r = self.s, self.r
        piece = max(1, r.output_rate * s.limits.delta_ms // 1000)
        while (entry := await audio.get()) is not None:
            text, samples = entry
            duration = len(samples) * 1000 / r.output_rate
            if text or not r.item.phrases:
                r.item.phrases.append(Phrase(text, r.generated_ms, duration))
            else:
                r.item.phrases[-1].duration_ms += duration
            r.generated_ms += duration
            for start in range(0, len(samples), piece):
                chunk = samples[start:start + piece]
                await self._pace(len(chunk) * 1000 / r.output_rate)
                if not self.current():
                    raise StaleResponse
                await s.sink_audio(r.epoch, OutputChunk(r.id, r.item.id, chunk))

    async def _pace(self, chunk_ms: float) -> None:
        s = self.s
        while True:
            if not s.audio_gate.is_set():  # the user may be barging in: nothing more until that is decided (bounded,
                hold_s = s.limits.min_speech_ms / 1000 + 0.2  # should the client stop sending audio meanwhile)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(s.audio_gate.wait(), hold_s)
            over = s.playback.lead_ms(s.clock()) + chunk_ms - s.limits.max_lead_ms
            if over <= 0:
                return
            await asyncio.sleep(over / 1000)


def turn_sampling(s: VoiceSession, params: ResponseParams) -> SamplingParams:
    """A response's sampling: its temperature and token cap, the voice's seed."""
    return SamplingParams(temperature=params.temperature, max_tokens=params.max_output_tokens, seed=s.spec.seed)


def voice_turn_request(s: VoiceSession, params: ResponseParams, messages: list[dict[str, Any]],
                       heard: HeardSpeech | None = None, *, voice: str, speed: float, rate: int) -> VoiceTurnRequest:
    """A cascade's turn graph request for `params` (a response's, or a speculation's: equal requests are one turn)."""
    sampling = turn_sampling(s, params)
    tts = SpeechRequest("", voice=voice, speed=speed, sample_rate=rate, tenant=s.tenant) \
        if "audio" in params.output_modalities else None
    tools = params.tools if params.calls else None
    chat = ChatRequest(messages=messages, params=sampling, tenant=s.tenant, tools=tools)
    return VoiceTurnRequest(chat, tts, heard)


def response_object(r: Response, *, status: str, reason: str | None = None, error: dict[str, Any] | None = None,
                    beta: bool, output_format, output: list | None = None) -> dict[str, Any]:
    """The response as response.created / response.done carry it."""
    usage = None
    if r.usage:
        prompt, completion = r.usage.get("prompt_tokens", 0), r.usage.get("completion_tokens", 0)
        usage = {"total_tokens": prompt + completion, "input_tokens": prompt, "output_tokens": completion,
                 "input_token_details": {"text_tokens": prompt, "audio_tokens": 0, "cached_tokens": 0},
                 "output_token_details": {"text_tokens": completion, "audio_tokens": 0}}
    details = None
    if status != "in_progress" and status != "completed":
        details = {"type": status, "reason": reason, "error": error}
    body: dict[str, Any] = {"object": "realtime.response", "id": r.id, "status": status, "status_details": details,
                            "output": output or [], "usage": usage, "metadata": r.params.metadata,
                            "conversation_id": "conv_default" if r.params.conversation == "auto" else None,
                            "max_output_tokens": r.params.max_output_tokens, "epoch": r.epoch}
    if beta:
        body |= {"modalities": list(r.params.output_modalities) + (["text"] if r.audio else []),
                 "voice": r.voice, "output_audio_format": output_format.name}
    else:
        body |= {"output_modalities": list(r.params.output_modalities),
                 "audio": {"output": {"format": output_format.ga(), "voice": r.voice}}}
    return body
