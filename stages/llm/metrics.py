"""The llm stage's Prometheus series (DESIGN §6), on the engine's registry (stages.metrics.Metrics.llm)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stages.metric_buckets import BATCH_BUCKETS, TIME_BUCKETS


class LLMMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = self.registry = registry
        self.ttft = Histogram("mmserve_llm_time_to_first_token_seconds", "Admission to first token",
                              ["model"], buckets=TIME_BUCKETS, registry=r)
        self.itl = Histogram("mmserve_llm_inter_token_latency_seconds", "Time between a request's tokens",
                             ["model"], buckets=TIME_BUCKETS, registry=r)
        self.tokens = Counter("mmserve_llm_generated_tokens_total", "Tokens sampled", ["model"], registry=r)
        self.running = Gauge("mmserve_llm_running_sequences", "Sequences holding KV blocks", ["model"], registry=r)
        self.waiting = Gauge("mmserve_llm_waiting_sequences", "Sequences waiting for blocks", ["model"], registry=r)
        self.blocks = Gauge("mmserve_llm_kv_blocks", "KV blocks by state (free, used, cached)",
                            ["model", "state"], registry=r)
        self.prefix_hit_tokens = Gauge("mmserve_llm_prefix_cache_hit_tokens", "Prompt tokens served from the "
                                       "prefix cache", ["model"], registry=r)
        self.preemptions = Gauge("mmserve_llm_preemptions", "Sequences preempted (recompute)", ["model"],
                                 registry=r)
        self.forward_seqs = Histogram("mmserve_llm_forward_sequences", "Sequences in one forward of the llm "
                                      "stage (prefill chunks and decodes)", ["model"], buckets=BATCH_BUCKETS,
                                      registry=r)
        self.tokenized_chars = Counter("mmserve_llm_tokenized_characters_total", "Prompt characters run through "
                                       "the tokenizer (a prompt refused on its length alone adds none)",
                                       ["model"], registry=r)

    def forwards(self, model: str, *, min_seqs: int = 1) -> int:
        """Forwards of `model`'s llm stage that held at least `min_seqs` sequences (for tests and benchmarks)."""
        below = 0.0
        if min_seqs > 1:
            if min_seqs - 1 not in BATCH_BUCKETS:
                raise ValueError(f"min_seqs - 1 must be a bucket bound {BATCH_BUCKETS}, got {min_seqs}")
            below = self.registry.get_sample_value("mmserve_llm_forward_sequences_bucket",
                                                   {"model": model, "le": str(float(min_seqs - 1))}) or 0.0
        total = self.registry.get_sample_value("mmserve_llm_forward_sequences_count", {"model": model}) or 0.0
        return int(total - below)
