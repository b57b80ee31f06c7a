"""An ABORT that comes before its room opened at the decode (issue 25, item 3).

A writer that fails a room before the decode's BOOTSTRAP reached it has no room nonce
to echo (shared/capability.py), so its ABORT proves nothing and is dropped: a forged
one could otherwise fail any room before it opens. The writer remembers that the room
failed; the decode's BOOTSTRAP, sent at the open, is answered with the ABORT and its
nonce. So the room fails one message after it opens, never after its timeout, and
releases what it would hold."""

from __future__ import annotations

from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import AbortRoom, OpenRoom, RoomFailed, Send, Tick
from kvstage.shared.layout import Geometry
from kvstage.shared.machine import ProtocolConfig
from kvstage.shared.prefill import PrefillMachine
from kvstage.shared.protocol import Abort, Bootstrap, StagingReq, StagingRsp

G = Geometry(2, 1, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
CFG = ProtocolConfig(room_timeout_s=30.0)


def _machine() -> DecodeMachine:
    return DecodeMachine(0, G, G.chunk_bytes() * 4, CFG)


def _sent(out, cls) -> list:
    return [a.msg for a in out if isinstance(a, Send) and isinstance(a.msg, cls)]


def test_an_abort_without_the_room_nonce_changes_nothing():
    m = _machine()
    m.handle(Abort(0, 1, 0, "failed at the writer"), 0.1)
    assert m.dropped == 1 and not m.is_finished(0)
    m.handle(Abort(0, 1, 0, "a guessed nonce", nonce=12345), 0.1)
    assert m.dropped == 2 and not m.is_finished(0)


def test_a_writer_that_failed_before_the_bootstrap_fails_the_room_at_the_open():
    d = _machine()
    p = PrefillMachine(1, G, CFG)
    p.handle(OpenRoom(0, prompt_tokens=32), 0.0)
    out = p.handle(AbortRoom(0, "failed at the writer"), 0.05)
    (abort,) = _sent(out, Abort)
    assert abort.nonce == 0  # it never had the BOOTSTRAP
    assert not [a for a in d.handle(abort, 0.1) if isinstance(a, RoomFailed)]
    # the open sends the BOOTSTRAP; the writer answers with its ABORT, now proven
    out = d.handle(OpenRoom(0, prompt_tokens=32), 0.2)
    (boot,) = [b for b in _sent(out, Bootstrap) if b.prefill_rank == 1]
    (abort,) = _sent(p.handle(boot, 0.25), Abort)
    assert abort.nonce == boot.nonce != 0
    out = d.handle(abort, 0.3)
    failed = [a for a in out if isinstance(a, RoomFailed)]
    assert failed and "aborted by prefill rank 1" in failed[0].reason
    # the other writer is told; the one that aborted is not told again
    assert [a.prefill_rank for a in _sent(out, Abort)] == [0]
    # its request is answered with the abort, not a region
    out = d.handle(StagingReq(0, 0, 4, 0, 0), 0.4)
    assert not _sent(out, StagingRsp) and _sent(out, Abort)
    assert d.ring.empty and d.live_rooms == 0
    assert not [a for a in d.handle(Tick(), 31.0) if isinstance(a, RoomFailed)]


def test_an_unproven_abort_of_an_open_room_is_answered_with_the_bootstrap():
    m = _machine()
    m.handle(StagingReq(0, 0, 4, 0, 0), 0.0)  # kept for the open
    m.handle(OpenRoom(0, prompt_tokens=32), 0.05)
    out = m.handle(Abort(0, 1, 0, "failed at the writer"), 0.1)
    assert not [a for a in out if isinstance(a, RoomFailed)] and m.live_rooms == 1
    (boot,) = _sent(out, Bootstrap)
    assert boot.prefill_rank == 1 and boot.nonce
    out = m.handle(Abort(0, 1, 0, "failed at the writer", boot.nonce), 0.2)
    assert [a for a in out if isinstance(a, RoomFailed)]


def test_an_abort_from_no_writer_of_the_room_is_dropped():
    m = _machine()
    m.handle(Abort(0, 3, 0, "not a writer"), 0.1)
    assert m.dropped == 1 and not m.is_finished(0)
