"""The served-model contract: what the engine needs of a loaded model, whatever its kind.

A served model is loaded from a `ModelSpec` (`load`), names the stages its pools run (`stages`), says what it
is (`info`, the /v1/models entry), turns a checked request into the graph and inputs the executor runs
(`execution`) and warms itself before the server is ready (`warm`). The engine holds one table of them and
runs every request the same way (`Engine.submit`). pipelines/registry.py maps each family to its class here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from encoders.cache import EncoderCache
from pipelines.asr import ASR_FAMILY, ASR_POOL, TranscriptionModel, TranscriptionRequest
from pipelines.chat import ChatModel, ChatRequest, LanguageModel
from pipelines.chat_parts import ParsedChat
from pipelines.config import MediaConfig, ModelSpec
from pipelines.embeddings import EMBED_POOL, EmbeddingModel, EmbeddingRequest
from pipelines.image_request import MAX_LORAS, ImageLimits, RequestError
from pipelines.omni import (
    CodeWindows,
    OmniVoice,
    OneEach,
    SpeechOutput,
    Token2WavStage,
    VocoderStage,
    not_speaking,
    streamed_reply,
)
from pipelines.omni3 import Omni3Voice, Talker3Stage
from pipelines.omni3_code2wav import CODE2WAV_POOL, Code2WavStage, CodeChunks, streamed_reply3, talked3
from pipelines.omni_talker import TalkerStage, talked
from pipelines.tools import with_calls
from pipelines.tts import SPEECH_TASK, TTS_POOL, SpeechModel, SpeechRequest
from pipelines.vlm import VLM_FAMILY, DecodeChatMedia, VLMChatModel, decode_chat_media
from stages.graph import Node, StageGraph, Stream
from stages.llm.params import SamplingParams
from stages.lora import LoraSlots
from stages.media.stage import MediaDecodeStage
from stages.metrics import Metrics
from stages.pool import PoolConfig
from stages.stage import Stage

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pipelines.engine import Engine
    from stages.media.pool import MediaPool

@dataclass(frozen=True)
class ModelInfo:
    id: str  # the name clients use
    family: str  # "sd", "sdxl", "sd3", "flux", "causal-lm", "whisper", ...
    path: str  # checkpoint directory or hub id
    tasks: tuple[str, ...]  # "text-to-image", "chat", "text-to-speech", ...
    size_factor: int = 0  # diffusion: width and height must be multiples of this
    default_size: int = 0  # diffusion: square size used when the request names none
    voices: tuple[str, ...] = ()  # text-to-speech models: the voice names a request may use
    adapters: tuple[str, ...] = ()  # LoRA adapters a request may name (`lora`)
    quantization: dict | None = None  # diffusion: component -> method ([models.quantize])
    resident_bytes: int | None = None  # diffusion: bytes of the weights as loaded
    video_defaults: dict | None = None  # video models: {"width", "height", "num_frames", "fps", "frame_factor"}
    random_weights: bool = False  # a demo/test checkpoint: real code path, noise out; never a default when a
    #                               real-weight model does the task (model_default.py)
    # "stage-graph": mmserve's own stages run it; "pipeline": a diffusers pipeline's own __call__ runs it, one request
    # at a time (pipelines/fallback.py)
    execution: str = "stage-graph"


@dataclass(frozen=True)
class Execution:
    """What the executor runs for one request: the graph and the inputs of its first nodes."""

    graph: StageGraph
    inputs: dict[str, Any]


@dataclass(frozen=True)
class LoadContext:
    """What loading a model may use of the engine: its metrics, caches, request limits and media workers."""

    metrics: Metrics
    prompt_cache: EncoderCache
    encoder_cache: EncoderCache
    limits: ImageLimits
    media: Callable[[], MediaPool]  # the engine's media worker processes (started on first use)
    media_config: MediaConfig  # their count (the media stages keep as many tasks in flight) and decode limits
    # False: this copy runs no forward (the ray backend's API process: checks, tokenizers, batch keys), so a parallel
    # model starts no ranks here
    runs: bool = True

    @property
    def media_pool(self) -> PoolConfig:
        """The pool of a media stage: one request a call, as many at once as there are media workers."""
        return PoolConfig(replicas=self.media_config.workers, max_queue=256)


class ServedModel(Protocol):
    name: str
    info: ModelInfo
    model: Any  # what was loaded: an ImageFamily or VideoFamily, LanguageModel, EmbeddingModel, SpeechModel, ...
    does: ClassVar[str]  # what it does, for errors: "chat", "make speech", ...
    kinds: ClassVar[str]  # its kind in the plural, for errors: "chat models", ...

    def stages(self) -> tuple[tuple[str, Stage, PoolConfig | None], ...]:
        """(kind, stage, default pool config) of each pool the model needs; the pool is named model/kind."""
        ...

    def execution(self, request: Any) -> Execution:
        """The request's cheap checks (RequestError naming the field), then what the executor runs."""
        ...

    def warm(self, engine: Engine) -> None:
        """Run what must run once before the server is ready (a tiny request, graph capture)."""
        ...

    def describe(self) -> str:
        """What the load log line says of it beyond its name, family and path."""
        ...


