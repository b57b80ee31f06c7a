"""Transport layer tests.

Two kinds:
- engine tests (marked ``hw``): for each backend, a receiver process and a sender
  process move real bytes and the receiver checks every byte;
- base-class tests: a tiny in-process engine (memmove) exercises the envelope,
  validation, waiting and closing without NIXL or Mooncake.

A missing engine skips its tests locally and fails them in CI (CI=true), where the
engines are installed.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import random
import time
import traceback
from typing import Any

import pytest

from kvstage.hw.transport.base import (
    BACKENDS,
    EngineUnavailableError,
    LaneBatch,
    PeerInfo,
    Region,
    TransferError,
    Transport,
    make_transport,
    probe_engine,
)

IN_CI = os.environ.get("CI") == "true"
STEP_TIMEOUT_S = 60.0  # one protocol step between processes; generous for a loaded CI box
XFER_TIMEOUT_S = 30.0  # one wait() on a transfer
WORKER_IDLE_S = 600.0  # a worker process waiting for its next test

SIZE = 16 << 20  # sender source and receiver region
GUARD = 1 << 20  # unregistered bytes on both sides of the receiver region
BIG = 8 << 20  # (a) one large write into [0, BIG)
NSMALL = 1536  # (b) scattered small writes, one per SLOT-sized slot after BIG
SLOT = 2048
SPARE = BIG + NSMALL * SLOT  # [SPARE, SIZE) must stay zero: rejected batches aim there
SEED = 20240611

assert SPARE + (1 << 20) <= SIZE


def _require_engine(backend: str) -> None:
    reason = probe_engine(backend)
    if reason is None:
        return
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: the engines must be installed)")
    pytest.skip(reason)


# ----------------------------------------------------------------------------
# Two-process byte check (runs in spawned children)
# ----------------------------------------------------------------------------
def _pattern(seed: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=gen)


def _child_recv(conn: Any, what: str) -> tuple:
    if not conn.poll(STEP_TIMEOUT_S):
        raise TimeoutError(f"child: no {what!r} from the test within {STEP_TIMEOUT_S} s")
    return conn.recv()


def _receiver(backend: str, conn: Any) -> None:
    import torch

    transport = make_transport(backend, "kv-recv")
    buf = torch.zeros(GUARD + SIZE + GUARD, dtype=torch.uint8)
    transport.register(buf[GUARD : GUARD + SIZE])
    conn.send(("metadata", transport.metadata()))

    _, ops, seed = _child_recv(conn, "check")
    src = _pattern(seed)
    expected = torch.zeros(SIZE, dtype=torch.uint8)
    for s, d, n in ops:
        expected[d : d + n] = src[s : s + n]
    inner = buf[GUARD : GUARD + SIZE]
    wrong = (inner != expected).nonzero().flatten()
    conn.send(
        (
            "result",
            {
                "mismatches": int(wrong.numel()),
                "first_mismatch": int(wrong[0]) if wrong.numel() else None,
                "guard_nonzero": int((buf[:GUARD] != 0).sum() + (buf[GUARD + SIZE :] != 0).sum()),
                "spare_nonzero": int((inner[SPARE:] != 0).sum()),
                "expected_nonzero": int((expected != 0).sum()),
            },
        )
    )
    _child_recv(conn, "finish")
    transport.close()


def _sender(backend: str, conn: Any) -> None:
    transport = make_transport(backend, "kv-send")
    src = _pattern(SEED)
    local = transport.register(src)
    _, metadata = _child_recv(conn, "peer")
    transport.add_peer("kv-recv", metadata)
    dst = transport.peer("kv-recv").regions[0]

    def addr_ops(ops: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        return [(local.addr + s, dst.addr + d, n) for s, d, n in ops]

    rng = random.Random(SEED)
    big = [(0, 0, BIG)]
    slots = list(range(NSMALL))
    rng.shuffle(slots)  # scattered, in no address order
    small = []
    for slot in slots:
        n = rng.randint(1, SLOT)  # odd sizes and offsets, not just aligned pages
        small.append((rng.randint(0, SIZE - n), BIG + slot * SLOT + rng.randint(0, SLOT - n), n))

    # Both batches in flight at once, then wait for each (bounded).
    h_big = transport.write("kv-recv", addr_ops(big))
    h_small = transport.write("kv-recv", addr_ops(small))
    transport.wait(h_big, XFER_TIMEOUT_S, "8 MiB write")
    transport.wait(h_small, XFER_TIMEOUT_S, f"{NSMALL} small writes")
    posted_ok = transport.requests_posted

    # Each rejected batch carries valid ops aimed at the spare area plus one bad op;
    # the receiver proves nothing of it landed.
    valid = [(0, SPARE + i * 4096, 1024) for i in range(8)]
    bad_ops = {
        "remote past region end": (local.addr, dst.end - 16, 64),
        "remote before region start": (local.addr, dst.addr - 64, 128),
        "local outside registered": (local.addr + SIZE - 8, dst.addr + SPARE, 64),
        "zero length": (local.addr, dst.addr + SPARE, 0),
    }
    errors: dict[str, str | None] = {}
    for label, op in bad_ops.items():
        try:
            transport.write("kv-recv", [*addr_ops(valid), op])
            errors[label] = None
        except TransferError as e:
            errors[label] = str(e)
    try:
        transport.write("nobody", addr_ops(valid))
        errors["unknown peer"] = None
    except TransferError as e:
        errors["unknown peer"] = str(e)

    conn.send(
        (
            "done",
            {
                "ops": big + small,
                "posted_ok": posted_ok,
                "posted_after_rejects": transport.requests_posted,
                "errors": errors,
            },
        )
    )
    _child_recv(conn, "finish")
    transport.close()


def _worker_main(role: str, conn: Any) -> None:
    """One long-lived child per role, serving every backend in turn.

    Importing torch costs seconds here; one receiver and one sender process for the
    whole module halve the start-up of a process pair per backend.
    """
    run = _receiver if role == "receiver" else _sender
    while True:
        # Bounded like every wait: an orphaned worker leaves on its own.
        if not conn.poll(WORKER_IDLE_S):
            return
        msg = conn.recv()
        if msg[0] != "run":
            return
        try:
            run(msg[1], conn)
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class _Worker:
    def __init__(self, ctx: Any, role: str) -> None:
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(role, child), name=role, daemon=True)
        self.proc.start()
        # Drop our copy of the child's end, so a child that dies reads as EOF here at
        # once instead of a silent pipe until the step timeout.
        child.close()

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def expect(self, tag: str) -> tuple:
        if not self.conn.poll(STEP_TIMEOUT_S):
            pytest.fail(
                f"timed out after {STEP_TIMEOUT_S} s waiting for {tag!r} from the {self.role}"
            )
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            pytest.fail(
                f"the {self.role} died before sending {tag!r} (exit code {self.proc.exitcode})"
            )
        if msg[0] == "error":
            pytest.fail(f"the {self.role} failed:\n{msg[1]}")
        assert msg[0] == tag, msg
        return msg

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("quit")
            except OSError:
                pass
            self.proc.join(STEP_TIMEOUT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class _Workers:
    """The receiver/sender pair; restarted if a test left one dead or out of step."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.pair: tuple[_Worker, _Worker] | None = None

    def get(self) -> tuple[_Worker, _Worker]:
        if self.pair is None or not all(w.proc.is_alive() for w in self.pair):
            self.stop()
            self.pair = (_Worker(self.ctx, "receiver"), _Worker(self.ctx, "sender"))
        return self.pair

    def stop(self) -> None:
        if self.pair is not None:
            for worker in self.pair:  # ask both first, so they shut down in parallel
                try:
                    worker.send("quit")
                except OSError:
                    pass
            for worker in self.pair:
                worker.stop()
            self.pair = None


