"""The `mmserve` command (in-process through serve.cli.main) and the TOML config it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serve.cli import main
from serve.config import engine_config, load_config, parse_model_arg
from stages.pool import PoolConfig

try:
    from tests.test_serve_support import read_image
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_serve_support import read_image


@pytest.fixture
def demo_root(sd_path) -> Path:
    """The session's demo checkpoints (tests/conftest.py), laid out as `mmserve demo-models` lays them out."""
    return Path(sd_path).parent


def _imported(stderr: str) -> set[str]:
    """The modules a `python -X importtime` run imported (its stderr)."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_help_and_a_batch_run_against_a_server_import_no_torch(tmp_path):
    """`mmserve --help` and `mmserve batch run --server URL` (an HTTP client) answer at once: neither waits for torch
    and the model code (~9 s of imports on 2 cores); the other commands import what they run."""
    import subprocess
    import sys

    from tests.test_serve_support import ENV, REPO, free_port

    cli = [sys.executable, "-X", "importtime", "-m", "serve.cli"]
    run = subprocess.run([*cli, "--help"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "demo-models" in run.stdout and "batch" in run.stdout, run.stderr[-2000:]
    assert "torch" not in _imported(run.stderr) and "serve.demo_catalog" in _imported(run.stderr)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "body": {"model": "m", "messages": []}}) + "\n")
    run = subprocess.run([*cli, "batch", "run", str(src), "-o", str(out), "--endpoint", "/v1/chat/completions",
                          "--server", f"http://127.0.0.1:{free_port()}"], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 1, run.stderr[-2000:]  # nothing listens there: the line fails, and is recorded
    assert json.loads(out.read_text())["error"]["code"] == "request_failed"
    assert "torch" not in _imported(run.stderr) and "serve.batch_lines" in _imported(run.stderr)


def test_demo_models_command(demo_root, capsys):
    root = demo_root  # already built: the command finds the stamp and skips the build
    assert main(["demo-models", str(root), "--families", "sd"]) == 0
    name, family, path = capsys.readouterr().out.strip().split("\t")
    assert (name, family, path) == ("sd-demo", "sd", str(root / "sd"))
    assert json.loads((root / "sd" / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"


def test_generate_image_command(demo_root, tmp_path, capsys):
    root = demo_root
    out = tmp_path / "out" / "fox.webp"
    args = ["generate", "image", "a red fox", "-o", str(out), "--demo-dir", str(root), "--steps", "2",
            "--seed", "4", "--size", "64x48", "--guidance", "5", "--negative-prompt", "blurry"]
    assert main(args) == 0
    assert "seed 4" in capsys.readouterr().out
    image = read_image(out.read_bytes())
    assert image.format == "WEBP" and image.size == (64, 48)


def test_generate_image_bad_field_is_exit_2(demo_root, tmp_path, capsys):
    root = demo_root
    assert main(["generate", "image", "x", "-o", str(tmp_path / "a.gif"), "--demo-dir", str(root)]) == 2
    assert ".png" in capsys.readouterr().err
    assert main(["generate", "image", "x", "-o", str(tmp_path / "a.png"), "--demo-dir", str(root),
                 "--size", "65x64", "--steps", "1"]) == 2
    assert "(size)" in capsys.readouterr().err


def test_unknown_family_is_exit_2_listing_supported(tmp_path, capsys):
    # (a pipeline class diffusers has, such as KandinskyPipeline, is served by the diffusers fallback)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "NoSuchPipeline"}))
    assert main(["serve", "--model", f"unknown={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "NoSuchPipeline" in err and all(f in err for f in ("sd", "sdxl", "sd3", "flux"))
    assert main(["serve", "--model", f"missing={tmp_path / 'nope'}"]) == 2
    assert "model_index.json" in capsys.readouterr().err


# -- config -------------------------------------------------------------------------------------


def test_config_file_builds_the_engine_tree(tmp_path):
    (tmp_path / "ckpt").mkdir()
    path = tmp_path / "mmserve.toml"
    path.write_text("""
[server]
host = "0.0.0.0"
port = 9000
api_keys_file = "keys.json"

[engine]
request_timeout_s = 30

[limits]
max_pixels = 262144
max_steps = 50

[media]
workers = 1

[[models]]
name = "mine"
path = "./ckpt"
family = "sd"
[models.pools.denoise]
max_batch_size = 4
replicas = 2

[[models]]
name = "hub"
path = "org/some-model"
""")
    loaded = load_config(path)
    assert (loaded.server.host, loaded.server.port) == ("0.0.0.0", 9000)
    assert loaded.server.api_keys_file == tmp_path / "keys.json"
    cfg = loaded.engine
    assert [m.name for m in cfg.models] == ["mine", "hub"]
    mine, hub = cfg.models
    assert mine.path == str(tmp_path / "ckpt") and mine.family == "sd"
    assert hub.path == "org/some-model" and hub.family is None  # hub ids are not paths
    assert mine.pool("denoise") == PoolConfig(max_batch_size=4, replicas=2)
    assert cfg.limits.max_pixels == 262144 and cfg.limits.max_steps == 50
    assert cfg.media.workers == 1 and cfg.request_timeout_s == 30


@pytest.mark.parametrize("text, names", [
    ("colour = 1", "colour"),
    ("[server]\nprot = 1", "prot"),
    ("[limits]\nmax_pixel = 1", "max_pixel"),
    ('[[models]]\nname = "a"\npath = "b"\nfamliy = "sd"', "famliy"),
    ('[[models]]\nname = "a"\npath = "b"\n[models.pools.denoize]\nreplicas = 1', "denoize"),
    ('[[models]]\nname = "a"\npath = "b"\n[models.pools.denoise]\nbatch = 1', "batch"),
])
def test_config_unknown_keys_are_named(tmp_path, text, names):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=names):
        load_config(path)


def test_config_max_body_bytes(tmp_path):
    path = tmp_path / "mmserve.toml"
    assert load_config(None).server.max_body_bytes == 16 * 2**20  # the default: JSON bodies up to 16 MiB
    path.write_text("[server]\nmax_body_bytes = 1048576")
    assert load_config(path).server.max_body_bytes == 2**20
    for bad in ("0", "1.5", "true"):
        path.write_text(f"[server]\nmax_body_bytes = {bad}")
        with pytest.raises(ValueError, match="server.max_body_bytes must be a whole number of bytes >= 1"):
            load_config(path)


def test_config_errors_teach(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[[models]]\nname = "a"')
    with pytest.raises(ValueError, match="'path' is required"):
        load_config(path)
    path.write_text("[server\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(path)
    assert load_config(None).engine is None  # no models: the caller serves the demo models


def test_model_args():
    assert parse_model_arg("sd15=/models/sd15") == ("sd15", "/models/sd15")
    assert parse_model_arg("/models/sd15/") == ("sd15", "/models/sd15/")
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_model_arg("=/models/x")
    with pytest.raises(ValueError, match="max_queue"):
        engine_config([], {"engine": {"max_queue": 3}})
