"""Realtime video parts without a server: the wire checks, the overload ladder, the similarity filter,
credits, and fragmented-MP4 segments that concatenate into one stream."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from realtime.sessions import pack_frame
from realtime.video.credits import CreditGate
from realtime.video.degrade import OverloadLadder, next_degradation
from realtime.video.img2img import SimilarityFilter
from realtime.video.protocol import (
    MAX_CREDIT_GRANT,
    ProtocolError,
    VideoSettings,
    parse_control,
    parse_credit,
    parse_event,
    parse_media,
)
from stages.media.video_encode import encode_fmp4_segment
from tests.test_realtime_video_support import decode_mp4


def _code(fn, *args, **kwargs) -> tuple[str, str | None]:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kwargs)
    return info.value.code, info.value.param


def test_settings_refuse_unknown_fields_bad_ranges_and_changing_the_mode():
    s = VideoSettings().apply({"mode": "t2v", "prompt": "a", "size": "64x64", "fps": 24}, created=False)
    assert (s.mode, s.size, s.fps) == ("t2v", "64x64", 24)
    assert _code(s.apply, {"promt": "typo"}, created=True) == ("unknown_field", "session.promt")
    assert _code(s.apply, {"mode": "img2img"}, created=True) == ("immutable_field", "session.mode")
    assert _code(s.apply, {"steps": 0}, created=True) == ("invalid_value", "session.steps")
    assert _code(s.apply, {"steps": True}, created=True) == ("invalid_value", "session.steps")
    assert _code(s.apply, {"fps": float("nan")}, created=True) == ("invalid_value", "session.fps")
    assert _code(s.apply, {"size": "64 by 64"}, created=True) == ("invalid_size", "session.size")
    assert _code(s.apply, {"output_format": "gif"}, created=True) == ("invalid_value", "session.output_format")
    assert _code(s.apply, {"lookahead": 99}, created=True) == ("invalid_value", "session.lookahead")
    assert _code(s.apply, "not an object", created=True) == ("invalid_value", "session")


def test_media_headers_content_types_and_sizes_are_checked_before_decoding():
    header, payload = parse_media(pack_frame({"seq": 3, "content_type": "image/jpeg", "capture_ts_ms": 5.0}, b"x"),
                                  max_bytes=10)
    assert (header.seq, header.capture_ts_ms, payload) == (3, 5.0, b"x")
    assert _code(parse_media, b"\x00\x00", 10)[0] == "invalid_frame"
    assert _code(parse_media, pack_frame({"content_type": "image/jpeg"}, b"x"), 10)[0] == "invalid_frame"
    assert _code(parse_media, pack_frame({"seq": 1, "content_type": "image/gif"}, b"x"), 10) == \
        ("unsupported_content_type", "frame.content_type")
    assert _code(parse_media, pack_frame({"seq": 1, "content_type": "image/png"}, b"x" * 11), 10) == \
        ("media_bytes", "frame")
    assert _code(parse_media, pack_frame({"seq": 1, "content_type": "image/png", "colour": 1}, b"x"), 10) == \
        ("unknown_field", "frame.colour")
    assert _code(parse_media, pack_frame({"seq": -1, "content_type": "image/png"}, b"x"), 10)[1] == "frame.seq"


def test_client_events_credits_and_controls_name_what_is_wrong():
    assert _code(parse_event, "{not json")[0] == "invalid_json"
    assert _code(parse_event, json.dumps({"type": "response.create"}))[0] == "unknown_event"
    assert parse_credit({"type": "credit", "n": 5}, held=0) == 5
    for bad in (-1, 0, MAX_CREDIT_GRANT + 1, "5", 2.5, None):
        assert _code(parse_credit, {"type": "credit", "n": bad}, held=0) == ("invalid_value", "n")
    assert _code(parse_credit, {"type": "credit", "n": 10, "extra": 1}, held=0)[0] == "unknown_field"
    settings = VideoSettings(prompt="a")
    control, after = parse_control({"type": "control", "kind": "prompt", "payload": {"prompt": "b"},
                                    "event_id": "e1"}, settings)
    assert (control.event_id, after.prompt) == ("e1", "b")
    assert _code(parse_control, {"type": "control", "kind": "prompt", "payload": {"prompt": "b", "style": 1}},
                 settings) == ("unknown_field", "payload.style")
    assert _code(parse_control, {"type": "control", "kind": "camera", "payload": {}}, settings)[1] == "kind"
    assert _code(parse_control, {"type": "control", "kind": "params", "payload": {"steps": -2}},
                 settings) == ("invalid_value", "session.steps")


def test_overload_degrades_lookahead_then_steps_then_resolution_and_stops_at_the_floor():
    knobs, state = [], dict(lookahead=3, steps=8, width=128, height=96)
    while (step := next_degradation(min_steps=2, size_factor=8, min_side=32, **state)) is not None:
        knobs.append((step.knob, step.before, step.after))
        if step.knob == "resolution":
            state["width"], state["height"] = map(int, step.after.split("x"))
        else:
            state[step.knob] = step.after
    assert knobs == [("lookahead", 3, 2), ("lookahead", 2, 1), ("steps", 8, 4), ("steps", 4, 2),
                     ("resolution", "128x96", "64x48"), ("resolution", "64x48", "32x32")]


def test_the_ladder_needs_a_window_of_mostly_late_outcomes_then_starts_over():
    ladder = OverloadLadder(window=4)
    assert [ladder.observe(late) for late in (True, False, True, False)] == [False, False, False, True]
    assert [ladder.observe(True) for _ in range(4)] == [False, False, False, True]  # fresh evidence needed
    assert not any(ladder.observe(False) for _ in range(10))


def test_a_long_calm_run_gives_back_one_notch_at_a_time():
    ladder = OverloadLadder(window=2, calm_windows=3)
    assert not any(ladder.observe(False) or ladder.calm() for _ in range(5))
    assert not ladder.observe(False) and ladder.calm()  # 6 on time in a row
    assert not ladder.calm()  # the count starts over: the next notch needs 6 more
    for late in (False, False, True):
        ladder.observe(late)
    assert not ladder.calm()  # a late outcome restarts the count
    assert not any(ladder.observe(False) or ladder.calm() for _ in range(5))
    assert not ladder.observe(False) and ladder.calm()


def test_similarity_filter_skips_near_copies_at_most_max_skip_in_a_row():
    f, frame = SimilarityFilter(), np.full((64, 64, 3), 100, np.uint8)
    other = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    assert [f.skip(frame, 0.98, 2) for _ in range(7)] == [False, True, True, False, True, True, False]
    assert not f.skip(other, 0.98, 2)
    assert not f.skip(frame, None, 2)  # no threshold: the filter is off


def test_credits_are_reserved_before_work_and_refunded_when_it_is_dropped():
    async def main():
        gate = CreditGate(1)
        assert gate.try_reserve() and not gate.try_reserve()
        waiter = asyncio.create_task(gate.reserve(2))
        await asyncio.sleep(0)
        gate.refund()
        await asyncio.sleep(0)
        assert not waiter.done()
        gate.grant(1)
        await asyncio.wait_for(waiter, 5)
        return gate.available

    assert asyncio.run(main()) == 0


def test_fmp4_segments_concatenate_into_one_stream_of_the_same_frames():
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (20, 48, 64, 3), dtype=np.uint8)
    cuts, stream, first_frame, first_fragment = [(0, 9), (9, 17), (17, 20)], b"", 0, 1
    for i, (a, b) in enumerate(cuts):
        seg = encode_fmp4_segment(frames[a:b], 25.0, first_frame=first_frame, first_fragment=first_fragment,
                                  with_init=i == 0)
        assert seg.frames == b - a and seg.fragments == 1 and (seg.data[4:8] == b"ftyp") == (i == 0)
        stream += seg.data
        first_frame, first_fragment = first_frame + seg.frames, first_fragment + seg.fragments
        # What a client holds so far decodes already: every chunk is playable as it arrives.
        assert len(decode_mp4(stream)) == b
    import io

    import av

    with av.open(io.BytesIO(stream)) as container:
        pts = [f.pts for f in container.decode(video=0)]
    assert pts == sorted(pts) and len(set(np.diff(pts))) == 1  # one continuous timeline
    alone = np.concatenate([decode_mp4(encode_fmp4_segment(frames[a:b], 25.0).data) for a, b in cuts])
    assert np.array_equal(decode_mp4(stream), alone)
