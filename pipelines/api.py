"""The Python API: a diffusers-like object that runs on the same engine as the server.

    from pipelines import Pipeline
    pipe = Pipeline.from_pretrained("path/or/hub-id")
    images = pipe("a red bicycle", seed=0)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipelines.config import EngineConfig, ModelSpec
from pipelines.engine import Engine
from pipelines.image_request import ImageLimits, ImageRequest
from pipelines.served_diffusion import image_task
from stages.pool import PoolConfig
from stages.request_state import RequestHandle


class Pipeline:
    def __init__(self, engine: Engine, model: str, *, owns_engine: bool = False):
        self.engine = engine
        self.model = model
        self._owns_engine = owns_engine

    @classmethod
    def from_pretrained(cls, path_or_id: str | Path, *, family: str | None = None, device: str = "cpu",
                        dtype: str = "float32", max_batch_size: int = 8, limits: ImageLimits | None = None,
                        request_timeout_s: float | None = None, **speedups) -> "Pipeline":
        """Load a diffusers checkpoint (directory or hub id) and start its stage pools. `speedups`: ModelSpec's
        graphs, compile, step_cache and fused_kernels (all off by default)."""
        name = Path(str(path_or_id)).name or "model"
        pools = {"denoise": PoolConfig(max_batch_size=max_batch_size)}
        spec = ModelSpec(name, str(path_or_id), family=family, device=device, dtype=dtype, pools=pools, **speedups)
        engine = Engine(EngineConfig(models=(spec,), limits=limits or ImageLimits(),
                                     request_timeout_s=request_timeout_s))
        engine.start()
        return cls(engine, name, owns_engine=True)

    def submit(self, prompt: str, *, negative_prompt: str | None = None, width: int | None = None,
               height: int | None = None, num_inference_steps: int | None = None,
               guidance_scale: float | None = None, seed: int | None = None, num_images_per_prompt: int = 1,
               image: Any = None, mask_image: Any = None, strength: float = 0.8, partial_images: int = 0,
               preview_every: int = 0, tenant: str = "default", step_cache: dict | None = None,
               **extra) -> RequestHandle:
        """Start a request; the handle streams events (progress per step, with a "preview" for `partial_images`
        spread over the steps or one every `preview_every` steps) and can cancel().
        `step_cache`: opt-in approximate step caching, e.g. {"method": "teacache", "threshold": 0.2}."""
        request = ImageRequest(
            prompt=prompt, task=image_task(image is not None, mask_image is not None), negative_prompt=negative_prompt,
            width=width, height=height, n=num_images_per_prompt, num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale, seed=seed, strength=strength, image=image, mask=mask_image,
            tenant=tenant, previews=partial_images, preview_every=preview_every, extra=extra, step_cache=step_cache)
        return self.engine.submit_image(self.model, request)

    def __call__(self, prompt: str, *, output_type: str = "pil", **kwargs):
        """Generate and wait. Returns a list of PIL images, or a float array [n, H, W, 3] for output_type="np"."""
        return _select(self.submit(prompt, **kwargs).result(), output_type)

    async def agenerate(self, prompt: str, *, output_type: str = "pil", **kwargs):
        """The same as calling the pipeline, awaited."""
        return _select(await self.submit(prompt, **kwargs).aresult(), output_type)

    def close(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _select(outputs: dict[str, Any], output_type: str):
    if output_type == "pil":
        return outputs["images"]
    if output_type == "np":
        return outputs["pixels"]
    raise ValueError(f"output_type must be 'pil' or 'np', got {output_type!r}")
