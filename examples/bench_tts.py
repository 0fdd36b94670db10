"""Benchmark: time to first audio vs full synthesis time, text to speech with phrase-level streaming.

    python examples/bench_tts.py [--checkpoint DIR] [--scale small] [--repeats 5]

A 5-sentence text goes through the engine's tts stage (the same path as /v1/audio/speech with
`stream_format`). Measured side by side in one run, median of --repeats:
* time to first audio (the first phrase's DELTA event) and time to the whole audio (FINAL);
* the same text synthesised in one forward, as a server without phrase streaming would do.
The ratio first-audio / full is the result (target <= 0.35). Without --checkpoint it builds the
"small" demo VITS (random weights, heavy enough that compute dominates on the CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = ("The weather today is mild, with a light breeze from the west. "
        "Later in the afternoon, clouds will gather over the hills. "
        "There is a small chance of rain before the evening. "
        "Tomorrow should bring clear skies and warmer air. "
        "Enjoy the sunshine while it lasts, and have a good week.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a VITS or SpeechT5 checkpoint directory (default: the demo VITS)")
    parser.add_argument("--scale", default="small", choices=("tiny", "small"), help="demo VITS size")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.demo import build_demo_model
    from pipelines.engine import Engine
    from pipelines.tts import SpeechRequest
    from stages.events import EventKind

    path = args.checkpoint or str(build_demo_model("vits", os.path.join(tempfile.gettempdir(),
                                                                          f"mmserve-bench-vits-{args.scale}"),
                                                   scale=args.scale))
    engine = Engine(EngineConfig(models=(ModelSpec("tts", path),)))
    engine.start()
    try:
        speech = engine.speech_model("tts")
        job = speech.job(SpeechRequest(TEXT))
        print(f"model {path} ({speech.family}, {speech.sample_rate} Hz); {len(TEXT)} characters, "
              f"{len(job.phrases)} phrases, torch threads {torch.get_num_threads()}")
        first, full, audio_s, one_shot = [], [], 0.0, []
        all_ids = speech.speaker.tokenize(TEXT)
        for _ in range(args.repeats):
            # 1. streamed: first DELTA, then FINAL
            started = time.perf_counter()
            t_first = None
            for event in engine.submit_speech("tts", SpeechRequest(TEXT)).events(timeout=600):
                if event.kind is EventKind.DELTA and t_first is None:
                    t_first = time.perf_counter() - started
                elif event.kind is EventKind.FINAL:
                    full.append(time.perf_counter() - started)
                    audio_s = len(event.data["outputs"]["audio"]) / event.data["outputs"]["sample_rate"]
                elif event.kind is EventKind.ERROR:
                    raise RuntimeError(event.data)
            first.append(t_first)
            # 2. the whole text in one forward (no phrases)
            started = time.perf_counter()
            speech.speaker.synthesize(all_ids, speech.speaker.voices[speech.voices[0]], 1.0,
                                      torch.Generator().manual_seed(0))
            one_shot.append(time.perf_counter() - started)
        t_first, t_full, t_one = (statistics.median(x) for x in (first, full, one_shot))
        print(f"audio {audio_s:.1f} s; time to first audio {t_first * 1000:.0f} ms; full synthesis (phrases) "
              f"{t_full * 1000:.0f} ms; one forward of the whole text {t_one * 1000:.0f} ms")
        print(f"real-time factor {t_full / audio_s:.3f}")
        print(f"first audio / full synthesis: {t_first / t_full:.2f}x (target <= 0.35x); "
              f"first audio / one-forward synthesis: {t_first / t_one:.2f}x")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
