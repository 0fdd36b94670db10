"""The encoder stages of chat models: vision_encode (images, video) and audio_encode (audio clips) -> features,
through the one encoder-output cache.

A batch is several requests' items (`inputs[stage.source]`: EncodeTasks in prompt order). Per batch:

1. claim every item's cache key: a hit, a wait on another caller's computation, or the lead
   (identical items within the batch share one claim);
2. prepare the leaders' pixels and group them by the adapter's bucket (same shape, or packed
   variable-length input), then one encoder forward per group;
3. publish each leader's features to the cache (visible only now, complete), then collect
   every request's features in order: {stage.output: [Tensor [tokens, hidden], ...]}.

Single flight: concurrent misses of one key (8 requests for one new image) encode it once.
"""

from __future__ import annotations

import time
from typing import Any, Hashable

import torch

from encoders.cache import EncoderCache
from encoders.vision import EncoderAdapter, EncodeTask, Prepared
from stages.metrics import Metrics
from stages.stage import Stage, WorkItem

WAIT_TIMEOUT_S = 600.0  # a waiter gives up on a leader in another worker after this long


class VisionEncodeStage(Stage):
    kind = "vision_encode"
    source = "media"  # the input holding the request's EncodeTasks of this encoder
    output = "features"  # the output holding their features, in order

    def __init__(self, model: str, adapter: EncoderAdapter, cache: EncoderCache, metrics: Metrics,
                 max_items_per_forward: int = 32):
        self.model = model
        self.adapter = adapter
        self.cache = cache
        self.metrics = metrics
        self.max_items_per_forward = max_items_per_forward  # bounds one forward's activation memory
        self.forwards = 0  # encoder forward calls (tests, benchmarks)
        self.items_encoded = 0  # items that went through a forward

    def batch_key(self, item: WorkItem) -> Hashable:
        return self.adapter.weights_id  # one encoder; the buckets are formed per media item in run_batch

    def run_batch(self, items: list[WorkItem]) -> list[dict[str, Any]]:
        # 1. claim every item: a hit, a wait (on another worker, or on a leader in this batch) or the lead
        claims = [[self.cache.claim(task.key) for task in item.inputs[self.source]] for item in items]
        for item, cs in zip(items, claims):
            if item.trace is not None:
                led = sum(c.kind == "lead" for c in cs)
                item.trace.cache(hits=len(cs) - led, misses=led)
        leaders = {c.key: task for item, cs in zip(items, claims) for task, c in zip(item.inputs[self.source], cs)
                   if c.kind == "lead"}
        # 2. encode the leaders, one forward per bucket
        lead_claims = {c.key: c for cs in claims for c in cs if c.kind == "lead"}
        try:
            results = self._encode(list(leaders.values()))
        except BaseException as exc:
            for claim in lead_claims.values():
                self.cache.abandon(claim, exc)
            raise
        # 3. publish (complete entries only), then gather each request's features in prompt order
        for key, claim in lead_claims.items():
            self.cache.fulfil(claim, results[key])
        saved = self.metrics.cache.saved.labels(cache=self.cache.name)
        outputs = []
        for cs in claims:
            features = []
            for claim in cs:
                if claim.kind == "lead":
                    entry = results[claim.key]
                else:
                    entry = claim.value if claim.kind == "hit" else results.get(claim.key) or \
                        claim.wait(WAIT_TIMEOUT_S)
                    saved.inc(entry["encode_s"])
                features.append(entry["features"])
            outputs.append({self.output: features})
        return outputs

    def _encode(self, tasks: list[EncodeTask]) -> dict[Hashable, dict[str, Any]]:
        """Leaders -> {key: {"features", "encode_s"}}; encode_s is the item's share of its forward."""
        groups: dict[Hashable, list[Prepared]] = {}
        for task in tasks:
            prepared = self.adapter.prepare(task)
            groups.setdefault(self.adapter.bucket(prepared), []).append(prepared)
        out: dict[Hashable, dict[str, Any]] = {}
        for group in groups.values():
            for i in range(0, len(group), self.max_items_per_forward):
                batch = group[i:i + self.max_items_per_forward]
                started = time.perf_counter()
                features = self.adapter.encode(batch)
                if self.adapter.device.type == "cuda":
                    torch.cuda.synchronize(self.adapter.device)
                share = (time.perf_counter() - started) / len(batch)
                self.forwards += 1
                self.items_encoded += len(batch)
                for prepared, feats in zip(batch, features, strict=True):
                    out[prepared.task.key] = {"features": feats, "encode_s": share}
        return out


class AudioEncodeStage(VisionEncodeStage):
    """Audio clips -> features (an audio-language model's Whisper-style encoder and projector): the same batching,
    buckets and cache as images, its own pool and node."""

    kind = "audio_encode"
    source = "audio_media"
    output = "audio_features"
