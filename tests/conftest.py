"""Test set-up: offline, Triton interpreted, tiny seeded checkpoints built once per session."""

import os

# Before anything imports torch, diffusers or triton.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRITON_INTERPRET", "1")  # examples/gpu_run.sh sets 0: native kernels on the GPU
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory):
    """Tiny random-weight checkpoints of every family, built with the same code as `mmserve demo-models`."""
    from pipelines.demo import build_demo_models

    return build_demo_models(tmp_path_factory.mktemp("demo-models"))


@pytest.fixture(scope="session")
def sd_path(demo_models):
    return str(demo_models["sd"])


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
