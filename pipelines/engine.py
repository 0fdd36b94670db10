"""The Engine: loaded models, their stage pools, the executor and the media workers.

One Engine serves the REST server, the CLI and the Python API alike.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

import numpy as np

from encoders.cache import EncoderCache
from pipelines.asr import ASR_FAMILY, ASR_POOL, TranscriptionModel, TranscriptionRequest
from pipelines.chat import LLM_FAMILY, ChatModel, ChatRequest
from pipelines.chat_parts import has_media_parts
from pipelines.config import EngineConfig, ModelSpec, VoiceSpec
from pipelines.embeddings import EMBED_POOL, EMBEDDING_FAMILIES, EmbeddingModel, EmbeddingRequest
from pipelines.families.base import ImageFamily
from pipelines.families.video_base import VideoFamily
from pipelines.image_request import ImageRequest, RequestError, Task
from pipelines.registry import detect_family, family_class
from pipelines.tts import SPEECH_TASK, TTS_FAMILIES, TTS_POOL, SpeechModel, SpeechRequest
from pipelines.video import VideoRequest
from pipelines.vlm import VLM_FAMILY, VLMChatModel, load_media
from stages.diffusion.stages import DenoiseStage, TextEncodeStage, VaeDecodeStage
from stages.executor import GraphExecutor
from stages.graph import StageGraph
from stages.llm.params import SamplingParams
from stages.metrics import Metrics
from stages.request_state import RequestHandle
from stages.thread_budget import ThreadBudget

log = logging.getLogger(__name__)

REALTIME_VOICE_TASK = "realtime-voice"  # ModelInfo.tasks of a voice model (WS /v1/realtime)
REALTIME_VIDEO_TASK = "realtime-video"  # ModelInfo.tasks of a model that serves WS /v1/realtime/video sessions
MEDIA_STATUS = {"media_bytes": 413, "media_pixels": 413, "media_frames": 413, "media_duration": 413}


@dataclass(frozen=True)
class ModelInfo:
    id: str  # the name clients use
    family: str  # "sd", "sdxl", "sd3", "flux"
    path: str  # checkpoint directory or hub id
    tasks: tuple[str, ...]  # "text-to-image", "image-to-image", "inpainting"
    size_factor: int  # width and height must be multiples of this
    default_size: int  # square size used when the request names none
    voices: tuple[str, ...] = ()  # text-to-speech models: the voice names a request may use
    video_defaults: dict | None = None  # video models: {"width", "height", "num_frames", "fps", "frame_factor"}
    random_weights: bool = False  # a demo/test checkpoint: real code path, noise out; never a default when a
    #                               real-weight model does the task (model_default.py)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.metrics = Metrics()
        self.executor = GraphExecutor(self.metrics, ThreadBudget(config.cpu_threads))
        self.prompt_cache = EncoderCache("prompt_embedding", config.prompt_cache_mb << 20, self._cache_event)
        self.encoder_cache = EncoderCache("encoder_output", config.encoder_cache_mb << 20, self._cache_event)
        self.models: dict[str, ModelInfo] = {}
        self._families: dict[str, ImageFamily] = {}
        self._specs: dict[str, ModelSpec] = {}
        self._chats: dict[str, ChatModel] = {}
        self._embedders: dict[str, EmbeddingModel] = {}
        self._speakers: dict[str, SpeechModel] = {}
        self._transcribers: dict[str, TranscriptionModel] = {}
        self._voices: dict[str, VoiceSpec] = {}
        self._media = None  # started on first use: the Python API may never encode
        self._media_lock = threading.Lock()
        self._ready = threading.Event()
        self.load_error: str | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Load every model, start the pools, warm each model with one tiny request; then ready."""
        self.executor.start()
        try:
            for spec in self.config.models:
                self._load(spec)
            for name in self.models:
                self._warm(name)
            for voice in self.config.voices:
                self._add_voice(voice)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            raise
        self._ready.set()

    def shutdown(self) -> None:
        self._ready.clear()
        self.executor.shutdown()
        if self._media is not None:
            self._media.close()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def _load(self, spec: ModelSpec) -> None:
        family_name = spec.family or detect_family(spec.path)
        if family_name == LLM_FAMILY:
            return self._load_llm(spec)
        if family_name == VLM_FAMILY:
            return self._load_vlm(spec)
        if family_name in EMBEDDING_FAMILIES:
            return self._load_embedding(spec, family_name)
        if family_name in TTS_FAMILIES:
            return self._load_speech(spec, family_name)
        if family_name == ASR_FAMILY:
            return self._load_asr(spec)
        cls = family_class(family_name)
        options = {"video": spec.video} if issubclass(cls, VideoFamily) else {}
        family: ImageFamily = cls(spec.name, spec.path, device=spec.device, dtype=spec.dtype,
                                  prompt_cache=self.prompt_cache, **options)
        family.accelerate(spec.speedups, self.metrics)  # fused kernels, compile, step-cache wrappers, graph config
        for kind, stage in (("text_encode", TextEncodeStage(family)), ("denoise", DenoiseStage(family)),
                            ("vae_decode", VaeDecodeStage(family))):
            self.executor.add_pool(f"{spec.name}/{kind}", stage, spec.pool(kind))
        self._families[spec.name] = family
        self._specs[spec.name] = spec
        tasks = _realtime_video(family_name, family.tasks)
        if isinstance(family, VideoFamily):
            (width, height), video = family.request_default_size, family.video_defaults
            self.models[spec.name] = ModelInfo(spec.name, family_name, spec.path, tasks, family.size_factor,
                                               max(width, height), video_defaults=video,
                                               random_weights=_random_weights(spec))
        else:
            self.models[spec.name] = ModelInfo(spec.name, family_name, spec.path, tasks, family.size_factor,
                                               family.default_size, random_weights=_random_weights(spec))
        log.info("loaded %s (%s) from %s", spec.name, family_name, spec.path)

    def _load_llm(self, spec: ModelSpec) -> None:
        chat = ChatModel(spec.name, spec.path, device=spec.device, dtype=spec.dtype, config=spec.llm,
                         metrics=self.metrics, graphs=spec.graphs, fused_kernels=spec.fused_kernels)
        self.executor.add_pool(f"{spec.name}/llm", chat.stage, spec.pool("llm"))
        self._chats[spec.name] = chat
        self._specs[spec.name] = spec
        self.models[spec.name] = ModelInfo(spec.name, LLM_FAMILY, spec.path, ("chat",), 0, 0,
                                           random_weights=_random_weights(spec))
        log.info("loaded %s (%s, %d KV blocks of %d tokens) from %s", spec.name, LLM_FAMILY, chat.runner.num_blocks,
                 chat.runner.kv.block_size, spec.path)

    def _load_vlm(self, spec: ModelSpec) -> None:
        # A reload gets a new weights id (file fingerprint); entries of the old weights are dropped now.
        self.encoder_cache.invalidate(lambda key: key[1].startswith(f"{VLM_FAMILY}:{spec.path}:"))
        chat = VLMChatModel(spec.name, spec.path, device=spec.device, dtype=spec.dtype, config=spec.llm, vlm=spec.vlm,
                            metrics=self.metrics, cache=self.encoder_cache)
        self.executor.add_pool(f"{spec.name}/vision_encode", chat.encode_stage, spec.pool("vision_encode"))
        self.executor.add_pool(f"{spec.name}/llm", chat.stage, spec.pool("llm"))
        self._chats[spec.name] = chat
        self._specs[spec.name] = spec
        self.models[spec.name] = ModelInfo(spec.name, VLM_FAMILY, spec.path, ("chat", "vision-chat"), 0, 0,
                                           random_weights=_random_weights(spec))
        log.info("loaded %s (%s, %s, %d KV blocks of %d tokens) from %s", spec.name, VLM_FAMILY, chat.adapter.family,
                 chat.runner.num_blocks, chat.runner.kv.block_size, spec.path)

    def _load_embedding(self, spec: ModelSpec, family_name: str) -> None:
        embedder = EmbeddingModel(spec.name, spec.path, family_name, device=spec.device, dtype=spec.dtype)
        self.executor.add_pool(f"{spec.name}/embed", embedder.stage, spec.pool("embed", EMBED_POOL))
        self._embedders[spec.name] = embedder
        self._specs[spec.name] = spec
        self.models[spec.name] = ModelInfo(spec.name, family_name, spec.path, embedder.tasks, 0, 0,
                                           random_weights=_random_weights(spec))
        log.info("loaded %s (%s, %d dimensions, %d tokens) from %s", spec.name, family_name, embedder.dimension,
                 embedder.max_tokens, spec.path)

    def _load_speech(self, spec: ModelSpec, family_name: str) -> None:
        speech = SpeechModel(spec.name, spec.path, family_name, device=spec.device, dtype=spec.dtype)
        self.executor.add_pool(f"{spec.name}/tts", speech.stage, spec.pool("tts", TTS_POOL))
        self._speakers[spec.name] = speech
        self._specs[spec.name] = spec
        self.models[spec.name] = ModelInfo(spec.name, family_name, spec.path, (SPEECH_TASK,), 0, 0,
                                           voices=speech.voices, random_weights=_random_weights(spec))
        log.info("loaded %s (%s, %d Hz, voices %s) from %s", spec.name, family_name, speech.sample_rate,
                 list(speech.voices), spec.path)

    def _load_asr(self, spec: ModelSpec) -> None:
        asr = TranscriptionModel(spec.name, spec.path, device=spec.device, dtype=spec.dtype, config=spec.asr)
        self.executor.add_pool(f"{spec.name}/asr", asr.stage, spec.pool("asr", ASR_POOL))
        self._transcribers[spec.name] = asr
        self._specs[spec.name] = spec
        self.models[spec.name] = ModelInfo(spec.name, ASR_FAMILY, spec.path, asr.tasks, 0, 0,
                                           random_weights=_random_weights(spec))
        log.info("loaded %s (%s, %s) from %s", spec.name, ASR_FAMILY,
                 "English-only" if asr.english_only else "multilingual", spec.path)

    def _add_voice(self, voice: VoiceSpec) -> None:
        """A voice model names served models of the right kinds; checked once, at start."""
        for key, table, kinds in (("asr", self._transcribers, "speech-recognition"), ("chat", self._chats, "chat"),
                                  ("tts", self._speakers, "text-to-speech")):
            if getattr(voice, key) not in table:
                raise ValueError(f"voice model {voice.name}: {key} = {getattr(voice, key)!r} is not a served "
                                 f"{kinds} model; those are {sorted(table)}")
        speaker = self._speakers[voice.tts]
        if voice.voice is not None and voice.voice not in speaker.voices:
            raise ValueError(f"voice model {voice.name}: voice {voice.voice!r} is not a voice of {voice.tts}; its "
                             f"voices: {list(speaker.voices)}")
        self._voices[voice.name] = voice
        parts = [self.models[getattr(voice, key)] for key in ("asr", "chat", "tts")]
        self.models[voice.name] = ModelInfo(voice.name, REALTIME_VOICE_TASK, f"{voice.asr}+{voice.chat}+{voice.tts}",
                                            (REALTIME_VOICE_TASK,), 0, 0, voices=speaker.voices,
                                            random_weights=any(p.random_weights for p in parts))
        log.info("voice model %s: %s -> %s -> %s", voice.name, voice.asr, voice.chat, voice.tts)

    def _warm(self, name: str) -> None:
        if name in self._transcribers:  # one second of silence
            self.submit_transcription(name, TranscriptionRequest(np.zeros(16000, np.float32))).result(timeout=600)
            return
        if name in self._speakers:
            self.submit_speech(name, SpeechRequest("warm-up")).result(timeout=600)
            return
        if name in self._embedders:
            self.submit_embeddings(name, EmbeddingRequest(["warm-up"])).result(timeout=600)
            return
        if name in self._chats:
            params = SamplingParams(temperature=0, max_tokens=1)
            self.submit_chat(name, ChatRequest(prompt="warm-up", params=params)).result(timeout=600)
            self._chats[name].runner.capture_graphs()  # every decode bucket, before ready
            return
        # Diffusion: a tiny request, or one per declared graph shape (each captures its buckets); then seal.
        info, graphs = self.models[name], self._specs[name].graphs
        if isinstance(self._families[name], VideoFamily):  # a small video: one latent frame past the first
            from PIL import Image

            size, frames = info.size_factor, info.video_defaults["frame_factor"] + 1
            image = None if "text-to-video" in info.tasks else Image.new("RGB", (size, size), (128, 128, 128))
            for (width, height), num_frames in [(s, f) for s in graphs.sizes or [(size, size)]
                                                for f in graphs.frames or [frames]]:
                self.submit_video(name, VideoRequest(prompt="warm-up", width=width, height=height,
                                                     num_frames=num_frames, num_inference_steps=2, seed=0,
                                                     image=image)).result(timeout=600)
        else:
            size = info.size_factor * 2
            for width, height in graphs.sizes or [(size, size)]:
                self.submit_image(name, ImageRequest(prompt="warm-up", width=width, height=height,
                                                     num_inference_steps=1, seed=0)).result(timeout=600)
        self._families[name].denoiser.seal()

    # -- requests -------------------------------------------------------------------------
    def voice_model(self, model: str) -> VoiceSpec:
        return _served(self._voices, model, "serve realtime voice sessions", "voice models")

    def chat_model(self, model: str) -> ChatModel:
        return _served(self._chats, model, "chat", "chat models")

    def submit_chat(self, model: str, request: ChatRequest, *, request_id: str | None = None) -> RequestHandle:
        """Tokenize (chat template), check, then run the llm stage.

        Events: DELTA {"index", "text", "finish_reason"[, "logprobs"]} as tokens are sampled; FINAL outputs
        {"choices": [{"index", "text", "token_ids", "finish_reason", "logprobs"}], "usage": {...}}.
        """
        chat = self.chat_model(model)
        if isinstance(chat, VLMChatModel) and request.messages is not None and has_media_parts(request.messages):
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop in this thread: run the fetch and decode here
                return asyncio.run(self.asubmit_chat(model, request, request_id=request_id))
            raise RuntimeError("submit_chat with image or video parts inside an event loop: await asubmit_chat")
        generation = chat.generation_request(request)
        graph = StageGraph.chain(("llm", f"{model}/llm"))
        return self.executor.submit(graph, {"request": generation}, request_id=request_id,
                                    deadline_s=self.config.request_timeout_s, model=model,
                                    max_inflight=self._specs[model].max_inflight)

    async def asubmit_chat(self, model: str, request: ChatRequest, *, request_id: str | None = None) -> RequestHandle:
        """submit_chat for callers in an event loop; images and video (vision-language models) go this way:
        content parts checked -> sources fetched and decoded (media workers) -> placeholders expanded, the
        context checked with the media tokens counted -> vision_encode -> llm. Same events as submit_chat."""
        chat = self.chat_model(model)
        if not isinstance(chat, VLMChatModel) or request.messages is None or not has_media_parts(request.messages):
            return self.submit_chat(model, request, request_id=request_id)
        parsed = chat.parse(request)
        media = await load_media(self, chat, parsed)
        generation, tasks = chat.generation_request_with_media(request, parsed, media)
        graph = StageGraph.chain(("vision_encode", f"{model}/vision_encode"), ("llm", f"{model}/llm"))
        return self.executor.submit(graph, {"request": generation, "media": tasks}, request_id=request_id,
                                    deadline_s=self.config.request_timeout_s, model=model,
                                    max_inflight=self._specs[model].max_inflight)

    def family(self, model: str) -> ImageFamily:
        family = self._families.get(model)
        if family is None:
            raise RequestError("model", f"model {model!r} does not exist; available: {sorted(self._families)}",
                               code="model_not_found", status=404)
        return family

    def graph(self, model: str) -> StageGraph:
        return StageGraph.chain(("text_encode", f"{model}/text_encode"), ("denoise", f"{model}/denoise"),
                                ("vae_decode", f"{model}/vae_decode"))

    def submit_image(self, model: str, request: ImageRequest, *, request_id: str | None = None) -> RequestHandle:
        """Validate (cheap checks, before any model work), then run the image graph.

        Final outputs: {"images": [PIL.Image], "pixels": float [n, H, W, 3], "seed": int}.
        """
        family = self.family(model)
        request = family.validate(request, self.config.limits)
        return self.executor.submit(self.graph(model), {"request": request}, request_id=request_id,
                                    deadline_s=self.config.request_timeout_s, model=model,
                                    max_inflight=self._specs[model].max_inflight)

    def submit_video(self, model: str, request: VideoRequest, *, request_id: str | None = None) -> RequestHandle:
        """Validate (field-naming RequestErrors: size, num_frames, fps, steps, limits), then run the video graph
        (text_encode -> denoise -> vae_decode, the image stages on video latents).

        Events: PROGRESS {"step": i, "total": n}; FINAL outputs {"frames": uint8 [T, H, W, 3], "fps": float,
        "seed": int} (and "pixels": float [T, H, W, 3] in [0, 1]).
        """
        request = self.check_video(model, request)
        return self.executor.submit(self.graph(model), {"request": request}, request_id=request_id,
                                    deadline_s=self.config.request_timeout_s, model=model,
                                    max_inflight=self._specs[model].max_inflight)

    def check_video(self, model: str, request: VideoRequest) -> VideoRequest:
        """The request as submit_video would run it (defaults filled, a seed drawn), or the field-naming
        RequestError it would raise; runs nothing. The /v1/videos route calls it before it stores a job."""
        family = self.family(model)
        if not isinstance(family, VideoFamily):
            raise RequestError("model", f"model {model!r} does not make videos; video models: "
                                        f"{sorted(n for n, f in self._families.items() if isinstance(f, VideoFamily))}",
                               code="model_not_found", status=404)
        return family.validate(request)

    def embedding_model(self, model: str) -> EmbeddingModel:
        return _served(self._embedders, model, "embed", "embedding models")

    def submit_embeddings(self, model: str, request: EmbeddingRequest, *, request_id: str | None = None) -> RequestHandle:
        """Check and tokenize (images decoded already), then run the embed stage.

        Final outputs: {"embeddings": float32 [n, D] in input order, "prompt_tokens": int}.
        """
        job = self.embedding_model(model).job(request)
        graph = StageGraph.chain(("embed", f"{model}/embed"))
        return self.executor.submit(graph, {"request": job}, request_id=request_id,
                                    deadline_s=self.config.request_timeout_s, model=model,
                                    max_inflight=self._specs[model].max_inflight)

    def speech_model(self, model: str) -> SpeechModel:
        return _served(self._speakers, model, "speak", "text-to-speech models")

    def submit_speech(self, model: str, request: SpeechRequest, *, request_id: str | None = None) -> RequestHandle:
        """Check, split into phrases and tokenize, then run the tts stage (stages/speech/tts.py).

        Events: DELTA {"index", "audio": float32 [n], "sample_rate"} per phrase, in order; FINAL outputs
        {"audio": float32 [N] (the DELTAs concatenated), "sample_rate", "phrases", "input_tokens"}.
        """
        job = self.speech_model(model).job(request)
        graph = StageGraph.chain(("tts", f"{model}/tts"))
        return self.executor.submit(graph, {"request": job}, request_id=request_id,
                                    deadline_s=self.config.request_timeout_s, model=model,
                                    max_inflight=self._specs[model].max_inflight)

    def transcription_model(self, model: str) -> TranscriptionModel:
        return _served(self._transcribers, model, "transcribe", "speech recognition models")

    def submit_transcription(self, model: str, request: TranscriptionRequest, *,
                             request_id: str | None = None) -> RequestHandle:
        """Check and cut into 30 s windows, then run the asr stage (stages/speech/asr.py: features, encoder, decode).

        Events: DELTA {"text"} as text is decoded (request.stream only), in order; FINAL outputs {"text",
        "segments": [stages.speech.asr_transcript.Segment], "language": code, "duration": s, "windows": [DecodedWindow]}.
        """
        job = self.transcription_model(model).job(request)
        graph = StageGraph.chain(("asr", f"{model}/asr"))
        return self.executor.submit(graph, {"request": job}, request_id=request_id,
                                    deadline_s=self.config.request_timeout_s, model=model,
                                    max_inflight=self._specs[model].max_inflight)

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
            raise RequestError(param, exc.message, code=exc.code, status=MEDIA_STATUS.get(exc.code, 400)) from exc
        return decoded.to_pil()

    async def run_media(self, fn_name: str, *args, param: str, **kwargs):
        """A media worker function (decode_image, probe_video, decode_video, ...), awaited; errors name `param`."""
        from stages.media.image import MediaError
        try:
            return await asyncio.wrap_future(self.media().submit(fn_name, *args, **kwargs))
        except MediaError as exc:
            raise RequestError(param, exc.message, code=exc.code, status=MEDIA_STATUS.get(exc.code, 400)) from exc

    async def load_source(self, source: str, *, param: str) -> bytes:
        """The bytes of a `data:` URI, an http(s) URL or an allowed file:// path, fetched safely."""
        from stages.media.fetch import load_source
        from stages.media.image import MediaError
        try:
            return await load_source(source, self.config.media.fetch, observe=self._fetch_event)
        except MediaError as exc:
            raise RequestError(param, exc.message, code=exc.code, status=MEDIA_STATUS.get(exc.code, 400)) from exc

    def _fetch_event(self, outcome) -> None:
        self.metrics.media_fetches.labels(kind=outcome.kind, outcome=outcome.error_code or "ok").inc()
        self.metrics.media_fetch_bytes.labels(kind=outcome.kind).inc(outcome.nbytes)

    def _cache_event(self, cache: str, kind: str, bytes_held: int) -> None:
        if kind == "hit":
            self.metrics.cache_hits.labels(cache=cache).inc()
        elif kind == "miss":
            self.metrics.cache_misses.labels(cache=cache).inc()
        self.metrics.cache_bytes.labels(cache=cache).set(bytes_held)


