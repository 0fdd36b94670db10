"""Embedding models: the request checks, the tokenizer, and the embed stage behind them.

Two families:
* "embedding" — a transformers encoder (BERT, RoBERTa, MPNet, ... or any sentence-transformers
  checkpoint): pooling, normalisation and truncation as its sentence-transformers files say.
* "clip-embedding" — a `CLIPModel`: images and texts into one normalised space.

Texts longer than the model's limit are truncated (as sentence-transformers does), never
refused; `usage.prompt_tokens` counts the tokens the model read, special tokens included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipelines.image_request import RequestError
from stages.embedding import EmbeddingJob, EmbeddingStage, EmbedInput, ForwardBudget
from stages.pool import PoolConfig

if TYPE_CHECKING:
    from encoders.image_embedding import ClipEncoder
    from encoders.text_embedding import SentenceEncoder

EMBEDDING_FAMILY = "embedding"
CLIP_EMBEDDING_FAMILY = "clip-embedding"
EMBEDDING_FAMILIES = (EMBEDDING_FAMILY, CLIP_EMBEDDING_FAMILY)
EMBEDDINGS_TASK = "embeddings"  # ModelInfo.tasks of an embedding model
IMAGE_EMBEDDINGS_TASK = "image-embeddings"  # ... plus this one when it also embeds images (CLIP)
# Requests share a call when they arrive within 2 ms; run_batch buckets their texts by length.
EMBED_POOL = PoolConfig(max_batch_size=32, max_delay_ms=2.0, max_queue=256)


@dataclass(frozen=True)
class EmbeddingLimits:
    max_inputs: int = 2048  # items in one request (OpenAI's limit)
    max_input_chars: int = 100_000  # one text, before tokenizing (it is truncated to the model's limit after)
    max_total_chars: int = 4_000_000  # all texts of one request
    max_images: int = 16  # images in one request (each is fetched and decoded)

    def __post_init__(self):
        if min(self.max_inputs, self.max_input_chars, self.max_total_chars, self.max_images) < 1:
            raise ValueError("embedding limits must be >= 1")


@dataclass
class ImageInput:
    """An image to embed: where it comes from, and the decoded picture once fetched."""

    source: str  # data: URI, http(s):// or allowed file:// URL, as sent
    image: Any = None  # PIL image, set after fetch + decode


@dataclass
class EmbeddingRequest:
    """What the caller asked to embed, parsed but not yet tokenized."""

    inputs: list[str | list[int] | ImageInput]  # texts, token-id lists, images; output keeps this order
    dimensions: int | None = None  # shorten to this many components (renormalised); None: the full vector
    tenant: str = "default"  # the caller's namespace (no embedding cache yet; kept for when one keys on it)
    single: bool = False  # the caller sent one input, not a list: errors name "input", not "input[0]"

    def param(self, i: int) -> str:
        return "input" if self.single else f"input[{i}]"


class EmbeddingModel:
    """A loaded embedding model: its encoder, limits and the embed stage that runs it."""

    def __init__(self, name: str, path: str, family: str, *, device: str = "cpu", dtype: str = "float32",
                 limits: EmbeddingLimits = EmbeddingLimits(), budget: ForwardBudget = ForwardBudget()):
        encoder_cls: type[SentenceEncoder] | type[ClipEncoder]
        if family == EMBEDDING_FAMILY:
            from encoders.text_embedding import SentenceEncoder as encoder_cls
        elif family == CLIP_EMBEDDING_FAMILY:
            from encoders.image_embedding import ClipEncoder as encoder_cls
        else:
            raise ValueError(f"family {family!r} is not an embedding family; use one of {EMBEDDING_FAMILIES}")
        self.name = name
        self.family = family
        self.limits = limits
        self.encoder = encoder_cls(path, device=device, dtype=dtype)
        self.stage = EmbeddingStage(name, self.encoder, budget)

    @property
    def dimension(self) -> int:
        return self.encoder.dimension

    @property
    def tasks(self) -> tuple[str, ...]:
        return (EMBEDDINGS_TASK, IMAGE_EMBEDDINGS_TASK) if self.encoder.accepts_images else (EMBEDDINGS_TASK,)

    @property
    def max_tokens(self) -> int:
        return self.encoder.template.max_tokens

    def check(self, request: EmbeddingRequest) -> None:
        """The cheap checks, before anything is fetched, decoded or tokenized. Raises RequestError."""
        inputs, limits = request.inputs, self.limits
        if not inputs:
            raise RequestError("input", "input must hold at least one item (a string, a list of strings, a list of "
                                        "token ids or a list of token-id lists)")
        if len(inputs) > limits.max_inputs:
            raise RequestError("input", f"input holds {len(inputs)} items; the limit is {limits.max_inputs} "
                                        "per request", code="too_many_inputs")
        total_chars, num_images = 0, 0
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                if not x:
                    raise RequestError(request.param(i), f"{request.param(i)} is an empty string; send some text")
                if len(x) > limits.max_input_chars:
                    raise RequestError(request.param(i), f"{request.param(i)} is {len(x)} characters; the limit is "
                                       f"{limits.max_input_chars}", code="input_too_long")
                total_chars += len(x)
            elif isinstance(x, ImageInput):
                if not self.encoder.accepts_images:
                    raise RequestError(request.param(i), f"model {self.name} embeds text only; {request.param(i)} is "
                                       "an image (use a clip-embedding model)", code="unsupported_input")
                num_images += 1
            else:
                self._check_token_ids(x, request.param(i))
        if total_chars > limits.max_total_chars:
            raise RequestError("input", f"input holds {total_chars} characters; the limit is {limits.max_total_chars} "
                                        "per request", code="input_too_long")
        if num_images > limits.max_images:
            raise RequestError("input", f"input holds {num_images} images; the limit is {limits.max_images} "
                                        "per request", code="too_many_images")
        if request.dimensions is not None and not 1 <= request.dimensions <= self.dimension:
            raise RequestError("dimensions", f"dimensions must be between 1 and {self.dimension} "
                                             f"for model {self.name}; got {request.dimensions}")

    def _check_token_ids(self, ids: Any, param: str) -> None:
        if not isinstance(ids, list) or not ids:
            raise RequestError(param, f"{param} must be a non-empty string, list of token ids or image part")
        vocab = self.encoder.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(param, f"{param}: token ids must be integers in [0, {vocab}); got {bad[:5]}")

    def job(self, request: EmbeddingRequest) -> EmbeddingJob:
        """Check, tokenize and truncate: what the embed stage runs. Images must be decoded already."""
        self.check(request)
        texts = [(i, x) for i, x in enumerate(request.inputs) if isinstance(x, str)]
        tokenized = dict(zip((i for i, _ in texts), self.encoder.tokenize([x for _, x in texts]), strict=True))
        inputs = []
        for i, x in enumerate(request.inputs):
            if isinstance(x, str):
                inputs.append(EmbedInput(token_ids=tokenized[i]))
            elif isinstance(x, ImageInput):
                if x.image is None:
                    raise RequestError(request.param(i), f"{request.param(i)}: the image was not decoded")
                inputs.append(EmbedInput(image=x.image))
            else:
                inputs.append(EmbedInput(token_ids=self.encoder.template.wrap(x)))
        return EmbeddingJob(tuple(inputs), request.dimensions)
