"""One TOML file -> the engine's config tree plus the server's own settings.

    [server]                      # all optional
    host = "127.0.0.1"
    port = 8000
    api_keys_file = "keys.json"   # relative paths are relative to this file
    demo_dir = "~/.cache/mmserve/demo"

    [engine]                      # optional
    prompt_cache_mb = 256
    request_timeout_s = 600

    [limits]                      # optional: pipelines.request.ImageLimits
    max_pixels = 1048576

    [media]                       # optional: pipelines.config.MediaConfig
    workers = 2

    [[models]]                    # none: the demo models (sd, sdxl, sd3, flux, llama: `<family>-demo`)
    name = "sd-demo"
    path = "/path/to/checkpoint"  # or a hub id (from the local hub cache; the server is offline)
    family = "sd"                 # optional: detected from model_index.json / config.json
    device = "cpu"
    dtype = "float32"
    max_inflight = 64             # admitted requests at once; more answer 429
    [models.pools.denoise]        # text_encode | denoise | vae_decode | llm: stages.pool.PoolConfig
    max_batch_size = 8
    replicas = 1
    [models.llm]                  # causal LMs only: pipelines.chat.LLMConfig
    kv_cache_mb = 256
    block_size = 16

Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.chat import LLM_FAMILY, LLMConfig
from pipelines.config import EngineConfig, MediaConfig, ModelSpec
from pipelines.request import ImageLimits
from stages.pool import PoolConfig

DEFAULT_DEMO_DIR = Path("~/.cache/mmserve/demo")
IMAGE_DEMO_FAMILIES = ("sd", "sdxl", "sd3", "flux")
CHAT_DEMO_FAMILIES = ("llama",)  # served as "llama-demo", family causal-lm (chat and completions)
DEMO_FAMILIES = IMAGE_DEMO_FAMILIES + CHAT_DEMO_FAMILIES
DEMO_LLM = LLMConfig(kv_cache_mb=32)  # the tiny demo LM: 64k tokens of KV (512 bytes a token) is plenty
POOL_KINDS = ("text_encode", "denoise", "vae_decode", "llm")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys_file: Path | None = None  # JSON or TOML mapping key -> tenant; None: no auth
    demo_dir: Path = DEFAULT_DEMO_DIR  # where demo checkpoints are built when no model is configured

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"server.port must be in 0..65535, got {self.port}")


@dataclass(frozen=True)
class LoadedConfig:
    server: ServerConfig
    engine: EngineConfig | None  # None: no models configured, so the caller serves the demo models
    raw_engine: dict[str, Any]  # the [engine]/[limits]/[media] settings, to combine with --model entries


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
    _only(data, ("server", "engine", "limits", "media", "models"), "the config file")
    server = _server(data.get("server", {}), base)
    models = [_model(m, i, base) for i, m in enumerate(data.get("models", []))] + list(extra_models)
    raw = {k: data.get(k, {}) for k in ("engine", "limits", "media")}
    engine = engine_config(models, raw)  # built even without models: the tables are checked now
    return LoadedConfig(server, engine if models else None, raw)


def engine_config(models: list[ModelSpec], raw: dict[str, Any] | None = None) -> EngineConfig:
    """EngineConfig from model specs and the [engine]/[limits]/[media] tables."""
    raw = raw or {}
    engine = dict(raw.get("engine", {}))
    _only(engine, _fields(EngineConfig, exclude=("models", "limits", "media")), "[engine]")
    limits = _build(ImageLimits, raw.get("limits", {}), "[limits]")
    media = _build(MediaConfig, raw.get("media", {}), "[media]")
    return EngineConfig(models=tuple(models), limits=limits, media=media, **engine)


def demo_specs(root: Path, families: tuple[str, ...] = DEMO_FAMILIES) -> list[ModelSpec]:
    """Build (once, cached on disk) and name the demo checkpoints: `<family>-demo`."""
    from pipelines.demo import build_demo_models

    built = build_demo_models(Path(root).expanduser(), families=families)
    return [_demo_spec(family, path) for family, path in built.items()]


def _demo_spec(family: str, path: Path) -> ModelSpec:
    if family in CHAT_DEMO_FAMILIES:  # a causal LM: its engine family is causal-lm, whatever its architecture
        return ModelSpec(name=f"{family}-demo", path=str(path), family=LLM_FAMILY, llm=DEMO_LLM)
    return ModelSpec(name=f"{family}-demo", path=str(path), family=family)


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
    _only(table, ("host", "port", "api_keys_file", "demo_dir"), "[server]")
    values = dict(table)
    if "api_keys_file" in values:
        values["api_keys_file"] = _path(values["api_keys_file"], base)
    if "demo_dir" in values:
        values["demo_dir"] = _path(values["demo_dir"], base)
    return ServerConfig(**values)


def _model(table: dict[str, Any], index: int, base: Path) -> ModelSpec:
    where = f"[[models]] #{index + 1}"
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table with name and path")
    _only(table, ("name", "path", "family", "device", "dtype", "pools", "max_inflight", "llm"), where)
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
    return ModelSpec(**values)


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
