"""Wire codec: round trips for every message, rejection of malformed frames."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.shared.protocol import (
    MESSAGE_TYPES,
    Abort,
    Bootstrap,
    ChunkReady,
    DoneAck,
    Heartbeat,
    ProtocolError,
    ReadyAck,
    StagingReq,
    StagingRsp,
    Watermark,
    WriterDone,
    decode,
    encode,
)

SAMPLES = [
    StagingReq(room=7, chunk=2, num_pages=512, prefill_rank=3, decode_rank=1),
    StagingRsp(
        room=7,
        chunk=2,
        offset=4096,
        round=9,
        end=8192,
        oversized=False,
        prefill_rank=3,
        decode_rank=1,
    ),
    StagingRsp(
        room=7, chunk=3, offset=0, round=0, end=0, oversized=True, prefill_rank=3, decode_rank=1
    ),
    Watermark(round=5, tail=123, prefill_rank=0, decode_rank=0),
    ChunkReady(room=1, chunk=0, page_start=0, num_pages=4, prefill_rank=5, writer=1, decode_rank=1),
    WriterDone(room=1, num_chunks=4, prefill_rank=5, writer=1, decode_rank=1),
    Bootstrap(room=1, dst_page_base=640, prefill_rank=5, decode_rank=1),
    ReadyAck(room=1, chunk=3, prefill_rank=5, decode_rank=1),
    DoneAck(room=1, prefill_rank=5, decode_rank=1),
    Heartbeat(prefill_rank=5, decode_rank=1, from_decode=True),
    Abort(
        room=1, prefill_rank=5, decode_rank=1, reason="timed out — waiting for ✓"
    ),  # last: the str one
]


def test_every_message_type_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = encode(msg)
    assert all(isinstance(f, bytes) for f in frames)
    assert decode(frames) == msg


@pytest.mark.parametrize(
    "frames, needle",
    [
        ([], "empty"),
        ([b"HELLO"], "bad magic"),
        ([b"KVS1:NOPE", b""], "unknown message type"),
        ([b"KVS1:REQ"], "expected 2 frames"),
        ([b"KVS1:REQ", b"\x00" * 7], "truncated"),
        (encode(SAMPLES[0]) + [b"extra"], "expected 2 frames"),
        ([b"KVS1:ABORT", encode(SAMPLES[-1])[1], b"\xff\xfe"], "not utf-8"),
        ([b"KVS1:ABORT", encode(SAMPLES[-1])[1], b"x" * 5000], "max"),
        ("not a list", "empty"),
    ],
)
def test_malformed_frames_raise_protocol_error(frames, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode(frames)


def test_out_of_range_values_rejected_at_the_boundary():
    import struct

    payload = struct.pack("!qqqqq", 1, 10**12, 4, 0, 0)  # chunk index 10^12
    with pytest.raises(ProtocolError, match=r"chunk=1000000000000 out of range"):
        decode([b"KVS1:REQ", payload])
    payload = struct.pack("!qqqqq", 1, 0, -4, 0, 0)  # negative page count
    with pytest.raises(ProtocolError, match="num_pages=-4 out of range"):
        decode([b"KVS1:REQ", payload])
    with pytest.raises(ProtocolError):
        encode(StagingReq(room=-1, chunk=0, num_pages=1, prefill_rank=0, decode_rank=0))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.binary(max_size=80), max_size=4))
def test_random_frames_only_ever_raise_protocol_error(frames):
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    assert decode(encode(msg)) == msg


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.integers(0, 64), st.binary(max_size=8))
def test_mutated_valid_frames_only_ever_raise_protocol_error(msg, pos, junk):
    frames = encode(msg)
    payload = bytearray(frames[1])
    payload[pos % max(1, len(payload)) : pos % max(1, len(payload)) + len(junk)] = junk
    frames[1] = bytes(payload)
    try:
        decode(frames)
    except ProtocolError:
        pass
