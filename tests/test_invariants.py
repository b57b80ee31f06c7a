"""The invariant checker catches deliberately broken protocols (it has teeth)."""

from __future__ import annotations

from protocol_harness import World

from kvstage.shared import decode as decode_mod
from kvstage.shared import prefill as prefill_mod
from kvstage.shared.invariants import check_records
from kvstage.shared.layout import Geometry


def _run(seed=0, rooms=5, pool_chunks=1, P=4, D=1):
    g = Geometry(P, D, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    w = World(g, pool_bytes=g.chunk_bytes() * pool_chunks, seed=seed)
    for room in range(rooms):
        w.open_room(room, prompt_tokens=37 + 13 * room)
    w.run()
    return w


def test_clean_run_has_no_violation():
    w = _run()
    assert check_records(w.records) == []


def test_ignoring_the_watermark_breaks_safety(monkeypatch):
    monkeypatch.setattr(prefill_mod, "is_ready", lambda *a: True)
    found = [v for s in range(3) for v in check_records(_run(seed=s).records)]
    assert any(v.invariant == "safety" for v in found)
    assert "overlaps live data" in found[0].format() or "lived until" in found[0].format()


def test_leaked_region_is_reported(monkeypatch):
    real_free = decode_mod.DecodeMachine._free

    def leaky_free(self, room, chunk, alloc_id, now, out):
        if (room, chunk) != (2, 1):
            real_free(self, room, chunk, alloc_id, now, out)

    monkeypatch.setattr(decode_mod.DecodeMachine, "_free", leaky_free)
    # the leak pins the watermark: with a one-chunk pool nothing after it can be written
    found = check_records(_run(pool_chunks=1).records)
    kinds = {v.invariant for v in found}
    assert {"no_leak", "liveness"} <= kinds
    # with a big pool everything finishes, but the ring is not empty at the end
    found = check_records(_run(pool_chunks=50).records)
    assert [v.invariant for v in found] == ["no_leak"]


# --- deliberate breakages of the core: each must be caught --------------------------


def _geometry(P=2, D=1):
    return Geometry(
        P, D, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16
    )


def test_counting_writers_by_number_is_caught(monkeypatch):
    from kvstage.shared import decode as decode_mod

    def on_ready_by_count(self, msg, now, out):
        w = self._writer_for(msg, now, out)
        if w is None:
            return
        room = self._live_room(msg, now, out)
        if room is None:
            return
        arrived = room.arrived.setdefault(msg.chunk, [])
        arrived.append(w)  # a list: a duplicate counts as another writer
        if len(arrived) == 1:
            room.first_arrival[msg.chunk] = now
        self._chunk_maybe_complete(room, msg.chunk, now, out)
        self._maybe_done(room, now, out)

    monkeypatch.setitem(
        decode_mod.DecodeMachine._HANDLERS, decode_mod.ChunkReady, on_ready_by_count
    )
    found = []
    for seed in range(6):
        w = World(
            _geometry(4, 1), pool_bytes=_geometry(4, 1).chunk_bytes() * 2, seed=seed, dup_p=0.5
        )
        for room in range(4):
            w.open_room(room, prompt_tokens=37 + 13 * room)
        w.run(until_quiet=True)
        found += check_records(w.records)
    assert any(v.invariant == "exactly_once" and "incomplete data" in v.message for v in found)


def test_freeing_before_scatter_completes_is_caught(monkeypatch):
    from kvstage.shared import decode as decode_mod

    real = decode_mod.DecodeMachine._chunk_maybe_complete

    def free_early(self, room, chunk, now, out):
        real(self, room, chunk, now, out)
        if (
            room.state.get(chunk) is decode_mod.DecodeChunk.SCATTERING
        ):  # free the region as soon as the scatter is issued
            self._free(room.room, chunk, room.allocs[chunk].id, now, out)

    monkeypatch.setattr(decode_mod.DecodeMachine, "_chunk_maybe_complete", free_early)
    w = _run(seed=1, rooms=4, pool_chunks=1)
    found = check_records(w.records)
    assert any(v.invariant == "safety" and "while its scatter ran" in v.message for v in found)


def test_forgetting_to_release_an_aborted_room_is_caught(monkeypatch):
    from kvstage.shared import decode as decode_mod
    from kvstage.shared.machine import ProtocolConfig
    from kvstage.shared.protocol import ChunkReady

    def fail_without_release(self, room, reason, now, out, skip_writer=-1):
        del self._rooms[room.room]
        self._finish(room.room, ok=False)
        self._record(
            out,
            "room_failed",
            now,
            now,
            room=room.room,
            ring_used=self.ring.used_bytes,
            detail=reason,
        )

    monkeypatch.setattr(decode_mod.DecodeMachine, "_fail", fail_without_release)
    g = _geometry()
    w = World(g, pool_bytes=g.chunk_bytes() * 8, seed=2, config=ProtocolConfig(room_timeout_s=2.0))
    w.open_room(0, prompt_tokens=40)
    # writers never report: the decode's timeout fails the room, holding 3 regions
    w.run(drop=lambda role, rank, ev: isinstance(ev, ChunkReady), until_quiet=True)
    assert w.decode[0].rooms_failed == 1
    found = check_records(w.records)
    assert any(v.invariant == "no_leak" for v in found)


def test_without_empty_ring_restart_a_room_hangs_and_is_reported(monkeypatch):
    """The watermark case of docs/design.md: pool of one chunk, half a chunk assigned and freed, then a full
    chunk. With WATERMARK sent only after frees (as DESIGN describes) and no re-request,
    only the empty-ring restart keeps that full chunk writable."""
    from kvstage.shared import decode as decode_mod
    from kvstage.shared import ring as ring_mod
    from kvstage.shared.machine import ProtocolConfig

    def free_without_restart(self, alloc_id):
        alloc = self._live.pop(alloc_id, None)
        if alloc is None:
            return False
        self._used -= alloc.nbytes
        while self._queue and self._queue[0].id not in self._live:
            self._queue.popleft()
        return True  # the ring may now be empty, but stays in its round

    real_free = decode_mod.DecodeMachine._free
    real_broadcast = decode_mod.DecodeMachine._broadcast_if_moved

    def free_then_broadcast(self, room, chunk, alloc_id, now, out):
        real_free(self, room, chunk, alloc_id, now, out)
        real_broadcast(self, now, out)

    monkeypatch.setattr(
        decode_mod.DecodeMachine, "_broadcast_if_moved", lambda self, now, out: None
    )
    # The writer stays subscribed between its rooms (a decode drops a writer with no
    # live room, and a new subscriber is sent the current watermark, which the assign
    # before it already moved: that alone would unstick the chunk).
    monkeypatch.setattr(
        decode_mod.DecodeMachine, "_end_room", lambda self, room: self._rooms.pop(room.room)
    )
    monkeypatch.setattr(decode_mod.DecodeMachine, "_free", free_then_broadcast)
    g = _geometry()
    cfg = ProtocolConfig(room_timeout_s=5.0, retry_s=1000.0)  # no re-requests: the hang shows

    def scenario():
        w = World(g, pool_bytes=g.chunk_bytes(), seed=0, config=cfg)
        w.open_room(0, prompt_tokens=8)  # 2 pages: half a chunk
        w.run(until_quiet=True)
        w.open_room(1, prompt_tokens=16)  # a full chunk
        w.run(until_quiet=True)
        return w

    w = scenario()
    assert w.decode[0].rooms_done == 2 and check_records(w.records) == []  # with the restart: fine
    monkeypatch.setattr(ring_mod.StagingRing, "free", free_without_restart)
    w = scenario()
    # the full chunk never becomes ready: the hang ends only by the room timeout of the
    # decode, which holds the ring (a prefill leaves a room waiting for a watermark to
    # it: tests/test_fences.py), whose reason names the chunk never written
    assert w.decode[0].rooms_done == 1 and w.decode[0].rooms_failed == 1
    reasons = [r for f in w.failed.values() for r in f.values()]
    assert reasons and all("timed out" in r and "CHUNK_READY from chunk 0" in r for r in reasons)


def test_a_write_outliving_the_abort_grace_is_recorded_and_flagged():
    """A room fails with a write in flight; the write reports back only after the drain
    grace ran out (the decode may have handed the region out again): the prefill traces
    a late_write and the checker calls it a safety violation."""
    from kvstage.shared.events import (
        AbortRoom,
        ChunkComputed,
        Gather,
        GatherDone,
        OpenRoom,
        Tick,
        Write,
        WriteDone,
    )
    from kvstage.shared.machine import ProtocolConfig
    from kvstage.shared.prefill import PrefillMachine
    from kvstage.shared.protocol import StagingRsp, Watermark

    g = _geometry()
    p = PrefillMachine(0, g, ProtocolConfig(abort_grace_s=0.5, room_timeout_s=60.0))
    records = []

    def feed(ev, now):
        out = p.handle(ev, now)
        records.extend(a.record for a in out if hasattr(a, "record"))
        return out

    feed(OpenRoom(0, prompt_tokens=16), 0.0)
    size = g.region_bytes(g.chunks(4)[0].num_pages)
    for d in g.targets(0):
        feed(StagingRsp(0, 0, 0, 0, size, False, 0, d), 0.01)
        feed(Watermark(0, 0, 0, d), 0.01)
    out = feed(ChunkComputed(0, 0), 0.02)
    gathers = [a for a in out if isinstance(a, Gather)]
    assert gathers
    writes = [
        a
        for ga in gathers
        for a in feed(GatherDone(0, 0, ga.decode_rank), 0.03)
        if isinstance(a, Write)
    ]
    assert writes
    feed(AbortRoom(0, "test: abort with writes in flight"), 0.04)
    feed(Tick(), 1.0)  # the grace (0.5 s) ran out: the drain gave up on the writes
    for w in writes:
        feed(WriteDone(0, 0, w.decode_rank), 1.2)  # ...which land now
    late = [r for r in records if r.phase == "late_write"]
    assert len(late) == len(writes)
    found = check_records(records)
    assert any(v.invariant == "safety" and "after the abort grace" in v.message for v in found)


def test_clock_tolerance_orders_two_clocks_only_beyond_their_uncertainty():
    """A decode's scatter 0.3 ms 'before' a prefill's write ended: a violation on one clock,
    but within two hosts' clock uncertainty (1 ms) it is not evidence of an early scatter."""
    from kvstage.shared.trace import TraceRecord

    write = TraceRecord(
        "prefill",
        0,
        "write",
        1.0000,
        1.0010,
        room=0,
        chunk=0,
        writer=0,
        peer=0,
        offset=0,
        bytes=64,
        requests=1,
    )
    scatter = TraceRecord(
        "decode", 0, "scatter", 1.0007, 1.0020, room=0, chunk=0, offset=0, bytes=64
    )
    one_clock = check_records([write, scatter])
    assert any(
        v.invariant == "exactly_once" and "before the last block" in v.message for v in one_clock
    )
    assert not [
        v
        for v in check_records([write, scatter], clock_tolerance_s=0.001)
        if v.invariant == "exactly_once"
    ]


def test_a_run_with_a_lost_rank_is_checked_over_what_the_others_recorded(monkeypatch):
    """Issue 39, item 6: hardware mode checks every run, failed ranks or not. Without a
    lost decode rank's records its writers' writes into its ring cannot be judged
    (nothing says their data ended): `missing` excuses exactly that, and a broken safety
    rule at the rank that did report is still caught."""

    def without_decode1(w):
        return [r for r in w.records if not (r.role == "decode" and r.rank == 1)]

    kept = without_decode1(_run(rooms=5, P=2, D=2, pool_chunks=1))
    # read as if complete, the lost rank's absence looks like data that never died
    assert {v.invariant for v in check_records(kept)} == {"safety"}
    assert check_records(kept, missing={("decode", 1)}) == []
    monkeypatch.setattr(prefill_mod, "is_ready", lambda *a: True)  # the watermark ignored
    found = [
        v
        for seed in range(3)
        for v in check_records(
            without_decode1(_run(seed=seed, rooms=5, P=2, D=2, pool_chunks=1)),
            missing={("decode", 1)},
        )
    ]
    assert any(v.invariant == "safety" for v in found)
