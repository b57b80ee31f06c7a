"""Fences that keep the healthy running (issue 39, item 5), in the shared core.

A message about a room that has not opened at the decode is kept for the open (clock
skew, a full KV pool), but it does not start the room's timeout: a compromised rank
that names future rooms cannot time them out before they arrive (measured in hardware
mode before this: 30 of 40 rooms failed). The timeout runs from the open."""

from __future__ import annotations

from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import OpenRoom, Record, RoomFailed, Tick
from kvstage.shared.layout import Geometry
from kvstage.shared.machine import ProtocolConfig
from kvstage.shared.protocol import ChunkReady, StagingReq, WriterDone

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
