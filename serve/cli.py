"""The `mmserve` command: serve, demo-models, generate image.

Exit codes: 0 done; 1 a model failed to load or run; 2 bad usage (unknown family, bad config,
bad request field) with a message saying what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from serve.demo_catalog import DEFAULT_DEMO_DIR, DEMO_FAMILIES, IMAGE_DEMO_FAMILIES
from stages.redact import RedactingFormatter

if TYPE_CHECKING:
    from pipelines.config import EngineConfig, ModelSpec

# The parser and --help import nothing heavy (serve/demo_catalog.py): each command imports what it runs.

log = logging.getLogger("mmserve")

API_KEYS_HELP = ("a tenants file (TOML [[tenants]] tables: name, keys, quotas, models, priority; README "
                 "'Operations') or a file mapping API key -> tenant: JSON ({\"sk-abc\": \"alice\"}) or, if the name "
                 "ends in .toml, TOML (\"sk-abc\" = \"alice\"). Callers then send 'Authorization: Bearer <key>'; "
                 "without this file the server needs no key and every caller is tenant 'default'")


class UsageError(Exception):
    """Bad flags or config: printed without a traceback, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # URL secrets (userinfo, tokens in queries) masked in every line: stages/redact.py
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), handlers=[handler])
    try:
        return args.run(args)
    except UsageError as e:
        print(f"mmserve: error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmserve", description="Multimodal and diffusion pipeline server.")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the HTTP server (OpenAI-compatible endpoints)",
                       description="Run the server. Without --config models or --model it serves the demo models "
                                   "(tiny random-weight checkpoints of every image family and a tiny Llama chat "
                                   "model, built on first run).")
    s.add_argument("--host", help="bind address (default: [server] host, else 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default: [server] port, else 8000)")
    s.add_argument("--config", type=Path, help="TOML config: models, pools, batching, limits (see serve/config.py)")
    s.add_argument("--model", action="append", default=[], metavar="NAME=PATH_OR_ID",
                   help="serve a checkpoint (local directory or cached hub id) as NAME; repeatable; "
                        "the family is detected from model_index.json / config.json")
    s.add_argument("--api-keys", "--tenants", dest="api_keys", type=Path, metavar="FILE", help=API_KEYS_HELP)
    s.add_argument("--demo-dir", type=Path, help=f"where demo checkpoints are built (default {DEFAULT_DEMO_DIR})")
    s.add_argument("--data-dir", type=Path, help="the job store: videos, files, batches (default: [server] "
                                                 "data_dir, else ~/.local/share/mmserve)")
    s.add_argument("--backend", choices=["local", "ray"],
                   help="where model stages run: local (threads in this process; the default) or ray (each pool "
                        "replica a Ray actor; needs pip install 'mmserve[ray]'); default: [engine] backend")
    s.add_argument("--ray-address", metavar="HOST:PORT",
                   help="the Ray cluster's head (implies --backend ray); without it --backend ray starts a local Ray "
                        "instance; default: [engine] ray_address")
    s.set_defaults(run=_serve)

    d = sub.add_parser("demo-models", help="build the demo checkpoints (tiny, random weights, offline)")
    d.add_argument("dir", nargs="?", type=Path, default=DEFAULT_DEMO_DIR,
                   help=f"output directory (default {DEFAULT_DEMO_DIR})")
    d.add_argument("--families", nargs="+", default=list(DEMO_FAMILIES), choices=DEMO_FAMILIES)
    d.set_defaults(run=_demo_models)

    c = sub.add_parser("convert", help="convert a checkpoint of another format into a standard transformers one")
    csub = c.add_subparsers(dest="format", required=True)
    cw = csub.add_parser("whisper-ct2", help="CTranslate2 Whisper (faster-whisper's format) -> transformers Whisper",
                         description="Convert a CTranslate2 Whisper directory (model.bin, config.json, tokenizer.json) "
                                     "into a transformers checkpoint that `serve --model NAME=DST` serves.")
    cw.add_argument("src", type=Path, help="CTranslate2 model directory")
    cw.add_argument("dst", type=Path, help="output directory (created)")
    cw.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="weights dtype of the output (default float32)")
    cw.set_defaults(run=_convert_whisper_ct2)

    g = sub.add_parser("generate", help="run one request in this process (no server)")
    gsub = g.add_subparsers(dest="what", required=True)
    gi = gsub.add_parser("image", help="text-to-image into a file")
    gi.add_argument("prompt")
    gi.add_argument("-o", "--output", type=Path, required=True, help="output file: .png, .jpg/.jpeg or .webp")
    gi.add_argument("--model", default="sd-demo",
                    help="a demo name (sd-demo, sdxl-demo, sd3-demo, flux-demo), a model named in --config, "
                         "NAME=PATH, or a checkpoint path / cached hub id (default sd-demo)")
    gi.add_argument("--config", type=Path, help="TOML config to take the model (and limits) from")
    gi.add_argument("--seed", type=int)
    gi.add_argument("--steps", type=int)
    gi.add_argument("--size", help="WIDTHxHEIGHT (default: the model's)")
    gi.add_argument("--guidance", type=float)
    gi.add_argument("--negative-prompt")
    gi.add_argument("-n", type=int, default=1, help="number of images (files get -1, -2, ... suffixes)")
    gi.add_argument("--demo-dir", type=Path, default=DEFAULT_DEMO_DIR)
    gi.set_defaults(run=_generate_image)

    from serve.batch_cli import add_batch_parser

    add_batch_parser(sub)
    return p


