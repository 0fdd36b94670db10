"""The embed stage: texts and images of concurrent requests share encoder forwards.

A batch of work items (requests) is flattened into its inputs; texts are sorted by length and
cut into forwards (length buckets) under a padded-token budget, each holding only texts at least
`min_fill` as long as its longest, so a short text never pads up to a long one; images go in
chunks of a fixed count. Vectors are scattered back to their
request and position: the order of a request's inputs is kept whatever the batching.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Hashable, Protocol, Sequence

import numpy as np
import torch

from stages.stage import Stage, WorkItem


class Embedder(Protocol):
    """What an encoder adapter provides (encoders/text_embedding.py, encoders/image_embedding.py)."""

    dimension: int  # width of one vector

    def embed_tokens(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """One forward over token sequences -> float32 vectors [B, dimension]."""

    def embed_images(self, images: list) -> torch.Tensor:
        """One forward over decoded images -> float32 vectors [N, dimension]."""


@dataclass(frozen=True)
class EmbedInput:
    """One input of a request, ready to run: a text as token ids, or a decoded image."""

    token_ids: tuple[int, ...] = ()  # special tokens included, truncated to the model's limit
    image: Any = None  # a decoded PIL image (then token_ids is empty)


@dataclass(frozen=True)
class EmbeddingJob:
    """What one embeddings request runs (the ExecutionRequest of the embed graph)."""

    inputs: tuple[EmbedInput, ...]  # in the caller's order
    dimensions: int | None  # keep this many leading components, then renormalise; None: all

    @property
    def num_tokens(self) -> int:
        return sum(len(x.token_ids) for x in self.inputs)


@dataclass(frozen=True)
class ForwardBudget:
    max_tokens: int = 8192  # padded tokens (rows x longest row) in one text forward
    max_rows: int = 256  # texts in one forward
    max_images: int = 32  # images in one forward
    # A text joins a forward only if it fills at least this share of the forward's longest row (lengths
    # under SHORT_TOKENS count as SHORT_TOKENS: tiny rows cost about the same): at most 1/min_fill padding.
    min_fill: float = 0.75

    def __post_init__(self):
        if min(self.max_tokens, self.max_rows, self.max_images) < 1:
            raise ValueError("embedding forward budgets must be >= 1")
        if not 0.0 <= self.min_fill <= 1.0:
            raise ValueError(f"min_fill must be in [0, 1], got {self.min_fill}")


SHORT_TOKENS = 16


def plan_forwards(lengths: Sequence[int], max_tokens: int, max_rows: int, min_fill: float = 0.75) -> list[list[int]]:
    """Indices of `lengths` grouped into forwards (length buckets), longest first.

    Each group stays under max_tokens once padded and holds only texts at least min_fill as long as
    its longest, so sorting plus that floor bounds the padding; a text longer than the budget runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        # The group's first member is its longest: padded size = that length x rows.
        if (group and len(group) < max_rows and lengths[group[0]] * (len(group) + 1) <= max_tokens
                and max(lengths[i], SHORT_TOKENS) >= min_fill * lengths[group[0]]):
            group.append(i)
        else:
            groups.append([i])
    return groups


def shorten(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """OpenAI's `dimensions`: the first N components, rescaled to unit length. [n, D] -> [n, N]."""
    if dimensions is None or dimensions == vectors.shape[1]:
        return vectors
    cut = vectors[:, :dimensions]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return (cut / np.maximum(norms, 1e-12)).astype(np.float32)


@dataclass
class EmbedStats:
    """Bookkeeping of the stage's forwards (for metrics and tests); no request state."""

    text_forwards: int = 0
    image_forwards: int = 0
    tokens: int = 0  # real tokens run
    padded_tokens: int = 0  # rows x longest row, summed over text forwards


class EmbeddingStage(Stage):
    kind = "embed"

    def __init__(self, name: str, embedder: Embedder, budget: ForwardBudget = ForwardBudget()):
        self.model = name
        self.embedder = embedder
        self.budget = budget
        self.stats = EmbedStats()
        self._stats_lock = threading.Lock()

    def batch_key(self, item: WorkItem) -> Hashable:
        return "embed"  # texts of any length share a call; run_batch buckets them itself

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        # 1. every input of every request, remembering where its vector goes
        texts: list[tuple[int, int, tuple[int, ...]]] = []
        images: list[tuple[int, int, Any]] = []
        for i, item in enumerate(items):
            for j, x in enumerate(item.inputs["request"].inputs):
                if x.image is not None:
                    images.append((i, j, x.image))
                else:
                    texts.append((i, j, x.token_ids))
        rows: dict[tuple[int, int], np.ndarray] = {}
        # 2. texts: length buckets under the padded-token budget
        lengths = [len(ids) for _, _, ids in texts]
        for group in plan_forwards(lengths, self.budget.max_tokens, self.budget.max_rows, self.budget.min_fill):
            batch = [texts[k] for k in group]
            vectors = self.embedder.embed_tokens([ids for _, _, ids in batch]).numpy()
            for (i, j, _), v in zip(batch, vectors, strict=True):
                rows[i, j] = v
            self._count(text=True, tokens=sum(len(ids) for _, _, ids in batch),
                        padded=len(batch[0][2]) * len(batch))
        # 3. images: fixed-count chunks (the processor gives every image one shape)
        for start in range(0, len(images), self.budget.max_images):
            batch = images[start:start + self.budget.max_images]
            vectors = self.embedder.embed_images([im for _, _, im in batch]).numpy()
            for (i, j, _), v in zip(batch, vectors, strict=True):
                rows[i, j] = v
            self._count(text=False)
        # 4. per request, in its own order; then `dimensions`
        outputs = []
        for i, item in enumerate(items):
            job: EmbeddingJob = item.inputs["request"]
            vectors = np.stack([rows[i, j] for j in range(len(job.inputs))]).astype(np.float32, copy=False)
            outputs.append({"embeddings": shorten(vectors, job.dimensions), "prompt_tokens": job.num_tokens})
        return outputs

    def _count(self, *, text: bool, tokens: int = 0, padded: int = 0) -> None:
        with self._stats_lock:
            if text:
                self.stats.text_forwards += 1
                self.stats.tokens += tokens
                self.stats.padded_tokens += padded
            else:
                self.stats.image_forwards += 1
