"""Capabilities, not trust (issue 25, item 2): in the protocol core, so both modes.

A decode rank hands each writer nonces (shared/capability.py) and drops a writer's
message that does not echo them; a prefill rank refuses a region that overlaps one of
its own live grants, and a watermark its grants make impossible (shared/prefill.py
`_watermark_problem`). Checked on the machines one message at a time, and as the
simulated twin of tests/test_adversary.py: an insider that speaks under the real
ranks' names without their nonces, in a world of randomly ordered delivery with no
MACs at all, harms no room.
"""

from __future__ import annotations

import itertools
import random

import pytest
from protocol_harness import World, echo

from kvstage.shared.capability import Capabilities
from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import (
    ChunkComputed,
    GatherDone,
    OpenRoom,
    RoomFailed,
    Scatter,
    Send,
    WriteDone,
)
from kvstage.shared.invariants import check_records
from kvstage.shared.layout import Geometry
from kvstage.shared.machine import ProtocolConfig
from kvstage.shared.prefill import PrefillMachine
from kvstage.shared.protocol import (
    Abort,
    Bootstrap,
    ChunkReady,
    DoneAck,
    StagingReq,
    StagingRsp,
    Watermark,
    WriterDone,
)
from kvstage.shared.ring import StagingRing

G = Geometry(2, 1, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)


def _sent(out, cls) -> list:
    return [a.msg for a in out if isinstance(a, Send) and isinstance(a.msg, cls)]


def _decode_with_grants(path: str = "staging"):
    """A decode rank with room 0 (two chunks) open and both writers granted both."""
    m = DecodeMachine(0, G, G.chunk_bytes() * 4, ProtocolConfig(path=path))
    out = m.handle(OpenRoom(0, prompt_tokens=32), 0.0)
    boots = {b.prefill_rank: b for b in _sent(out, Bootstrap)}
    rsps = {}
    for p in (0, 1):
        for c in (0, 1):
            for r in _sent(m.handle(StagingReq(0, c, 4, p, 0), 0.0), StagingRsp):
                rsps[(p, c)] = r
    return m, boots, rsps


def test_nonces_are_per_writer_per_region_and_never_zero():
    m, boots, rsps = _decode_with_grants()
    nonces = [r.nonce for r in rsps.values()] + [b.nonce for b in boots.values()]
    assert 0 not in nonces and len(set(nonces)) == len(nonces) == 6
    # a re-sent STAGING_REQ is answered with the same grant, and the same nonce
    (again,) = _sent(m.handle(StagingReq(0, 0, 4, 1, 0), 0.1), StagingRsp)
    assert again.nonce == rsps[(1, 0)].nonce
    # two decode ranks (two keys) hand out different nonces for the same grant
    assert Capabilities.for_simulation(0).grant(0, 0, 0, 0) != Capabilities.for_simulation(1).grant(
        0, 0, 0, 0
    )
    with pytest.raises(ValueError, match="16 to 64 bytes"):
        Capabilities(b"short")


def test_a_chunk_ready_that_does_not_echo_its_grant_completes_nothing():
    m, boots, rsps = _decode_with_grants()
    ready = {p: ChunkReady(0, 0, 0, 4, p, p, 0) for p in (0, 1)}
    forged = [
        ready[1],  # no nonce
        ChunkReady(0, 0, 0, 4, 1, 1, 0, nonce=rsps[(0, 0)].nonce),  # writer 0's grant
        ChunkReady(0, 0, 0, 4, 1, 1, 0, nonce=rsps[(1, 1)].nonce),  # another chunk's
        ChunkReady(0, 0, 0, 4, 1, 1, 0, nonce=boots[1].nonce),  # the room's, not the grant's
    ]
    out = m.handle(echo(m, ready[0]), 0.1)
    for msg in forged:
        out += m.handle(msg, 0.2)
    assert not [a for a in out if isinstance(a, Scatter)]
    assert m.dropped == len(forged)
    # the honest one, echoing its grant's nonce, completes the chunk
    out = m.handle(ChunkReady(0, 0, 0, 4, 1, 1, 0, nonce=rsps[(1, 0)].nonce), 0.3)
    assert len([a for a in out if isinstance(a, Scatter)]) == 1