# -- serve --------------------------------------------------------------------------------


def _serve(args) -> int:
    from serve.config import demo_specs, engine_config
    from serve.tenants import load_tenants

    loaded = _load_config(args.config, args.model)  # bad flags fail fast, before a model loads
    server_cfg = loaded.server
    host = args.host or server_cfg.host
    port = args.port if args.port is not None else server_cfg.port
    config = loaded.engine
    if config is None:
        demo_dir = args.demo_dir or server_cfg.demo_dir
        log.info("no models configured: serving the demo models from %s", demo_dir)
        config = _usage(lambda: engine_config(demo_specs(demo_dir), loaded.raw_engine, demo=True))
    config = _usage(lambda: _with_backend(config, args.backend, args.ray_address))
    keys_file = args.api_keys or server_cfg.api_keys_file
    tenants = _usage(lambda: load_tenants(keys_file)) if keys_file else None

    import uvicorn

    from pipelines.engine import Engine
    from serve.app import create_app
    from serve.drain import DrainingServer
    from serve.routes.loras import ADMIN_KEY_ENV
    from serve.tracing import JsonFormatter
    from stages.tracing import Tracing

    if server_cfg.log_format == "json":  # every line a JSON object from here on (the root logger's handlers)
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    tracing = Tracing.from_mode(server_cfg.tracing)
    engine = Engine(config)
    app = create_app(engine, tenants=tenants, data_dir=args.data_dir or server_cfg.data_dir,
                     job_policy=loaded.jobs, max_body_bytes=server_cfg.max_body_bytes,
                     admin_key=os.environ.get(ADMIN_KEY_ENV) or None, drain_grace_s=server_cfg.drain_grace_s,
                     tracing=tracing, log_format=server_cfg.log_format,
                     slow_consumer_grace_s=server_cfg.slow_consumer_grace_s,
                     slow_consumer_outbox_bytes=server_cfg.slow_consumer_outbox_bytes)
    # SIGTERM drains first (serve/drain.py); what uvicorn then waits for is only what the drain left.
    # JSON logs: uvicorn's loggers go to the root's JSON handler, and the request lines replace its access lines.
    json_logs = {"log_config": None, "access_log": False} if server_cfg.log_format == "json" else {}
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, ws="auto", log_level=args.log_level,
                                           timeout_graceful_shutdown=5, **json_logs), app)
    app.state.slow_consumers.connections = server.server_state.connections  # so a client that stops reading is reset
    failed = threading.Event()

    def load() -> None:  # in the background, so /health answers while weights load
        try:
            engine.start()
            log.info("ready: %s", ", ".join(engine.models))
        except Exception:
            log.exception("loading the models failed; stopping")
            failed.set()
            server.should_exit = True

    log.info("mmserve on http://%s:%d loading %d model(s): %s (GET /ready turns 200 when they are warm)",
             host, port, len(config.models), ", ".join(m.name for m in config.models))
    threading.Thread(target=load, name="model-loader", daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()
        if tracing is not None:
            tracing.shutdown()  # the spans still buffered go out
    return 1 if failed.is_set() else 0


def _with_backend(config: EngineConfig, backend: str | None, ray_address: str | None) -> EngineConfig:
    """The config with --backend / --ray-address over [engine] backend / ray_address (an address means ray)."""
    if backend is None and ray_address is None:
        return config
    backend = backend or "ray"
    address = ray_address if ray_address is not None else config.ray_address if backend == "ray" else None
    return dataclasses.replace(config, backend=backend, ray_address=address)


def _load_config(path: Path | None, model_args: list[str]):
    from serve.config import load_config

    specs = [_spec_from_arg(arg) for arg in model_args]
    return _usage(lambda: load_config(path, extra_models=specs))


def _spec_from_arg(arg: str) -> ModelSpec:
    """--model NAME=PATH: the family comes from the checkpoint; an unknown one is a usage error."""
    from pipelines.config import ModelSpec
    from pipelines.registry import detect_family
    from serve.config import parse_model_arg

    name, path = _usage(lambda: parse_model_arg(arg))
    family = _usage(lambda: detect_family(path))
    return ModelSpec(name=name, path=path, family=family)


def _usage(build):
    """Run a config builder; its ValueError/OSError becomes a UsageError (exit 2, no traceback)."""
    try:
        return build()
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None


# -- demo-models --------------------------------------------------------------------------


def _demo_models(args) -> int:
    from serve.config import demo_specs

    for spec in _usage(lambda: demo_specs(args.dir, tuple(args.families))):
        print(f"{spec.name}\t{spec.family}\t{spec.path}")
    return 0


# -- convert ------------------------------------------------------------------------------


def _convert_whisper_ct2(args) -> int:
    from pipelines.convert_whisper import convert_whisper_ct2

    dst = _usage(lambda: convert_whisper_ct2(args.src, args.dst, dtype=args.dtype))
    print(f"wrote {dst} (serve it with: mmserve serve --model whisper={dst})")
    return 0


# -- generate image -----------------------------------------------------------------------


def _generate_image(args) -> int:
    from pipelines.chat import LLM_FAMILY
    from pipelines.engine import Engine
    from pipelines.image_request import ImageRequest
    from serve.config import engine_config
    from serve.schemas import parse_size
    from stages.events import StageError

    fmt = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}.get(args.output.suffix.lower())
    if fmt is None:
        raise UsageError(f"-o {args.output}: the file name must end in .png, .jpg, .jpeg or .webp")
    spec, raw = _generate_model(args)
    if spec.family == LLM_FAMILY:
        raise UsageError(f"--model {args.model} is a chat model; `generate image` needs an image model (for "
                         f"example {', '.join(f'{f}-demo' for f in IMAGE_DEMO_FAMILIES)}); chat through `serve`")
    engine = Engine(_usage(lambda: engine_config([spec], raw)))
    try:
        size = parse_size(args.size)
        width, height = size or (None, None)
        engine.start()
        request = ImageRequest(prompt=args.prompt, negative_prompt=args.negative_prompt, width=width, height=height,
                               n=args.n, num_inference_steps=args.steps, guidance_scale=args.guidance, seed=args.seed)
        outputs = engine.submit_image(spec.name, request).result()
        encoded = engine.encode_images(outputs["images"], fmt)
    except StageError as e:  # RequestError included: a bad field is a usage error
        where = f" ({e.param})" if e.param else ""
        print(f"mmserve: error{where}: {e.message}", file=sys.stderr)
        return 2 if e.kind.caller_fault else 1
    finally:
        engine.shutdown()
    paths = [args.output] if len(encoded) == 1 else [
        args.output.with_name(f"{args.output.stem}-{i + 1}{args.output.suffix}") for i in range(len(encoded))]
    for path, data in zip(paths, encoded, strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {path} (model {spec.name}, seed {outputs['seed']})")
    return 0


def _generate_model(args) -> tuple[ModelSpec, dict]:
    """The one model `generate` loads, and the [engine]/[limits]/[media] settings to load it with."""
    from serve.config import demo_specs, load_config

    loaded = _usage(lambda: load_config(args.config)) if args.config else None
    raw = loaded.raw_engine if loaded else {}
    if loaded and loaded.engine:
        for spec in loaded.engine.models:
            if spec.name == args.model:
                return spec, raw
    demo = {f"{family}-demo": family for family in DEMO_FAMILIES}
    if args.model in demo:
        return _usage(lambda: demo_specs(args.demo_dir, (demo[args.model],)))[0], raw
    return _spec_from_arg(args.model), raw


if __name__ == "__main__":
    sys.exit(main())
