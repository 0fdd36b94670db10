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
from pipelines.config import CPU_VIDEO_POOLS, MediaConfig, ModelSpec
from pipelines.embeddings import EMBED_POOL, EmbeddingModel, EmbeddingRequest
from pipelines.families.base import ImageFamily
from pipelines.families.video_base import VideoFamily
from pipelines.image_request import MAX_LORAS, ImageLimits, ImageRequest, ModelNotFound, RequestError, Task
from pipelines.offload import apply_offload
from pipelines.omni import TalkerStage, Token2WavStage, VocoderStage, not_speaking
from pipelines.quantize import quantized_methods
from pipelines.registry import family_class
from pipelines.tts import SPEECH_TASK, TTS_POOL, SpeechModel, SpeechRequest
from pipelines.video import VideoRequest
from pipelines.vlm import VLM_FAMILY, DecodeChatMedia, VLMChatModel, decode_chat_media
from stages.cuda_graphs import GraphConfig
from stages.diffusion.stages import DenoiseStage, TextEncodeStage, VaeDecodeStage
from stages.graph import Node, StageGraph
from stages.llm.params import SamplingParams
from stages.lora import LoraSlots
from stages.media.stage import MediaDecodeStage, MediaEncodeStage, decode_images
from stages.metrics import Metrics
from stages.pool import PoolConfig
from stages.stage import Stage

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pipelines.engine import Engine
    from stages.media.pool import MediaPool

REALTIME_VIDEO_TASK = "realtime-video"  # ModelInfo.tasks of a model that serves WS /v1/realtime/video sessions


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


def load_family(spec: ModelSpec, family_name: str, prompt_cache: EncoderCache) -> ImageFamily | VideoFamily:
    """The diffusion family of `spec` loaded on spec.device (a served model's, or a parallel replica's rank's)."""
    cls = family_class(family_name)
    options = {"video": spec.video} if issubclass(cls, VideoFamily) else {}
    return cls(spec.name, spec.path, device=spec.device, dtype=spec.dtype, prompt_cache=prompt_cache,
               quantize=spec.quantize, **options)


def lora_limits(spec: ModelSpec) -> dict[str, Any]:
    """A model's adapter budget (bytes) and run-time lora_dirs, as load_loras takes them."""
    budget = None if spec.lora_budget_mb is None else int(spec.lora_budget_mb * 2**20)
    return {"budget_bytes": budget, "dirs": spec.lora_dirs}


class ServedImages:
    """A model that makes images from an ImageRequest: a native family's stage graph (ServedDiffusion) or a diffusers
    pipeline run through its own __call__ (pipelines/fallback.py's ServedPipeline)."""

    does, kinds = "generate images", "image models"
    name: str
    info: ModelInfo

    def check_fields(self, request: ImageRequest) -> None:
        """The request's own fields, before an input image is fetched or decoded; RequestErrors name the field."""
        raise NotImplementedError


