"""Verified before scattered (issue 25, item 4; issue 39, item 2): transfer.verify_writes,
"mac" (the default) and "checksum".

Each writer sends, in CHUNK_READY, a tag of the block it wrote into the decode's
staging ring (hw/rank/writemac.py, keyed by its pair key with the decode and the grant's
nonce); the decode copies the region out of the ring, checks every block of the copy
and scatters only a copy that passes (hw/rank/decode.py). Two writers that are not the
granted one, on real transfers (hardware mode, P2->D1, every byte verified), write
junk over the region of room HELD's first chunk, over and over, from before the first
room until the run ends:

- an insider holding the run secret, through a transfer engine of its own (NIXL and
  Mooncake);
- a process with no secret and no kvstage code that writes into the ring through
  Mooncake's open TCP port (docs/hardware-mode.md, the engines' own listeners) with
  Mooncake's own API: only the target's address and session are looked up here
  (`ss -ltnp` shows the port; the handshake answers with the segment's buffers),
  and once into the decode's KV pool, which the staging path does not register.

The window such a write has to land in (after the granted writers' writes, before the
decode's copy) is held open by construction, not left to timing: `faults.late_scatter`
makes the decode start that chunk's scatter HOLD_S after its last CHUNK_READY, and the
attacker, ready before t0, writes every PAUSE_S, so about a hundred of its writes land in it
(a copy right after the CHUNK_READYs, unheld, is a window of microseconds that a
neighbour on a loaded host can close: 2 runs in 5 missed every room). That region is
the ring's first, offset 0 (room HELD = 0 arrives first: each prefill rank asks for its
first chunk before any other, and the decode opens rooms in arrival order; the trace's
grant is checked), and, with a ring larger than the whole workload (one round), no other room's: so
exactly room HELD fails, on a rejected write, and every other room is done.

Asserted: 0 bytes wrong in the KV cache, the region where the attack aimed, a rejected
write, exactly room HELD failed and on a rejected write, every other room done and
verified, no invariant violated.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from conftest import require_engine, require_triton
from test_hw import write_scenario

from kvstage.hw.launch.launcher import launch
from kvstage.hw.rank.kvpool import PoolDesc
from kvstage.hw.transport.base import TransferError, _unpack_metadata, make_transport
from kvstage.hw.transport.placement import transport_options
from kvstage.shared.invariants import check_records
from kvstage.shared.layout import room_pages
from kvstage.shared.scenario import load_scenario
from kvstage.shared.trace import TraceRecord
from kvstage.shared.workload import generate_requests

pytestmark = [pytest.mark.hw, pytest.mark.timeout(300)]

REQUESTS = 16  # at 20 rooms/s (write_scenario): arrivals over 0.8 s
HELD = 0  # the room whose first chunk's scatter starts late, and is attacked
HOLD_S = 1.0  # faults.late_scatter: how long its written region waits in the ring
PAUSE_S = 0.01  # between two of the attacker's writes: ~HOLD_S / PAUSE_S land in the window
# (at 2 ms a Mooncake attacker took about half a core beside the ranks, on a loaded host)
RING_MB = 8  # decode.staging_pool_mb: more than the workload's regions (one round)


def _scenario(tmp_path, backend: str, kind: str, path: str = "staging", extra=()):
    late = f"late_scatter = [{{ room = {HELD}, chunk = 0, seconds = {HOLD_S} }}]"
    path = write_scenario(tmp_path, 2, 1, 8, requests=REQUESTS, faults=late, path=path)
    kinds = [] if kind == "mac" else [f"transfer.verify_writes={kind}"]  # "mac": the default
    s = load_scenario(
        path,
        overrides=[
            f"hardware.backend={backend}",
            f"decode.staging_pool_mb={RING_MB}",
            *kinds,
            *extra,
        ],
    )
    assert s.transfer.verify_writes == kind
    return s


def _chunk_regions(s) -> list[list[int]]:
    """The staging bytes of each chunk of each room (the decode's grid)."""
    g = s.geometry()
    return [
        [
            g.region_bytes(c.num_pages)
            for c in g.chunks(room_pages(r.prompt_tokens, r.prefix_tokens, g.page_size))
        ]
        for r in generate_requests(s)
    ]


def _held_region(s) -> int:
    """The size of room HELD's first region, at the ring's offset 0. Every region of the
    workload fits in the ring at once, so the ring never wraps: no other room's region
    ever lies there."""
    regions = _chunk_regions(s)
    assert HELD == 0 and sum(map(sum, regions)) <= s.pool_bytes, "the ring would wrap"
    return regions[HELD][0]


class _Insider:
    """A secret holder's own transfer engine writing into the decode's ring (built
    before the run: it writes from the table on, before t0)."""

    def __init__(self, s, size: int) -> None:
        backend = s.hardware.backend
        opts = transport_options(s.hardware, backend, "127.0.0.1")
        self.t = make_transport(backend, "kvstage-insider", "cpu", **opts)
        self.junk = torch.full((size,), 0xA5, dtype=torch.uint8)
        self.t.register(self.junk)
        self.size = size

    def aim(self, table: dict) -> None:
        info = table["decode0"]
        self.t.add_peer(info.agent, info.metadata)
        self.peer, self.ring = info.agent, int(info.extra["ring_addr"])

    def write(self) -> bool:
        ops = [(int(self.junk.data_ptr()), self.ring, self.size)]
        try:
            self.t.wait(self.t.write(self.peer, ops), 10.0, "insider")
        except TransferError:  # the decode is gone (the run ended) or refused it
            return False
        return True

    def close(self) -> None:
        self.t.close()


class _CoWriter(_Insider):
    """What a compromised prefill1 writes on the slice path, where every writer's head
    slices land straight in the decode's KV pool (registered there): junk over its
    co-writer prefill0's slices of room HELD's first chunk, one write per (K/V, layer,
    token), through an engine of its own. The bytes and addresses are those prefill1's
    own engine would write; its engine's name is not what the decode checks."""

    def __init__(self, s, size: int) -> None:
        g = s.geometry()
        self.heads = g.head_slice(0, 0)  # prefill0's heads in decode0's pages
        held = generate_requests(s)[HELD]
        first = g.chunks(room_pages(held.prompt_tokens, held.prefix_tokens, g.page_size))[0]
        # room HELD opens first on an empty pool, so its pages start at 0 (first fit,
        # shared/pages.py; _assert_slice_caught checks the order): its chunk 0's tokens
        self.tokens = first.num_pages * g.page_size
        super().__init__(s, size)

    def aim(self, table: dict) -> None:
        super().aim(table)
        pool = PoolDesc.from_wire(table["decode0"].extra["kv_pool"])
        run = self.heads.num_heads * pool.token_bytes_per_head
        assert run <= self.size
        src = int(self.junk.data_ptr())
        self.ops = [
            (src, pool.addr(kv, layer, token, self.heads.dst_head_start), run)
            for kv in range(pool.kv_planes)
            for layer in range(pool.layers)
            for token in range(self.tokens)
        ]

    def write(self) -> bool:
        try:
            self.t.wait(self.t.write(self.peer, self.ops), 10.0, "co-writer")
        except TransferError:
            return False
        return True


class _RawMooncake:
    """Mooncake's own engine, no kvstage code and no secret in the write path."""

    def __init__(self, s, size: int) -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.junk = np.full(size, 0x5A, dtype=np.uint8)
        assert self.engine.register_memory(self.junk.ctypes.data, self.junk.nbytes) == 0
        self.size = size
        self.probes: dict[str, int] = {}

    def aim(self, table: dict) -> None:
        info = table["decode0"]
        self.session = _unpack_metadata(info.metadata)[1].decode()  # host:port, what `ss` shows
        self.ring = int(info.extra["ring_addr"])
        local = self.junk.ctypes.data
        # the KV pool is not registered on the staging path (hw/rank/decode.py): refused
        pool = int(info.extra["kv_pool"]["base_addr"])
        self.probes["pool_write_rc"] = self.engine.batch_transfer_sync_write(
            self.session, [local], [pool], [4096]
        )
        # nor is a prefill's KV pool (hw/rank/prefill.py, issue 39 item 3): a read is refused
        prefill = table["prefill0"]
        self.probes["prefill_pool_read_rc"] = self.engine.batch_transfer_sync_read(
            _unpack_metadata(prefill.metadata)[1].decode(),
            [local],
            [int(prefill.extra["kv_pool"]["base_addr"])],
            [4096],
        )

    def write(self) -> bool:
        rc = self.engine.batch_transfer_sync_write(
            self.session, [self.junk.ctypes.data], [self.ring], [self.size]
        )
        return rc == 0

    def close(self) -> None:
        self.engine.unregister_memory(self.junk.ctypes.data)
        del self.engine  # its threads and listener go with it


class _RawReader(_RawMooncake):
    """Mooncake's own engine, no kvstage code and no secret, reading the decode's ring
    through its open port: room HELD's first region, every PAUSE_S (the attack's act is
    this read), while the region waits HOLD_S there before its scatter."""

    def __init__(self, s, size: int) -> None:
        super().__init__(s, size)
        self.junk[:] = 0
        self.seen: list[np.ndarray] = []  # each read that found bytes written there

    def write(self) -> bool:
        self.junk[:] = 0
        rc = self.engine.batch_transfer_sync_read(
            self.session, [self.junk.ctypes.data], [self.ring], [self.size]
        )
        if rc == 0 and self.junk.any() and len(self.seen) < 64:
            self.seen.append(self.junk.copy())
        return rc == 0


class _RawPrefillPool(_RawMooncake):
    """Mooncake's own engine, no kvstage code and no secret, aimed at prefill0's KV pool
    on the slice path, where the pool is the source of the writes: a write and a read
    at the table (before t0), then junk over room HELD's first chunk's pages of K, layer
    0 (room HELD opens first on an empty pool: its pages start at 0) every PAUSE_S, each
    followed by a read of them, until the run ends."""

    def __init__(self, s, size: int) -> None:
        super().__init__(s, size)
        g = s.geometry()
        held = generate_requests(s)[HELD]
        self.pages = g.chunks(room_pages(held.prompt_tokens, held.prefix_tokens, g.page_size))[0]
        self.reader = np.zeros(size, dtype=np.uint8)
        assert self.engine.register_memory(self.reader.ctypes.data, self.reader.nbytes) == 0
        self.landed = self.read = 0

    def close(self) -> None:
        self.engine.unregister_memory(self.reader.ctypes.data)
        super().close()

    def aim(self, table: dict) -> None:
        info = table["prefill0"]
        header, blob = _unpack_metadata(info.metadata)
        self.session = blob.decode()
        self.probes["published_regions"] = len(header["regions"])  # what a peer may write
        pool = PoolDesc.from_wire(info.extra["kv_pool"])
        self.at, n = pool.page_runs(0, self.pages.num_pages)[0]
        self.n = min(n, self.size)
        self.probes["pool_write_rc"] = self._write()
        self.probes["pool_read_rc"] = self._read()

    def _write(self) -> int:
        local = self.junk.ctypes.data
        return self.engine.batch_transfer_sync_write(self.session, [local], [self.at], [self.n])

    def _read(self) -> int:
        local = self.reader.ctypes.data
        return self.engine.batch_transfer_sync_read(self.session, [local], [self.at], [self.n])

    def write(self) -> bool:
        self.landed += self._write() == 0
        self.read += self._read() == 0
        return True  # refused or not, it keeps trying until the run ends


def _kv_rows(read: np.ndarray, row_bytes: int) -> int:
    """How many rows of KV a read of a staging region holds. Every row of a room's KV
    (`kvstage.hw.rank.kvpool.pattern_bits`: a row is its 32-bit row hash repeated, XOR a
    mask of the room's) has the same shape, its words XOR its first word; so the rows of
    the read that share the commonest shape among its written rows. Ciphertext rows are
    noise: no two share a shape (224 bits here), so this counts at most 1."""
    words = read.view("<u4").reshape(-1, row_bytes // 4)
    words = words[words.any(axis=1)]  # rows written there
    if not len(words):
        return 0
    shapes = words[:, 1:] ^ words[:, :1]
    _, counts = np.unique(shapes, axis=0, return_counts=True)
    top = int(counts.max())
    return top if top > 1 else 0


def _attack(attacker, table: dict, t0: float, stop: threading.Event, stats: dict) -> None:
    """Aim at the decode's ring, then write junk over room HELD's region every PAUSE_S
    until the run ends: how many writes landed, and from when."""
    attacker.aim(table)
    stats["aimed_after_t0_s"] = round(time.time() - t0, 3)  # what a failure says
    while not stop.is_set():
        if attacker.write():
            stats["writes"] += 1
        elif stats["writes"]:
            # refused after its writes landed: the decode is gone, the run is over (a
            # blocking write to a peer that is gone can hold the launcher's thread up)
            break
        stop.wait(PAUSE_S)


def _run(tmp_path, backend: str, make_attacker, kind: str = "mac", path: str = "staging", extra=()):
    require_engine(backend)
    s = _scenario(tmp_path, backend, kind, path, extra)
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "scenario.toml").write_text(s.to_toml())
    attacker = make_attacker(s, _held_region(s))
    stats = {"writes": 0}
    stop = threading.Event()
    threads = []

    def on_table(table, t0):
        args = (attacker, table, t0, stop, stats)
        th = threading.Thread(target=_attack, args=args, daemon=True)
        th.start()
        threads.append(th)

    try:
        result = launch(
            run_dir / "scenario.toml",
            2,
            1,
            run_dir / "logs",
            backend=backend,
            device="cpu",
            timeout_s=240,
            on_table=on_table,
        )
    finally:
        stop.set()
        for th in threads:
            th.join(30)
        attacker.close()
    return s, result, stats, attacker


def _assert_rejected_not_scattered(s, result, stats: dict) -> None:
    reports = result.reports
    assert set(reports) == {"prefill0", "prefill1", "decode0"}, result.errors
    dec = reports["decode0"]
    seen = {k: dec.get(k) for k in ("writes_rejected", "rooms_done", "rooms_failed", "failures")}
    records = sorted(
        (TraceRecord(*row) for r in reports.values() for row in r["records"]),
        key=lambda r: (r.end, r.start, r.role, r.rank),
    )
    # the attack aimed where room HELD's first chunk was: the ring's first region
    held = [
        (r.offset, r.bytes)
        for r in records
        if r.role == "decode" and r.phase == "req" and (r.room, r.chunk) == (HELD, 0)
    ]
    assert held and set(held) == {(0, _held_region(s))}, held
    assert stats["writes"] > 0, (stats, seen)
    assert sum(r.get("bytes_wrong", 0) for r in reports.values()) == 0
    assert dec["writes_rejected"] > 0, (stats, seen)
    assert dec["bytes_checksummed"] > 0
    # exactly the held room failed, on a rejected write; every other room is done
    assert {int(room) for room in dec["failures"]} == {HELD}, (stats, seen)
    assert "write rejected" in str(dec["failures"][str(HELD)]), seen
    assert dec["rooms_failed"] == 1 and dec["rooms_done"] == REQUESTS - 1, (stats, seen)
    assert dec["rooms_verified"] == dec["rooms_done"]
    assert not check_records(records, s.transfer.path)


def _assert_slices_caught(s, result, stats: dict) -> None:
    """The slice path: the attacked chunk's check (before the room is done) rejects
    prefill0's block, exactly room HELD fails, and no done room holds a wrong byte."""
    reports = result.reports
    assert set(reports) == {"prefill0", "prefill1", "decode0"}, result.errors
    dec = reports["decode0"]
    seen = {k: dec.get(k) for k in ("writes_rejected", "rooms_done", "rooms_failed", "failures")}
    records = [TraceRecord(*row) for row in dec["records"]]
    opens = sorted((r.start, r.room) for r in records if r.phase == "room_open")
    failed = [r.end for r in records if r.phase == "room_failed" and r.room == HELD]
    # the attack aimed at pages [0, ...): room HELD's, as the first room opened on an
    # empty pool (first fit); every other room opened before room HELD failed and freed
    # them, so no other room's pages were ever under the attack
    assert opens[0][1] == HELD and len(opens) == REQUESTS, opens
    assert failed and all(start < failed[0] for start, _ in opens), (opens, failed)
    assert stats["writes"] > 0, (stats, seen)
    assert sum(r.get("bytes_wrong", 0) for r in reports.values()) == 0
    assert dec["writes_rejected"] > 0 and dec["bytes_checksummed"] > 0, (stats, seen)
    assert {int(room) for room in dec["failures"]} == {HELD}, (stats, seen)
    why = str(dec["failures"][str(HELD)])
    assert "write rejected" in why and "(prefill rank 0," in why, seen
    assert dec["rooms_failed"] == 1 and dec["rooms_done"] == REQUESTS - 1, (stats, seen)
    assert dec["rooms_verified"] == dec["rooms_done"]
    every = [TraceRecord(*row) for r in reports.values() for row in r["records"]]
    every.sort(key=lambda r: (r.end, r.start, r.role, r.rank))
    assert not check_records(every, s.transfer.path)


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_co_writers_write_over_the_other_writers_slices_is_caught(tmp_path, backend):
    """Issue 39: the slice path, default settings (transfer.verify_writes = "mac")."""
    s, result, stats, _ = _run(tmp_path, backend, _CoWriter, path="slice")
    assert s.transfer.path == "slice"
    _assert_slices_caught(s, result, stats)


@pytest.mark.parametrize(
    ("backend", "kind"), [("nixl", "mac"), ("mooncake", "mac"), ("nixl", "checksum")]
)
def test_an_insiders_write_over_a_written_region_is_never_scattered(tmp_path, backend, kind):
    s, result, stats, _ = _run(tmp_path, backend, _Insider, kind)
    _assert_rejected_not_scattered(s, result, stats)


@pytest.mark.slow
def test_a_raw_write_through_mooncakes_open_port_is_never_scattered(tmp_path):
    s, result, stats, raw = _run(tmp_path, "mooncake", _RawMooncake)
    _assert_rejected_not_scattered(s, result, stats)
    assert raw.probes["pool_write_rc"] != 0, "a write into the unregistered KV pool landed"
    assert raw.probes["prefill_pool_read_rc"] != 0, "a read of a prefill's unregistered pool worked"


def test_on_the_slice_path_a_prefills_pool_is_on_the_engine_only_while_written(tmp_path):
    """Issue 39, item 3: on the slice path a prefill's KV pool is the writes' source. Its
    pages are registered after their tag is taken, for the write that reads them only,
    and only where the engine needs a source registered (hw/rank/prefill.py `SourceRuns`,
    `Transport.sources_on_engine`): Mooncake over TCP sends from the address, so there
    the pool is never given to the engine. A process with no secret that writes and
    reads the pool through Mooncake's open port is refused at the table (the whole pool
    was registered there before: checked) and on every try through the run; 0 bytes
    wrong, and every room done."""
    s, result, stats, raw = _run(tmp_path, "mooncake", _RawPrefillPool, path="slice")
    assert s.transfer.path == "slice"
    assert raw.probes["pool_write_rc"] != 0, "a write into a prefill's pool at t0 landed"
    assert raw.probes["pool_read_rc"] != 0, "a read of a prefill's pool at t0 worked"
    assert raw.probes["published_regions"] == 0  # its metadata offers no memory to a peer
    reports = result.reports
    assert set(reports) == {"prefill0", "prefill1", "decode0"}, result.errors
    dec = reports["decode0"]
    seen = {"attempts": stats["writes"], "landed": raw.landed, "read": raw.read}
    seen.update({k: dec.get(k) for k in ("writes_rejected", "rooms_failed", "failures")})
    assert stats["writes"] > 1, (
        seen
    )  # it kept trying through the run (a refusal takes Mooncake ~1 s)
    assert raw.landed == 0 and raw.read == 0, seen  # never on Mooncake's port
    assert sum(r.get("bytes_wrong", 0) for r in reports.values()) == 0
    assert dec["rooms_done"] == dec["rooms_verified"] == REQUESTS, seen
    every = [TraceRecord(*row) for r in reports.values() for row in r["records"]]
    every.sort(key=lambda r: (r.end, r.start, r.role, r.rank))
    assert not check_records(every, s.transfer.path)
    print(seen)


# alone: the interpreted kernels hold the GIL in long stretches; beside the parallel
# part's tests on a two-core CI host a prefill's loop missed its heartbeats for 3 s
# (15 rooms failed, "prefill rank 0 stopped answering", clean-clone run of fb508f0)
@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.parametrize("path", ["staging", "slice"])
def test_the_gpu_path_checks_as_it_moves_and_catches_the_attacker(tmp_path, monkeypatch, path):
    """The GPU path's code in a whole run, where no GPU is: every rank runs the moves
    that carry the write tag (the writer's gather into its send buffer or, on the slice
    path, out of its pool; the decode's scatter out of the ring or its read of the
    pages) by Triton's interpreter on host pools (KVSTAGE_TAG_KERNEL_ON_HOST). The same
    attackers as above are caught the same way: 0 bytes wrong, exactly the held room
    failed on a rejected write, every other room done and verified, and the decode's
    checked bytes were all hashed by the moves themselves."""
    from kvstage.hw.rank.kernels import HOST_KERNEL_ENV

    require_triton()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(HOST_KERNEL_ENV, "1")
    attacker = _CoWriter if path == "slice" else _Insider
    # the kernels run in numpy under the interpreter, about 1 s per 512 KiB moved: on a
    # loaded two-core CI host a room's chunks outlast the default 30 s deadline (3-6
    # rooms timed out there waiting for their scatter); the deadline is liveness, and
    # this test is about what the moves catch
    slow = ("transfer.room_timeout_s=150",)
    s, result, stats, _ = _run(tmp_path, "nixl", attacker, path=path, extra=slow)
    (_assert_slices_caught if path == "slice" else _assert_rejected_not_scattered)(s, result, stats)
    dec = result.reports["decode0"]
    assert dec["bytes_hashed_in_moves"] == dec["bytes_checksummed"] > 0, dec
    if path == "staging":  # decrypted, by the host form (the kernel: tests/test_cipher.py)
        assert dec["bytes_decrypted"] > 0, dec


@pytest.mark.parametrize("cipher", ["chacha20", "none"])
def test_a_raw_read_of_the_ring_through_mooncakes_open_port_finds_no_kv(tmp_path, cipher):
    """Issue 39, item 3: Mooncake serves the registered ring to any process that reaches
    its port, so the ring holds ciphertext (transfer.encrypt_writes, the default
    "chacha20"). A process with no secret reads room HELD's region over and over while
    it waits there: by default it finds no row of KV in what it read, and the run is
    whole (every room done and verified, 0 bytes wrong, no invariant violated). With
    encrypt_writes = "none" the same reads find the region's KV rows: the attack and the
    count are real."""
    extra = () if cipher == "chacha20" else ("transfer.encrypt_writes=none",)
    s, result, stats, reader = _run(tmp_path, "mooncake", _RawReader, extra=extra)
    assert s.transfer.encrypt_writes == cipher
    reports = result.reports
    assert set(reports) == {"prefill0", "prefill1", "decode0"}, result.errors
    dec = reports["decode0"]
    assert dec["rooms_done"] == REQUESTS and dec["rooms_verified"] == REQUESTS, dec["failures"]
    assert sum(r.get("bytes_wrong", 0) for r in reports.values()) == 0
    assert dec["writes_rejected"] == 0
    records = sorted(
        (TraceRecord(*row) for r in reports.values() for row in r["records"]),
        key=lambda r: (r.end, r.start, r.role, r.rank),
    )
    assert not check_records(records, s.transfer.path)
    assert stats["writes"] > 0 and reader.seen, ("no read found written bytes", stats)
    g = s.geometry()
    rows = [_kv_rows(read, g.head_dim * g.dtype_bytes) for read in reader.seen]
    if cipher == "none":
        assert max(rows) > 0, rows
        assert dec["bytes_decrypted"] == 0
    else:
        assert max(rows) == 0, rows  # no row of KV in any read
        assert dec["bytes_decrypted"] == sum(map(sum, _chunk_regions(s)))
