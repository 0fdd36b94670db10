"""The parts of a voice session that need no model: wire audio, turn detection, the protocol's shapes, the
conversation and its playback clock."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from realtime.voice.audio_codec import ALAW, PCM16, ULAW, AudioDecodeError, StreamResampler, b64decode, decode, encode
from realtime.voice.items import Conversation, Item, Phrase, PlaybackClock
from realtime.voice.protocol import (
    ProtocolError,
    SessionConfig,
    apply_session_update,
    is_beta_session,
    parse_client_event,
    parse_item,
    parse_response_params,
    session_object,
)
from realtime.voice.turn_detection import TurnDetection
from realtime.voice.vad import EnergyModel, TurnDetector, VadLoader, VadParams, silero_file
from tests.test_realtime_voice_support import ESPEAK, silence, speech, voiced

# -- wire audio -----------------------------------------------------------------------------------------------


def test_g711_matches_the_reference_codec():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")  # CPython <= 3.12: the ITU reference algorithm
    pcm = np.arange(-32768, 32768, dtype=np.int32).astype("<i2")
    samples = pcm.astype(np.float32) / 32767.0  # encode() scales by 32767 and rounds: the same int16 values
    assert encode(samples, ULAW) == audioop.lin2ulaw(pcm.tobytes(), 2)
    assert encode(samples, ALAW) == audioop.lin2alaw(pcm.tobytes(), 2)
    codes = bytes(range(256))
    for fmt, ref in ((ULAW, audioop.ulaw2lin), (ALAW, audioop.alaw2lin)):
        assert np.array_equal(np.round(decode(codes, fmt) * 32768).astype(np.int16),
                              np.frombuffer(ref(codes, 2), "<i2"))


def test_g711_round_trip_and_known_codes():
    assert encode(np.zeros(1), ULAW) == b"\xff" and encode(np.zeros(1), ALAW) == b"\xd5"
    x = np.sin(np.arange(8000) / 8000 * 2 * np.pi * 300).astype(np.float32) * 0.5
    for fmt in (ULAW, ALAW):
        y = decode(encode(x, fmt), fmt)
        assert np.max(np.abs(y - x)) < 0.02  # 8-bit logarithmic: under 4% of the peak
    assert np.array_equal(decode(encode(x, PCM16), PCM16), np.round(x * 32767) / 32768)


def test_bad_audio_is_named():
    with pytest.raises(AudioDecodeError, match="base64"):
        b64decode("not base64!!")
    with pytest.raises(AudioDecodeError, match="even number"):
        decode(b"\x00\x01\x02", PCM16)


def test_streaming_resampler_equals_resampling_whole():
    from stages.speech.audio_dsp import resample

    x = np.random.default_rng(0).standard_normal(24_000).astype(np.float32) * 0.3
    for orig, new in ((24_000, 16_000), (8_000, 16_000)):
        r, pieces, i = StreamResampler(orig, new), [], 0
        for n in (7, 480, 1000, 33, 2400) * 20:
            pieces.append(r.feed(x[i:i + n]))
            i += n
        out, whole = np.concatenate(pieces), resample(x[:i], orig, new)
        assert len(whole) - len(out) <= 2 * new * 2 // 1000 + 2  # only the last ~2 ms wait for context
        assert np.allclose(out, whole[:len(out)], atol=1e-5)


# -- turn detection -------------------------------------------------------------------------------------------


def _events(detector: TurnDetector, audio: np.ndarray, piece: int = 640):
    out = []
    for i in range(0, len(audio), piece):
        out += detector.feed(audio[i:i + piece])
    return [(e.kind, e.sample) for e in out]


def test_energy_vad_applies_silence_duration_and_min_speech():
    params = VadParams(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500, min_speech_ms=64)
    audio = np.concatenate([silence(0.5, 16_000), voiced(1.0, 16_000), silence(1.0, 16_000)])
    events = _events(TurnDetector(EnergyModel(), params), audio)
    assert [k for k, _ in events] == ["start", "stop"]
    (_, start), (_, stop) = events
    assert abs(start - 8_000) <= 512  # the window where speech begins
    assert 500 * 16 <= stop - 24_000 <= 500 * 16 + 2 * 512  # the silence it took, in whole windows
    click = np.concatenate([np.zeros(16 * 512 + 100, np.float32), voiced(0.015, 16_000), silence(1.0, 16_000)])
    assert _events(TurnDetector(EnergyModel(), params), click) == []  # shorter than min_speech_ms
    quiet = voiced(1.0, 16_000) * 0.02  # about -50 dBFS: under threshold 0.5, over 0.1
    assert _events(TurnDetector(EnergyModel(), params), quiet) == []
    low = VadParams(threshold=0.1, silence_duration_ms=200)
    assert [k for k, _ in _events(TurnDetector(EnergyModel(), low), np.concatenate([quiet, silence(0.5, 16_000)]))] \
        == ["start", "stop"]


@pytest.mark.skipif(silero_file() is None or ESPEAK is None, reason="needs the silero-vad package and espeak-ng")
def test_silero_finds_the_speech_in_espeak_audio():
    import torch

    threads = torch.get_num_threads()
    loader = VadLoader()
    model = loader.new()
    assert loader.kind == "silero" and torch.get_num_threads() == threads  # the package's loader would set 1
    words = speech("The little girl opened the green door this morning.", 16_000)
    audio = np.concatenate([silence(0.7, 16_000), words, silence(1.2, 16_000)])
    events = _events(TurnDetector(model, VadParams()), audio)
    assert [k for k, _ in events] == ["start", "stop"], events
    onset, end = 11_200 + np.argmax(np.abs(words) > 0.02), 11_200 + len(words)
    assert onset - 1600 <= events[0][1] <= onset + 4800  # within 0.1 s before .. 0.3 s after the first sound
    assert end <= events[1][1] <= end + 1.2 * 16_000
    assert _events(TurnDetector(loader.new(), VadParams()), silence(2.0, 16_000)) == []


def test_energy_loader_needs_no_package():
    loader = VadLoader("energy")
    assert loader.kind == "energy" and isinstance(loader.new(), EnergyModel)
    with pytest.raises(ValueError):
        VadLoader("webrtc")


# -- the protocol's shapes ------------------------------------------------------------------------------------


def test_client_events_are_checked_before_anything_runs():
    assert parse_client_event('{"type": "response.create", "event_id": "e1"}', 1000)["event_id"] == "e1"
    cases = [("{not json", "invalid_json"), ("[1, 2]", "invalid_event"),
             ('{"event_id": "x"}', "missing_required_parameter"),
             ('{"type": "response.explode"}', "invalid_event_type"), ('{"type": "response.create", "event_id": 3}',
                                                                      "invalid_value"),
             (b"\x00\x01", "invalid_frame"),
             ('{"type": "session.update", "pad": "' + "x" * 2000 + '"}', "event_too_large")]
    for message, code in cases:
        with pytest.raises(ProtocolError) as e:
            parse_client_event(message, 1000)
        assert e.value.code == code, message


def _config(**kw) -> SessionConfig:
    return SessionConfig(voice="alloy", instructions="Be brief.", max_output_tokens=48, **kw)


def test_ga_and_beta_session_updates_mean_the_same():
    ga = {"type": "realtime", "output_modalities": ["text"], "instructions": "Hi",
          "audio": {"input": {"format": {"type": "audio/pcmu"},
                              "turn_detection": {"type": "server_vad", "threshold": 0.7, "silence_duration_ms": 300}},
                    "output": {"format": {"type": "audio/pcma"}, "voice": "echo"}}, "max_output_tokens": 20}
    beta = {"modalities": ["text"], "instructions": "Hi", "input_audio_format": "g711_ulaw",
            "output_audio_format": "g711_alaw", "turn_detection": {"type": "server_vad", "threshold": 0.7,
                                                                   "silence_duration_ms": 300},
            "voice": "echo", "max_response_output_tokens": 20}
    kw = dict(model="voice", voices=("alloy", "echo"), max_tokens_cap=48, voice_locked=False)
    a, b = apply_session_update(_config(), ga, **kw), apply_session_update(_config(), beta, **kw)
    assert a == b and not is_beta_session(ga) and is_beta_session(beta)
    assert (a.input_format, a.output_format, a.voice, a.max_output_tokens) == (ULAW, ALAW, "echo", 20)
    assert a.turn_detection == TurnDetection(threshold=0.7, silence_duration_ms=300)
    assert apply_session_update(a, {"turn_detection": None}, **kw).turn_detection is None
    assert apply_session_update(a, {"max_output_tokens": "inf"}, **kw).max_output_tokens == 48  # the model's cap


def test_session_update_errors_name_the_field():
    kw = dict(model="voice", voices=("alloy", "echo"), max_tokens_cap=48, voice_locked=False)
    cases = [({"voise": "x"}, "session.voise", "unknown_parameter"),
             ({"audio": {"output": {"voice": "nova"}}}, "session.audio.output.voice", "invalid_value"),
             ({"turn_detection": {"type": "near_field_vad"}}, "session.turn_detection.type", "unsupported_value"),
             ({"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}},
              "session.turn_detection.eagerness", "invalid_value"),
             ({"turn_detection": {"type": "semantic_vad", "silence_duration_ms": 300}},
              "session.turn_detection.silence_duration_ms", "unknown_parameter"),
             ({"turn_detection": {"sentence_silence_ms": -1}}, "session.turn_detection.sentence_silence_ms",
              "invalid_value"),
             ({"turn_detection": {"type": "server_vad", "idle_timeout_ms": 100}},
              "session.turn_detection.idle_timeout_ms", "invalid_value"),
             ({"turn_detection": {"threshold": 2}}, "session.turn_detection.threshold", "invalid_value"),
             ({"input_audio_format": "mp3"}, "session.input_audio_format", "invalid_value"),
             ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
              "session.audio.input.format.rate", "invalid_value"),
             ({"type": "transcription"}, "session.type", "unsupported_value"),
             ({"model": "gpt-realtime"}, "session.model", "invalid_value"),
             ({"tools": [{"type": "function", "name": "f"}]}, "session.tools", "unsupported_value"),
             ({"output_modalities": ["video"]}, "session.output_modalities", "invalid_value")]
    for session, param, code in cases:
        with pytest.raises(ProtocolError) as e:
            apply_session_update(_config(), session, **kw)
        assert (e.value.param, e.value.code) == (param, code), session
    with pytest.raises(ProtocolError) as e:
        apply_session_update(_config(), {"voice": "echo"}, **{**kw, "voice_locked": True})
    assert e.value.param == "session.voice"


def test_session_objects_validate_as_the_sdk_types():
    from openai.types.beta.realtime.session import Session as BetaSession
    from openai.types.realtime import RealtimeSessionCreateRequest

    ga = session_object(_config(), session_id="sess_1", model="voice")
    RealtimeSessionCreateRequest.model_validate(ga)
    beta = session_object(_config(beta=True, turn_detection=None), session_id="sess_1", model="voice")
    beta.pop("model")  # the beta type lists OpenAI's model names only
    assert BetaSession.model_validate(beta).turn_detection is None


def test_response_params_and_items():
    params = parse_response_params({"modalities": ["text", "audio"], "max_output_tokens": 100,
                                    "conversation": "none",
                                    "input": [{"type": "message", "role": "user",
                                               "content": [{"type": "input_text", "text": "hi"}]}]},
                                   _config(), 48)
    assert params.output_modalities == ("audio",) and params.max_output_tokens == 48
    assert params.input_items[0]["text"] == "hi" and params.conversation == "none"
    for bad, param in (({"conversation": "all"}, "response.conversation"), ({"voice": "echo"}, "response.voice"),
                       ({"max_output_tokens": 0}, "response.max_output_tokens"), ({"colour": 1}, "response.colour")):
        with pytest.raises(ProtocolError) as e:
            parse_response_params(bad, _config(), 48)
        assert e.value.param == param
    item = parse_item({"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "AAAA"}]},
                      "item")
    assert item["audio"] == "AAAA"
    for bad, param in (({"type": "function_call"}, "item.type"), ({"role": "tool", "content": [{}]}, "item.role"),
                       ({"role": "user", "content": []}, "item.content"),
                       ({"role": "assistant", "content": [{"type": "input_audio", "audio": "AAAA"}]},
                        "item.content[0].type")):
        with pytest.raises(ProtocolError) as e:
            parse_item(bad, "item")
        assert e.value.param == param, bad


# -- the conversation and the playback clock ------------------------------------------------------------------


def test_history_keeps_only_what_was_heard():
    item = Item("item_a", "assistant", "audio", text="One two three. Four five six seven.")
    item.phrases = [Phrase("One two three.", 0, 1000), Phrase("Four five six seven.", 1000, 2000)]
    item.audio_ms = 3000
    assert item.history_text == "One two three. Four five six seven."  # not truncated: all of it
    for heard, text in ((0, ""), (999, "One two"), (1000, "One two three."), (2000, "One two three. Four five"),
                        (3000, "One two three. Four five six seven.")):
        item.heard_ms = heard
        assert item.history_text == text
    item.heard_ms = 1500
    assert item.wire(beta=False)["content"] == [{"type": "output_audio", "transcript": "One two three. Four"}]
    assert item.wire(beta=True)["content"][0]["type"] == "audio"


def test_conversation_inserts_deletes_and_names_unknown_items():
    c = Conversation(max_items=3)
    for name in ("a", "b"):
        c.add(Item(name, "user", "text", text=name))
    assert c.add(Item("c", "user", "text"), previous_item_id="a") == "a"
    assert [i.id for i in c] == ["a", "c", "b"]
    assert c.add(Item("d", "system", "text"), previous_item_id="root") is None
    assert [i.id for i in c] == ["d", "c", "b"]  # at capacity the oldest went first
    for call, code in ((lambda: c.get("zz"), "item_not_found"),
                       (lambda: c.add(Item("c", "user", "text")), "duplicate_item_id"),
                       (lambda: c.add(Item("e", "user", "text"), previous_item_id="zz"), "item_not_found")):
        with pytest.raises(ProtocolError) as e:
            call()
        assert e.value.code == code
    c.delete("c")
    assert [i.id for i in c] == ["d", "b"]


def test_playback_clock_paces_and_estimates_what_was_played():
    clock = PlaybackClock()
    for k in range(10):  # ten 100 ms deltas sent at once at t=0: one second ahead
        clock.schedule("x", k * 100, 100, now=0.0)
    assert clock.lead_ms(0.0) == pytest.approx(1000) and clock.lead_ms(0.4) == pytest.approx(600)
    assert clock.played_ms("x", 0.25) == pytest.approx(250) and clock.playing("x", 0.5)
    clock.schedule("x", 1000, 100, now=2.0)  # an underrun: the next delta plays when it arrives
    assert clock.played_ms("x", 1.5) == pytest.approx(1000) and clock.played_ms("x", 2.05) == pytest.approx(1050)
    clock.stop(2.05)
    assert clock.played_ms("x", 5.0) == pytest.approx(1050) and not clock.playing("x", 2.06)


def test_voice_session_config_is_validated():
    from pipelines.config import VoiceSessionConfig
    from serve.config import engine_config

    assert engine_config([], {"realtime": {"voice": {"max_lead_ms": 500,
                                                     "vad": "energy"}}}).realtime.voice.max_lead_ms == 500
    for bad in ({"delta_ms": 5}, {"max_lead_ms": 50}, {"vad": "webrtc"}, {"max_event_bytes": 10}):
        with pytest.raises(ValueError):
            VoiceSessionConfig(**bad)
    with pytest.raises(ValueError, match="unknown key"):
        engine_config([], {"realtime": {"voice": {"lead": 1}}})
    assert json.dumps(TurnDetection().wire())  # the wire form is plain JSON


def test_the_outbox_guard_drops_a_frame_before_it_is_numbered():
    import asyncio

    from realtime.sessions import Journal, Outbox

    async def main():
        out, got, epoch = Outbox(Journal(100, 1 << 20)), [], {"now": 1}

        async def send(frame):
            got.append(json.loads(frame))

        await out.attach(send)
        assert await out.emit({"type": "a"}, guard=lambda: epoch["now"] == 1) == 1
        epoch["now"] = 2  # the fence moved: a frame of epoch 1 is dropped, and the numbering has no gap
        assert await out.emit({"type": "late"}, guard=lambda: epoch["now"] == 1) is None
        assert await out.emit({"type": "b"}) == 2
        return got

    assert [(e["type"], e["server_event_seq"]) for e in asyncio.run(main())] == [("a", 1), ("b", 2)]
