"""Prometheus metrics for the runtime. One registry per engine; labels never carry a tenant or request id."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_age = Histogram("mmserve_stage_queue_age_seconds", "Time a work item waited in a stage queue",
                                   ["stage", "model"], buckets=_TIME_BUCKETS, registry=r)
        self.run_time = Histogram("mmserve_stage_run_seconds", "Time of one batch (or one loop step) of a stage",
                                  ["stage", "model"], buckets=_TIME_BUCKETS, registry=r)
        self.batch_size = Histogram("mmserve_stage_batch_size", "Work items sharing one stage call",
                                    ["stage", "model"], buckets=_BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("mmserve_stage_queue_depth", "Items waiting in a stage queue", ["stage", "model"],
                                 registry=r)
        self.active = Gauge("mmserve_stage_active_items", "Items a stage is working on", ["stage", "model"], registry=r)
        self.thread_wait = Histogram("mmserve_stage_thread_wait_seconds", "Time a CPU stage worker waited for its "
                                     "torch threads (the shared thread budget) before a batch or loop step",
                                     ["stage", "model"], buckets=_TIME_BUCKETS, registry=r)
        self.requests = Counter("mmserve_requests_total", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.graph_requests = Counter("mmserve_graph_requests_total", "Graph requests by model and outcome",
                                      ["model", "outcome"], registry=r)
        self.media_tasks = Counter("mmserve_media_tasks_total", "Media worker tasks by function and outcome",
                                   ["function", "outcome"], registry=r)
        self.media_bytes = Counter("mmserve_media_input_bytes_total", "Bytes handed to media decode tasks",
                                   ["function"], registry=r)
        self.media_fetches = Counter("mmserve_media_fetch_total", "Media sources fetched, by kind and outcome",
                                     ["kind", "outcome"], registry=r)
        self.media_fetch_bytes = Counter("mmserve_media_fetch_bytes_total", "Bytes fetched for media sources",
                                         ["kind"], registry=r)
        # The llm stage (DESIGN §6).
        self.llm_ttft = Histogram("mmserve_llm_time_to_first_token_seconds", "Admission to first token",
                                  ["model"], buckets=_TIME_BUCKETS, registry=r)
        self.llm_itl = Histogram("mmserve_llm_inter_token_latency_seconds", "Time between a request's tokens",
                                 ["model"], buckets=_TIME_BUCKETS, registry=r)
        self.llm_tokens = Counter("mmserve_llm_generated_tokens_total", "Tokens sampled", ["model"], registry=r)
        self.llm_running = Gauge("mmserve_llm_running_sequences", "Sequences holding KV blocks", ["model"], registry=r)
        self.llm_waiting = Gauge("mmserve_llm_waiting_sequences", "Sequences waiting for blocks", ["model"], registry=r)
        self.llm_blocks = Gauge("mmserve_llm_kv_blocks", "KV blocks by state (free, used, cached)",
                                ["model", "state"], registry=r)
        self.llm_prefix_hit_tokens = Gauge("mmserve_llm_prefix_cache_hit_tokens", "Prompt tokens served from the "
                                           "prefix cache", ["model"], registry=r)
        self.llm_preemptions = Gauge("mmserve_llm_preemptions", "Sequences preempted (recompute)", ["model"],
                                     registry=r)
        self.llm_forward_seqs = Histogram("mmserve_llm_forward_sequences", "Sequences in one forward of the llm "
                                          "stage (prefill chunks and decodes)", ["model"], buckets=_BATCH_BUCKETS,
                                          registry=r)
        self.llm_tokenized_chars = Counter("mmserve_llm_tokenized_characters_total", "Prompt characters run through "
                                           "the tokenizer (a prompt refused on its length alone adds none)",
                                           ["model"], registry=r)
        # Graph runner (DESIGN §8): stage is "denoise" or "llm".
        self.graph_replays = Counter("mmserve_graph_replays_total", "Forwards replayed from a captured graph",
                                     ["stage", "model"], registry=r)
        self.graph_rows = Counter("mmserve_graph_rows_total", "Real rows of replayed forwards", ["stage", "model"],
                                  registry=r)
        self.graph_padded_rows = Counter("mmserve_graph_padded_rows_total", "Padding rows added to reach a bucket "
                                         "(pad ratio = padded / (rows + padded))", ["stage", "model"], registry=r)
        self.graph_eager = Counter("mmserve_graph_eager_total", "Forwards of a graph-enabled stage run eagerly, by "
                                   "reason (shape, rows, padding, step_cache)", ["stage", "model", "reason"],
                                   registry=r)
        self.graph_captures = Counter("mmserve_graph_captures_total", "Buckets captured (warm-up only)",
                                      ["stage", "model"], registry=r)
        self.graph_capture_seconds = Gauge("mmserve_graph_capture_seconds", "Time spent capturing graphs",
                                           ["stage", "model"], registry=r)
        self.graph_pool_bytes = Gauge("mmserve_graph_pool_bytes", "Device memory reserved by graph capture",
                                      ["stage", "model"], registry=r)
        self.compile_seconds = Gauge("mmserve_compile_warmup_seconds", "Time of the first call per shape of a "
                                     "model with compiled blocks: compilation, and with graphs that shape's capture",
                                     ["stage", "model"], registry=r)
        self.step_cache_steps = Counter("mmserve_step_cache_steps_total", "Branch-steps of step-cached requests, "
                                        "computed or skipped", ["model", "method", "outcome"], registry=r)
        self.cache_hits = Counter("mmserve_cache_hits_total", "Cache hits", ["cache"], registry=r)
        self.cache_misses = Counter("mmserve_cache_misses_total", "Cache misses", ["cache"], registry=r)
        self.cache_bytes = Gauge("mmserve_cache_bytes", "Bytes held by a cache", ["cache"], registry=r)
        self.cache_saved = Counter("mmserve_cache_compute_saved_seconds", "Compute time a cache saved (the "
                                   "recorded cost of each entry, per hit)", ["cache"], registry=r)

        # Realtime video sessions (realtime/video*.py): what happened to each input or output frame.
        self.rt_video_frames = Counter("mmserve_realtime_video_frames_total", "Realtime video frames by mode and "
                                       "outcome (sent, deadline, superseded, similar, invalid, failed)",
                                       ["model", "mode", "outcome"], registry=r)
        self.rt_video_latency = Histogram("mmserve_realtime_video_frame_latency_seconds", "Capture (img2img) or "
                                          "chunk start (t2v) to the output frame leaving the server",
                                          ["model", "mode"], buckets=_TIME_BUCKETS, registry=r)
        self.rt_video_sessions = Gauge("mmserve_realtime_video_sessions", "Live realtime video sessions",
                                       registry=r)
        self.rt_video_refused = Counter("mmserve_realtime_video_refused_total", "Video sessions refused at admission",
                                        ["reason"], registry=r)
        self.rt_video_degraded = Counter("mmserve_realtime_video_degraded_total", "Overload degradations by knob "
                                         "(lookahead, steps, resolution)", ["knob"], registry=r)
        self.rt_video_restored = Counter("mmserve_realtime_video_restored_total", "Degradations given back once a "
                                         "session ran on time again, by knob", ["knob"], registry=r)

        # Realtime voice sessions (realtime/voice*.py): admission, the epoch fence, stage-to-ear latencies.
        self.rt_voice_sessions = Gauge("mmserve_realtime_voice_sessions", "Live realtime voice sessions (attached "
                                       "or waiting for a resume)", registry=r)
        self.rt_voice_refused = Counter("mmserve_realtime_voice_refused_total", "Voice sessions refused at admission",
                                        ["reason"], registry=r)
        self.rt_voice_stale_dropped = Counter("mmserve_realtime_voice_stale_chunks_dropped_total", "Response audio "
                                              "of an old epoch dropped at the fence (cancellation lost the race)",
                                              registry=r)
        self.rt_voice_input_dropped = Counter("mmserve_realtime_voice_input_dropped_total", "Input audio appends "
                                              "dropped because they waited too long", registry=r)
        self.rt_voice_ttfa = Histogram("mmserve_realtime_voice_time_to_first_audio_seconds", "End of the user's turn "
                                       "(speech_stopped, commit or response.create) to the first audio delta sent",
                                       ["model"], buckets=_TIME_BUCKETS, registry=r)
        self.rt_voice_interrupt = Histogram("mmserve_realtime_voice_interruption_to_silence_seconds", "Barge-in (or "
                                            "cancel) seen to the last audio of the cancelled response sent",
                                            ["model"], buckets=_TIME_BUCKETS, registry=r)

    def batch_size_samples(self, stage: str, model: str = "") -> dict[int, float]:
        """Cumulative bucket counts of the batch-size histogram: {upper bound: count <= bound}."""
        out: dict[int, float] = {}
        for metric in self.batch_size.collect():
            for s in metric.samples:
                if s.name.endswith("_bucket") and s.labels["stage"] == stage and s.labels["model"] == model:
                    le = s.labels["le"]
                    if le != "+Inf":
                        out[int(float(le))] = s.value
        return out

    def llm_forwards(self, model: str, *, min_seqs: int = 1) -> int:
        """Forwards of `model`'s llm stage that held at least `min_seqs` sequences (for tests and benchmarks)."""
        below = 0.0
        if min_seqs > 1:
            if min_seqs - 1 not in _BATCH_BUCKETS:
                raise ValueError(f"min_seqs - 1 must be a bucket bound {_BATCH_BUCKETS}, got {min_seqs}")
            below = self.registry.get_sample_value("mmserve_llm_forward_sequences_bucket",
                                                   {"model": model, "le": str(float(min_seqs - 1))}) or 0.0
        total = self.registry.get_sample_value("mmserve_llm_forward_sequences_count", {"model": model}) or 0.0
        return int(total - below)

    def max_batch_size(self, stage: str, model: str = "") -> int:
        """The largest batch size bucket that has seen a batch (for tests and benchmarks)."""
        seen, prev = 0, 0.0
        for bound, count in sorted(self.batch_size_samples(stage, model).items()):
            if count > prev:
                seen = bound
            prev = count
        return seen
