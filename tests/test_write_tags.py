"""Write tags (issue 39, item 2): on by default, on both paths.

The pure part, in the randomly ordered world of tests/protocol_harness.py: a writer's
tag rides from its WriteDone into CHUNK_READY, with the nonce its Gather or SliceWrite
was keyed with; the decode hands every block's (tag, nonce) to its Scatter (staging) or
CheckSlice (slice path, with ProtocolConfig.check_slice_writes, as hardware mode sets
it), and a rejected block fails its room. An attacker here overwrites some rooms'
blocks after their writer wrote them: those rooms fail on a rejected write and every
other room is done. The hardware side (hw/rank/writemac.py, the MAC itself) is checked below
and in tests/test_verify_writes.py.
"""

from __future__ import annotations

import math
import time

import pytest
from protocol_harness import World

from kvstage.hw.rank.writemac import KINDS, block_mac, block_tag, mac_key, tag_key
from kvstage.shared.events import (
    CheckSlice,
    Gather,
    GatherDone,
    Scatter,
    ScatterDone,
    SliceChecked,
    SliceWrite,
    Write,
    WriteDone,
)
from kvstage.shared.invariants import check_records
from kvstage.shared.layout import Geometry
from kvstage.shared.machine import ProtocolConfig

ATTACKED = {3, 7}  # rooms whose blocks the attacker overwrites once they are written