def chain(model: str, *kinds: str) -> StageGraph:
    """A linear graph over the model's pools: model/kind for each kind, in order."""
    return StageGraph.chain(*((kind, f"{model}/{kind}") for kind in kinds))


def lora_limits(spec: ModelSpec) -> dict[str, Any]:
    """A model's adapter budget (bytes) and run-time lora_dirs, as load_loras takes them."""
    budget = None if spec.lora_budget_mb is None else int(spec.lora_budget_mb * 2**20)
    return {"budget_bytes": budget, "dirs": spec.lora_dirs}


class ServedChat:
    """A causal LM: the llm stage (continuous batching over paged KV)."""

    does, kinds = "chat", "chat models"

    def __init__(self, spec: ModelSpec, family_name: str, ctx: LoadContext, random_weights: bool):
        self.name = spec.name
        self.model: LanguageModel = self._load(spec, ctx)
        slots = None
        if spec.max_lora_rank is not None:
            slots = LoraSlots(spec.max_loras, spec.max_lora_rank, per_row=MAX_LORAS)
        self.model.load_loras(spec.loras, **lora_limits(spec), slots=slots)
        self.info = ModelInfo(spec.name, family_name, spec.path, self.tasks, random_weights=random_weights,
                              adapters=self.model.loras.names())
        self.ctx = ctx

    tasks: tuple[str, ...] = ("chat",)

    def _load(self, spec: ModelSpec, ctx: LoadContext) -> LanguageModel:
        return ChatModel(spec.name, spec.path, device=spec.device, dtype=spec.dtype, config=spec.llm,
                         metrics=ctx.metrics, graphs=spec.graphs, fused_kernels=spec.fused_kernels)

    def stages(self):
        return (("llm", self.model.stage, None),)

    def execution(self, request: ChatRequest) -> Execution:
        if request.speech is not None:
            raise not_speaking(self.name)
        generation = self.model.generation_request(request)
        graph = chain(self.name, "llm")
        if request.tools is not None:  # the reply's calls read back from its text
            tools, form = request.tools, self.model.tool_format
            graph = dataclasses.replace(graph, finish=lambda outputs: with_calls(outputs, tools, form))
        return Execution(graph, {"request": generation})

    def warm(self, engine: Engine) -> None:
        params = SamplingParams(temperature=0, max_tokens=1)
        engine.submit(self.name, ChatRequest(prompt="warm-up", params=params)).result(timeout=600)
        self.model.runner.capture_graphs()  # every decode bucket, before ready

    def describe(self) -> str:
        runner = self.model.runner
        return f"{runner.num_blocks} KV blocks of {runner.kv.block_size} tokens"


SPOKEN_CHAT_TASK = "spoken-chat"  # ModelInfo.tasks of a chat model that can speak its reply (a talker)

