"""Fences that keep the healthy running (issue 39, item 5), in the shared core.

A message about a room that has not opened at the decode is kept for the open (clock
skew, a full KV pool), but it does not start the room's timeout: a compromised rank
that names future rooms cannot time them out before they arrive (measured in hardware
mode before this: 30 of 40 rooms failed). The timeout runs from the open.

A lost writer's regions stay quarantined for the whole grace and may hold the ring's
watermark back; the rooms of healthy writers sharing the ring then cannot move. Their
clocks stop meanwhile at the decode (measured in hardware mode before this: 34 of 80
rooms done against 45 before the quarantine), and a prefill leaves the timing out of
a room that waits for a decode's watermark to that decode."""

from __future__ import annotations

from protocol_harness import echo

from kvstage.shared.cluster import Sessions
from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import (
    ChunkComputed,
    OpenRoom,
    PeerLost,
    Record,
    RoomFailed,
    ScatterDone,
    Send,
    Tick,
)
from kvstage.shared.layout import Geometry
from kvstage.shared.machine import ProtocolConfig
from kvstage.shared.prefill import PrefillMachine
from kvstage.shared.prefill_state import ChunkState
from kvstage.shared.protocol import Abort, ChunkReady, StagingReq, StagingRsp, WriterDone

G = Geometry(2, 1, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
CFG = ProtocolConfig(room_timeout_s=30.0)


def _failed(out) -> list[RoomFailed]:
    return [a for a in out if isinstance(a, RoomFailed)]


def test_messages_before_the_open_do_not_start_the_rooms_timeout():
    m = DecodeMachine(0, G, G.chunk_bytes() * 4, CFG)
    # what an insider sends for rooms that have not arrived: kept, no clock started
    for room in range(5, 9):
        m.handle(StagingReq(room, 0, 4, 0, 0), 0.0)
        m.handle(ChunkReady(room, 0, 0, 4, 1, 1, 0), 0.0)
        m.handle(WriterDone(room, 1, 0, 0, 0), 0.0)
    assert m.next_deadline is None
    assert not _failed(m.handle(Tick(), 31.0)) and m.live_rooms == 4
    out = m.handle(OpenRoom(5, prompt_tokens=32), 40.0)
    assert [a.record.phase for a in out if isinstance(a, Record)][0] == "room_open"
    assert not _failed(m.handle(Tick(), 69.9))
    (failed,) = _failed(m.handle(Tick(), 70.1))  # 30 s after its open, not after the message
    assert failed.room == 5 and "timed out" in failed.reason
    assert not m.is_finished(6) and m.live_rooms == 3


def test_an_open_room_keeps_its_timeout():
    m = DecodeMachine(0, G, G.chunk_bytes() * 4, CFG)
    m.handle(OpenRoom(1, prompt_tokens=32), 1.0)
    m.handle(StagingReq(1, 0, 4, 0, 0), 2.0)
    assert not _failed(m.handle(Tick(), 30.9))
    assert [f.room for f in _failed(m.handle(Tick(), 31.1))] == [1]


# --- a lost writer's fence and the healthy rooms sharing the ring --------------------------


def _two_instances(timeout_s: float) -> DecodeMachine:
    """One decode ring shared by two prefill instances of TP1: room 0 is prefill 0's,
    room 1 prefill 1's."""

    g = Geometry(1, 1, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    ss = Sessions(g, prefill_instances=2, decode_instances=1)
    ss.routes.update({0: (0, 0), 1: (1, 0)})
    cfg = ProtocolConfig(room_timeout_s=timeout_s, abort_grace_s=5.0)
    m = DecodeMachine(0, g, g.chunk_bytes() * 4, cfg, sessions=ss)
    for room, p in ((0, 0), (1, 1)):
        m.handle(OpenRoom(room, prompt_tokens=16), 0.0)
        m.handle(StagingReq(room, 0, 4, p, 0), 0.0)
    return m


def test_a_healthy_writers_room_keeps_its_time_while_a_lost_writer_is_fenced():
    """Prefill 0 is lost at 1 s: its room's region stays quarantined for the grace (5 s),
    holding the ring back. Room 1 (a healthy writer's, timeout 3 s) does not time out
    meanwhile; at the release it gets back the 5 s it spent behind the fence."""

    m = _two_instances(timeout_s=3.0)
    (lost,) = _failed(m.handle(PeerLost("prefill", 0, "silent"), 1.0))
    assert lost.room == 0 and m._quarantine[0].fenced
    assert not _failed(m.handle(Tick(), 3.5)) and m.live_rooms == 1
    m.handle(Tick(), 6.0)  # the grace ends: the fence is released, room 1's clock moves on
    assert not m._quarantine and not _failed(m.handle(Tick(), 7.9))
    m.handle(echo(m, ChunkReady(1, 0, 0, 4, 1, 0, 0)), 7.95)
    m.handle(echo(m, WriterDone(1, 1, 1, 0, 0)), 7.95)
    m.handle(ScatterDone(1, 0), 7.99)
    assert m.rooms_done == 1 and m.live_rooms == 0


def test_a_stuck_room_still_times_out_after_the_fence():

    m = _two_instances(timeout_s=3.0)
    m.handle(PeerLost("prefill", 0, "silent"), 1.0)
    m.handle(Tick(), 6.0)
    assert not _failed(m.handle(Tick(), 7.9))
    (failed,) = _failed(m.handle(Tick(), 8.1))  # 3 s + the 5 s it spent behind the fence
    assert failed.room == 1 and "timed out" in failed.reason


def test_without_a_fence_the_clock_runs():
    m = _two_instances(timeout_s=3.0)
    (failed,) = [f for f in _failed(m.handle(Tick(), 3.1)) if f.room == 1]
    assert "timed out" in failed.reason


def _waiting_prefill():
    """A prefill whose only chunk was granted a region of the ring's next round: it
    waits for the decode's watermark (WM_WAIT)."""

    g = Geometry(1, 1, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    p = PrefillMachine(0, g, ProtocolConfig(room_timeout_s=3.0), g.chunk_bytes() * 4)
    p.handle(OpenRoom(0, prompt_tokens=16), 0.0)
    p.handle(ChunkComputed(0, 0), 0.1)
    p.handle(StagingRsp(0, 0, 0, 1, g.region_bytes(4), False, 0, 0, nonce=7), 0.2)
    assert p._rooms[0].targets[0].chunks_in(ChunkState.WM_WAIT) == [0]
    return p


def test_a_prefill_leaves_a_room_behind_the_watermark_to_the_decode():
    """The decode times out a room that waits for its watermark (its clock stops behind
    a fence); the prefill keeps asking it, and fails the room at its ABORT."""

    p = _waiting_prefill()
    out = p.handle(Tick(), 3.5)
    assert not _failed(out) and p.live_rooms == 1
    assert [a.msg for a in out if isinstance(a, Send) and isinstance(a.msg, StagingReq)]
    (failed,) = _failed(p.handle(Abort(0, 0, 0, "timed out at the decode", 0), 4.0))
    assert "timed out at the decode" in failed.reason


def test_a_prefill_room_stuck_elsewhere_times_out_at_the_prefill():

    g = Geometry(1, 1, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    p = PrefillMachine(0, g, ProtocolConfig(room_timeout_s=3.0), g.chunk_bytes() * 4)
    p.handle(OpenRoom(0, prompt_tokens=16), 0.0)
    p.handle(ChunkComputed(0, 0), 0.1)  # no STAGING_RSP ever comes
    (failed,) = _failed(p.handle(Tick(), 3.1))
    assert "STAGING_RSP" in failed.reason
