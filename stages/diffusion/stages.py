"""The three model stages of a diffusion graph: text_encode -> denoise (loop) -> vae_decode.

The stages own scheduling concerns (batch keys, step boundaries, progress events); a family
adapter (in pipelines/) owns the model math. Per-request state sits on the WorkItem.
"""

from __future__ import annotations

from typing import Any, Hashable, Protocol

from stages.events import EventKind
from stages.stage import LoopStage, Stage, WorkItem


class DiffusionAdapter(Protocol):
    """What a model family provides to the diffusion stages (see pipelines/families/)."""

    name: str  # model id, used as the metric label

    def encode_prompts(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        """text_encode: conditioning for each item (cached per prompt)."""

    def prepare(self, item: WorkItem) -> None:
        """denoise start: per-request scheduler, timesteps, initial latents into item.state."""

    def denoise_key(self, item: WorkItem) -> Hashable:
        """Items with equal keys share one denoiser forward (shapes, dtype, CFG mode, ...)."""

    def forward(self, items: list[WorkItem]) -> list[Any]:
        """One batched denoiser call over items that may sit at different timesteps."""

    def commit(self, item: WorkItem, model_output: Any) -> None:
        """Guidance and the scheduler step for one item; advances item.state['i']."""

    def preview(self, item: WorkItem) -> Any:
        """A decoded picture of the current latents (costs a VAE decode)."""

    def decode(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        """vae_decode: latents -> images for each item (one batched VAE call where shapes agree)."""

    def decode_key(self, item: WorkItem) -> Hashable:
        ...

    def close(self) -> None:
        """Stop what runs outside this process (a parallel replica's ranks)."""


class TextEncodeStage(Stage):
    kind = "text_encode"

    def __init__(self, adapter: DiffusionAdapter):
        self.adapter = adapter
        self.model = adapter.name

    def batch_key(self, item: WorkItem) -> Hashable:
        return "text"

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        return self.adapter.encode_prompts(items)


class DenoiseStage(LoopStage):
    """The explicit step loop with step-level batching across requests (DESIGN §5)."""

    kind = "denoise"

    def __init__(self, adapter: DiffusionAdapter):
        self.adapter = adapter
        self.model = adapter.name

    def batch_key(self, item: WorkItem) -> Hashable:
        return self.adapter.denoise_key(item)

    def close(self) -> None:
        self.adapter.close()

    def start(self, item: WorkItem) -> None:
        self.adapter.prepare(item)
        item.state["i"] = 0
        request = item.inputs["request"]
        total, every = item.state["total"], getattr(request, "preview_every", 0)
        if every:  # the per-step extension: after every `every` steps, but not the last (the image itself comes)
            item.state["preview_at"] = set(range(every, total, every))
        else:  # partial_images: spread over the loop, the last one a step before the end
            item.state["preview_at"] = {max(1, (k + 1) * total // (request.previews + 1))
                                        for k in range(request.previews)}

    def step(self, items: list[WorkItem]) -> None:
        outputs = self.adapter.forward(items)
        for item, out in zip(items, outputs, strict=True):
            self.adapter.commit(item, out)
            i = item.state["i"]
            data: dict[str, Any] = {"step": i, "total": item.state["total"]}
            if i in item.state["preview_at"] and i < item.state["total"]:
                data["preview"] = self.adapter.preview(item)
            item.emit(EventKind.PROGRESS, **data)

    def fit(self, items: list[WorkItem]) -> int:
        fit = getattr(self.adapter, "fit", None)  # a family with a memory budget caps the step's rows
        return len(items) if fit is None else fit(items)

    def is_done(self, item: WorkItem) -> bool:
        return item.state["i"] >= item.state["total"]

    def finish(self, item: WorkItem) -> dict[str, Any]:
        return {"latents": item.state["latents"], "decode_extras": item.state.get("decode_extras", {})}


class VaeDecodeStage(Stage):
    kind = "vae_decode"

    def __init__(self, adapter: DiffusionAdapter):
        self.adapter = adapter
        self.model = adapter.name

    def batch_key(self, item: WorkItem) -> Hashable:
        return self.adapter.decode_key(item)

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        return self.adapter.decode(items)