def image_task(has_image: bool, has_mask: bool) -> Task:
    if has_mask:
        return Task.INPAINTING
    return Task.IMAGE_TO_IMAGE if has_image else Task.TEXT_TO_IMAGE


def _realtime_video(family: str, tasks: tuple[str, ...]) -> tuple[str, ...]:
    """A model's tasks plus realtime-video when it can serve video sessions: SD-family image-to-image
    (StreamDiffusion-style img2img) and text-to-video families (chunked t2v)."""
    img2img = family in ("sd", "sdxl") and Task.IMAGE_TO_IMAGE.value in tasks
    return (*tasks, REALTIME_VIDEO_TASK) if img2img or "text-to-video" in tasks else tasks


def _random_weights(spec: ModelSpec) -> bool:
    """The spec's word, else the checkpoint's own (a demo stamp); a checkpoint that says nothing has real weights."""
    if spec.random_weights is not None:
        return spec.random_weights
    from pipelines.demo import stamped_random_weights

    return bool(stamped_random_weights(spec.path))


def _served(table: dict, model: str, does: str, kinds: str):
    """The loaded model of one kind, or a 404 naming the models of that kind."""
    served = table.get(model)
    if served is None:
        raise RequestError("model", f"model {model!r} does not exist or does not {does}; {kinds}: {sorted(table)}",
                           code="model_not_found", status=404)
    return served