class ServedVLM(ServedChat):
    """A vision- or audio-language model: vision_encode and/or audio_encode (through the encoder-output cache)
    -> llm."""

    def __init__(self, spec: ModelSpec, family_name: str, ctx: LoadContext, random_weights: bool):
        super().__init__(spec, family_name, ctx, random_weights)
        model = self.model
        assert isinstance(model, VLMChatModel)
        kinds = (["vision-chat"] if "image" in model.accepts else []) + (["audio-chat"] if "audio" in model.accepts
                                                                            else [])
        kinds += [SPOKEN_CHAT_TASK] if model.voice is not None else []
        self.speech_vlm = spec.vlm  # a streamed spoken reply's token2wav chunks
        if isinstance(model.voice, OmniVoice):  # its graphs stream the thinker into this stage
            self.talker = TalkerStage(self.name, model.voice, spec.vlm.max_speech_codes)
        elif isinstance(model.voice, Omni3Voice):  # its graphs stream the thinker into this stage (text prompts)
            self.talker3 = Talker3Stage(self.name, model.voice, spec.vlm.max_speech_codes)
        self.info = dataclasses.replace(self.info, tasks=("chat", *kinds),
                                        voices=model.voice.voices if model.voice is not None else ())

    def _load(self, spec: ModelSpec, ctx: LoadContext) -> LanguageModel:
        # A reload gets a new weights id (file fingerprint); entries of the old weights are dropped now.
        stale = f"{VLM_FAMILY}:{spec.path}:"
        ctx.encoder_cache.invalidate(lambda key: key[1].startswith(stale))  # type: ignore[index]  # (tenant, id, ..)
        return VLMChatModel(spec.name, spec.path, device=spec.device, dtype=spec.dtype, config=spec.llm, vlm=spec.vlm,
                            metrics=ctx.metrics, cache=ctx.encoder_cache)

    def stages(self):
        model = self.model
        assert isinstance(model, VLMChatModel)
        decode = MediaDecodeStage(self.name, self.ctx.media, decode_chat_media(model, self.ctx.media_config),
                                  self.finalize)
        speech: tuple = ()
        if isinstance(model.voice, Omni3Voice):  # Qwen3-Omni: talker (+ code predictor) -> code2wav
            speech = (("talker", self.talker3, None),
                      ("code2wav", Code2WavStage(self.name, model.voice), CODE2WAV_POOL))
        elif model.voice is not None:
            speech = (("talker", self.talker, None),
                      ("token2wav", Token2WavStage(self.name, model.voice), None),
                      ("vocoder", VocoderStage(self.name, model.voice), None))
        return (("media_decode", decode, self.ctx.media_pool),
                *((kind, stage, None) for kind, stage in model.encode_stages.items()), ("llm", model.stage, None),
                *speech)

    def check_speech(self, request: ChatRequest) -> None:
        """A spoken reply needs this model's talker and one of its voices; RequestErrors name the field."""
        model = self.model
        assert isinstance(model, VLMChatModel)
        if request.speech is None:
            return
        if model.voice is None:
            raise not_speaking(self.name)
        if request.speech.voice not in model.voice.voices:
            raise RequestError("audio.voice", f"model {self.name} has no voice {request.speech.voice!r}; voices: "
                               f"{list(model.voice.voices)}")
        if request.params.n != 1:
            raise RequestError("n", "a spoken reply is one choice (n = 1)")

    def execution(self, request: ChatRequest) -> Execution:
        self.check_speech(request)
        generation = self.model.generation_request(request)
        if request.speech is None:
            return Execution(chain(self.name, "llm"), {"request": generation})
        return Execution(self._spoken((Node("llm", f"{self.name}/llm"),), (), request.speech),
                         {"request": generation, "speech": request.speech})

    def _spoken(self, nodes: tuple[Node, ...], before: tuple[str, ...], speech: SpeechOutput) -> StageGraph:
        """`nodes` (up to the thinker's llm), then the speech half. Qwen2.5-Omni: the talker streamed from the
        thinker (it starts at the thinker's first token), then token2wav's DiT and the vocoder, after it for a whole
        reply, or streamed from it chunk by chunk. Qwen3-Omni: the talker streamed from the thinker too, reading
        `before` (the nodes of the prompt's media, done before the thinker starts); then code2wav after it, or
        streamed from it chunk by chunk (a node named `vocoder`, as Qwen2.5-Omni's chunks are told, on the code2wav
        pool)."""
        model = self.model
        assert isinstance(model, VLMChatModel)
        if isinstance(model.voice, Omni3Voice):
            pool = f"{self.name}/talker"
            talker3 = Node("talker", pool, before, stream=Stream("llm", self.talker3.feed))
            if not speech.stream:
                return StageGraph((*nodes, talker3, Node("code2wav", f"{self.name}/code2wav", ("talker",),
                                                         prepare=talked3)), "code2wav")
            return StageGraph((*nodes, talker3, Node("vocoder", f"{self.name}/code2wav",
                                                     stream=Stream("talker", CodeChunks))), "vocoder",
                              finish=streamed_reply3)
        assert isinstance(model.voice, OmniVoice)
        talker = Node("talker", f"{self.name}/talker", stream=Stream("llm", self.talker.feed))
        if not speech.stream:
            return StageGraph((*nodes, talker, Node("token2wav", f"{self.name}/token2wav", ("llm", "talker"),
                                                    prepare=talked),
                               Node("vocoder", f"{self.name}/vocoder", ("token2wav",))), "vocoder")
        block = model.voice.block // model.voice.repeats  # codes a DiT block
        vlm = self.speech_vlm
        chunk, most = block * vlm.speech_chunk_blocks, block * vlm.speech_max_chunk_blocks
        windows = Stream("talker", lambda: CodeWindows(chunk, block * vlm.speech_context_blocks, most))
        return StageGraph((*nodes, talker, Node("token2wav", f"{self.name}/token2wav", stream=windows),
                           Node("vocoder", f"{self.name}/vocoder", stream=Stream("token2wav", OneEach))), "vocoder",
                          finish=streamed_reply)

    def execution_with_media(self, request: ChatRequest, parsed: ParsedChat, sources: list[bytes]) -> Execution:
        """A request with media parts, its sources fetched: media_decode -> the encoders its parts need
        (vision_encode, audio_encode) -> llm, which reads media_decode too (the prompt it planned) besides the
        features: a fan-in."""
        model = self.model
        assert isinstance(model, VLMChatModel)
        if request.tools is not None:
            raise RequestError("tools", f"model {self.name} does not take tools yet (text chat models do)")
        needed = {"audio_encode" if part.kind == "audio" else "vision_encode" for part in parsed.media}
        encoders = [kind for kind in model.encode_stages if kind in needed]
        self.check_speech(request)
        nodes = (Node("media_decode", f"{self.name}/media_decode"),
                 *(Node(kind, f"{self.name}/{kind}", ("media_decode",)) for kind in encoders),
                 Node("llm", f"{self.name}/llm", ("media_decode", *encoders)))
        inputs = {"request": request, "decode": DecodeChatMedia(parsed, tuple(sources))}
        if request.speech is None:
            return Execution(StageGraph(nodes, "llm"), inputs)
        # Qwen3-Omni's talker recomputes the thinker's states at the media placeholders: it reads their features too
        before = ("media_decode", *encoders) if isinstance(model.voice, Omni3Voice) else ("media_decode",)
        return Execution(self._spoken(nodes, before, request.speech), {**inputs, "speech": request.speech})

    def finalize(self, request: ChatRequest, decoded) -> dict[str, Any]:
        """The prompt with every placeholder expanded, checked against the context (media_decode calls it), and
        each encoder's tasks."""
        model = self.model
        assert isinstance(model, VLMChatModel)
        parsed, media = decoded
        generation, tasks = model.generation_request_with_media(request, parsed, media)
        return {"request": generation, "media": tasks.get("vision_encode", ()),
                "audio_media": tasks.get("audio_encode", ())}


