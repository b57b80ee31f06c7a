"""An ABORT that comes before its room opened at the decode is remembered (issue 25,
item 3): the room fails at once, releases what it would hold, and the open that
comes later neither waits for the room's timeout nor reserves anything."""

from __future__ import annotations

from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import OpenRoom, RoomFailed, Send, Tick
from kvstage.shared.layout import Geometry
from kvstage.shared.machine import ProtocolConfig
from kvstage.shared.protocol import Abort, StagingReq, StagingRsp


def _machine() -> DecodeMachine:
    g = Geometry(2, 1, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    return DecodeMachine(0, g, g.chunk_bytes() * 4, ProtocolConfig(room_timeout_s=30.0))


def test_an_abort_before_anything_else_fails_the_room_at_once():
    m = _machine()
    out = m.handle(Abort(0, 1, 0, "failed at the writer"), 0.1)
    failed = [a for a in out if isinstance(a, RoomFailed)]
    assert failed and "aborted by prefill rank 1" in failed[0].reason
    # the other writer is told; the one that aborted is not told again
    told = [a.msg.prefill_rank for a in out if isinstance(a, Send) and isinstance(a.msg, Abort)]
    assert told == [0]
    assert m.is_finished(0) and m.live_rooms == 0 and m.settled
    # the open that comes later reserves nothing, and the other writer's request is
    # answered with the abort, not a region
    m.handle(OpenRoom(0, prompt_tokens=32), 0.2)
    out = m.handle(StagingReq(0, 0, 4, 0, 0), 0.3)
    assert not any(isinstance(a, Send) and isinstance(a.msg, StagingRsp) for a in out)
    assert any(isinstance(a, Send) and isinstance(a.msg, Abort) for a in out)
    assert m.ring.empty and m.live_rooms == 0
    assert not [a for a in m.handle(Tick(), 31.0) if isinstance(a, RoomFailed)]


def test_an_abort_after_an_early_request_fails_the_room_as_before():
    m = _machine()
    m.handle(StagingReq(0, 0, 4, 0, 0), 0.0)  # kept for the open
    out = m.handle(Abort(0, 1, 0, "failed at the writer"), 0.1)
    assert any(isinstance(a, RoomFailed) for a in out)
    assert m.ring.empty and m.live_rooms == 0


def test_an_abort_from_no_writer_of_the_room_is_dropped():
    m = _machine()
    m.handle(Abort(0, 3, 0, "not a writer"), 0.1)
    assert m.dropped == 1 and not m.is_finished(0)
