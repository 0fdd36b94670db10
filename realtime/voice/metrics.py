"""Realtime voice sessions' series (realtime/voice/): admission, the epoch fence, stage-to-ear latencies.
On the engine's registry through `engine.metrics.part(VoiceMetrics)`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stages.metric_buckets import TIME_BUCKETS


class VoiceMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.sessions = Gauge("mmserve_realtime_voice_sessions", "Live realtime voice sessions (attached "
                              "or waiting for a resume)", registry=r)
        self.refused = Counter("mmserve_realtime_voice_refused_total", "Voice sessions refused at admission",
                               ["reason"], registry=r)
        self.stale_dropped = Counter("mmserve_realtime_voice_stale_chunks_dropped_total", "Response audio "
                                     "of an old epoch dropped at the fence (cancellation lost the race)",
                                     registry=r)
        self.input_dropped = Counter("mmserve_realtime_voice_input_dropped_total", "Input audio appends "
                                     "dropped because they waited too long", registry=r)
        self.ttfa = Histogram("mmserve_realtime_voice_time_to_first_audio_seconds", "End of the user's turn "
                              "(speech_stopped, commit or response.create) to the first audio delta sent",
                              ["model"], buckets=TIME_BUCKETS, registry=r)
        self.speculations = Counter("mmserve_realtime_voice_speculations_total", "Responses started while the "
                                    "speaker paused, by outcome (started; kept: adopted at the turn's end; "
                                    "discarded)", ["model", "outcome"], registry=r)
        self.finals = Counter("mmserve_realtime_voice_final_transcripts_total", "Final transcripts at the end of "
                              "a turn, by where they were decoded (early: the pause's early final, no decode "
                              "after the turn ended; graph: the response's asr node; lane: the session's ASR "
                              "lane)", ["model", "source"], registry=r)
        self.interrupt = Histogram("mmserve_realtime_voice_interruption_to_silence_seconds", "Barge-in (or "
                                   "cancel) seen to the last audio of the cancelled response sent",
                                   ["model"], buckets=TIME_BUCKETS, registry=r)
