"""The session plumbing voice and video share: numbered events, the replay journal, admission and expiry."""

import asyncio

import pytest

from realtime.sessions import Journal, Outbox, SessionRefused, SessionRegistry, pack_frame, unpack_frame


def test_journal_replays_after_a_seq_and_reports_a_gap():
    j = Journal(max_events=3, max_bytes=1 << 20)
    for i in range(5):
        j.add(j.next_seq(), f"e{i + 1}")
    assert j.after(5) == []
    assert j.after(3) == ["e4", "e5"]
    assert j.after(2) == ["e3", "e4", "e5"]
    assert j.after(1) is None  # e2 fell out: the client must resync
    j.ack(4)
    assert j.after(4) == ["e5"] and j.after(3) is None


def test_journal_is_bounded_by_bytes():
    j = Journal(max_events=100, max_bytes=10)
    for _ in range(4):
        j.add(j.next_seq(), "abcd")
    assert j.after(2) == ["abcd", "abcd"] and j.after(1) is None


def test_outbox_numbers_journals_while_detached_and_replays_once():
    async def main():
        out, got = Outbox(Journal(100, 1 << 20)), []

        async def send(frame):
            got.append(frame)

        await out.attach(send)
        await out.emit({"type": "a"})
        out.detach()
        await out.emit({"type": "b"})
        await out.emit({"type": "c"})
        assert len(got) == 1
        assert await out.attach(send, last_seq=1)
        await out.emit({"type": "d"})
        return got

    got = asyncio.run(main())
    assert [f.split('"type":"')[1][0] for f in got] == ["a", "b", "c", "d"]
    assert all(f'"server_event_seq":{i + 1}' in f for i, f in enumerate(got))


def test_outbox_detaches_when_the_socket_fails():
    async def main():
        out = Outbox(Journal(100, 1 << 20))

        async def broken(frame):
            raise ConnectionError("gone")

        await out.attach(broken)
        await out.emit({"type": "a"})
        return out

    out = asyncio.run(main())
    assert not out.attached and out.journal.after(0) is not None


def test_binary_frames_round_trip_and_bad_headers_are_named():
    header, payload = unpack_frame(pack_frame({"seq": 3, "content_type": "image/jpeg"}, b"\xff\xd8data"))
    assert header == {"seq": 3, "content_type": "image/jpeg"} and payload == b"\xff\xd8data"
    for bad in (b"\x00\x00", b"\x00\x00\x00\x09{}", b"\x00\x00\x00\x02[]", b"\x00\x00\x00\x02\xff\xfe"):
        with pytest.raises(ValueError):
            unpack_frame(bad)


class _Session:
    def __init__(self, registry):
        self.id, self.resume_token = registry.new_ids()
        self.outbox = Outbox(Journal(10, 1000))
        self.closed = None

    async def close(self, reason):
        self.closed = reason


def test_registry_refuses_at_capacity_resumes_and_reaps():
    now = [0.0]
    reg = SessionRegistry("voice", 2, resume_grace_s=5, idle_timeout_s=60, max_duration_s=100, clock=lambda: now[0])
    a, b, c = _Session(reg), _Session(reg), _Session(reg)
    reg.admit(a)
    reg.admit(b)
    with pytest.raises(SessionRefused) as refused:
        reg.admit(c)
    assert refused.value.code == "session_limit_reached" and len(reg) == 2  # nobody was evicted
    reg.detach(a.id)
    with pytest.raises(SessionRefused) as bad:
        reg.resume(a.id, "wrong")
    assert bad.value.code == "invalid_resume_token"
    assert reg.resume(a.id, a.resume_token) is a
    reg.detach(a.id)
    now[0] = 6.0
    assert asyncio.run(reg.reap()) == [a.id] and a.closed == "resume_grace_expired"
    with pytest.raises(SessionRefused) as gone:
        reg.resume(a.id, a.resume_token)
    assert gone.value.code == "session_expired"
    now[0] = 70.0
    assert reg.expired() == [(b.id, "idle_timeout")]
    reg.touch(b.id)
    now[0] = 101.0
    assert reg.expired() == [(b.id, "max_duration")]