class ServedDiffusion(ServedImages):
    """An image or video diffusion family: text_encode -> denoise (the loop) -> vae_decode, then media_encode
    when the request asks for encoded files (the server's do; the Python API's keep pixels)."""

    does, kinds = "generate images or videos", "diffusion models"

    def __init__(self, spec: ModelSpec, family_name: str, ctx: LoadContext, random_weights: bool):
        if spec.preview_vae and not getattr(family_class(family_name), "takes_preview_vae", False):
            raise ValueError(f"model {spec.name}: preview_vae is not supported by family {family_name} (it is for "
                             "the image families sd, sdxl, sd3 and flux, and those built on them)")
        family = load_family(spec, family_name, ctx.prompt_cache)
        if spec.preview_vae:  # previews decode with a tiny VAE; the parallel ranks never preview, so load it here
            assert isinstance(family, ImageFamily)  # (takes_preview_vae)
            family.load_preview_vae(spec.preview_vae)
        if spec.max_lora_rank is not None:
            raise ValueError(f"model {spec.name}: max_lora_rank is for language models (their decode graphs)")
        if (spec.loras or spec.lora_dirs) and isinstance(family, VideoFamily):
            raise ValueError(f"model {spec.name}: loras are for image and language models (video requests name no "
                             "adapter yet)")
        family.load_loras(spec.loras, **lora_limits(spec))  # before the speed-ups wrap the modules
        speedups = spec.speedups
        if spec.offload:
            apply_offload(spec.name, family.pipe.components, spec.offload, family.device)
            if spec.graphs.enabled:
                log.warning("model %s: CUDA graphs off: offloaded weights move between forwards, which a captured "
                            "graph cannot follow", spec.name)
                speedups = dataclasses.replace(speedups, graphs=GraphConfig())
        family.accelerate(speedups, ctx.metrics)  # fused kernels, compile, step-cache wrappers, graph config
        family.set_memory_budget(None if spec.memory_budget_mb is None else int(spec.memory_budget_mb * 2**20))
        family.parallel = spec.parallel
        if spec.parallel.vae:  # the tiled decode's tiles over the ranks: tiling on (video.vae_tile's size)
            from pipelines.parallel_vae import check_parallel_vae

            check_parallel_vae(family)
            assert isinstance(family, VideoFamily)  # (a Wan VAE is a video family's)
            family.enable_vae_tiling()
        if spec.parallel.world > 1 and ctx.runs:  # the denoise replica's other ranks: processes with the family
            from pipelines.parallel import start_ranks

            family.ranks = start_ranks(spec, family_name, family, ctx.metrics)
        self.name, self.model, self.graphs, self.limits = spec.name, family, speedups.graphs, ctx.limits
        self.device = spec.device
        self.media, self.media_pool, self.decode_limits = ctx.media, ctx.media_pool, ctx.media_config.image
        tasks = _realtime_video(family_name, family.tasks)
        memory: dict[str, Any] = {"quantization": quantized_methods(family.quantization) or None,
                                  "resident_bytes": family.resident_bytes}
        if isinstance(family, VideoFamily):
            (width, height), video = family.request_default_size, family.video_defaults
            self.info = ModelInfo(spec.name, family_name, spec.path, tasks, family.size_factor, max(width, height),
                                  video_defaults=video, random_weights=random_weights, **memory)
        else:
            self.info = ModelInfo(spec.name, family_name, spec.path, tasks, family.size_factor, family.default_size,
                                  random_weights=random_weights, adapters=family.loras.names(), **memory)

    def close(self) -> None:
        """Stop what runs outside the serving process (a parallel replica's ranks)."""
        if self.model.ranks is not None:
            self.model.ranks.close()

    def stages(self):
        video = isinstance(self.model, VideoFamily)
        vae_pool = CPU_VIDEO_POOLS["vae_decode"] if video and self.device == "cpu" else None
        stages = (("text_encode", TextEncodeStage(self.model), None), ("denoise", DenoiseStage(self.model), None),
                  ("vae_decode", VaeDecodeStage(self.model), vae_pool))
        if video:  # videos are encoded by their job (serve/job_runner.py)
            return stages
        media = self.media_pool
        decode = MediaDecodeStage(self.name, self.media, decode_images(self.decode_limits), self.finalize)
        return (("media_decode", decode, media), *stages, ("media_encode", MediaEncodeStage(self.name, self.media),
                                                           media))

    def execution(self, request: ImageRequest | VideoRequest) -> Execution:
        if isinstance(request, VideoRequest):
            return Execution(chain(self.name, "text_encode", "denoise", "vae_decode"), {"request": self.check(request)})
        inputs: dict[str, Any] = {}
        if request.source is not None:  # an upload to decode first: check what needs no image now
            self.check_fields(request)
            inputs["request"], inputs["decode"] = request, request.source
        else:
            inputs["request"] = self.check(request)
        if request.output is not None:
            inputs["encode"] = request.output
        return Execution(self.image_graph(decode=request.source is not None, encode=request.output is not None),
                         inputs)

    def image_graph(self, *, decode: bool, encode: bool) -> StageGraph:
        """[media_decode ->] text_encode -> denoise -> vae_decode [-> media_encode]. After media_decode every
        model node also reads it (the request it finalized, with its images and drawn seed); a node reads its
        inputs from the nodes it names, the later one winning."""
        first: tuple[str, ...] = ("media_decode",) if decode else ()
        nodes = [Node(kind, f"{self.name}/{kind}", after) for kind, after in (
            ("text_encode", first), ("denoise", (*first, "text_encode")), ("vae_decode", (*first, "denoise")))]
        if decode:
            nodes.insert(0, Node("media_decode", f"{self.name}/media_decode"))
        if encode:
            nodes.append(Node("media_encode", f"{self.name}/media_encode", ("vae_decode",)))
        return StageGraph(tuple(nodes), nodes[-1].name)

    def check_fields(self, request: ImageRequest) -> None:
        """An edit's own fields against the model and limits, before its upload is decoded (what depends on the
        image, and the family's default steps and guidance, is checked in `finalize`)."""
        if request.task.value not in self.info.tasks:
            raise RequestError("model", f"model {self.name} does not support {request.task.value}; it supports "
                                        f"{list(self.info.tasks)}")
        request.check_fields(size_factor=self.info.size_factor, default_size=self.info.default_size,
                             limits=self.limits)

    def finalize(self, request: ImageRequest, decoded) -> dict[str, Any]:
        """The edit with its decoded image and mask, checked (media_decode calls it): with size auto it keeps the
        image's size, rounded down to the model's multiple."""
        image, mask = decoded
        factor = self.info.size_factor
        width, height = request.width, request.height
        if width is None and height is None:
            width, height = (dim // factor * factor for dim in image.size)
            if width < factor or height < factor:
                raise RequestError("image", f"image is {image.size[0]}x{image.size[1]}; this model needs at least "
                                            f"{factor}x{factor}", code="image_too_small")
        edit = dataclasses.replace(request, image=image, mask=mask, width=width, height=height, source=None)
        assert isinstance(self.model, ImageFamily)  # media_decode runs on image graphs only (stages)
        edit = self.model.validate(edit, self.limits)
        self.model.check_memory(edit)
        return {"request": edit}

    def check(self, request: ImageRequest | VideoRequest) -> ImageRequest | VideoRequest:
        """The request as it will run (defaults filled, a seed drawn), or the field-naming RequestError."""
        if isinstance(request, VideoRequest):
            if not isinstance(self.model, VideoFamily):  # (routes refuse it sooner: unsupported_task)
                raise ModelNotFound(f"model {self.name!r} does not make videos; it does "
                                    f"{list(self.info.tasks)}")
            video = self.model.validate(request)
            self.model.check_memory(video)
            return video
        if isinstance(self.model, VideoFamily):
            raise RequestError("model", f"model {self.name} makes videos ({list(self.model.tasks)}); use /v1/videos")
        image = self.model.validate(request, self.limits)
        self.model.check_memory(image)
        return image

    def warm(self, engine: Engine) -> None:
        """A tiny request, or one per declared graph shape (each captures its buckets); then seal."""
        info, graphs = self.info, self.graphs
        if isinstance(self.model, VideoFamily):  # a small video: one latent frame past the first
            from PIL import Image

            assert info.video_defaults is not None  # a video family's info always has them
            size, frames = info.size_factor, info.video_defaults["frame_factor"] + 1
            image = None if "text-to-video" in info.tasks else Image.new("RGB", (size, size), (128, 128, 128))
            for (width, height), num_frames in [(s, f) for s in graphs.sizes or [(size, size)]
                                                for f in graphs.frames or [frames]]:
                engine.submit(self.name, VideoRequest(prompt="warm-up", width=width, height=height,
                                                      num_frames=num_frames, num_inference_steps=2, seed=0,
                                                      image=image)).result(timeout=600)
        else:  # a parallel replica's ranks may run one row each: too few pixels for a small UNet's group norms
            size = info.size_factor * 2 if self.model.parallel.world == 1 else info.default_size
            for width, height in graphs.sizes or [(size, size)]:
                engine.submit(self.name, self.model.warm_request(width, height)).result(timeout=600)
        self.model.denoiser.seal()

    def describe(self) -> str:
        return ", ".join(self.info.tasks)


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
        return Execution(chain(self.name, "llm"), {"request": self.model.generation_request(request)})

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
        speech = ()
        if model.voice is not None:
            speech = (("talker", TalkerStage(self.name, model.voice), None),
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
        nodes = (Node("llm", f"{self.name}/llm"), *self._speech_nodes(()))
        return Execution(StageGraph(nodes, "vocoder"), {"request": generation, "speech": request.speech})

    def _speech_nodes(self, before: tuple[str, ...]) -> tuple[Node, ...]:
        """The talker after the thinker's reply (and the node that planned the prompt's media), token2wav's DiT and
        vocoder after it."""
        return (Node("talker", f"{self.name}/talker", (*before, "llm")),
                Node("token2wav", f"{self.name}/token2wav", ("llm", "talker")),
                Node("vocoder", f"{self.name}/vocoder", ("token2wav",)))

    def execution_with_media(self, request: ChatRequest, parsed: ParsedChat, sources: list[bytes]) -> Execution:
        """A request with media parts, its sources fetched: media_decode -> the encoders its parts need
        (vision_encode, audio_encode) -> llm, which reads media_decode too (the prompt it planned) besides the
        features: a fan-in."""
        model = self.model
        assert isinstance(model, VLMChatModel)
        needed = {"audio_encode" if part.kind == "audio" else "vision_encode" for part in parsed.media}
        encoders = [kind for kind in model.encode_stages if kind in needed]
        self.check_speech(request)
        nodes = (Node("media_decode", f"{self.name}/media_decode"),
                 *(Node(kind, f"{self.name}/{kind}", ("media_decode",)) for kind in encoders),
                 Node("llm", f"{self.name}/llm", ("media_decode", *encoders)))
        inputs = {"request": request, "decode": DecodeChatMedia(parsed, tuple(sources))}
        if request.speech is None:
            return Execution(StageGraph(nodes, "llm"), inputs)
        return Execution(StageGraph((*nodes, *self._speech_nodes(("media_decode",))), "vocoder"),
                         {**inputs, "speech": request.speech})

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


# The request type each kind of served model runs (Engine.submit checks the pair).
REQUESTS: dict[type, type] = {ImageRequest: ServedImages, VideoRequest: ServedDiffusion, ChatRequest: ServedChat,
                              EmbeddingRequest: ServedEmbedding, SpeechRequest: ServedSpeech,
                              TranscriptionRequest: ServedTranscription}


def image_task(has_image: bool, has_mask: bool) -> Task:
    if has_mask:
        return Task.INPAINTING
    return Task.IMAGE_TO_IMAGE if has_image else Task.TEXT_TO_IMAGE


def _realtime_video(family: str, tasks: tuple[str, ...]) -> tuple[str, ...]:
    """A model's tasks plus realtime-video when it can serve video sessions: SD-family image-to-image
    (StreamDiffusion-style img2img) and text-to-video families (chunked t2v)."""
    img2img = family in ("sd", "sdxl") and Task.IMAGE_TO_IMAGE.value in tasks
    return (*tasks, REALTIME_VIDEO_TASK) if img2img or "text-to-video" in tasks else tasks

