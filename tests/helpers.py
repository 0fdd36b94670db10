"""Shared set-up for the engine and family tests: a running engine, seeded generators, tiny inputs.

No tests here; test modules import from this file (`from tests.helpers import ...`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from PIL import Image

from pipelines.config import EngineConfig, ModelSpec
from pipelines.engine import Engine
from stages.pool import PoolConfig


@contextmanager
def running_engine(path: str, *, name: str = "m", max_batch_size: int | None = None, voices: tuple = (),
                   **spec_kwargs) -> Iterator[Engine]:
    """A started engine serving one model (`name`, from `path`) and the realtime `voices` (VoiceSpecs) made of it,
    shut down on exit.

    `max_batch_size` sets the denoise pool's batch limit (None: the default pools); other keyword
    arguments go to `ModelSpec`.
    """
    if max_batch_size is not None:
        spec_kwargs["pools"] = {**spec_kwargs.get("pools", {}), "denoise": PoolConfig(max_batch_size=max_batch_size)}
    eng = Engine(EngineConfig(models=(ModelSpec(name, path, **spec_kwargs),), voices=voices))
    eng.start()
    try:
        yield eng
    finally:
        eng.shutdown()


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded as the engine seeds a request (diffusers' `generator=` semantics)."""
    return torch.Generator("cpu").manual_seed(seed)


def noise_image(size: int = 64, seed: int = 0) -> Image.Image:
    """A square RGB image of uniform noise, the same pixels for the same size and seed."""
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size, size, 3) * 255).astype("uint8"))


def half_mask(size: int = 64) -> Image.Image:
    """A square L mask: white (repaint) on the columns right of the middle, black elsewhere."""
    return Image.fromarray(((np.arange(size)[None, :].repeat(size, 0) > size // 2) * 255).astype("uint8")).convert("L")


def variant(reference, cls):
    """The diffusers pipeline `cls` (img2img, inpaint, ...) on `reference`'s components, progress bar off."""
    pipe = cls(**reference.components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def cancel_mid_loop(handle, pool) -> tuple[float, float]:
    """Cancel `handle` (a long denoise) once three of its steps have reported; wait until `pool` holds nothing.
    (seconds from the cancel to an idle pool, one step's seconds): the cancel is honoured within a step when the
    first is below about two of the second (the step in flight, and no more)."""
    from stages.events import EventKind

    seen = []
    for event in handle.events(timeout=120):
        if event.kind is EventKind.PROGRESS:
            seen.append(time.monotonic())
            if len(seen) == 3:
                break
    cancelled = time.monotonic()
    handle.cancel()
    while not pool.idle:
        assert time.monotonic() - cancelled < 30, "the pool did not drop the cancelled item"
        time.sleep(0.002)
    return time.monotonic() - cancelled, (seen[-1] - seen[0]) / 2


def wav_bytes(samples, rate: int = 16000) -> bytes:
    """A mono 16-bit WAV file of float samples in [-1, 1]."""
    import io
    import wave

    import numpy as np

    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def demo_path(tmp_path_factory, family: str) -> str:
    """The demo checkpoint of `family`, built in a fresh temporary directory (pipelines/demo)."""
    from pipelines.demo import build_demo_model

    return str(build_demo_model(family, tmp_path_factory.mktemp(family) / family))


def vlm_engine_fixture(voices: tuple = ()):
    """A module-scoped `engine` fixture serving the module's `path` fixture as model "m" (family vlm), and `voices`."""
    import pytest

    @pytest.fixture(scope="module")
    def engine(path):
        with running_engine(path, family="vlm", voices=voices) as eng:
            yield eng
    return engine


def assert_cancel_after_first_audio_ends_everywhere(engine, handle) -> None:
    """Cancel a streamed spoken request at its first audio chunk (a `vocoder` DELTA): it ends with a cancelled
    error, no chunk follows, and every stage lets go of it (the executor is idle within 30 s)."""
    import time

    from stages.events import EventKind

    after: list = []
    for event in handle.events(timeout=300):
        if after or (event.kind is EventKind.DELTA and event.stage == "vocoder"):
            if not after:
                handle.cancel()
            after.append(event)
    assert after[-1].kind is EventKind.ERROR and after[-1].data["code"] == "cancelled"
    assert not [e for e in after[1:] if e.kind is EventKind.DELTA and e.stage == "vocoder"]
    deadline = time.monotonic() + 30
    while not engine.executor.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.executor.idle()