def test_on_the_slice_path_chunk_ready_echoes_the_room_nonce():
    m = DecodeMachine(0, G, G.chunk_bytes() * 4, ProtocolConfig(path="slice"))
    boots = {b.prefill_rank: b for b in _sent(m.handle(OpenRoom(0, 16), 0.0), Bootstrap)}
    m.handle(ChunkReady(0, 0, 0, 4, 0, 0, 0), 0.1)
    assert m.dropped == 1
    m.handle(ChunkReady(0, 0, 0, 4, 0, 0, 0, nonce=boots[0].nonce), 0.1)
    assert m.dropped == 1 and m._rooms[0].arrived[0] == {0}


def test_an_unproven_writer_done_is_not_acknowledged_and_brings_the_bootstrap():
    m, boots, _ = _decode_with_grants()
    out = m.handle(WriterDone(0, 2, 1, 1, 0, nonce=boots[0].nonce), 0.1)  # writer 0's nonce
    assert not _sent(out, DoneAck) and m.dropped == 1
    assert [b.prefill_rank for b in _sent(out, Bootstrap)] == [1]
    out = m.handle(WriterDone(0, 2, 1, 1, 0, nonce=boots[1].nonce), 0.2)
    assert _sent(out, DoneAck) and m._rooms[0].writers_done == {1: 2}


def test_an_unproven_abort_neither_fails_a_room_nor_releases_its_quarantine():
    """The row of the issue's table where a write landed in a freed region: a forged
    ABORT under a live writer's name released memory that writer was still writing."""
    m, boots, _ = _decode_with_grants()
    out = m.handle(Abort(0, 1, 0, "forged", nonce=boots[0].nonce), 0.1)
    assert not [a for a in out if isinstance(a, RoomFailed)] and m.live_rooms == 1
    out = m.handle(Abort(0, 1, 0, "honest", nonce=boots[1].nonce), 0.2)
    assert [a for a in out if isinstance(a, RoomFailed)]
    (told,) = _sent(out, Abort)
    assert (told.prefill_rank, told.nonce) == (0, boots[0].nonce)  # the decode's ABORT carries it
    held = m.ring.live_count
    assert held == 2  # writer 0 may still write: quarantined until it confirms
    for nonce in (0, boots[1].nonce, 7):  # none, another writer's, a guess
        m.handle(Abort(0, 0, 0, "forged confirmation", nonce=nonce), 0.3)
        assert m.ring.live_count == held
    m.handle(Abort(0, 0, 0, "drained", nonce=boots[0].nonce), 0.4)
    assert m.ring.empty and m.settled


def _prefill_with_grant():
    """Prefill rank 0 with room 0 (two chunks) computed and chunk 0 granted [0, R)."""
    p = PrefillMachine(0, G, ProtocolConfig(), pool_bytes=G.chunk_bytes() * 4)
    p.handle(OpenRoom(0, prompt_tokens=32), 0.0)
    p.handle(Bootstrap(0, 0, 0, 0, nonce=5), 0.0)
    p.handle(Watermark(0, 0, 0, 0), 0.0)
    for c in (0, 1):
        p.handle(ChunkComputed(0, c), 0.0)
    size = G.region_bytes(4)
    out = p.handle(StagingRsp(0, 0, 0, 0, size, False, 0, 0, nonce=11), 0.1)
    assert [a for a in out if type(a).__name__ == "Gather"]
    return p, size