@pytest.fixture(scope="module")
def workers() -> Any:
    pool = _Workers()
    yield pool
    pool.stop()


@pytest.mark.hw
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.slow
def test_two_processes_every_byte_lands(backend: str, workers: _Workers) -> None:
    receiver, sender = workers.get()  # start the children first: they boot while we probe
    _require_engine(backend)
    ok = False
    try:
        receiver.send("run", backend)
        sender.send("run", backend)
        _, metadata = receiver.expect("metadata")
        sender.send("peer", metadata)
        _, report = sender.expect("done")
        receiver.send("check", report["ops"], SEED)
        _, result = receiver.expect("result")
        for worker in (sender, receiver):
            worker.send("finish")
        ok = True
    finally:
        if not ok:
            workers.stop()  # a failed run leaves the pair mid-protocol: start afresh

    assert result["expected_nonzero"] > BIG // 2, "pattern is degenerate; the check proves nothing"
    assert result["mismatches"] == 0, result
    assert result["guard_nonzero"] == 0, "bytes outside the registered region were written"
    assert result["spare_nonzero"] == 0, "a rejected batch was partly posted"
    assert report["posted_ok"] == 1 + NSMALL
    assert report["posted_after_rejects"] == report["posted_ok"], "rejected ops were counted"
    for label, message in report["errors"].items():
        assert message is not None, f"{label}: no TransferError"
        assert message.startswith(f"{backend}:"), message
    assert "kv-recv" in report["errors"]["remote past region end"]
    assert "outside" in report["errors"]["remote past region end"]
    assert "nobody" in report["errors"]["unknown peer"]


