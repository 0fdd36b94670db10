"""Benchmark: spoken replies from Qwen2.5-Omni, mmserve against transformers' generate(), side by side.

    python examples/bench_omni.py [--checkpoint OMNI_DIR] [--requests 8] [--tokens 24] [--codes 240] [--rounds 3]

One run is --requests spoken chat requests (text in, text + 24 kHz audio out, greedy thinker, each its own
seed and prompt, each reply --codes talker codes at most: 50 codes a second of audio):

  mmserve       all submitted at once to an engine serving the checkpoint: the thinker's steps batch across
                the requests (the llm stage), the talker's steps too, token2wav's DiT for 4 replies a call on
                two replicas, the vocoder per request on two replicas. Whole replies (equal to generate()).
  transformers  Qwen2_5OmniForConditionalGeneration.generate(), one request after another (torch.manual_seed
                before each), as a script serving them would: in a process of its own (an engine's worker threads
                each hold an OpenMP team; with more OpenMP threads than cores libgomp stops spinning, which slows
                another side's small ops in the same process 2-3x, measured). Its runs are timed inside that
                process.
  streamed      the same requests to mmserve with streamed audio (token2wav in chunks while the talker speaks):
                each request's time to its first audio chunk against its time to its whole reply.

Both sides are warmed with one run first; then --rounds rounds, the side that goes first alternating. Every run
is printed with the load average, then the medians, the throughput ratio (transformers' time / mmserve's) and the
median over requests of time to first audio / time to the whole reply. The first round checks that mmserve's
whole replies equal transformers' (same text and waveforms for the same seeds). Without --checkpoint the demo
Qwen2.5-Omni (random weights) is built in a temporary directory with a 1024-code codec, whose random talker
rarely says its end code: replies run to --codes, as a real model's few seconds of speech do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: pipelines/, stages/
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ("Say something nice.", "Tell me a story.", "What is the weather like?", "Count to five.",
           "Name a color.", "Describe a cat.", "Sing a song.", "Good morning!")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def transformers_side(conn, path: str, voice: str | None, tokens: int, codes: int, requests: list) -> None:
    """The baseline in a process of its own, as a script serving the requests would run: load once, then on each
    "run" generate() the requests one after another and send back (seconds, [(reply ids, waveform)])."""
    import torch
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    voice = voice or next(iter(model.speaker_map))
    eos = [model.talker.codec_pad_token, model.talker.codec_eos_token]
    conn.send(voice)
    while conn.recv() == "run":
        started = time.perf_counter()
        results = []
        for messages, seed in requests:
            inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True, return_tensors="pt")
            torch.manual_seed(seed)
            with torch.inference_mode():
                ids, wav = model.generate(**inputs, speaker=voice, thinker_max_new_tokens=tokens,
                                          talker_eos_token_id=eos, talker_max_new_tokens=codes)
            results.append((ids[0, inputs["input_ids"].shape[1]:].tolist(), wav.numpy()))
        conn.send((time.perf_counter() - started, results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="a Qwen2.5-Omni checkpoint with its talker (default: the demo, random weights)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=24, help="text tokens per reply (the thinker's max_tokens)")
    p.add_argument("--codes", type=int, default=240, help="talker codes per reply at most (50 a second of audio)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--voice", default=None, help="a speaker of the checkpoint (default: its first)")
    args = p.parse_args()

    import multiprocessing

    import numpy as np

    from pipelines.chat import ChatRequest
    from pipelines.chat_parts import VLMConfig
    from pipelines.config import EngineConfig, ModelSpec
    from pipelines.engine import Engine
    from pipelines.omni import SpeechOutput
    from stages.events import EventKind
    from stages.llm.params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None:
            from pipelines.demo.omni import build_qwen2_5_omni

            path = str(Path(tmp) / "omni")
            build_qwen2_5_omni(0, codec_vocab=1024).save_pretrained(path)
        requests = [([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], 100 + i) for i in range(args.requests)]
        conn, child_conn = multiprocessing.get_context("spawn").Pipe()
        baseline = multiprocessing.get_context("spawn").Process(
            target=transformers_side, args=(child_conn, path, args.voice, args.tokens, args.codes, requests),
            daemon=True)
        baseline.start()
        voice = conn.recv()
        engine = Engine(EngineConfig(models=(ModelSpec("omni", path, family="vlm",
                                                       vlm=VLMConfig(max_speech_codes=args.codes)),)))
        engine.start()
        try:
            def ours() -> tuple[float, list]:
                started = time.perf_counter()
                handles = [engine.submit_chat("omni", ChatRequest(
                    messages=m, params=SamplingParams(temperature=0, max_tokens=args.tokens),
                    speech=SpeechOutput(voice, seed))) for m, seed in requests]
                results = [h.result(timeout=600) for h in handles]
                return time.perf_counter() - started, results

            def streamed() -> tuple[float, list[float]]:
                """(the run's time, each request's time to first audio / time to its whole reply)."""
                started = time.perf_counter()
                handles = [engine.submit_chat("omni", ChatRequest(
                    messages=m, params=SamplingParams(temperature=0, max_tokens=args.tokens),
                    speech=SpeechOutput(voice, seed, stream=True))) for m, seed in requests]
                firsts: dict[int, float] = {}

                def follow(i: int) -> float:
                    for event in handles[i].events(timeout=600):
                        if event.kind is EventKind.DELTA and event.stage == "vocoder" and i not in firsts:
                            firsts[i] = time.perf_counter() - started
                        elif event.kind is EventKind.FINAL:
                            return time.perf_counter() - started
                    raise RuntimeError(f"streamed request {i} did not finish")

                with ThreadPoolExecutor(len(handles)) as pool:
                    wholes = list(pool.map(follow, range(len(handles))))
                # (a reply whose talker ended at once has no audio, and no first chunk)
                return time.perf_counter() - started, [firsts[i] / wholes[i] for i in firsts]

            def theirs() -> tuple[float, list]:
                conn.send("run")
                return conn.recv()

            ours()
            theirs()
            streamed()  # warm every side
            times: dict[str, list[float]] = {"mmserve": [], "transformers": [], "streamed": []}
            ratios: list[float] = []
            for r in range(args.rounds):
                order = ("mmserve", "transformers", "streamed") if r % 2 == 0 else ("streamed", "transformers",
                                                                                     "mmserve")
                for side in order:
                    if side == "mmserve":
                        took, mine = ours()
                    elif side == "streamed":
                        took, first = streamed()
                        ratios += first
                    else:
                        took, reference = theirs()
                    times[side].append(took)
                    print(f"round {r + 1} {side:12s} {args.requests} spoken replies {took * 1000:9.1f} ms   "
                          f"(load {load()})")
                if r == 0:
                    texts = all(m["choices"][0]["token_ids"] == ids for m, (ids, _) in zip(mine, reference))
                    shapes = all(m["audio"].shape == wav.shape for m, (_, wav) in zip(mine, reference))
                    apart = max(float(np.abs(m["audio"].numpy() - wav).max()) if m["audio"].shape == wav.shape
                                else float("inf") for m, (_, wav) in zip(mine, reference))
                    print(f"round 1: text {'equal' if texts else 'DIFFERS'}, audio lengths "
                          f"{'equal' if shapes else 'DIFFER'}, largest waveform difference {apart:.1e} "
                          f"({'within' if apart <= 1e-4 else 'BEYOND'} 1e-4)")
            audio_s = sum(len(m["audio"]) for m in mine) / 24000
            ours_med, theirs_med = statistics.median(times["mmserve"]), statistics.median(times["transformers"])
            print(f"\nmedians over {args.rounds} rounds (load {load()}), {audio_s:.2f} s of audio a run:")
            print(f"  throughput {args.requests} concurrent: mmserve {ours_med * 1000:.1f} ms, transformers one after "
                  f"another {theirs_med * 1000:.1f} ms   ratio {theirs_med / ours_med:.2f}x")
            print(f"  streamed: {statistics.median(times['streamed']) * 1000:.1f} ms a run; time to first audio / time "
                  f"to the whole reply, median over {len(ratios)} requests: {statistics.median(ratios):.2f} "
                  f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
        finally:
            engine.shutdown()
            conn.send("stop")
            baseline.join(timeout=30)


if __name__ == "__main__":
    main()