class TagWorld(World):
    """Blocks as tokens: ("honest", nonce) once written, "junk" once the attacker wrote."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.blocks: dict[tuple[int, int, int, int], object] = {}  # (d, room, chunk, p)
        self.nonces: dict[tuple[int, int, int, int], int] = {}  # what each write was keyed by
        self.checked = 0

    @staticmethod
    def tag(d: int, room: int, chunk: int, p: int, nonce: int) -> int:
        return hash(("tag", d, room, chunk, p, nonce)) & ((1 << 63) - 1) or 1

    def _carry(self, role: str, rank: int, a) -> None:
        if isinstance(a, Gather):
            self.nonces[(a.decode_rank, a.room, a.chunk, rank)] = a.nonce
            self.bag.append((role, rank, GatherDone(a.room, a.chunk, a.decode_rank)))
        elif isinstance(a, (Write, SliceWrite)):
            key = (a.decode_rank, a.room, a.chunk, rank)
            if isinstance(a, SliceWrite):
                self.nonces[key] = a.nonce
            else:
                self._check_write(a)
            nonce = self.nonces[key]
            self.blocks[key] = "junk" if a.room in ATTACKED else ("honest", nonce)
            tag = self.tag(*key, nonce)
            self.bag.append((role, rank, WriteDone(a.room, a.chunk, a.decode_rank, checksum=tag)))
        elif isinstance(a, (Scatter, CheckSlice)):
            why = self._rejected(rank, a)
            if isinstance(a, Scatter):
                self.bag.append((role, rank, ScatterDone(a.room, a.chunk, rejected=why)))
            else:
                self.bag.append((role, rank, SliceChecked(a.room, a.chunk, rejected=why)))
        else:
            super()._carry(role, rank, a)

    def _rejected(self, d: int, a) -> str:
        self.checked += 1
        assert len(a.checksums) == len(self.geometry.writers(d))
        for _w, p, tag, nonce in a.checksums:
            key = (d, a.room, a.chunk, p)
            if nonce != self.nonces[key]:
                self.violations.append(f"{key}: checked under nonce {nonce}, written under another")
            if self.blocks.get(key) != ("honest", nonce) or tag != self.tag(*key, nonce):
                return f"block of prefill {p} does not match its write tag"
        return ""


def _world(path: str, check: bool) -> TagWorld:
    g = Geometry(4, 2, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    cfg = ProtocolConfig(path=path, room_timeout_s=120.0, check_slice_writes=check)
    w = TagWorld(g, pool_bytes=g.chunk_bytes() * 3, seed=5, config=cfg)
    for room in range(10):
        w.open_room(room, prompt_tokens=23 + 11 * room)
    w.run(until_quiet=True)
    return w


@pytest.mark.parametrize("path", ["staging", "slice"])
def test_a_block_overwritten_after_its_write_fails_its_room_and_only_it(path):
    w = _world(path, check=True)
    assert not w.violations
    assert w.checked > 0
    for m in w.decode:
        assert w.done.get(("decode", m.rank), set()) == set(range(10)) - ATTACKED
        failed = w.failed.get(("decode", m.rank), {})
        assert set(failed) == ATTACKED and all("write rejected" in r for r in failed.values())
        assert m.writes_rejected >= 1
        assert m.settled
    assert not check_records(w.records, expect_path=path)


def test_the_slice_path_without_the_check_scatters_the_attackers_bytes():
    """The twin can fail: without check_slice_writes (the simulator's setting) the
    overwritten rooms are done."""
    w = _world("slice", check=False)
    assert w.checked == 0
    assert ATTACKED <= w.done[("decode", 0)]


# --- the MAC (hw/rank/writemac.py) ---------------------------------------------------------------


def test_the_mac_is_bound_to_every_input_and_to_every_byte():
    key = mac_key(bytes(range(32)))
    data = bytearray(b"\x5a" * 4096)
    base = block_mac(key, 1, 2, 3, bytes(data))
    assert 0 < base < 1 << 63
    assert block_mac(key, 1, 2, 3, bytes(data)) == base
    others = {
        block_mac(mac_key(bytes(32)), 1, 2, 3, bytes(data)),
        block_mac(key, 9, 2, 3, bytes(data)),
        block_mac(key, 1, 9, 3, bytes(data)),
        block_mac(key, 1, 2, 9, bytes(data)),
        block_mac(key, 1, 2, 3, bytes(data[:-1])),
        block_mac(key, 1, 2, 3, bytes(data) + b"\0"),
    }
    for i in (0, 17, 4095):
        flipped = bytearray(data)
        flipped[i] ^= 1
        others.add(block_mac(key, 1, 2, 3, bytes(flipped)))
    assert base not in others and len(others) == 9


def test_a_tag_of_a_tensor_is_the_tag_of_its_bytes():
    torch = pytest.importorskip("torch")
    block = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    for kind in ("mac", "checksum"):
        key = tag_key(kind, bytes(32))
        assert block_tag(kind, key, 4, 5, 6, block) == block_tag(
            kind, key, 4, 5, 6, block.numpy().tobytes()
        )
    assert tag_key("mac", bytes(32)) != tag_key("checksum", bytes(32))


def test_none_has_no_key_and_no_tag():
    assert "none" in KINDS
    with pytest.raises(ValueError, match="allowed: checksum, mac"):
        tag_key("none", bytes(32))
    with pytest.raises(ValueError, match="allowed: checksum, mac"):
        block_tag("crc32", bytes(32), 0, 0, 0, b"x")


def test_the_default_is_the_mac():
    from kvstage.shared.scenario.schema import TransferConfig

    assert TransferConfig().verify_writes == "mac"


def _late(results, lands: bool):
    """A decode rank's state as `_checked` reads it, and a check that answers
    `results` one after another (then the last for ever), counting bytes as the real
    ones do."""
    from types import SimpleNamespace

    me = SimpleNamespace(
        transport=SimpleNamespace(lands_on_completion=lands),
        bytes_checksummed=0,
        bytes_hashed_in_moves=0,
        late_landings=0,
        name="decode0",
    )
    answers = iter(results)
    last = [results[-1]]

    def check() -> str:
        me.calls = getattr(me, "calls", 0) + 1
        me.bytes_checksummed += 100
        me.bytes_hashed_in_moves += 100
        last[0] = next(answers, last[0])
        return last[0]

    return me, check


def test_a_block_that_lands_late_passes_on_a_recheck_and_junk_still_fails(monkeypatch):
    """Mooncake's TCP completion is the writer's alone (the bytes handed to a socket):
    a decode that checks at once may see an honest block half landed. On such an engine
    a failing check is run again after short waits: the honest block passes on a
    re-check (counted once, and as a late landing); a block that never matches is
    rejected once the grace is over; an engine whose completion is the peer's is never
    re-checked."""
    from kvstage.hw.rank import decode

    monkeypatch.setattr(decode, "LANDING_GRACE_S", 0.05)
    me, check = _late(["bad", "bad", ""], lands=False)
    assert decode.DecodeRank._checked(me, check) == ""
    assert me.late_landings == 1 and me.bytes_checksummed == me.bytes_hashed_in_moves == 100
    me, check = _late(["junk"], lands=False)
    t = time.perf_counter()
    assert decode.DecodeRank._checked(me, check) == "junk"
    assert time.perf_counter() - t >= 0.05 and me.late_landings == 0
    assert me.calls <= 2 + math.log2(0.05 / 0.001) + 1  # waits that double from 1 ms
    assert me.bytes_checksummed == 100
    me, check = _late(["bad", ""], lands=True)
    assert decode.DecodeRank._checked(me, check) == "bad"  # no second look


def test_mooncake_over_tcp_says_its_writes_may_land_after_completion():
    from conftest import require_engine

    from kvstage.hw.transport.base import make_transport

    for backend, lands in (("mooncake", False), ("nixl", True)):
        require_engine(backend)
        t = make_transport(backend, f"landing-probe-{backend}")
        try:
            assert t.lands_on_completion is lands, backend
        finally:
            t.close()