# ----------------------------------------------------------------------------
# Factory
# ----------------------------------------------------------------------------
def test_unknown_backend_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match=r"unknown transport backend 'gloo'.*'mooncake'.*'nixl'"):
        make_transport("gloo", "a")


def test_missing_engine_is_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstage.hw.transport.nixl import NixlTransport

    monkeypatch.setattr(NixlTransport, "engine_module", "no_such_engine_module")
    with pytest.raises(
        EngineUnavailableError, match=r"nixl: cannot import no_such_engine_module.*pip install"
    ):
        make_transport("nixl", "a")
    assert "no_such_engine_module" in (probe_engine("nixl") or "")


def test_backend_names_are_case_insensitive() -> None:
    with pytest.raises(ValueError, match="unknown device"):
        make_transport(" NIXL ", "a", device="tpu")  # resolves the backend, then the device


# ----------------------------------------------------------------------------
# Base class, with an in-process memmove engine
# ----------------------------------------------------------------------------
class _MemmoveTransport(Transport):
    """Copies with ctypes.memmove; 'peers' are other instances in this process."""

    name = "memmove"
    polls_to_finish = 2  # pretend the engine needs a few polls
    mode = "ok"  # "ok" | "never" (never completes) | "fail"

    def __init__(self, agent_name: str, device: str = "cpu") -> None:
        super().__init__(agent_name, device)
        self.closed_native: bool | None = None

    def _register_native(self, addr: int, nbytes: int) -> None:
        pass

    def _deregister_native(self, addr: int, nbytes: int) -> None:
        pass

    def _native_metadata(self) -> bytes:
        return b"blob:" + self.agent_name.encode()

    def _add_peer_native(self, peer: PeerInfo) -> Any:
        assert peer.engine_blob == b"blob:" + peer.name.encode()
        return None

    def _post(self, peer: PeerInfo, ops: Any) -> Any:
        for local, remote, n in ops.tolist():
            ctypes.memmove(remote, local, n)
        return {"polls": self.polls_to_finish}

    def _check(self, native: Any) -> bool:
        if self.mode == "fail":
            raise RuntimeError("link down")
        if self.mode == "never":
            return False
        native["polls"] -= 1
        return native["polls"] <= 0

    def _close_native(self, in_flight: bool) -> None:
        self.closed_native = in_flight


