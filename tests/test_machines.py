"""The prefill and decode state machines wired through random delivery orders."""

from __future__ import annotations

import pytest
from protocol_harness import World, echo

from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import AbortRoom, OpenRoom, RoomFailed, Scatter, ScatterDone, Send
from kvstage.shared.invariants import check_records
from kvstage.shared.layout import Geometry
from kvstage.shared.machine import ProtocolConfig
from kvstage.shared.protocol import Abort, ChunkReady, StagingReq, StagingRsp, WriterDone


def geo(P, D, H, **kw):
    base = dict(layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    base.update(kw)
    return Geometry(P, D, H, **base)


CASES = [
    (2, 1, 8),
    (4, 2, 8),
    (8, 2, 8),
    (1, 2, 8),
    (2, 8, 8),
    (16, 4, 8),
    (2, 8, 4),
    (4, 4, 8),
    (8, 2, 2),
]


def _check_clean_end(w: World, rooms: int) -> None:
    assert not w.violations, w.violations[:3]
    found = check_records(w.records, w.config.path)
    assert not found, "\n".join(v.format() for v in found[:3])
    for d in w.decode:
        assert d.rooms_done == rooms, w.failed
        assert d.ring.empty and d.ring.watermark == d.ring.head, "leak: ring not empty at the end"
        assert d.live_rooms == 0
    for p in w.prefill:
        assert p.rooms_done == rooms and p.live_rooms == 0
    # exactly once: every chunk of every room scattered once on every decode rank
    for d in range(len(w.decode)):
        for room in range(rooms):
            n = len(
                w.geometry.chunks(-(-(37 + 13 * room - 4 * (room % 2)) // w.geometry.page_size))
            )
            for c in range(n):
                assert w.scattered[d].get((room, c)) == 1, (d, room, c)


@pytest.mark.parametrize("P,D,H", CASES)
@pytest.mark.parametrize("seed", range(8))
def test_random_delivery_with_duplicates(P, D, H, seed):
    g = geo(P, D, H)
    w = World(g, pool_bytes=g.chunk_bytes() * 2, seed=seed, dup_p=0.25)
    for room in range(6):
        w.open_room(room, prompt_tokens=37 + 13 * room, prefix_tokens=4 * (room % 2))
    w.run()
    _check_clean_end(w, 6)
    # the watermark views at every prefill are monotone by construction; check the trace
    wm = {}
    for r in w.records:
        if r.role == "decode" and r.phase == "watermark":
            assert (r.wm_round, r.wm_tail) >= wm.get(r.rank, (0, 0))
            wm[r.rank] = (r.wm_round, r.wm_tail)


@pytest.mark.parametrize("seed", range(5))
def test_pool_of_exactly_one_chunk_completes(seed):
    g = geo(8, 2, 8)
    w = World(g, pool_bytes=g.chunk_bytes(), seed=seed, dup_p=0.1)
    for room in range(5):
        w.open_room(room, prompt_tokens=37 + 13 * room, prefix_tokens=4 * (room % 2))
    w.run()
    _check_clean_end(w, 5)


@pytest.mark.parametrize("seed", range(4))
def test_slice_path(seed):
    g = geo(4, 2, 8)
    w = World(g, pool_bytes=0, seed=seed, dup_p=0.2, config=ProtocolConfig(path="slice"))
    for room in range(4):
        w.open_room(room, prompt_tokens=37 + 13 * room, prefix_tokens=4 * (room % 2))
    w.run()
    for d in w.decode:
        assert d.rooms_done == 4 and d.scatters_issued == 0
    slice_rows = [r for r in w.records if r.phase == "slice_write"]
    assert slice_rows and all(
        r.requests == g.slice_requests(0, 0, 4)
        for r in slice_rows
        if r.bytes == g.block_bytes(16, 2)
    )


def test_oversized_chunk_falls_back_to_slice():
    g = geo(2, 1, 8)
    pool = g.region_bytes(2)  # smaller than a full chunk (4 pages), so full chunks are OVERSIZED
    w = World(g, pool_bytes=pool, seed=1)
    w.open_room(0, prompt_tokens=4 * 4 * 2 + 8)  # two full chunks + one of 2 pages
    w.run()
    assert w.decode[0].rooms_done == 1 and w.decode[0].ring.empty
    phases = [r.phase for r in w.records if r.role == "prefill"]
    assert phases.count("slice_write") == 4 and phases.count("write") == 2


def test_duplicate_chunk_ready_cannot_trigger_early_scatter():
    g = geo(4, 1, 8)
    m = DecodeMachine(0, g, g.chunk_bytes() * 4)
    m.handle(OpenRoom(0, prompt_tokens=16), 0.0)
    for p in range(4):
        m.handle(StagingReq(0, 0, 4, p, 0), 0.0)
    out = []
    for _ in range(5):  # writer 0 says ready five times
        out += m.handle(echo(m, ChunkReady(0, 0, 0, 4, 0, 0, 0)), 0.1)
    assert not any(isinstance(a, Scatter) for a in out)
    for p in (1, 2, 3):
        out += m.handle(echo(m, ChunkReady(0, 0, 0, 4, p, p, 0)), 0.2)
    assert sum(isinstance(a, Scatter) for a in out) == 1


def test_forged_writer_identity_is_dropped():
    g = geo(4, 2, 8)
    m = DecodeMachine(0, g, g.chunk_bytes() * 4)
    m.handle(OpenRoom(0, prompt_tokens=16), 0.0)
    m.handle(StagingReq(0, 0, 4, 0, 0), 0.0)
    # prefill_rank 0 claims to be writer 1; prefill_rank 3 is not a writer of decode rank 0 at all
    m.handle(ChunkReady(0, 0, 0, 4, 0, 1, 0), 0.1)
    m.handle(ChunkReady(0, 0, 0, 4, 3, 1, 0), 0.1)
    assert m.dropped == 2
    assert m._rooms[0].arrived.get(0, set()) == set()


def test_abort_releases_everything_and_late_messages_are_ignored():
    g = geo(2, 1, 8)
    m = DecodeMachine(0, g, g.chunk_bytes() * 4)
    m.handle(OpenRoom(0, prompt_tokens=64), 0.0)
    for c in range(4):
        for p in (0, 1):
            m.handle(StagingReq(0, c, 4, p, 0), 0.0)
    for p in (0, 1):
        m.handle(echo(m, ChunkReady(0, 0, 0, 4, p, p, 0)), 0.1)  # chunk 0 scattering
    assert m.ring.live_count == 4
    out = m.handle(echo(m, Abort(0, 1, 0, "user cancelled")), 0.2)
    assert any(isinstance(a, RoomFailed) for a in out)
    assert any(
        isinstance(a, Send) and isinstance(a.msg, Abort) and a.msg.prefill_rank == 0 for a in out
    )
    # writer 0 may still have writes in flight: its regions stay out of reuse
    assert m.ring.live_count == 4
    m.handle(echo(m, Abort(0, 0, 0, "drained")), 0.25)  # writer 0 confirms
    assert m.ring.live_count == 1  # the region being scattered waits for its scatter
    m.handle(ScatterDone(0, 0), 0.3)
    assert m.ring.empty
    before = m.ring.watermark
    m.handle(ChunkReady(0, 1, 4, 4, 0, 0, 0), 0.4)
    m.handle(StagingReq(0, 2, 4, 0, 0), 0.4)
    m.handle(WriterDone(0, 4, 0, 0, 0), 0.4)
    assert m.ring.empty and m.live_rooms == 0 and m.ring.watermark == before


def test_timeout_fails_with_reason_and_releases():
    g = geo(2, 1, 8)
    cfg = ProtocolConfig(room_timeout_s=5.0)
    m = DecodeMachine(0, g, g.chunk_bytes() * 4, cfg)
    m.handle(OpenRoom(0, prompt_tokens=32), 0.0)
    m.handle(StagingReq(0, 0, 4, 0, 0), 0.0)
    m.handle(StagingReq(0, 0, 4, 1, 0), 0.0)
    m.handle(echo(m, ChunkReady(0, 0, 0, 4, 0, 0, 0)), 1.0)
    assert m.next_deadline == 5.0
    from kvstage.shared.events import Tick

    out = m.handle(Tick(), 5.0)
    failed = [a for a in out if isinstance(a, RoomFailed)]
    assert failed and "timed out" in failed[0].reason and "chunk 0: prefill [1]" in failed[0].reason
    # quarantined until both writers confirm (or the grace passes)
    assert m.ring.live_count == 1
    m.handle(echo(m, Abort(0, 0, 0, "drained")), 5.1)
    m.handle(echo(m, Abort(0, 1, 0, "drained")), 5.1)
    assert m.ring.empty


def test_misaligned_prefix_fails_on_both_sides():
    g = geo(2, 1, 8)
    w = World(g, pool_bytes=g.chunk_bytes() * 2, seed=3)
    w.open_room(0, prompt_tokens=40, prefix_tokens=3)
    w.run()
    assert all("not a multiple of page_size" in r for f in w.failed.values() for r in f.values())
    assert len(w.failed) == 3  # both prefill ranks and the decode rank
    assert w.decode[0].ring.empty


def test_prefill_timeout_names_the_wait():
    from kvstage.shared.events import Tick
    from kvstage.shared.prefill import PrefillMachine

    g = geo(2, 1, 8)
    p = PrefillMachine(0, g, ProtocolConfig(room_timeout_s=2.0))
    p.handle(OpenRoom(0, prompt_tokens=32), 0.0)
    out = p.handle(Tick(), 2.5)
    reason = next(a.reason for a in out if isinstance(a, RoomFailed))
    assert "STAGING_RSP from decode rank 0" in reason and "forward of chunks" in reason
    # the decode is told, so it can release what it reserved
    assert any(isinstance(a, Send) and isinstance(a.msg, Abort) for a in out)


def test_local_abort_on_prefill_notifies_decode():
    from kvstage.shared.prefill import PrefillMachine

    g = geo(1, 2, 8)
    p = PrefillMachine(0, g)
    p.handle(OpenRoom(0, prompt_tokens=32), 0.0)
    out = p.handle(AbortRoom(0, "test"), 0.1)
    assert {a.dest.rank for a in out if isinstance(a, Send)} == {0, 1}


def test_stale_watermark_and_duplicate_rsp_are_harmless():
    from kvstage.shared.events import ChunkComputed, Gather
    from kvstage.shared.prefill import PrefillMachine
    from kvstage.shared.protocol import Watermark

    g = geo(1, 1, 8)
    p = PrefillMachine(0, g)
    p.handle(OpenRoom(0, prompt_tokens=16), 0.0)
    p.handle(ChunkComputed(0, 0), 0.0)
    p.handle(Watermark(1, 10, 0, 0), 0.0)
    p.handle(Watermark(0, 99, 0, 0), 0.0)  # older: ignored
    assert tuple(p.watermark_view(0)) == (1, 10)
    size = g.region_bytes(4)
    out = p.handle(
        StagingRsp(0, 0, 0, 4, size, False, 0, 0), 0.1
    )  # round 4: needs wm round 3 tail >= size
    assert not any(isinstance(a, Gather) for a in out)
    out = p.handle(StagingRsp(0, 0, 0, 4, size, False, 0, 0), 0.1)
    assert not out or not any(isinstance(a, Gather) for a in out)
    out = p.handle(Watermark(4, 0, 0, 0), 0.2)
    assert sum(isinstance(a, Gather) for a in out) == 1


def test_quarantine_released_after_grace_without_confirmation():
    from kvstage.shared.events import Tick

    g = geo(2, 1, 8)
    m = DecodeMachine(0, g, g.chunk_bytes() * 4, ProtocolConfig(abort_grace_s=2.0))
    m.handle(OpenRoom(0, prompt_tokens=32), 0.0)
    for p in (0, 1):
        m.handle(StagingReq(0, 0, 4, p, 0), 0.0)
    m.handle(AbortRoom(0, "test"), 1.0)
    assert m.ring.live_count == 1
    m.handle(Tick(), 2.9)
    assert m.ring.live_count == 1
    m.handle(Tick(), 3.0)
    assert m.ring.empty


def test_prefill_abort_waits_for_in_flight_writes():
    from kvstage.shared.events import ChunkComputed, Gather, GatherDone, Write, WriteDone
    from kvstage.shared.prefill import PrefillMachine
    from kvstage.shared.protocol import Watermark

    g = geo(1, 1, 8)
    p = PrefillMachine(0, g)
    p.handle(OpenRoom(0, prompt_tokens=16), 0.0)
    p.handle(Watermark(0, 0, 0, 0), 0.0)
    p.handle(ChunkComputed(0, 0), 0.0)
    out = p.handle(StagingRsp(0, 0, 0, 0, g.region_bytes(4), False, 0, 0), 0.1)
    assert any(isinstance(a, Gather) for a in out)
    out = p.handle(GatherDone(0, 0, 0), 0.2)
    assert any(isinstance(a, Write) for a in out)
    out = p.handle(AbortRoom(0, "user"), 0.3)  # the write is in flight
    assert any(isinstance(a, RoomFailed) for a in out)
    assert not any(isinstance(a, Send) and isinstance(a.msg, Abort) for a in out)
    out = p.handle(WriteDone(0, 0, 0), 0.4)
    assert any(isinstance(a, Send) and isinstance(a.msg, Abort) for a in out)


@pytest.mark.parametrize("seed", range(6))
def test_lost_rsp_and_watermark_recovered_by_retry(seed):
    """Drop 30% of STAGING_RSP and WATERMARK messages: retries bring every room home."""
    import random as _random

    from kvstage.shared.protocol import Watermark

    g = geo(4, 2, 8)
    cfg = ProtocolConfig(retry_s=0.05, room_timeout_s=100.0)
    w = World(g, pool_bytes=g.chunk_bytes() * 2, seed=seed, config=cfg)
    lose = _random.Random(seed)
    for room in range(5):
        w.open_room(room, prompt_tokens=37 + 13 * room, prefix_tokens=4 * (room % 2))
    w.run(
        drop=lambda role, rank, ev: isinstance(ev, (StagingRsp, Watermark)) and lose.random() < 0.3,
        until_quiet=True,
    )
    _check_clean_end(w, 5)
    retries = [r for r in w.records if r.phase == "req" and r.detail.startswith("retry")]
    assert retries, "nothing was lost?"


def test_lost_chunk_ready_is_resent_and_the_room_finishes():
    """CHUNK_READY is acknowledged: one that is lost is sent again, and the room ends done."""
    g = geo(2, 1, 8)
    cfg = ProtocolConfig(room_timeout_s=2.0, abort_grace_s=0.5)
    w = World(g, pool_bytes=g.chunk_bytes() * 10, seed=1, config=cfg)
    w.open_room(0, prompt_tokens=40)
    w.open_room(1, prompt_tokens=40)
    dropped = []

    def drop(role, rank, ev):
        if isinstance(ev, ChunkReady) and ev.room == 0 and not dropped:
            dropped.append(ev)
            return True
        return False

    w.run(drop=drop, until_quiet=True)
    assert dropped and w.decode[0].rooms_done == 2 and w.decode[0].rooms_failed == 0
    assert all(p.rooms_done == 2 for p in w.prefill)
    assert w.decode[0].ring.empty
    assert not check_records(w.records)


def test_chunk_ready_never_arriving_fails_room_with_reason_and_frees():
    g = geo(2, 1, 8)
    cfg = ProtocolConfig(room_timeout_s=1.0, abort_grace_s=0.5)
    # a pool big enough that room 1 is not stuck behind room 0's pinned region
    w = World(g, pool_bytes=g.chunk_bytes() * 10, seed=1, config=cfg)
    w.open_room(0, prompt_tokens=40)
    w.open_room(1, prompt_tokens=40)

    def drop(role, rank, ev):  # every copy of writer 0's CHUNK_READY for room 0 is lost
        return isinstance(ev, ChunkReady) and ev.room == 0 and ev.writer == 0

    w.run(drop=drop, until_quiet=True)
    assert w.decode[0].rooms_done == 1 and w.decode[0].rooms_failed == 1
    reason = w.failed[("decode", 0)][0]
    assert ("CHUNK_READY" in reason or "READY_ACK" in reason) and "timed out" in reason
    assert w.decode[0].ring.empty
    assert not check_records(w.records)


def test_dead_writer_fails_its_rooms_and_is_unsubscribed():
    from kvstage.shared.events import PeerLost, Tick

    g = geo(2, 1, 8)
    m = DecodeMachine(0, g, g.chunk_bytes() * 4, ProtocolConfig(abort_grace_s=1.0))
    m.handle(OpenRoom(0, prompt_tokens=32), 0.0)
    for p in (0, 1):
        m.handle(StagingReq(0, 0, 4, p, 0), 0.0)
    out = m.handle(PeerLost("prefill", 1, "process exited"), 0.5)
    failed = [a for a in out if isinstance(a, RoomFailed)]
    assert failed and "prefill rank 1 is gone" in failed[0].reason
    assert not any(isinstance(a, Send) and a.dest.rank == 1 for a in out)
    assert 1 not in m._subscribers
    assert not m._subscribers  # the only room failed: no writer has a live room here
    m.handle(echo(m, Abort(0, 0, 0, "drained")), 0.6)  # the live writer confirms
    assert not m.ring.empty  # the lost one may be hung, not dead: fenced by the grace
    m.handle(Tick(), 1.5)
    assert m.ring.empty
    out = m.handle(OpenRoom(1, prompt_tokens=32), 1.6)  # new rooms fail at once
    assert any(isinstance(a, RoomFailed) and "gone" in a.reason for a in out)


def test_a_writer_with_no_live_room_is_not_told_of_watermark_moves():
    """Two prefill instances share one decode ring. Once instance 0's room is done,
    the ring's moves go to instance 1's writer only; instance 0's next STAGING_REQ
    subscribes it again, with the current watermark after the RSP (so the RSP's round
    makes that watermark plausible)."""
    from kvstage.shared.cluster import Sessions
    from kvstage.shared.protocol import Watermark

    g = geo(1, 1, 8)
    ss = Sessions(g, prefill_instances=2, decode_instances=1)
    ss.routes.update({0: (0, 0), 1: (1, 0), 2: (0, 0)})
    m = DecodeMachine(0, g, g.chunk_bytes() * 4, sessions=ss)

    def told(out):
        return [a.dest.rank for a in out if isinstance(a, Send) and isinstance(a.msg, Watermark)]

    for room, p in ((0, 0), (1, 1)):
        m.handle(OpenRoom(room, prompt_tokens=16), 0.0)
        out = m.handle(StagingReq(room, 0, 4, p, 0), 0.0)
        assert [type(a.msg) for a in out if isinstance(a, Send)] == [StagingRsp, Watermark]
    assert list(m._subscribers) == [0, 1]
    m.handle(echo(m, ChunkReady(0, 0, 0, 4, 0, 0, 0)), 0.1)
    m.handle(echo(m, WriterDone(0, 1, 0, 0, 0)), 0.1)
    out = m.handle(ScatterDone(0, 0), 0.2)  # room 0 done, its region freed: the ring moved
    assert told(out) == [1]
    assert list(m._subscribers) == [1]
    m.handle(OpenRoom(2, prompt_tokens=16), 0.3)
    out = m.handle(StagingReq(2, 0, 4, 0, 0), 0.3)
    sends = [a.msg for a in out if isinstance(a, Send)]
    assert [type(x) for x in sends] == [StagingRsp, Watermark]
    assert (sends[1].round, sends[1].tail) == tuple(m.ring.watermark)
    assert list(m._subscribers) == [1, 0]