class ServedEmbedding:
    """A text (or CLIP text and image) embedding model: the embed stage."""

    does, kinds = "embed", "embedding models"

    def __init__(self, spec: ModelSpec, family_name: str, ctx: LoadContext, random_weights: bool):
        self.name = spec.name
        self.model = EmbeddingModel(spec.name, spec.path, family_name, device=spec.device, dtype=spec.dtype)
        self.info = ModelInfo(spec.name, family_name, spec.path, self.model.tasks, random_weights=random_weights)

    def stages(self):
        return (("embed", self.model.stage, EMBED_POOL),)

    def execution(self, request: EmbeddingRequest) -> Execution:
        return Execution(chain(self.name, "embed"), {"request": self.model.job(request)})

    def warm(self, engine: Engine) -> None:
        engine.submit(self.name, EmbeddingRequest(["warm-up"])).result(timeout=600)

    def describe(self) -> str:
        return f"{self.model.dimension} dimensions, {self.model.max_tokens} tokens"


class ServedSpeech:
    """A text-to-speech model: the tts stage, phrase by phrase."""

    does, kinds = "speak", "text-to-speech models"

    def __init__(self, spec: ModelSpec, family_name: str, ctx: LoadContext, random_weights: bool):
        self.name = spec.name
        self.model = SpeechModel(spec.name, spec.path, family_name, device=spec.device, dtype=spec.dtype)
        self.info = ModelInfo(spec.name, family_name, spec.path, (SPEECH_TASK,), voices=self.model.voices,
                              random_weights=random_weights)

    def stages(self):
        return (("tts", self.model.stage, TTS_POOL),)

    def execution(self, request: SpeechRequest) -> Execution:
        return Execution(chain(self.name, "tts"), {"request": self.model.job(request)})

    def warm(self, engine: Engine) -> None:
        engine.submit(self.name, SpeechRequest("warm-up")).result(timeout=600)

    def describe(self) -> str:
        return f"{self.model.sample_rate} Hz, voices {list(self.model.voices)}"


class ServedTranscription:
    """A Whisper model: the asr stage (30 s windows share one decode loop)."""

    does, kinds = "transcribe", "speech recognition models"

    def __init__(self, spec: ModelSpec, family_name: str, ctx: LoadContext, random_weights: bool):
        self.name = spec.name
        self.model = TranscriptionModel(spec.name, spec.path, device=spec.device, dtype=spec.dtype, config=spec.asr)
        self.info = ModelInfo(spec.name, ASR_FAMILY, spec.path, self.model.tasks, random_weights=random_weights)

    def stages(self):
        return (("asr", self.model.stage, ASR_POOL),)

    def execution(self, request: TranscriptionRequest) -> Execution:
        return Execution(chain(self.name, "asr"), {"request": self.model.job(request)})

    def warm(self, engine: Engine) -> None:  # one second of silence
        engine.submit(self.name, TranscriptionRequest(np.zeros(16000, np.float32))).result(timeout=600)

    def describe(self) -> str:
        return "English-only" if self.model.english_only else "multilingual"