def _pair() -> tuple[_MemmoveTransport, _MemmoveTransport, Any, Any, Region, Region]:
    import torch

    a, b = _MemmoveTransport("a"), _MemmoveTransport("b")
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)  # 16 KiB
    dst = torch.zeros(16384, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    a.add_peer("b", b.metadata())
    return a, b, src, dst, ra, rb


def test_metadata_round_trip_and_write() -> None:
    a, b, src, dst, ra, rb = _pair()
    info = a.peer("b")
    assert info.regions == (rb,) and info.device_type == "cpu" and info.device_id == 0
    handle = a.write("b", [(ra.addr, rb.addr + 100, 50), (ra.addr + 1000, rb.addr, 10)])
    a.wait(handle, 5.0, "two ops")
    assert handle.done and a.poll(handle)
    assert bytes(dst[100:150]) == bytes(src[:50]) and bytes(dst[:10]) == bytes(src[1000:1010])
    assert (a.requests_posted, a.writes_posted, a.bytes_posted) == (2, 1, 60)
    empty = a.write("b", [])
    assert a.poll(empty) and a.requests_posted == 2


def test_overlapping_views_validate_as_one_region() -> None:
    import torch

    a, b, src, _, ra, _ = _pair()
    big = torch.zeros(8192, dtype=torch.uint8)
    c = _MemmoveTransport("c")
    c.register(big[4096:])  # registered before the whole: indices must merge
    c.register(big)
    a.add_peer("c", c.metadata())
    base = big.data_ptr()
    a.wait(a.write("c", [(ra.addr, base + 4000, 200)]), 5.0)  # spans both views
    assert bytes(big[4000:4200]) == bytes(src[:200])
    with pytest.raises(TransferError, match="outside"):
        a.write("c", [(ra.addr, base + 8100, 200)])


@pytest.mark.parametrize(
    "op_offsets, match",
    [
        ((0, 16384 - 8, 16), "remote range"),
        ((0, -1, 16), "remote range"),
        ((16384 - 4, 0, 16), "local range"),
        ((0, 0, 0), "non-positive length"),
        ((0, 0, -5), "non-positive length"),
    ],
)
def test_bad_ops_are_refused_before_posting(op_offsets: tuple[int, int, int], match: str) -> None:
    a, b, _, dst, ra, rb = _pair()
    ls, rs, n = op_offsets
    good = (ra.addr, rb.addr, 64)
    with pytest.raises(TransferError, match=match) as err:
        a.write("b", [good, (ra.addr + ls, rb.addr + rs, n)])
    assert str(err.value).startswith("memmove:") and "'b'" in str(err.value)
    assert int(dst.sum()) == 0 and a.requests_posted == 0  # the good op was not posted either


def test_malformed_ops_and_unknown_peer() -> None:
    a, *_ = _pair()
    with pytest.raises(TransferError, match="triples"):
        a.write("b", [(1, 2)])
    with pytest.raises(TransferError, match=r"unknown peer 'z'.*add_peer"):
        a.write("z", [(1, 2, 3)])


def test_add_peer_rejects_wrong_or_broken_metadata() -> None:
    a, b, *_ = _pair()
    with pytest.raises(TransferError, match="malformed"):
        a.add_peer("b", b"garbage")
    with pytest.raises(TransferError, match="belongs to agent 'b'"):
        a.add_peer("c", b.metadata())

    class Other(_MemmoveTransport):
        name = "other"

    with pytest.raises(TransferError, match="engine 'other'"):
        a.add_peer("x", Other("x").metadata())


def test_wait_timeout_names_what_was_awaited() -> None:
    a, _, _, _, ra, rb = _pair()
    a.mode = "never"
    handle = a.write("b", [(ra.addr, rb.addr, 8)])
    with pytest.raises(
        TransferError, match=r"memmove: timed out after 0.05 s waiting for chunk 7.*'b'"
    ):
        a.wait(handle, 0.05, "chunk 7")
    with pytest.raises(ValueError):
        a.wait(handle, 0)
    a.close_drain_s = 0.05
    a.close()  # drains (bounded), then tells the adapter a write is still in flight
    assert a.closed_native is True


def test_failure_raises_and_stays_raised() -> None:
    a, _, _, _, ra, rb = _pair()
    a.mode = "fail"
    handle = a.write("b", [(ra.addr, rb.addr, 8)])
    for _ in range(2):
        with pytest.raises(
            TransferError, match=r"memmove: write of 1 op\(s\), 8 B to peer 'b' failed: link down"
        ):
            a.poll(handle)


class _LaneTransport(_MemmoveTransport):
    """The memmove engine, each batch carried out on its peer's lane (as NIXL's, Mooncake's)."""

    name = "lanes"

    def _post(self, peer: PeerInfo, ops: Any) -> Any:
        batch = LaneBatch()
        self._on_lane(peer, batch, lambda _peer, _batch: _MemmoveTransport._post(self, peer, ops))
        return batch

    def _check(self, native: Any) -> bool:
        return native.ended()


def test_close_ends_the_lane_threads() -> None:
    """A transport's lane threads (one per peer) end with it: a process that makes
    transports one after another (a test's attacker, a tool) does not keep them all."""
    import threading

    import torch

    a, b = _LaneTransport("a"), _LaneTransport("b")
    src, dst = torch.full((64,), 7, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    a.add_peer("b", b.metadata())
    a.wait(a.write("b", [(ra.addr, rb.addr, 64)]), 5.0, "one op")
    assert bytes(dst) == bytes(src)
    lanes = [t for t in threading.enumerate() if t.name == "lanes-lane-b"]
    assert len(lanes) == 1
    a.close()
    lanes[0].join(5.0)
    assert not lanes[0].is_alive()


def test_register_checks_and_close() -> None:
    import torch

    t = _MemmoveTransport("t")
    with pytest.raises(ValueError, match="contiguous"):
        t.register(torch.zeros(8, 8, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="empty"):
        t.register(torch.zeros(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unknown device"):
        _MemmoveTransport("u", device="gpu")
    t.close()
    t.close()  # idempotent
    assert t.closed_native is False
    with pytest.raises(TransferError, match="closed"):
        t.metadata()


def test_a_deregistered_region_is_refused_as_a_source() -> None:
    a, b, src, dst, ra, rb = _pair()
    a.wait(a.write("b", [(ra.addr, rb.addr, 4096)]), 5.0)
    a.deregister(ra)
    assert a.regions == ()
    with pytest.raises(TransferError, match="outside the regions registered by 'a'"):
        a.write("b", [(ra.addr, rb.addr, 4096)])
    with pytest.raises(ValueError, match=r"is not registered by agent 'a'; allowed: a region"):
        a.deregister(ra)
    again = a.register(src)  # and it can be registered again
    a.wait(a.write("b", [(again.addr, rb.addr, 16384)]), 5.0)
    assert bytes(dst.numpy()) == bytes(src.numpy())


def test_a_region_a_posted_write_reads_from_is_not_deregistered() -> None:
    a, b, src, dst, ra, rb = _pair()
    a.mode = "never"
    handle = a.write("b", [(ra.addr + 4096, rb.addr, 4096)])
    with pytest.raises(TransferError, match=r"1 posted write\(s\) to \['b'\] still read from it"):
        a.deregister(ra)
    assert a.regions == (ra,)  # still registered
    a.mode = "ok"
    a.wait(handle, 5.0)
    a.deregister(ra)
    assert a.regions == ()


def test_a_region_between_the_regions_a_write_reads_can_be_deregistered() -> None:
    """The slice path's pages (hw/rank/prefill.py `SourceRuns`): one write reads runs of
    the pool on both sides of another write's runs. When the registered regions are
    disjoint, a region counts as busy only if a posted write reads inside it, not if it
    merely lies between the bytes that write reads; regions that overlap fall back to
    the span of the write."""
    import torch

    a, b = _MemmoveTransport("a"), _MemmoveTransport("b")
    pool = torch.zeros(3 * 4096, dtype=torch.uint8)
    dst = torch.zeros(8192, dtype=torch.uint8)
    rb = b.register(dst)
    a.add_peer("b", b.metadata())
    first, middle, last = (a.register(pool[k * 4096 : (k + 1) * 4096]) for k in range(3))
    a.mode = "never"
    handle = a.write("b", [(first.addr, rb.addr, 4096), (last.addr, rb.addr + 4096, 4096)])
    assert handle.reads == frozenset({first, last})
    a.deregister(middle)  # inside the write's span, read by none of its ops
    for busy in (first, last):
        with pytest.raises(TransferError, match=r"1 posted write\(s\) to \['b'\] still read"):
            a.deregister(busy)
    a.mode = "ok"
    a.wait(handle, 5.0)
    a.deregister(first)
    # overlapping regions: which one an op reads is not known, so the whole span counts
    whole, inner = a.register(pool), a.register(pool[4096:8192])
    a.mode = "never"
    handle = a.write("b", [(whole.addr, rb.addr, 4096), (last.addr, rb.addr + 4096, 4096)])
    assert handle.reads is None
    with pytest.raises(TransferError, match="still read"):
        a.deregister(inner)
    # an op across two regions that adjoin lies in both
    a.mode = "ok"
    a.wait(handle, 5.0)
    a.deregister(whole)
    a.deregister(inner)
    left, right = a.register(pool[:4096]), a.register(pool[4096:8192])
    a.mode = "never"
    handle = a.write("b", [(left.addr + 2048, rb.addr, 4096)])  # 2 KiB in each
    assert handle.reads is None
    with pytest.raises(TransferError, match="still read"):
        a.deregister(right)
    a.deregister(last)  # outside the write's span


@pytest.mark.hw
@pytest.mark.timeout(120)
def test_mooncake_refuses_a_read_of_a_deregistered_block() -> None:
    """What registered memory is to a process outside the run (issue 39, item 3):
    readable through Mooncake's open port while registered, refused once deregistered.
    A source (a prefill's send block, a slice write's pages: register(source=True)) is
    never given to Mooncake over TCP, which sends a write's source from its address: no
    outsider reads or writes it while it is registered, and the write from it lands."""
    _require_engine("mooncake")
    import numpy as np
    import torch
    from mooncake.engine import TransferEngine

    t, peer = make_transport("mooncake", "block-owner"), make_transport("mooncake", "ring")
    outsider = TransferEngine()
    try:
        assert outsider.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        into = np.zeros(4096, dtype=np.uint8)
        assert outsider.register_memory(into.ctypes.data, into.nbytes) == 0
        block = torch.full((4096,), 0x3C, dtype=torch.uint8)
        region = t.register(block)
        read = [t.session, [into.ctypes.data], [region.addr], [4096]]
        assert outsider.batch_transfer_sync_read(*read) == 0
        assert (into == 0x3C).all()
        t.deregister(region)
        into[:] = 0
        assert outsider.batch_transfer_sync_read(*read) != 0
        assert (into == 0).all()
        # a source: kvstage checks writes against it, Mooncake's port serves nothing of it
        assert not t.sources_on_engine
        ring = torch.zeros(4096, dtype=torch.uint8)
        peer.register(ring)
        t.add_peer("ring", peer.metadata())
        source = t.register(block, source=True)
        assert outsider.batch_transfer_sync_read(*read) != 0
        assert outsider.batch_transfer_sync_write(*read) != 0
        assert (into == 0).all() and (block == 0x3C).all()
        t.wait(t.write("ring", [(source.addr, int(ring.data_ptr()), 4096)]), 10.0, "source")
        deadline = time.monotonic() + 10  # over TCP complete means sent, not yet landed
        while not (ring == 0x3C).all() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert (ring == 0x3C).all()
        with pytest.raises(TransferError, match="outside the regions registered"):
            t.write("ring", [(source.addr + 4096, int(ring.data_ptr()), 1)])
        t.deregister(source)
        assert t.regions == ()
        outsider.unregister_memory(into.ctypes.data)
    finally:
        del outsider
        t.close()
        peer.close()