def test_a_prefill_refuses_a_region_overlapping_its_own_live_grant():
    p, size = _prefill_with_grant()
    dropped = p.dropped
    # chunk 1 placed over chunk 0's region in the same round: no ring does that
    out = p.handle(StagingRsp(0, 1, size // 2, 0, size // 2 + size, False, 0, 0, 12), 0.2)
    assert p.dropped == dropped + 1 and not [a for a in out if type(a).__name__ == "Gather"]
    # the next round over it is the ring's overcommit: taken, and waits for the watermark
    out = p.handle(StagingRsp(0, 1, 0, 1, size, False, 0, 0, 13), 0.3)
    assert p.dropped == dropped + 1 and not [a for a in out if type(a).__name__ == "Gather"]


def test_a_watermark_past_an_unwritten_grant_is_refused():
    p, size = _prefill_with_grant()
    p.handle(StagingRsp(0, 1, size, 0, 2 * size, False, 0, 0, 12), 0.15)
    dropped = p.dropped
    # round 1 is possible (one past round 0), but not while chunk 0's region is unwritten
    p.handle(Watermark(1, 0, 0, 0), 0.2)
    assert p.dropped == dropped + 1 and p.watermark_view(0) == (0, 0)
    p.handle(GatherDone(0, 0, 0), 0.3)
    out = p.handle(WriteDone(0, 0, 0), 0.4)
    (ready,) = _sent(out, ChunkReady)
    assert ready.nonce == 11  # the grant's nonce, echoed
    p.handle(Watermark(0, size + 1, 0, 0), 0.45)  # past chunk 1's, still unwritten
    assert p.dropped == dropped + 2 and p.watermark_view(0) == (0, 0)
    p.handle(Watermark(0, size, 0, 0), 0.45)  # chunk 0's freed: possible
    assert p.watermark_view(0) == (0, size)
    p.handle(GatherDone(0, 1, 0), 0.5)
    p.handle(WriteDone(0, 1, 0), 0.6)
    p.handle(Watermark(1, 0, 0, 0), 0.7)
    assert p.dropped == dropped + 2 and p.watermark_view(0) == (1, 0)


def test_a_region_behind_the_watermark_view_is_refused():
    """A live region is never behind its ring's watermark, sent before or after it was
    placed: a grant behind the view means the grant or the view is false."""
    p, size = _prefill_with_grant()
    p.handle(StagingRsp(0, 1, size, 0, 2 * size, False, 0, 0, 12), 0.15)
    for c in (0, 1):
        p.handle(GatherDone(0, c, 0), 0.3)
        p.handle(WriteDone(0, c, 0), 0.4)
    p.handle(Watermark(0, 2 * size, 0, 0), 0.5)
    p.handle(OpenRoom(1, prompt_tokens=16), 0.6)
    p.handle(Bootstrap(1, 0, 0, 0, nonce=6), 0.6)
    dropped = p.dropped
    p.handle(StagingRsp(1, 0, size, 0, 2 * size, False, 0, 0, 14), 0.7)
    assert p.dropped == dropped + 1
    p.handle(StagingRsp(1, 0, 2 * size, 0, 3 * size, False, 0, 0, 15), 0.8)
    assert p.dropped == dropped + 1


def test_a_ring_never_grants_overlapping_regions_in_one_round():
    rng = random.Random(7)
    ring = StagingRing(10_000)
    for _ in range(5000):
        if ring.live_count and rng.random() < 0.45:
            ring.free(rng.choice(ring.live()).id)
        else:
            ring.assign(rng.randrange(1, 3000))
        live = ring.live()
        placed = sorted((a.round, a.offset, a.end) for a in live)
        for (r1, _, end), (r2, offset, _) in itertools.pairwise(placed):
            assert r1 != r2 or end <= offset, (r1, end, offset)
        wm = ring.watermark
        assert all((a.round, a.offset) >= wm for a in live)


# --- the simulated twin of tests/test_adversary.py --------------------------------------


class InsiderWorld(World):
    """The randomly ordered world, with an insider that, every few deliveries, sends
    a forgery about a live room under a real rank's name, never knowing a nonce.

    Under a writer's name: CHUNK_READY on the room's own chunk grid with the real
    writer ids, WRITER_DONE, ABORT of a live room, and ABORT confirming a quarantined
    one, each with no nonce or a guessed one; they join the randomly ordered bag.
    Under a decode's name: a WATERMARK just past the oldest region that decode granted
    the writer and the writer has not written, and a STAGING_RSP of another chunk over
    that region; these arrive at once, while that region is live. (One that arrives
    later, once the region was written, may be one the ring could have sent: the
    decode's own word is not a capability, and only the MACs of hardware mode,
    tests/test_adversary.py, tell it from a forgery.)
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self.forged = 0
        self.insider = random.Random(self.seed + 1)

    def deliver(self, role, rank, event) -> None:
        super().deliver(role, rank, event)
        if self.insider.random() < 0.3:
            forgery = self._forge()
            if forgery is not None:
                self.forged += 1
                if forgery[0] == "prefill":
                    super().deliver(*forgery)
                else:
                    self.bag.append(forgery)

    def _forge(self):
        rng, g = self.insider, self.geometry
        d = rng.randrange(g.decode_tp)
        dm = self.decode[d]
        rooms = [r for r in dm._rooms.values() if r.chunks]
        quarantined = list(dm._quarantine)
        if not rooms and not quarantined:
            return None
        writers = g.writers(d)
        p = rng.choice(writers)
        w = writers.index(p)
        guess = rng.choice([0, rng.getrandbits(63) or 1])
        kind = rng.randrange(6)
        if kind == 5 and quarantined:  # a confirmation that would release a quarantine
            return ("decode", d, Abort(rng.choice(quarantined), p, d, "forged", guess))
        if not rooms:
            return None
        room = rng.choice(rooms)
        c = room.chunks[rng.randrange(len(room.chunks))]
        if kind == 0:
            msg = ChunkReady(room.room, c.index, c.page_start, c.num_pages, p, w, d, 0, guess)
            return ("decode", d, msg)
        if kind == 1:
            return ("decode", d, WriterDone(room.room, len(room.chunks), p, w, d, guess))
        if kind == 2:
            return ("decode", d, Abort(room.room, p, d, "forged", guess))
        # under the decode's name, to a writer: a watermark just past the oldest region
        # granted to it and not yet written, or a region over that one for another chunk
        pm = self.prefill[p]
        oldest = pm._live_grants[d].oldest()
        if oldest is None:
            return None
        if kind == 3:
            return ("prefill", p, Watermark(oldest[0], oldest[1] + 1, p, d))
        prm = pm._rooms.get(room.room)
        if prm is None:
            return None
        t = prm.targets[d]
        unanswered = [x.index for x in prm.chunks if x.index not in t.rsp]
        if not unanswered:
            return None
        size = g.region_bytes(prm.chunks[unanswered[0]].num_pages)
        rsp = StagingRsp(
            room.room, unanswered[0], oldest[1], oldest[0], oldest[1] + size, False, p, d
        )
        return ("prefill", p, rsp)


@pytest.mark.parametrize("path", ["staging", "slice"])
@pytest.mark.parametrize("seed", range(8))
def test_an_insider_without_the_nonces_harms_no_room(path, seed):
    g = Geometry(4, 2, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    cfg = ProtocolConfig(path=path, room_timeout_s=120.0)
    w = InsiderWorld(g, pool_bytes=g.chunk_bytes() * 3, seed=seed, config=cfg)
    rooms = range(12)
    for room in rooms:
        w.open_room(room, prompt_tokens=23 + 11 * room)
    w.run(until_quiet=True)
    assert w.forged > 50
    assert not w.violations
    for m in w.prefill + w.decode:
        assert w.done.get((m.role, m.rank), set()) == set(rooms), w.failed
        assert m.settled
    assert sum(m.dropped for m in w.decode) > 0
    assert not check_records(w.records, expect_path=path)
    # every chunk was scattered once, after each of its writers wrote it
    if path == "staging":
        assert all(n == 1 for s in w.scattered for n in s.values())


@pytest.mark.parametrize("off", ["decode nonces", "prefill rules"])
def test_the_twin_without_the_checks_is_harmed(monkeypatch, off):
    """The twin can fail: with the decode's nonce checks, or the prefill's rules on
    grants and watermarks, switched off, the same insider harms rooms."""
    from kvstage.shared.prefill_state import LiveGrants

    if off == "decode nonces":
        monkeypatch.setattr(DecodeMachine, "_unproven", lambda self, msg, now, out: False)
        monkeypatch.setattr(DecodeMachine, "_implausible_ready", lambda self, room, msg, w: "")
    else:
        monkeypatch.setattr(PrefillMachine, "_past_live_grant", lambda self, d, new: "")
        monkeypatch.setattr(LiveGrants, "overlapping", lambda self, r, o, e: None)
    g = Geometry(4, 2, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    w = InsiderWorld(g, pool_bytes=g.chunk_bytes() * 3, seed=0, config=ProtocolConfig())
    for room in range(12):
        w.open_room(room, prompt_tokens=23 + 11 * room)
    w.run(until_quiet=True)
    assert w.violations or any(w.failed.values()) or check_records(w.records)


@pytest.mark.parametrize("path", ["staging", "slice"])
def test_a_lost_bootstrap_is_asked_for_and_every_room_finishes(path):
    """Without its BOOTSTRAP a writer has no room nonce for WRITER_DONE: it asks with a
    nonce-less one on its retry timer, and the decode answers with the BOOTSTRAP."""
    g = Geometry(2, 1, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    w = World(g, pool_bytes=g.chunk_bytes() * 3, seed=1, config=ProtocolConfig(path=path))
    for room in range(4):
        w.open_room(room, prompt_tokens=40 + room)
    lost = set()

    def drop(role, rank, event):
        if isinstance(event, Bootstrap) and (event.room, rank) not in lost:
            lost.add((event.room, rank))
            return True
        return False

    w.run(drop=drop, until_quiet=True)
    assert len(lost) == 8
    for m in w.prefill + w.decode:
        assert w.done.get((m.role, m.rank), set()) == set(range(4)), w.failed
    asked = [r for r in w.records if r.phase == "resend" and "room nonce" in r.detail]
    if path == "staging":  # (on the slice path a silent writer is sent it again)
        assert asked
    assert not check_records(w.records, expect_path=path)
