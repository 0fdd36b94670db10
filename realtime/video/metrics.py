"""Realtime video sessions' series (realtime/video/): what happened to each input or output frame, admission
and overload degradation. On the engine's registry through `engine.metrics.part(VideoMetrics)`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stages.metric_buckets import TIME_BUCKETS


class VideoMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.frames = Counter("mmserve_realtime_video_frames_total", "Realtime video frames by mode and "
                              "outcome (sent, deadline, superseded, similar, invalid, failed)",
                              ["model", "mode", "outcome"], registry=r)
        self.latency = Histogram("mmserve_realtime_video_frame_latency_seconds", "Capture (img2img) or "
                                 "chunk start (t2v) to the output frame leaving the server",
                                 ["model", "mode"], buckets=TIME_BUCKETS, registry=r)
        self.sessions = Gauge("mmserve_realtime_video_sessions", "Live realtime video sessions",
                              registry=r)
        self.refused = Counter("mmserve_realtime_video_refused_total", "Video sessions refused at admission",
                               ["reason"], registry=r)
        self.degraded = Counter("mmserve_realtime_video_degraded_total", "Overload degradations by knob "
                                "(lookahead, steps, resolution)", ["knob"], registry=r)
        self.restored = Counter("mmserve_realtime_video_restored_total", "Degradations given back once a "
                                "session ran on time again, by knob", ["knob"], registry=r)
