"""The engine's configuration tree: built once, validated on construction, never mutated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.asr import AsrConfig
from pipelines.chat import LLMConfig
from pipelines.chat_parts import VLMConfig
from pipelines.image_request import ImageLimits
from pipelines.offload import check_offload
from pipelines.quantize import Quantization
from pipelines.video import VideoConfig
from stages.cuda_graphs import GraphConfig
from stages.diffusion.compile import CompileConfig
from stages.diffusion.denoiser import Speedups
from stages.diffusion.step_cache import StepCacheConfig
from stages.media.audio import AudioDecodeLimits
from stages.media.fetch import FetchPolicy
from stages.media.image import ImageDecodeLimits
from stages.media.video import VideoDecodeLimits
from stages.pool import PoolConfig


@dataclass(frozen=True)
class ParallelConfig:
    """One request's denoiser forward across several ranks of one replica ([models.parallel]; DESIGN §3).

    cfg = 2: classifier-free guidance's two halves on two groups of ranks (the conditional on rank 0's), one
    exchange a step. ulysses = N / ring = M: each half's sequence sharded over N x M ranks by diffusers'
    context-parallel hooks (Ulysses all-to-all of heads, ring passes of keys and values; flux and wan).
    world = cfg x ulysses x ring ranks. The ranks' devices are the denoise pool's `devices` (one per rank); without
    them, a CPU model starts that many CPU ranks, the cores shared between them. vae = true: a video's tiled VAE
    decode spreads its tiles over the same ranks (Wan's VAE)."""

    cfg: int = 1
    ulysses: int = 1
    ring: int = 1
    vae: bool = False

    def __post_init__(self):
        if self.cfg not in (1, 2):
            raise ValueError(f"parallel.cfg must be 1 or 2 (the two halves of guidance), got {self.cfg!r}")
        for key in ("ulysses", "ring"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{key} must be an integer >= 1, got {value!r}")
        if self.vae and self.world == 1:
            raise ValueError("parallel.vae: the VAE's tiles are spread over the denoise replica's ranks; give it some "
                             "(parallel.cfg = 2 or parallel.ulysses > 1)")

    @property
    def world(self) -> int:
        """Ranks of one replica."""
        return self.cfg * self.ulysses * self.ring


MAX_LORA_SCALE = 8.0  # |scale| of one adapter, declared or asked


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter served with its base model (`[[models.loras]]`): loaded at start by diffusers'
    `load_lora_weights` (a .safetensors file, or a diffusers / PEFT LoRA directory; kohya and A1111 files too)."""

    name: str
    path: str
    scale: float = 1.0  # its weight when a request names it without one

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or ":" in self.name:
            raise ValueError(f"lora name must be a non-empty string without ':', got {self.name!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"lora {self.name}: path must be a non-empty string")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) \
                or not abs(self.scale) <= MAX_LORA_SCALE:
            raise ValueError(f"lora {self.name}: scale must be a number in [-{MAX_LORA_SCALE:g}, "
                             f"{MAX_LORA_SCALE:g}], got {self.scale!r}")


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the id clients use (`model` field)
    path: str  # local checkpoint directory or hub id
    family: str | None = None  # None: detected from model_index.json / config.json
    device: str = "cpu"
    dtype: str = "float32"
    # Pools by stage kind ("text_encode", "denoise", "vae_decode"); missing kinds use the defaults below.
    pools: dict[str, PoolConfig] = field(default_factory=dict)
    max_inflight: int = 64  # admitted requests of this model at once; more answer 429
    llm: LLMConfig = LLMConfig()  # causal LMs only: KV budget, block size, batching limits
    vlm: VLMConfig = VLMConfig()  # vision-language models only: media limits per request, encoder batching
    asr: AsrConfig = AsrConfig()  # speech recognition (Whisper) only: windows per forward, tokens per window
    video: VideoConfig = VideoConfig()  # video families (wan, ltx) only: VAE tiling/slicing, request limits
    # Speed-ups (DESIGN §8), all off by default: graph buckets (denoise rows x sizes; llm decode rows),
    # regional compile of the repeated blocks, step caching requests may opt into, fused Triton kernels.
    graphs: GraphConfig = GraphConfig()
    compile: CompileConfig = CompileConfig()
    step_cache: StepCacheConfig = StepCacheConfig()
    fused_kernels: bool = False
    parallel: ParallelConfig = ParallelConfig()  # diffusion only: one denoise replica over several ranks
    loras: tuple[LoraSpec, ...] = ()  # LoRA adapters a request may name (`lora` field; "base:adapter" for chat)
    lora_dirs: tuple[Path, ...] = ()  # where `POST /v1/loras` may load adapters from at run time (none: it may not)
    lora_budget_mb: float | None = None  # bytes of adapter weights resident in the model (an LRU); None: no limit
    # language models with graphs: the adapter-rank bucket (vLLM's --max-lora-rank). Adapters then live in
    # max_loras slots of static buffers, and decode steps with adapters replay the captured graphs.
    max_lora_rank: int | None = None
    max_loras: int = 8
    # diffusion only: component (model_index.json name) -> "int8wo" | "fp8" | "int4wo" | "nf4" | "gguf:FILE"
    # (pipelines/quantize.py)
    quantize: dict[str, str] = field(default_factory=dict)
    # diffusion only: component -> "block" | "leaf": weights on the CPU, streamed to the device (pipelines/offload.py)
    offload: dict[str, str] = field(default_factory=dict)
    # diffusion only: weights plus one denoiser forward's activations (measured) must fit; None: no budget
    memory_budget_mb: float | None = None
    # image diffusion only (sd, sdxl, flux): a diffusers AutoencoderTiny (TAESD) directory that decodes the previews
    # (partial images) instead of the full VAE; finals keep the full VAE. None: previews use the full VAE
    preview_vae: str | None = None
    # Whether the checkpoint's weights are random (a demo or test checkpoint: the code path is real, the outputs
    # are noise). None: the checkpoint says so itself (the stamp `mmserve demo-models` writes). A request that
    # names no model gets a random-weight model only when no real-weight one does its task
    # (pipelines/model_default.py).
    random_weights: bool | None = None


    def __post_init__(self):
        if not self.name or "/" in self.name and self.name.startswith("/"):
            raise ValueError(f"model name {self.name!r} must be a non-empty id")
        if self.max_inflight < 1:
            raise ValueError(f"model {self.name}: max_inflight must be >= 1, got {self.max_inflight}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"model {self.name}: dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if not (self.random_weights is None or isinstance(self.random_weights, bool)):
            raise ValueError(f"model {self.name}: random_weights must be true or false, got {self.random_weights!r}")
        if self.parallel.world > 1:
            self._check_parallel()
        names = [lora.name for lora in self.loras]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name}: lora names must be unique, got {names}")
        if (self.loras or self.lora_dirs) and self.parallel.world > 1:
            raise ValueError(f"model {self.name}: loras with [models.parallel] are not supported yet")
        if self.lora_budget_mb is not None and not (isinstance(self.lora_budget_mb, (int, float))
                                                    and self.lora_budget_mb > 0):
            raise ValueError(f"model {self.name}: lora_budget_mb must be a number > 0, got {self.lora_budget_mb!r}")
        if self.quantize:
            Quantization(dict(self.quantize)).check(self.name, self.device)
        check_offload(self.name, self.offload)
        for key in ("max_lora_rank", "max_loras"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"model {self.name}: {key} must be an integer >= 1, got {value!r}")
        if self.memory_budget_mb is not None and not (isinstance(self.memory_budget_mb, (int, float))
                                                      and self.memory_budget_mb > 0):
            raise ValueError(f"model {self.name}: memory_budget_mb must be a number > 0, got "
                             f"{self.memory_budget_mb!r}")
        if self.offload and (self.loras or self.lora_dirs or self.parallel.world > 1):
            raise ValueError(f"model {self.name}: offload with loras or [models.parallel] is not supported yet")
        for folder in self.lora_dirs:
            if not Path(folder).is_dir():
                raise ValueError(f"model {self.name}: lora_dirs entry {str(folder)!r} is not a directory")
        if self.preview_vae is not None and not Path(self.preview_vae).is_dir():
            raise ValueError(f"model {self.name}: preview_vae {str(self.preview_vae)!r} is not a directory (an "
                             "AutoencoderTiny saved with save_pretrained)")

    def _check_parallel(self) -> None:
        where, world = f"model {self.name}: ", self.parallel.world
        denoise = self.pools.get("denoise", PoolConfig())
        if denoise.devices and len(denoise.devices) != world:  # (a pool's replicas follow its devices' count)
            raise ValueError(f"{where}pools.denoise.devices must list one device per rank ({world}: parallel.cfg x "
                             f"ulysses x ring), got {len(denoise.devices)}")
        if not denoise.devices and denoise.replicas != 1:
            raise ValueError(f"{where}pools.denoise.replicas must be 1 with parallel (one replica of {world} ranks), "
                             f"got {denoise.replicas}")
        if not denoise.devices and self.device != "cpu":
            raise ValueError(f"{where}pools.denoise.devices must list the {world} ranks' devices (a {self.device} "
                             f"model starts CPU ranks only when device = \"cpu\")")
        if self.step_cache.enabled and self.parallel.ulysses * self.parallel.ring > 1:
            raise ValueError(f"{where}step_cache does not combine with parallel.ulysses or ring yet (each shard "
                             "would decide on its own tokens); cfg = 2 keeps each guidance branch's cache on its rank")
        for key in ("graphs", "compile"):
            if getattr(getattr(self, key), "enabled", False):
                raise ValueError(f"{where}{key} does not combine with parallel yet (the ranks run the plain "
                                 "denoiser)")
        if self.graphs.batch_sizes or self.fused_kernels:
            raise ValueError(f"{where}graphs and fused_kernels do not combine with parallel yet (the ranks run "
                             "the plain denoiser)")

    def ranks(self, kind: str) -> int:
        """Processes one replica of the stage `kind` runs as (a parallel denoise replica's ranks; else 1): on the
        ray backend its actor asks for that many times its pool's CPUs and GPUs, all on one node."""
        return self.parallel.world if kind == "denoise" else 1

    @property
    def denoise_devices(self) -> tuple[str, ...]:
        """One device per rank of the denoise replica (CPU ranks when the pool lists none)."""
        devices = self.pools.get("denoise", PoolConfig()).devices
        return tuple(devices) if devices else ("cpu",) * self.parallel.world

    def pool(self, kind: str, default: PoolConfig | None = None) -> PoolConfig:
        """The pool of one stage kind: configured, else `default`, else CPU_POOLS (a CPU model), else DEFAULT_POOLS;
        it runs on the model's device, or a placed pool on its first listed device (and the others, one per replica)."""
        cpu = CPU_POOLS.get(kind) if self.device == "cpu" else None
        config = self.pools.get(kind) or default or cpu or DEFAULT_POOLS.get(kind, PoolConfig())
        if kind == "denoise" and self.parallel.world > 1:  # one replica; its devices are its ranks', rank 0's first
            return dataclasses.replace(config, devices=(), replicas=1, device=self.denoise_devices[0]
                                       if config.devices else self.device)
        return dataclasses.replace(config, device=config.devices[0] if config.devices else self.device)

    @property
    def speedups(self) -> Speedups:
        return Speedups(self.graphs, self.compile, self.step_cache, self.fused_kernels)


# Batching windows: the denoise loop batches at step boundaries (no extra wait needed);
# text encoding and VAE decode are short, so a few milliseconds of company is cheap.
DEFAULT_POOLS = {
    # The llm stage's own scheduler caps each step (LLMConfig); the pool holds every admitted request.
    "llm": PoolConfig(max_batch_size=4096, max_delay_ms=0.0, max_queue=256),
    # Requests' media items share encoder forwards per shape bucket; a few ms gathers concurrent requests.
    "vision_encode": PoolConfig(max_batch_size=16, max_delay_ms=2.0, max_queue=256),
    "audio_encode": PoolConfig(max_batch_size=16, max_delay_ms=2.0, max_queue=256),
    "text_encode": PoolConfig(max_batch_size=8, max_delay_ms=2.0, max_queue=256),
    "denoise": PoolConfig(max_batch_size=8, max_delay_ms=0.0, max_queue=64),
    "vae_decode": PoolConfig(max_batch_size=4, max_delay_ms=2.0, max_queue=256),
    # An omni model's speech (pipelines/omni.py): token2wav's flow matching runs a batch's jobs in one DiT call; the
    # talker and the vocoder run one request at a time inside a batch.
    "talker": PoolConfig(max_batch_size=8, max_delay_ms=0.0, max_queue=256),
    "token2wav": PoolConfig(max_batch_size=8, max_delay_ms=2.0, max_queue=256),
    "vocoder": PoolConfig(max_batch_size=1, max_queue=256),
    # A diffusers pipeline run through its own __call__ (pipelines/fallback.py): one request per call, no step batching.
    "pipeline": PoolConfig(max_batch_size=1, max_delay_ms=0.0, max_queue=64),
}
# On a CPU a VAE decode is compute-bound and its activations outgrow the caches as the batch grows: past two images
# a call decodes slower per image (measured with examples/bench_images.py's checkpoint: 4 images at 256x256 cost 8 %
# more each than 1 or 2; at 128x128, 2 are the fastest).
CPU_POOLS = {"vae_decode": PoolConfig(max_batch_size=2, max_delay_ms=2.0, max_queue=256),
             # An omni model's speech on a CPU: small ops (the talker's steps, the DiT and vocoder of a tiny token2wav)
             # run faster on one torch thread than on a team of two in a worker thread; token2wav's two replicas
             # (4 jobs a call each) and the vocoder's two decode side by side. Measured with examples/bench_omni.py's
             # demo checkpoint on 2 cores, 8 spoken replies: the DiT's 8 in 1.05 s as one call, 0.6 s as two
             # side by side; see examples/RESULTS.md.
             "talker": PoolConfig(max_batch_size=8, max_delay_ms=5.0, max_queue=256),
             "token2wav": PoolConfig(max_batch_size=4, max_delay_ms=2.0, max_queue=256, threads=1, replicas=2),
             "vocoder": PoolConfig(max_batch_size=1, max_queue=256, replicas=2)}
# A video model's VAE decode on a CPU: two replicas, each a team of half the cores, so two batches decode side by
# side. Wan's VAE decodes a latent one frame at a time (causal 3D convolutions with a feature cache), ops too small to
# keep one team of every core busy. Measured with examples/bench_video.py's Wan checkpoint on 2 cores (4 concurrent
# jobs through the server, A/B alternating): 64x64 px x 17 frames 0.956 -> 0.820 s, 128x128 px x 33 frames 3.59 ->
# 2.95 s (LTX's VAE was not measured). Not for images: the same pool made SD's (examples/bench_images.py's checkpoint,
# 8 concurrent requests) 21 % slower at 128 px and 27 % at 256 px.
CPU_VIDEO_POOLS = {"vae_decode": PoolConfig(replicas=2, max_batch_size=2, max_delay_ms=2.0, max_queue=256)}


@dataclass(frozen=True)
class MediaConfig:
    image: ImageDecodeLimits = ImageDecodeLimits()  # uploads: bytes, pixels, GIF frames, formats
    video: VideoDecodeLimits = VideoDecodeLimits()  # bytes, pixels, duration, frames returned, decoded size
    audio: AudioDecodeLimits = AudioDecodeLimits()  # bytes, duration, channels, decoded size, formats
    fetch: FetchPolicy = FetchPolicy()  # URLs in requests: allow/deny hosts, file:// dirs, byte cap, timeouts
    workers: int = 2  # media worker processes
    task_cpu_s: float = 20.0  # CPU seconds one decode/encode may use
    task_memory_mb: int = 2048  # address-space limit of a media worker
    task_timeout_s: float = 30.0  # wall clock; a hung worker is killed and replaced

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"media.workers must be >= 1, got {self.workers}")


@dataclass(frozen=True)
class VoiceSpec:
    """A realtime voice model: a named cascade of served models, speech in -> ASR -> chat LM -> TTS -> speech out; or
    one omni model (`omni`) that hears the user's audio and speaks its reply itself (a Qwen2.5-Omni with its talker)."""

    name: str  # the id clients use: WS /v1/realtime?model=<name>
    asr: str = ""  # a served speech-recognition model (a cascade)
    chat: str = ""  # a served chat model (a cascade)
    tts: str = ""  # a served text-to-speech model (a cascade)
    omni: str = ""  # instead of asr/chat/tts: a served omni model (audio in, audio out)
    voice: str | None = None  # the TTS (or omni) voice; None: the model's first
    instructions: str = "You are a helpful voice assistant. Answer in one or two short sentences."
    max_output_tokens: int = 256  # per response, unless the session or response asks for fewer
    seed: int | None = None  # seeds every response's sampling (tests and benchmarks pin it); None: random

    def __post_init__(self):
        for key in ("name", "asr", "chat", "tts", "omni"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"voice model: '{key}' must be a string")
        if not self.name:
            raise ValueError("voice model: 'name' must be a non-empty string")
        cascade = [key for key in ("asr", "chat", "tts") if getattr(self, key)]
        if self.omni and cascade:
            raise ValueError(f"voice model {self.name}: an omni voice names no {cascade} (its model hears and speaks "
                             "itself)")
        if not self.omni and len(cascade) < 3:
            raise ValueError(f"voice model {self.name}: name asr, chat and tts (a cascade) or omni (one model)")
        if self.max_output_tokens < 1:
            raise ValueError(f"voice model {self.name}: max_output_tokens must be >= 1")

    @property
    def parts(self) -> tuple[str, ...]:
        """The served models it is made of."""
        return (self.omni,) if self.omni else (self.asr, self.chat, self.tts)


@dataclass(frozen=True)
class VoiceSessionConfig:
    """How voice sessions (WS /v1/realtime) pace, bound and detect: the server's side of the protocol."""

    max_lead_ms: int = 1000  # audio sent ahead of the client's (simulated) playback; bounds interruption-to-silence
    delta_ms: int = 100  # audio in one response.output_audio.delta
    max_append_bytes: int = 8 << 20  # decoded audio of one input_audio_buffer.append (its base64 must fit a frame)
    max_event_bytes: int = 12 << 20  # one client event (text frame); uvicorn's own frame cap is 16 MiB
    max_input_age_ms: int = 2000  # input audio that waited this long in the session's mailbox is dropped
    mailbox_events: int = 256  # client events queued per session; the socket reader waits when it is full
    partial_every_s: float = 1.0  # ASR partials (transcription deltas) per this much speech; each costs a decode
    # an utterance's audio ends this long after its last speech window; a pause this long starts its decode (the
    # early final), so the final transcript is mostly decoded before the endpointing silence is over
    early_final_ms: int = 100
    speculate: bool = True  # start the response on the early final while the pause holds (realtime/voice/speculation)
    min_speech_ms: int = 64  # server_vad: speech must last this long to count (debounce; delays barge-in as much)
    vad: str = "silero"  # "silero" (the silero-vad package; energy when absent) or "energy"
    max_items: int = 512  # conversation items kept per session; the oldest are forgotten

    def __post_init__(self):
        if not 20 <= self.delta_ms <= 1000 or self.max_lead_ms < self.delta_ms:
            raise ValueError("realtime.voice: delta_ms must be in 20..1000 and max_lead_ms >= delta_ms")
        if self.max_append_bytes < 1 or self.max_event_bytes < self.max_append_bytes * 4 // 3 + 1024:
            raise ValueError("realtime.voice: max_event_bytes must hold a base64 append of max_append_bytes "
                             f"(>= {self.max_append_bytes * 4 // 3 + 1024})")
        if self.max_input_age_ms < 1 or self.mailbox_events < 1 or self.max_items < 2:
            raise ValueError("realtime.voice: max_input_age_ms and mailbox_events must be >= 1, max_items >= 2")
        if self.partial_every_s <= 0 or self.min_speech_ms < 0 or self.early_final_ms < 0:
            raise ValueError("realtime.voice: partial_every_s must be > 0, min_speech_ms and early_final_ms >= 0")
        if self.vad not in ("silero", "energy"):
            raise ValueError(f"realtime.voice.vad must be 'silero' or 'energy', got {self.vad!r}")


@dataclass(frozen=True)
class RealtimeConfig:
    """Limits of realtime WebSocket sessions (realtime/): admission refuses at capacity, it never evicts."""

    max_voice_sessions: int = 16  # live voice sessions at once; one more is refused with an error event
    max_video_sessions: int = 4  # live video sessions at once
    idle_timeout_s: float = 120.0  # a session with no client event for this long is closed
    max_duration_s: float = 3600.0  # a session is closed after this long, whatever it does
    resume_grace_s: float = 30.0  # a dropped session waits this long for `session.resume`
    journal_max_events: int = 4096  # server events kept for replay on resume
    journal_max_bytes: int = 16 << 20  # ... and their bytes; older events fall out (resume then needs a resync)
    voice: VoiceSessionConfig = VoiceSessionConfig()  # [realtime.voice]: pacing, input bounds, VAD

    def __post_init__(self):
        if self.max_voice_sessions < 0 or self.max_video_sessions < 0:
            raise ValueError("realtime.max_voice_sessions and max_video_sessions must be >= 0")
        for key in ("idle_timeout_s", "max_duration_s", "resume_grace_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"realtime.{key} must be > 0, got {getattr(self, key)}")
        if self.journal_max_events < 1 or self.journal_max_bytes < 1:
            raise ValueError("realtime.journal_max_events and journal_max_bytes must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    models: tuple[ModelSpec, ...]
    limits: ImageLimits = ImageLimits()
    media: MediaConfig = MediaConfig()
    prompt_cache_mb: int = 256  # byte budget of the prompt-embedding cache
    encoder_cache_mb: int = 512  # byte budget of the vision encoder-output cache (features live on the device)
    request_timeout_s: float | None = 600.0  # default deadline of a request
    # The torch threads the stage workers of CPU models may run at once, all pools together: a worker holds its
    # pool's `threads` for each batch or loop step (stages/thread_budget.py). None: twice the CPUs this process may
    # run on (os.sched_getaffinity), so two busy stages each run on every core and a third waits.
    cpu_threads: int | None = None
    # Freed host memory each malloc arena keeps for the next step instead of returning it to the kernel (MiB;
    # glibc; stages/host_memory.py): a CPU model's steps free and reallocate tens of MB each, and every returned
    # page costs a fault and a zeroing when it is touched again. 0: the allocator's own thresholds.
    host_memory_keep_mb: int = 256
    voices: tuple[VoiceSpec, ...] = ()  # realtime voice models, composed of the models above
    realtime: RealtimeConfig = RealtimeConfig()
    # Where the model stages run (DESIGN §3): "local", threads in this process; "ray", each pool replica a Ray actor
    # (pipelines/ray_backend.py; `pip install "mmserve[ray]"`), on the cluster at `ray_address` ("HOST:PORT" of its
    # head), or, without one, on a Ray instance started on this machine.
    backend: str = "local"
    ray_address: str | None = None

    def __post_init__(self):
        if self.backend not in ("local", "ray"):
            raise ValueError(f"engine.backend must be 'local' or 'ray', got {self.backend!r}")
        if self.ray_address is not None:
            host, _, port = str(self.ray_address).rpartition(":")
            if self.backend != "ray":
                raise ValueError("engine.ray_address is for backend = 'ray'; set engine.backend = 'ray' (or drop it)")
            if not host or not port.isdigit():
                raise ValueError(f"engine.ray_address must be HOST:PORT of the Ray head (127.0.0.1:6379), got "
                                 f"{self.ray_address!r}")
        if self.backend != "ray":
            for spec in self.models:
                for kind, pool in spec.pools.items():
                    for key in ("resources", "num_gpus"):
                        if getattr(pool, key):
                            raise ValueError(f"model {spec.name}: pools.{kind}.{key} places a pool on Ray; it needs "
                                             f"engine.backend = 'ray'")
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int)
                                             or self.cpu_threads < 1):
            raise ValueError(f"engine.cpu_threads must be a whole number >= 1 (or unset: twice the CPUs this process "
                             f"may run on), got {self.cpu_threads!r}")
        if isinstance(self.host_memory_keep_mb, bool) or not isinstance(self.host_memory_keep_mb, int) or \
                not 0 <= self.host_memory_keep_mb <= 2047:
            raise ValueError(f"engine.host_memory_keep_mb must be a whole number of MiB from 0 (the allocator's "
                             f"default) to 2047, got {self.host_memory_keep_mb!r}")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        voices = [v.name for v in self.voices]
        if len(set(names + voices)) != len(names + voices):
            raise ValueError(f"voice model names must be unique and differ from model names, got {voices}")
