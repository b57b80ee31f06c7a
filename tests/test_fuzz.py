"""Bad input from peers: garbage never raises out of a rank and never corrupts state."""

from __future__ import annotations

import random

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_harness import World
from zmq.utils import z85

from kvstage.hw.control.plane import ControlPlane, curve_client, new_secret
from kvstage.shared.invariants import check_records
from kvstage.shared.layout import Geometry
from kvstage.shared.protocol import (
    MESSAGE_TYPES,
    Abort,
    ChunkReady,
    StagingReq,
    StagingRsp,
    Watermark,
    WriterDone,
    encode,
)

small_int = st.integers(min_value=0, max_value=40)


def messages():
    """Valid-on-the-wire messages with arbitrary (in-range) field values."""
    return st.one_of(
        st.builds(StagingReq, small_int, small_int, small_int, small_int, small_int),
        st.builds(
            StagingRsp,
            small_int,
            small_int,
            small_int,
            small_int,
            small_int,
            st.booleans(),
            small_int,
            small_int,
        ),
        st.builds(Watermark, small_int, small_int, small_int, small_int),
        st.builds(
            ChunkReady, small_int, small_int, small_int, small_int, small_int, small_int, small_int
        ),
        st.builds(WriterDone, small_int, small_int, small_int, small_int, small_int),
        st.builds(Abort, small_int, small_int, small_int, st.text(max_size=20)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    junk=st.lists(st.tuples(st.booleans(), st.integers(0, 7), messages()), max_size=40),
    seed=st.integers(0, 1000),
)
def test_forged_messages_never_raise_and_honest_rooms_are_unharmed(junk, seed):
    """Forged messages about rooms that do not exist (room ids >= 100) are dropped
    or ignored; the honest rooms, run in the same world, all complete cleanly."""
    g = Geometry(4, 2, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    w = World(g, pool_bytes=g.chunk_bytes() * 3, seed=seed)
    for room in range(3):
        w.open_room(room, prompt_tokens=37 + 13 * room)
    for to_decode, rank, msg in junk:
        if not hasattr(msg, "room"):
            # a well-formed WATERMARK that lies is out of scope (it comes from an
            # authenticated peer); malformed ones never decode
            continue
        forged = type(msg)(
            **{**{f: getattr(msg, f) for f in msg.__slots__}, "room": 100 + msg.room}
        )
        role = "decode" if to_decode else "prefill"
        w.bag.append((role, rank % (g.decode_tp if to_decode else g.prefill_tp), forged))
    w.run()
    for d in w.decode:
        assert d.rooms_done >= 3
    honest = [r for r in w.records if r.room < 100]
    assert not [
        v
        for v in check_records(honest)
        if v.invariant in ("safety", "exactly_once", "monotone_watermark")
    ]


SECRET = new_secret()


@pytest.fixture()
def plane():
    ctx = zmq.Context()
    cp = ControlPlane(ctx=ctx, secret=SECRET, name="fuzzed")
    peer = ControlPlane(ctx=ctx, secret=SECRET, name="peer")  # signs the frames sent by hand
    peer.connect("fuzzed", cp.address, cp.identity)
    cp.connect("peer", peer.address, peer.identity)
    yield cp, peer, ctx
    cp.close()
    peer.close()
    ctx.term()


def test_control_plane_drops_malformed_frames_and_keeps_good_ones(plane):
    cp, peer, ctx = plane
    push = ctx.socket(zmq.PUSH)
    # a holder of the run secret with a key the plane admits (a rank of its table)
    public, private = (z85.decode(k) for k in zmq.curve_keypair())
    cp.gate.admit(public)
    curve_client(push, SECRET, (public, private))
    push.connect(cp.address)
    rng = random.Random(0)
    good = [StagingReq(1, 0, 4, 0, 0), Watermark(2, 10, 0, 0)]
    sent_good = 0
    for i in range(200):
        if i % 50 == 0:
            push.send_multipart(peer.seal("fuzzed", encode(good[sent_good % 2])))
            sent_good += 1
        frames = [
            bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
            for _ in range(rng.randrange(1, 4))
        ]
        push.send_multipart(peer.seal("fuzzed", frames))  # authenticated junk: it must not decode
    got = []
    for _ in range(50):
        got += cp.receive(0.05)
        if len(got) >= sent_good and cp.malformed + len(got) >= 200 + sent_good - 5:
            break
    assert [type(m) for m in got] == [type(good[i % 2]) for i in range(sent_good)]
    assert cp.malformed >= 150
    push.close(linger=0)


def test_every_message_type_is_fuzzed():
    assert {StagingReq, StagingRsp, Watermark, ChunkReady, WriterDone, Abort} <= set(MESSAGE_TYPES)
