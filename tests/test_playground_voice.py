"""The playground's Voice tab (serve/static/playground/js/voice*.js) in a real headless Chromium.

Chromium's fake microphone (`--use-file-for-fake-audio-capture`) plays espeak-ng speech into the page's real capture
path (getUserMedia -> AudioWorklet -> 24 kHz pcm16 -> WS /v1/realtime) of a real `mmserve serve` on loopback serving
the demo voice cascade (real Whisper tiny.en, the tiny random llama and VITS: the answers are gibberish, the code
paths are real). The server requires API keys, so the socket is authenticated by the page's subprotocol.

Barge-in is tested against a mocked socket (Playwright's route_web_socket), where the test decides when the user
"speaks": the truncate the page sends must say how much of the answer the Web Audio calls actually played.

Every test fails on a console error, an uncaught page error or a request to another origin (test_playground's
Watched). The screenshot goes to the test's temporary directory; with PLAYGROUND_DOCS_SCREENSHOTS=1 it also
replaces docs/playground-voice.png.
"""

from __future__ import annotations

import base64
import json
import wave

import numpy as np
import pytest

from tests.test_playground import API_KEY, keyed_server, launch_chromium, screenshot, shots, watched_page
from tests.test_realtime_voice_support import (
    ESPEAK,
    needs_speech,
    silence,
    speech,
    voice_models,
    voice_server_config,
)

__all__ = ["shots", "voice_models"]
VOICE_MODEL = "voice-demo"
SENTENCE = "My brother bought a red car last night."
WAV_RATE = 48_000  # a usual microphone's rate: the page's worklet resamples it to the wire's 24 kHz


def write_wav(path, samples: np.ndarray, rate: int) -> None:
    """16-bit PCM mono: a format Chromium's fake capture device reads."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())


@pytest.fixture(scope="module")
def server(voice_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("playground-voice")
    srv = keyed_server(root, voice_server_config(voice_models, max_output_tokens=24))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """test_playground's chromium with a fake microphone that says SENTENCE once (`%noloop`: else Chromium repeats
    the file) and then hears silence, and audio allowed to play without a gesture."""
    wav = tmp_path_factory.mktemp("fake-microphone") / "speech.wav"
    said = speech(SENTENCE, WAV_RATE) if ESPEAK else silence(1.0, WAV_RATE)  # without espeak-ng: the barge-in test
    write_wav(wav, np.concatenate([silence(0.5, WAV_RATE), said, silence(2.0, WAV_RATE)]), WAV_RATE)
    with launch_chromium("--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                         f"--use-file-for-fake-audio-capture={wav}%noloop",
                         "--autoplay-policy=no-user-gesture-required") as chromium:
        yield chromium


def open_voice(page, server) -> None:
    page.goto(f"{server.url}/#voice")
    page.wait_for_selector("#voice-model option", state="attached")  # the model list has arrived
    assert page.input_value("#voice-model") == VOICE_MODEL
    assert page.is_enabled("#voice-toggle")


def played_ms(page) -> int:
    return int(page.get_attribute("#voice-played", "data-played-ms"))


@needs_speech
def test_a_spoken_turn_is_transcribed_answered_and_timed(browser, server, shots):
    with watched_page(browser, server, key=API_KEY) as watched:
        page = watched.page
        sent: list[dict] = []
        received: list[dict] = []

        def watch(ws):
            ws.on("framesent", lambda frame: sent.append(json.loads(frame)))
            ws.on("framereceived", lambda frame: received.append(json.loads(frame)))

        page.on("websocket", watch)
        open_voice(page, server)
        page.focus("#voice-toggle")
        page.keyboard.press("Enter")  # the keyboard starts it as a click would
        assert page.inner_text("#voice-toggle") == "Stop"
        user = page.wait_for_selector("#voice-log li.voice-user[data-final=true]", timeout=60_000)
        heard = user.query_selector(".voice-text").inner_text().lower()
        assert sum(word in heard for word in ("brother", "red", "car", "night")) >= 3, heard  # Whisper tiny.en
        page.wait_for_selector("#voice-log li.voice-assistant .voice-text:not(:empty)")
        page.wait_for_function("Number(document.getElementById('voice-played').dataset.playedMs) > 0")
        first = played_ms(page)
        page.wait_for_function(f"Number(document.getElementById('voice-played').dataset.playedMs) > {first}")
        latency = page.wait_for_selector("#voice-latency li")
        assert 0 < int(latency.get_attribute("data-ms")) < 30_000, latency.inner_text()
        assert "Turn 1:" in latency.inner_text()
        # once the answer has played out, all of its audio was played, none of it twice
        page.wait_for_function("document.getElementById('voice-status').textContent === 'Listening.'")
        deltas = [e for e in received if e["type"] == "response.output_audio.delta"]
        audio_ms = sum(len(base64.b64decode(e["delta"])) for e in deltas) / 48
        assert audio_ms > 0 and abs(played_ms(page) - audio_ms) <= 1, (played_ms(page), audio_ms)
        appends = [e for e in sent if e["type"] == "input_audio_buffer.append"]
        assert appends and all(len(base64.b64decode(e["audio"])) == 2400 for e in appends)  # 50 ms of 24 kHz pcm16
        screenshot(page, shots, "voice")
        page.set_viewport_size({"width": 390, "height": 844})  # a phone: the transcript wraps, nothing scrolls sideways
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        page.click("#voice-toggle")
        page.wait_for_function("document.getElementById('voice-status').textContent === 'Stopped.'")
        assert page.inner_text("#voice-toggle") == "Start" and page.is_enabled("#voice-model")
        assert watched.problems == [], "the page reported problems"


# Every AudioBufferSourceNode the page starts and stops, as the Web Audio API was asked: what was played, measured
# apart from the page's own bookkeeping.
RECORD_PLAYBACK = """
window.playback = [];
const start = AudioBufferSourceNode.prototype.start, stop = AudioBufferSourceNode.prototype.stop;
AudioBufferSourceNode.prototype.start = function (when = 0, ...rest) {
  window.playback.push({ node: this, when: Math.max(when, this.context.currentTime), duration: this.buffer.duration,
                         stoppedAt: null });
  return start.call(this, when, ...rest);
};
AudioBufferSourceNode.prototype.stop = function (...args) {
  const entry = window.playback.find((e) => e.node === this);
  if (entry && entry.stoppedAt === null) entry.stoppedAt = this.context.currentTime;
  return stop.apply(this, args);
};
"""
# Of the sources started so far: how many, how many stopped, and the ms they played up to the first stop.
PLAYED_UNTIL_STOP = """() => {
  const stops = window.playback.filter((e) => e.stoppedAt !== null).map((e) => e.stoppedAt);
  const at = Math.min(...stops);
  const ms = window.playback.reduce((sum, e) => sum + Math.min(Math.max(at - e.when, 0), e.duration), 0) * 1000;
  const unstopped = window.playback.filter((e) => e.stoppedAt === null && e.when + e.duration > at).length;
  return { started: window.playback.length, stopped: stops.length, unstopped, ms };
}"""
SILENCE_MS = 500


def tone(seconds: float, rate: int = 24_000) -> str:
    """A quiet 220 Hz answer, base64 pcm16 as a response.output_audio.delta carries it."""
    t = np.arange(int(seconds * rate)) / rate
    return base64.b64encode((0.1 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()).decode()


class MockSocket:
    """The server's end of the page's WS /v1/realtime, played by the test (Playwright's route_web_socket)."""

    def __init__(self, page):
        self.page = page
        self.route = None
        self.sent: list[dict] = []  # what the page sent
        page.route_web_socket("**/v1/realtime*", self._connect)

    def _connect(self, route) -> None:
        self.route = route
        route.on_message(lambda message: self.sent.append(json.loads(message)))

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.sent if e["type"] == kind]

    def wait(self, predicate, timeout_s: float = 20.0):
        """Until predicate() is truthy, letting Playwright deliver the page's frames meanwhile."""
        for _ in range(int(timeout_s / 0.05)):
            if value := predicate():
                return value
            self.page.wait_for_timeout(50)
        raise AssertionError(f"timed out; the page sent {[e['type'] for e in self.sent][-10:]}")

    def send(self, **event) -> None:
        self.route.send(json.dumps(event))

    def appended_ms(self) -> int:
        return sum(len(base64.b64decode(e["audio"])) for e in self.of("input_audio_buffer.append")) // 48


