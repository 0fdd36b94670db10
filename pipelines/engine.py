"""The Engine: loaded models, their stage pools, the executor and the media workers.

One Engine serves the REST server, the CLI and the Python API alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from encoders.cache import EncoderCache
from pipelines.adapters import Adapters
from pipelines.asr import TranscriptionModel, TranscriptionRequest
from pipelines.chat import ChatRequest, LanguageModel
from pipelines.chat_parts import has_media_parts
from pipelines.config import EngineConfig, LoraSpec, ModelSpec, VoiceSpec
from pipelines.embeddings import EmbeddingModel, EmbeddingRequest
from pipelines.families.base import ImageFamily
from pipelines.families.video_base import VideoFamily
from pipelines.image_request import ImageRequest, ModelNotFound, RequestError
from pipelines.registry import detect_family, served_class
from pipelines.replicas import placed_stages
from pipelines.served import (
    SPOKEN_CHAT_TASK,
    Execution,
    LoadContext,
    ModelInfo,
    ServedChat,
    ServedEmbedding,
    ServedModel,
    ServedSpeech,
    ServedTranscription,
    ServedVLM,
)
from pipelines.served_diffusion import REALTIME_VIDEO_TASK, ServedDiffusion, ServedImages, image_task
from pipelines.tts import SpeechModel, SpeechRequest
from pipelines.video import VideoRequest
from pipelines.vlm import VLMChatModel
from pipelines.voice_turn import VoiceTurnRequest, fit_prompt, heard_prompt, turn_graph
from stages.device_memory import DeviceMemory
from stages.executor import GraphExecutor
from stages.host_memory import retain_freed_memory
from stages.metrics import Metrics
from stages.request_state import RequestHandle, settled
from stages.thread_budget import ThreadBudget, one_thread

if TYPE_CHECKING:
    from pipelines.ray_backend import RayCluster
    from stages.media.pool import MediaPool

# Re-exported: what callers of the engine name (the model object, the Python API's task rule).
__all__ = ["Engine", "ModelInfo", "REALTIME_VIDEO_TASK", "REALTIME_VOICE_TASK", "image_task"]

log = logging.getLogger(__name__)

REALTIME_VOICE_TASK = "realtime-voice"  # ModelInfo.tasks of a voice model (WS /v1/realtime)


# The request type each kind of served model runs (Engine.submit checks the pair).
REQUESTS: dict[type, type] = {ImageRequest: ServedImages, VideoRequest: ServedDiffusion, ChatRequest: ServedChat,
                              EmbeddingRequest: ServedEmbedding, SpeechRequest: ServedSpeech,
                              TranscriptionRequest: ServedTranscription}


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.metrics = Metrics()
        self.executor = GraphExecutor(self.metrics, ThreadBudget(config.cpu_threads))
        self.metrics.registry.register(DeviceMemory(lambda: self.executor.pools))
        self.prompt_cache = EncoderCache("prompt_embedding", config.prompt_cache_mb << 20, self._cache_event)
        self.encoder_cache = EncoderCache("encoder_output", config.encoder_cache_mb << 20, self._cache_event)
        self.models: dict[str, ModelInfo] = {}  # every served model and voice model, in configuration order
        self._served: dict[str, ServedModel] = {}
        self._specs: dict[str, ModelSpec] = {}
        self._voices: dict[str, VoiceSpec] = {}
        self._media: MediaPool | None = None  # started on first use: the Python API may never encode
        self._media_lock = threading.Lock()
        self._ready = threading.Event()
        self.load_error: str | None = None
        self._ray: RayCluster | None = None  # backend = "ray": the cluster the model stages run on

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Load every model, start the pools, warm each model with one tiny request; then ready."""
        retain_freed_memory(self.config.host_memory_keep_mb)
        self.executor.start()
        try:
            if self.config.backend == "ray":  # the address and every pool's resources checked before any load
                from pipelines.ray_backend import RayCluster

                self._ray = RayCluster.connect(self.config)
            with one_thread():  # no OpenMP team of this thread beside the stage workers' (thread_budget.one_thread)
                for spec in self.config.models:
                    self._load(spec)
            for served in self._served.values():
                served.warm(self)
            for voice in self.config.voices:
                self._add_voice(voice)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            raise
        self._ready.set()

    def shutdown(self) -> None:
        self._ready.clear()
        self.executor.shutdown()
        for served in self._served.values():
            close = getattr(served, "close", None)  # a served model with processes of its own (parallel ranks)
            if close is not None:
                close()
        if self._media is not None:
            self._media.close()
        if self._ray is not None:
            self._ray.close()

    def health(self) -> dict[str, str]:
        """Each served model's replicas: "ok"; "degraded" while a pool has lost some (a restart is under way);
        "down" while one of its pools has none live."""
        states = {}
        for name in self._served:
            pools = [p for key, p in self.executor.pools.items() if key.startswith(f"{name}/")]
            live = [(p.live_replicas(), p.config.replicas) for p in pools]
            states[name] = ("down" if any(n == 0 for n, _ in live) else
                            "degraded" if any(n < total for n, total in live) else "ok")
        return states

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def _load(self, spec: ModelSpec) -> None:
        family = spec.family or detect_family(spec.path)
        if spec.quantize and not issubclass(served_class(family), ServedImages):  # (the diffusers fallback refuses it)
            raise ValueError(f"model {spec.name}: quantize is for the components of diffusion models ({family} is "
                             "not one)")
        if spec.preview_vae and not issubclass(served_class(family), ServedDiffusion):
            raise ValueError(f"model {spec.name}: preview_vae is for the native image families sd, sdxl and flux "
                             f"({family} is not one)")
        # On the ray backend each replica is an actor with its own copy on its device; this process's copy, on the
        # CPU, answers checks and batch keys and runs no forward (so no parallel ranks either).
        context = LoadContext(self.metrics, self.prompt_cache, self.encoder_cache, self.config.limits, self.media,
                              self.config.media, runs=self._ray is None)
        load = lambda s: served_class(family)(s, family, context, _random_weights(spec))  # noqa: E731
        if self._ray is not None:
            served: ServedModel = load(dataclasses.replace(spec, device="cpu"))
            self._ray.add_pools(self.executor, spec, family, served, _random_weights(spec))
        else:
            served = load(spec)
            for name, stages, config in placed_stages(spec, served, load):  # placed pools: a copy per replica
                self.executor.add_pool(name, stages, config)
        self._served[spec.name] = served
        self._specs[spec.name] = spec
        self.models[spec.name] = served.info
        log.info("loaded %s (%s: %s) from %s", spec.name, family, served.describe(), spec.path)

    def _add_voice(self, voice: VoiceSpec) -> None:
        """A voice model names served models of the right kinds; checked once, at start."""
        if voice.omni:
            omni = {name: served.info for name, served in self._served.items()
                    if {"audio-chat", SPOKEN_CHAT_TASK} <= set(served.info.tasks)}
            if voice.omni not in omni:
                raise ValueError(f"voice model {voice.name}: omni = {voice.omni!r} is not a served model that hears "
                                 f"audio and speaks (a Qwen2.5-Omni with its talker); those are {sorted(omni)}")
            voices, of = omni[voice.omni].voices, voice.omni
        else:
            for key, kind, kinds in (("asr", ServedTranscription, "speech-recognition"), ("chat", ServedChat, "chat"),
                                     ("tts", ServedSpeech, "text-to-speech")):
                if getattr(voice, key) not in self._of_kind(kind):
                    raise ValueError(f"voice model {voice.name}: {key} = {getattr(voice, key)!r} is not a served "
                                     f"{kinds} model; those are {sorted(self._of_kind(kind))}")
            voices, of = self.speech_model(voice.tts).voices, voice.tts
        if voice.voice is not None and voice.voice not in voices:
            raise ValueError(f"voice model {voice.name}: voice {voice.voice!r} is not a voice of {of}; its "
                             f"voices: {list(voices)}")
        self._voices[voice.name] = voice
        parts = [self.models[name] for name in voice.parts]
        self.models[voice.name] = ModelInfo(voice.name, REALTIME_VOICE_TASK, "+".join(voice.parts),
                                            (REALTIME_VOICE_TASK,), voices=tuple(voices),
                                            random_weights=any(p.random_weights for p in parts))
        log.info("voice model %s: %s", voice.name, " -> ".join(voice.parts))

    # -- requests -------------------------------------------------------------------------
    def submit(self, model: str, request: Any, *, request_id: str | None = None, fence=None) -> RequestHandle:
        """Check `request` (cheap checks, RequestErrors naming the field), then run its graph on `model`.

        The request's type says what it asks for (ImageRequest, VideoRequest, ChatRequest, EmbeddingRequest,
        SpeechRequest, TranscriptionRequest); a model of another kind is a 404 naming the models of that kind.
        """
        kind = REQUESTS.get(type(request))
        if kind is None:
            raise TypeError(f"Engine.submit runs {[t.__name__ for t in REQUESTS]}, not {type(request).__name__}")
        return self.run(model, self._served_as(model, kind).execution(request), request_id=request_id, fence=fence)

    def run(self, model: str, execution: Execution, *, request_id: str | None = None, fence=None) -> RequestHandle:
        """Hand a checked request's graph to the executor, with the engine's deadline and the model's admission.
        The LoRA adapters it names are held until it ends (pipelines/adapters.py)."""
        names = [name for name, _ in getattr(execution.inputs.get("request"), "lora", ())]
        release = self.loras_of(model).lease(names) if names else None
        try:
            handle = self.executor.submit(execution.graph, execution.inputs, request_id=request_id,
                                          deadline_s=self.config.request_timeout_s, model=model,
                                          max_inflight=self._specs[model].max_inflight, fence=fence)
        except BaseException:
            if release is not None:
                release()
            raise
        if release is not None:
            handle.on_close(release)
        return handle

    # -- LoRA adapters ------------------------------------------------------------------------
    def loras_of(self, model: str) -> Adapters:
        """The LoRA adapters of an image or language model (a 404 for other models)."""
        served = self._served.get(model)
        adapters = getattr(getattr(served, "model", None), "loras", None)
        if not isinstance(adapters, Adapters):
            raise ModelNotFound(f"model {model!r} does not exist or serves no LoRA adapters; models that do: "
                                f"{sorted(self.lora_models())}")
        return adapters

    def lora_models(self) -> dict[str, Adapters]:
        """The adapters of every model that may serve LoRAs (image and language models)."""
        return {name: loras for name, served in self._served.items()
                if isinstance(loras := getattr(getattr(served, "model", None), "loras", None), Adapters)}

    def load_lora(self, model: str, spec: LoraSpec) -> None:
        """Load an adapter at run time, from the model's lora_dirs only (`spec.path` inside one of them); it is
        listed in /v1/models once loaded. Blocks while forwards of the model finish: call it off the event loop."""
        loras = self.loras_of(model)
        spec = dataclasses.replace(spec, path=loras.file_in_dirs(spec.path))
        try:
            loras.add(spec)
        except ValueError as exc:  # not a LoRA of this model: the file's fault
            raise RequestError("path", str(exc), code="invalid_lora") from exc
        self._list_adapters(model)

    def unload_lora(self, model: str, name: str) -> bool:
        """Take an adapter away from new requests; its weights go now (True) or when the last request using it
        ends. Blocks while forwards of the model finish: call it off the event loop."""
        now = self.loras_of(model).remove(name)
        self._list_adapters(model)
        return now

    def _list_adapters(self, model: str) -> None:
        served = self._served[model]
        served.info = dataclasses.replace(served.info, adapters=self.loras_of(model).names())
        self.models[model] = served.info

    def _of_kind(self, kind: type) -> dict[str, ServedModel]:
        return {name: served for name, served in self._served.items() if isinstance(served, kind)}

    def _served_as(self, model: str, kind: Any):
        """The served model of one kind, or a 404 naming the models of that kind."""
        served = self._served.get(model)
        if not isinstance(served, kind):
            raise ModelNotFound(f"model {model!r} does not exist or does not {kind.does}; {kind.kinds}: "
                                f"{sorted(self._of_kind(kind))}")
        return served

    def voice_model(self, model: str) -> VoiceSpec:
        voice = self._voices.get(model)
        if voice is None:
            raise ModelNotFound(f"model {model!r} does not exist or does not serve realtime voice sessions; "
                                f"voice models: {sorted(self._voices)}")
        return voice

    def submit_voice_turn(self, voice: str, request: VoiceTurnRequest, *, fence=None) -> RequestHandle:
        """One turn of a voice model: its chat model's llm streaming phrases into its speech model's tts, one
        graph (pipelines/voice_turn.py), after its speech recognition model's asr node when the turn brings the
        audio of its last utterance (`request.heard`). `fence` (False once the session's epoch has passed) stops
        every node.

        Events: with `heard`, OUTPUTS {"outputs": the asr's} first; the llm's DELTAs {"text", ...}; with speech,
        the tts's DELTAs {"audio", "sample_rate", "piece",
        "text" (on a phrase's first chunk)} in phrase order; FINAL as `turn_graph` says. With `request.chat.tools`
        the FINAL llm outputs carry the reply's calls and a call is never spoken (pipelines/voice_turn.py).
        """
        spec = self.voice_model(voice)
        chat = self.chat_model(spec.chat)
        speaker = None if request.speech is None else self.speech_model(spec.tts)
        tools = request.chat.tools
        form = None if tools is None else chat.tool_format
        if request.heard is None:
            graph = turn_graph(spec.chat, spec.tts, request.speech, speaker, tools=tools, form=form)
            return self.run(spec.chat, Execution(graph, {"request": fit_prompt(chat, request.chat)}), fence=fence)
        heard = self._served_as(spec.asr, ServedTranscription).execution(request.heard.request).inputs["request"]
        graph = turn_graph(spec.chat, spec.tts, request.speech, speaker, asr=spec.asr, asr_job=heard,
                           prepare=heard_prompt(chat, request.chat, request.heard), tools=tools, form=form)
        return self.run(spec.chat, Execution(graph, {}), fence=fence)

    def chat_model(self, model: str) -> LanguageModel:
        return self._served_as(model, ServedChat).model

    def submit_chat(self, model: str, request: ChatRequest, *, request_id: str | None = None,
                    fence=None) -> RequestHandle:
        """Tokenize (chat template), check, then run the llm stage.

        Events: DELTA {"index", "text", "finish_reason"[, "logprobs"]} as tokens are sampled; FINAL outputs
        {"choices": [{"index", "text", "token_ids", "finish_reason", "logprobs"}], "usage": {...}}.
        """
        chat = self.chat_model(model)
        if isinstance(chat, VLMChatModel) and request.messages is not None and has_media_parts(request.messages):
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop in this thread: run the fetch and decode here
                return asyncio.run(self.asubmit_chat(model, request, request_id=request_id, fence=fence))
            raise RuntimeError("submit_chat with image or video parts inside an event loop: await asubmit_chat")
        return self.submit(model, request, request_id=request_id, fence=fence)

    async def asubmit_chat(self, model: str, request: ChatRequest, *, request_id: str | None = None,
                           fence=None) -> RequestHandle:
        """submit_chat for callers in an event loop; images and video (vision-language models) go this way:
        content parts checked -> sources fetched and decoded (media workers) -> placeholders expanded, the
        context checked with the media tokens counted -> vision_encode -> llm. Same events as submit_chat."""
        served = self._served_as(model, ServedChat)
        if not isinstance(served, ServedVLM) or request.messages is None or not has_media_parts(request.messages):
            return self.submit_chat(model, request, request_id=request_id, fence=fence)
        chat = served.model
        assert isinstance(chat, VLMChatModel)
        parsed = chat.parse(request)
        sources = await asyncio.gather(*(self.load_source(p.url, param=p.param) for p in parsed.media))
        handle = self.run(model, served.execution_with_media(request, parsed, list(sources)), request_id=request_id,
                          fence=fence)
        await settled(handle, "media_decode")  # its decode and prompt errors are the caller's, as a text one's
        return handle

    def family(self, model: str) -> ImageFamily | VideoFamily:
        served = self._served.get(model)
        if not isinstance(served, ServedDiffusion):
            families = sorted(self._of_kind(ServedDiffusion))
            raise ModelNotFound(f"model {model!r} does not exist; available: {families}")
        return served.model

    def check_image(self, model: str, request: ImageRequest) -> None:
        """The checks of an image request that need no input image (an edit's, before its upload is fetched or
        decoded); RequestErrors name the field. submit_image runs them again with the rest."""
        self._served_as(model, ServedImages).check_fields(request)

    def submit_image(self, model: str, request: ImageRequest, *, request_id: str | None = None) -> RequestHandle:
        """Validate (cheap checks, before any model work), then run the image graph.

        Final outputs: {"images": [PIL.Image], "pixels": float [n, H, W, 3], "seed": int}; a model served through its
        diffusers pipeline (pipelines/fallback.py) answers the same.
        """
        return self.submit(model, request, request_id=request_id)

    def submit_video(self, model: str, request: VideoRequest, *, request_id: str | None = None) -> RequestHandle:
        """Validate (field-naming RequestErrors: size, num_frames, fps, steps, limits), then run the video graph
        (text_encode -> denoise -> vae_decode, the image stages on video latents).

        Events: PROGRESS {"step": i, "total": n}; FINAL outputs {"frames": uint8 [T, H, W, 3], "fps": float,
        "seed": int} (and "pixels": float [T, H, W, 3] in [0, 1]).
        """
        return self.submit(model, request, request_id=request_id)

    def check_video(self, model: str, request: VideoRequest) -> VideoRequest:
        """The request as submit_video would run it (defaults filled, a seed drawn), or the field-naming
        RequestError it would raise; runs nothing. The /v1/videos route calls it before it stores a job."""
        served = self._served_as(model, ServedDiffusion)
        result = served.check(request)
        assert isinstance(result, VideoRequest)
        return result

    def embedding_model(self, model: str) -> EmbeddingModel:
        return self._served_as(model, ServedEmbedding).model

    def submit_embeddings(self, model: str, request: EmbeddingRequest, *,
                          request_id: str | None = None) -> RequestHandle:
        """Check and tokenize (images decoded already), then run the embed stage.

        Final outputs: {"embeddings": float32 [n, D] in input order, "prompt_tokens": int}.
        """
        return self.submit(model, request, request_id=request_id)

    def speech_model(self, model: str) -> SpeechModel:
        return self._served_as(model, ServedSpeech).model

    def submit_speech(self, model: str, request: SpeechRequest, *, request_id: str | None = None) -> RequestHandle:
        """Check, split into phrases and tokenize, then run the tts stage (stages/speech/tts.py).

        Events: DELTA {"index", "audio": float32 [n], "sample_rate"} per phrase, in order; FINAL outputs
        {"audio": float32 [N] (the DELTAs concatenated), "sample_rate", "phrases", "input_tokens"}.
        """
        return self.submit(model, request, request_id=request_id)

    def transcription_model(self, model: str) -> TranscriptionModel:
        return self._served_as(model, ServedTranscription).model

    def submit_transcription(self, model: str, request: TranscriptionRequest, *,
                             request_id: str | None = None) -> RequestHandle:
        """Check and cut into 30 s windows, then run the asr stage (stages/speech/asr.py: features, encoder,
        decode).

        Events: DELTA {"text"} as text is decoded (request.stream only), in order; FINAL outputs {"text",
        "segments": [stages.speech.asr_transcript.Segment], "language": code, "duration": s,
        "windows": [DecodedWindow]}.
        """
        return self.submit(model, request, request_id=request_id)

    # -- media ----------------------------------------------------------------------------
    def media(self):
        with self._media_lock:
            if self._media is None:
                from stages.media.pool import MediaPool

                m = self.config.media
                self._media = MediaPool(workers=m.workers, task_cpu_s=m.task_cpu_s, task_memory_mb=m.task_memory_mb,
                                        task_timeout_s=m.task_timeout_s, metrics=self.metrics)
            return self._media

    def encode_images(self, images: list, fmt: str, quality: int | None = None) -> list[bytes]:
        """PIL images -> encoded bytes, in the media worker processes."""
        from stages.media.image import MediaError
        try:
            return [self.media().run("encode_image", np.asarray(im.convert("RGB")), fmt, quality) for im in images]
        except MediaError as exc:
            raise RequestError("output_format", exc.message, code=exc.code) from exc

    def decode_image(self, data: bytes, *, param: str, mode: str = "RGB"):
        """Uploaded bytes -> PIL image, decoded with limits in a media worker process."""
        from stages.media.image import MediaError
        try:
            decoded = self.media().run("decode_image", data, self.config.media.image, mode=mode)
        except MediaError as exc:
            raise RequestError(param, exc.message, code=exc.code, kind=exc.kind) from exc
        return decoded.to_pil()

    async def run_media(self, fn_name: str, *args, param: str, **kwargs):
        """A media worker function (decode_image, probe_video, decode_video, ...), awaited; errors name `param`."""
        from stages.media.image import MediaError
        try:
            return await asyncio.wrap_future(self.media().submit(fn_name, *args, **kwargs))
        except MediaError as exc:
            raise RequestError(param, exc.message, code=exc.code, kind=exc.kind) from exc

    async def load_source(self, source: str, *, param: str) -> bytes:
        """The bytes of a `data:` URI, an http(s) URL or an allowed file:// path, fetched safely."""
        from stages.media.fetch import load_source
        from stages.media.image import MediaError
        try:
            return await load_source(source, self.config.media.fetch, observe=self._fetch_event)
        except MediaError as exc:
            raise RequestError(param, exc.message, code=exc.code, kind=exc.kind) from exc

    def _fetch_event(self, outcome) -> None:
        self.metrics.media.fetches.labels(kind=outcome.kind, outcome=outcome.error_code or "ok").inc()
        self.metrics.media.fetch_bytes.labels(kind=outcome.kind).inc(outcome.nbytes)

    def _cache_event(self, cache: str, kind: str, bytes_held: int) -> None:
        if kind == "hit":
            self.metrics.cache.hits.labels(cache=cache).inc()
        elif kind == "miss":
            self.metrics.cache.misses.labels(cache=cache).inc()
        self.metrics.cache.bytes.labels(cache=cache).set(bytes_held)


def _random_weights(spec: ModelSpec) -> bool:
    """The spec's word, else the checkpoint's own (a demo stamp); a checkpoint that says nothing has real weights."""
    if spec.random_weights is not None:
        return spec.random_weights
    from pipelines.demo import stamped_random_weights

    return bool(stamped_random_weights(spec.path))