def test_barge_in_stops_playback_and_truncates_to_what_was_played(browser, server):
    with watched_page(browser, server, key=API_KEY) as watched:
        page = watched.page
        page.add_init_script(RECORD_PLAYBACK)
        socket = MockSocket(page)
        open_voice(page, server)
        page.click("#voice-toggle")
        socket.wait(lambda: socket.route)
        voice = page.input_value("#voice-voice")
        socket.send(type="session.created", session={"type": "realtime", "audio": {
            "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": SILENCE_MS}},
            "output": {"voice": voice}}})
        socket.wait(lambda: socket.of("input_audio_buffer.append"))  # the microphone streams once the session is up
        # an answer of 3 s, sent well ahead of playback as the server does, then the user talks over it
        for _ in range(30):
            socket.send(type="response.output_audio.delta", response_id="resp_1", item_id="item_1", delta=tone(0.1))
        page.wait_for_function("window.playback.length === 30")
        page.wait_for_timeout(800)
        socket.send(type="input_audio_buffer.speech_started", audio_start_ms=socket.appended_ms(), item_id="item_2")
        [truncate] = socket.wait(lambda: socket.of("conversation.item.truncate"))
        played = page.evaluate(PLAYED_UNTIL_STOP)
        assert played["unstopped"] == 0, played  # silenced at once: nothing of the answer plays on
        assert truncate["item_id"] == "item_1" and truncate["content_index"] == 0
        assert abs(truncate["audio_end_ms"] - played["ms"]) <= 3, (truncate, played)  # one render quantum
        assert 500 < truncate["audio_end_ms"] < 3000, truncate
        page.wait_for_function(
            f"Math.abs(document.getElementById('voice-played').dataset.playedMs - {played['ms']}) <= 3")
        socket.send(type="conversation.item.truncated", item_id="item_1", content_index=0,
                    audio_end_ms=truncate["audio_end_ms"])
        cut = page.wait_for_selector("#voice-log li[data-item=item_1][data-heard-ms]")
        assert "interrupted" in cut.inner_text()
        # a delta of the cut answer still in flight is not played; the next answer is, and its turn is timed
        socket.send(type="response.output_audio.delta", response_id="resp_1", item_id="item_1", delta=tone(0.1))
        socket.send(type="input_audio_buffer.speech_stopped", audio_end_ms=socket.appended_ms(), item_id="item_2")
        socket.send(type="response.output_audio.delta", response_id="resp_2", item_id="item_3", delta=tone(0.1))
        latency = page.wait_for_selector("#voice-latency li")
        assert page.evaluate("window.playback.length") == 31  # item_3's chunk alone
        # the stopped speech ended SILENCE_MS before speech_stopped; the answer then started almost at once
        assert SILENCE_MS <= int(latency.get_attribute("data-ms")) < SILENCE_MS + 1500, latency.inner_text()
        page.click("#voice-toggle")
        assert watched.problems == [], "the page reported problems"
