"""A prefill rank process: forwards (pattern fills), gathers, bulk and slice writes."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvstage.hw.control.plane import rank_name
from kvstage.hw.control.rendezvous import RankInfo
from kvstage.hw.rank.cipher import cipher_key, xor_keystream
from kvstage.hw.rank.kernels import (
    fused_tag_possible,
    gather,
    gather_hashed,
    slice_ops,
    wait_for_stream,
)
from kvstage.hw.rank.kvpool import PoolDesc, fill_pattern
from kvstage.hw.rank.preflight import SEND_BUFFER_CHUNKS
from kvstage.hw.rank.process import BUSY_POLL_S, IDLE_POLL_S, RankProcess
from kvstage.hw.rank.writemac import block_tag, digest_tag, tag_key
from kvstage.hw.transport.bandwidth import (
    GB,
    PROBE_MIN_BYTES,
    PROBE_WRITES,
    probe_bytes,
    probe_pairs,
)
from kvstage.hw.transport.base import Region, TransferError, XferHandle
from kvstage.shared.events import (
    Forward,
    ForwardDone,
    ForwardStarted,
    Gather,
    GatherDone,
    SliceWrite,
    Write,
    WriteDone,
)
from kvstage.shared.serving.compute import packed_forward_s
from kvstage.shared.serving.prefill_batch import OpenForward

# Niceness added to the forward thread on a CPU device. There the forward's fill stands in
# for GPU compute, which on real hardware takes no CPU from the transfer engine; at equal
# priority two prefill ranks' fills kept a 2-core host busy and the writes (CMA copies,
# engine threads) ran at a fraction of the engine's speed.
FORWARD_NICE = int(os.environ.get("KVSTAGE_FORWARD_NICE", "10"))


def _lower_priority() -> None:
    """Thread initializer: run this (worker) thread at a lower CPU priority (Linux: per thread)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + FORWARD_NICE)
        )
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: the forward keeps the normal priority


class ByteArena:
    """First-fit allocator of byte ranges in one registered buffer (gather staging)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[list[int]] = [[0, size]] if size else []

    def alloc(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    self._free.pop(i)
                else:
                    self._free[i] = [start + n, length - n]
                return start
        return None

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    def free(self, start: int, n: int) -> None:
        self._free.append([start, n])
        self._free.sort()
        merged: list[list[int]] = []
        for s, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1][1] += length
            else:
                merged.append([s, length])
        self._free = merged


class SourceRuns:
    """The KV pool's bytes on the engine while a write reads them, and only then (the
    slice path, OVERSIZED chunks; issue 39, item 3): a write's pages are registered after
    its tag is taken, one region per (K/V, layer) run in one engine call, shared by the
    chunk's writes to several decode ranks, and taken off when the last of those writes
    ends. Bytes a peer writes into the pool before the tag meet an unregistered pool;
    after it, they are not the tagged bytes, and the decode's check rejects them. As
    sources (`Transport.sources_on_engine`): Mooncake over TCP is given none of it."""

    def __init__(self, transport, pool: torch.Tensor, desc: PoolDesc) -> None:
        self.transport = transport
        self.flat = pool.view(-1)  # the pool's bytes (uint8), desc.base_addr at 0
        self.desc = desc
        self.groups: dict[tuple[int, int], list[Region]] = {}  # (first, pages) -> regions
        self.refs: Counter[tuple[int, int]] = Counter()
        self.writes: dict[int, tuple[int, int]] = {}  # token -> its pages
        self.stuck: list[Region] = []  # taking off refused by the engine (logged)
        self._next = 0

    def open(self, first_page: int, num_pages: int) -> int:
        """Register the pages a write reads, unless another write holds them: a token
        for close(). Raises TransferError, having registered nothing."""
        pages = (first_page, num_pages)
        if not self.refs[pages]:
            base = self.desc.base_addr
            runs = self.desc.page_runs(first_page, num_pages)
            views = [self.flat[a - base : a - base + n] for a, n in runs]
            self.groups[pages] = self.transport.register_many(views, source=True)
        self.refs[pages] += 1
        self._next += 1
        self.writes[self._next] = pages
        return self._next

    def close(self, token: int) -> None:
        """The write of `token` ended: its pages, unless another write holds them, go
        off the engine."""
        pages = self.writes.pop(token)
        self.refs[pages] -= 1
        if self.refs[pages]:
            return
        del self.refs[pages]
        regions = self.groups.pop(pages)
        try:
            self.transport.deregister_many(regions)
        except TransferError as exc:
            log.warning("KV pool pages stay registered: %s", exc)
            self.stuck.extend(regions)

    @property
    def held(self) -> int:
        """Regions of the pool on the engine now."""
        return sum(map(len, self.groups.values())) + len(self.stuck)


log = logging.getLogger("kvstage.hw.rank.process")


@dataclass(slots=True)
class _Pending:
    """A posted transfer and what to report when it completes."""

    handle: XferHandle
    done: WriteDone
    release: Callable[[], None]  # gives back what the write held (its send-buffer block,
    # or its pages on the engine)


@dataclass(slots=True)
class _Computing:
    """The forward running on the compute thread: its chunks' fills, one job each."""

    jobs: list[Future]
    not_before: float  # with hardware.forward_delay: the modeled forward time
    forwards: list[Forward]  # the chunks packed into it, in order
    start: float


class PrefillRank(RankProcess):
    role = "prefill"

    def __init__(self, scenario, rank: int, rendezvous: str, **kw) -> None:
        super().__init__(scenario, rank, rendezvous, **kw)
        g = self.g
        # room for SEND_BUFFER_CHUNKS full chunks per decode rank written (every decode instance)
        targets = self.sessions.all_targets(rank)
        full = max(
            (
                g.block_bytes(
                    g.grid_pages * g.page_size, g.head_slice(self.local, d % g.decode_tp).num_heads
                )
                for d in targets
            ),
            default=0,
        )
        # (a rank that writes to nobody, as with MLA's one reader per decode rank, keeps a byte)
        self.send_buf = torch.zeros(
            max(1, full * SEND_BUFFER_CHUNKS * len(targets)), dtype=torch.uint8, device=self.device
        )
        # Not registered as a whole: each block is registered with the engine for its own
        # write only (`_write`, issue 39 item 3), so a peer reaches a block while its
        # write is posted and nothing else of this buffer (docs/hardware-mode.md, "What a
        # peer can reach"). send-buffer offset -> the Region of its write in flight
        self.arena = ByteArena(self.send_buf.numel())
        self.exposed: dict[int, Region] = {}
        # the KV pool, the source of slice writes, likewise: a write's pages for that write
        self.sources = SourceRuns(self.transport, self.pool.bytes, self.pool.desc)
        self.pending: list[_Pending] = []
        self.waiting_gathers: deque[Gather] = deque()
        self.slots: dict[
            tuple[int, int, int], tuple[int, int]
        ] = {}  # (room, chunk, d) -> (start, n)
        # hardware.posting: which thread does a write's descriptor work (the posting
        # section below); the names of the threads that posted, for the report
        self.posting = scenario.hardware.posting
        self.posted_on: Counter[str] = Counter()
        self.post_s: Counter[str] = Counter()  # thread name -> seconds building and posting
        if self.posting == "loop":  # NIXL: get_xfer_descs + initialize_xfer in write()
            self.transport.prepare_inline = True
        self.post_thread = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-post")
            if self.posting == "worker"
            else None
        )
        self.posts: deque[tuple[Future, WriteDone, Callable[[], None]]] = deque()
        self.forwards: deque[Forward] = deque()
        self.computing: _Computing | None = None
        self.compute_thread = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"{self.name}-forward",
            initializer=None if self.on_cuda else _lower_priority,
        )
        # gathers run on their own worker thread, in order: the loop keeps answering
        self.copy_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"{self.name}-gather"
        )
        self.gathers: deque[tuple[Future, Gather]] = deque()
        # transfer.verify_writes ("mac", "checksum"; "none": off): each written block's
        # tag, computed over a private copy before any peer can reach the bytes, carried
        # by its WriteDone into CHUNK_READY (hw/rank/writemac.py)
        self.verify_writes = scenario.transfer.verify_writes
        self.checksums: dict[tuple[int, int, int], int] = {}  # (room, chunk, d) -> tag
        # transfer.encrypt_writes ("chacha20"; "none": off): a staging block enters the
        # send buffer as ciphertext, before it is registered for its write (cipher.py)
        self.encrypt_writes = scenario.transfer.encrypt_writes

    def _register_memory(self) -> None:
        """Nothing for the whole run: a send-buffer block is registered for its write
        (`_write`), and the KV pool's pages for the slice write that reads them
        (`SourceRuns`), each after its tag is taken (docs/hardware-mode.md, "What a peer
        can reach")."""

    def _tag_key(self, decode_rank: int) -> bytes | None:
        """The key of this rank's write tags to `decode_rank` (None: verify_writes = "none")."""
        if self.verify_writes == "none":
            return None
        pair = self.control.pair_key(rank_name("decode", decode_rank), to_peer=True)
        return tag_key(self.verify_writes, pair)

    def _cipher_key(self, decode_rank: int) -> bytes | None:
        """The key of this rank's staging blocks to `decode_rank` (None: not encrypted)."""
        if self.encrypt_writes == "none":
            return None
        return cipher_key(self.control.pair_key(rank_name("decode", decode_rank), to_peer=True))

    def _connect_peers(self, table: dict[str, RankInfo]) -> None:
        for d in self.sessions.all_targets(self.rank):
            info = table[rank_name("decode", d)]
            self.control.connect(info.name, info.control, info.identity)
            self.transport.add_peer(info.agent, info.metadata)

    def _probe(self, probe: dict[str, float]) -> dict[str, Any]:
        """Each decode peer's raw write ceiling, in this rank's slots of the probe: a small
        warm-up write (connection set-up), then PROBE_WRITES writes of one large block
        into the peer's staging ring, unused before t0 (hw/transport/bandwidth.py), from a buffer of
        its own (the send buffer is sized for chunks, often far smaller than a ceiling
        write needs)."""
        out: dict[str, Any] = {}
        n = probe_bytes(self.s.pool_bytes)
        if n:
            source = torch.ones(n, dtype=torch.uint8, device=self.device)
            probe_region = self.transport.register(source, source=True)
        offset = self.clock.offset_s if self.clock else 0.0  # launcher time = wall() + offset
        counters = (
            self.transport.requests_posted,
            self.transport.writes_posted,
            self.transport.bytes_posted,
        )
        for k, (p, d) in enumerate(probe_pairs(self.sessions)):
            if p != self.rank:
                continue
            info = self.peers[rank_name("decode", d)]
            start = probe["start"] + k * probe["slot_s"] - offset
            while (left := start - self.wall()) > 0:
                time.sleep(min(left, 0.05))
            if n == 0:
                out[info.name] = {"skipped": f"a staging ring under {PROBE_MIN_BYTES >> 20} MiB"}
                continue
            local, remote = int(source.data_ptr()), int(info.extra["ring_addr"])
            self.transport.wait(
                self.transport.write(info.agent, [(local, remote, 4096)]), 30.0, "probe warm-up"
            )
            took = []
            for _ in range(PROBE_WRITES):
                t = time.perf_counter()
                self.transport.wait(
                    self.transport.write(info.agent, [(local, remote, n)]), 30.0, "probe write"
                )
                took.append(time.perf_counter() - t)
            best = min(took)
            out[info.name] = {
                "bytes": n,
                "best_s": round(best, 6),
                "gbs": round(n / best / GB, 4),
                "writes_s": [round(x, 6) for x in took],
                "overran_slot": self.wall() > start + probe["slot_s"],
            }
        if n:
            self.transport.deregister(probe_region)  # every probe write was waited for
        # the probe's writes are not the run's: the counters the summary reports stay the run's
        t = self.transport
        t.requests_posted, t.writes_posted, t.bytes_posted = counters
        return out

    def close(self) -> None:
        if self.post_thread is not None:
            self.post_thread.shutdown(wait=True, cancel_futures=True)
        self.compute_thread.shutdown(wait=True, cancel_futures=True)
        self.copy_thread.shutdown(wait=True, cancel_futures=True)
        super().close()

    def _still_held(self) -> list[str]:
        held = []
        if self.slots:
            held.append(
                f"send-buffer blocks of (room, chunk, decode rank) {sorted(self.slots)[:5]}"
            )
        if self.arena.free_bytes != self.arena.size:
            held.append(
                f"send buffer {self.arena.size - self.arena.free_bytes} of {self.arena.size} bytes"
            )
        if self.exposed:  # a block its write's end did not take off the engine
            held.append(f"{len(self.exposed)} send-buffer block(s) still registered")
        if self.sources.held:  # pages a slice write's end did not take off the engine
            held.append(f"{self.sources.held} run(s) of KV pool pages still registered")
        return held

    def _wait_s(self) -> float:
        c = self.computing
        if self.forwards and c is None:
            return 0.0  # a forward queued this turn starts next turn
        if c is not None and c.jobs[-1].done():  # one compute thread: the fills in order
            return max(0.0, c.not_before - self.now())  # hardware.forward_delay: its modeled end
        if self.pending and not self.transport.signals_completion:
            return BUSY_POLL_S  # the engine completes writes silently: look again soon
        return IDLE_POLL_S  # fills and gathers wake the loop when they finish

    def _progress(self) -> None:
        self._forward_step()
        self._gathers_done()
        self._posts_done()
        self._poll_transfers()

    # --- the forward -------------------------------------------------------------------------
    def _forward(self, f: Forward) -> None:
        self.forwards.append(f)

    def _forward_step(self) -> None:
        """Finish the running forward when its fills are done, then start the next one.
        The fills run on the compute thread, like kernels on a GPU stream: torch
        releases the GIL, so the loop keeps answering messages and polling transfers.
        With hardware.forward_delay the forward packs the chunks queued when it starts
        as the simulator's group forward does (`_packed`) and ends no sooner than the
        modeled time of the packed forward."""
        c = self.computing
        if c is not None:
            if not c.jobs[-1].done() or self.now() < c.not_before:
                return
            self.computing = None
            for job in c.jobs:
                job.result()  # a failed fill is a bug: raise it here, in the loop
            end = self.now()  # one end for every chunk of the forward
            for f in c.forwards:
                self._feed(ForwardDone(f.room, f.chunk, c.start), end)
        while self.computing is None and self.forwards:
            f = self.forwards.popleft()
            if not self.runtime.forward_wanted(f):  # its room failed before its turn
                self._feed(ForwardDone(f.room, f.chunk, self.now()))
                continue
            packed = self._packed(f)
            start = self.now()
            for p in packed:
                self._feed(ForwardStarted(p.room, p.chunk), start)
            if not f.num_pages:  # a room that only opens: alone, nothing to fill
                self._feed(ForwardDone(f.room, f.chunk, start), start)
                continue
            jobs = []
            for p in packed:
                fill = self.job_cpu.wrap(
                    "fill", fill_pattern, p.tokens * self.g.block_bytes(1, self.g.prefill_heads)
                )
                job = self.compute_thread.submit(
                    fill,
                    self.pool,
                    p.first_page + p.page_start,
                    p.num_pages,
                    p.room,
                    p.page_start * self.g.page_size,
                    self.global_heads,
                )
                job.add_done_callback(self._wake)
                jobs.append(job)
            delay = 0.0
            if self.s.hardware.forward_delay:  # the simulator's price of this forward
                page = self.g.page_size
                delay = packed_forward_s(
                    self.s, [(p.computed, p.context(page)) for p in packed]
                )  # one chunk: chunk_forward_s (shared/serving/compute.py)
            self.computing = _Computing(jobs, start + delay, packed, start)

    def _packed(self, f: Forward) -> list[Forward]:
        """`f` and the chunks queued behind it that share its forward. With
        hardware.forward_delay, SGLang's prefill batch as the simulator packs it
        (shared/serving/prefill_batch.py `OpenForward`): the queued chunks in order
        while the rule takes them, one chunk a room; a chunk with nothing to compute
        runs alone and closes the forward. A queued chunk whose room failed before its
        turn is reported done and skipped, as when it starts alone. Without
        forward_delay each forward is one chunk, its fill the real CPU time of that
        chunk (the simulator's cpu-loop host model, sim/forward.py `HostFills`, alike)."""
        computed = f.computed
        if not self.s.hardware.forward_delay or computed <= 0:
            return [f]
        rule = OpenForward(self.g.chunk_tokens)
        rule.add(f.room, computed)
        packed = [f]
        while self.forwards:
            nxt = self.forwards[0]
            if not self.runtime.forward_wanted(nxt):
                self.forwards.popleft()
                self._feed(ForwardDone(nxt.room, nxt.chunk, self.now()))
                continue
            tokens = nxt.computed
            if not rule.takes(nxt.room, tokens):
                break  # it does not fit, or has nothing to compute: the next forward
            rule.add(nxt.room, tokens)
            packed.append(self.forwards.popleft())
        return packed

    # --- gather and writes ----------------------------------------------------------------------
    def _gather(self, a: Gather) -> None:
        if not self.runtime.pages_held(a.room):  # its room failed while it waited for space
            self._feed(GatherDone(a.room, a.chunk, a.decode_rank))
            return
        slot = self.arena.alloc(a.nbytes)
        if slot is None:
            self.waiting_gathers.append(a)  # retried when a write frees send-buffer space
            return
        self.slots[(a.room, a.chunk, a.decode_rank)] = (slot, a.nbytes)
        first = self.runtime.page_base(a.room) + a.src_page
        keys = (self._tag_key(a.decode_rank), self._cipher_key(a.decode_rank))
        job = self.copy_thread.submit(
            self.job_cpu.wrap("gather", self._gather_job, a.nbytes), a, first, slot, *keys
        )
        job.add_done_callback(self._wake)
        self.gathers.append((job, a))

    def _gather_job(
        self, a: Gather, first_page: int, slot: int, key: bytes | None, seal: bytes | None
    ) -> int:
        """Gather `a`'s block into its send-buffer slot (not registered yet: no peer
        reaches it until its write), tagged over the plaintext, then encrypted in place."""
        out = self.send_buf[slot : slot + a.nbytes]
        if key is not None:
            tag = self._pool_tag(a, first_page, key, out, seal)
            wait_for_stream(self.device)  # the write must not read a half-gathered block
            return tag
        gather(self.pool, first_page, a.num_pages, a.heads.src_head_start, a.heads.num_heads, out)
        if seal is not None:
            xor_keystream(seal, a.room, a.chunk, a.nonce, out, out)
        wait_for_stream(self.device)
        return 0

    def _pool_tag(
        self, a: Gather | SliceWrite, first_page: int, key: bytes, out=None, seal=None
    ) -> int:
        """The write tag of `a`'s writer block as it leaves the pool (and, with `out`, the
        send buffer's slot, lands there, encrypted under `seal` if given): hashed by the
        gather itself (a CUDA pool, "mac"), else gathered into memory of this process
        alone (the pool is not registered on the staging path), tagged there, then copied
        (or encrypted) into the slot. The tag is always of the plaintext."""
        if self._fused(*([] if out is None else [out])):
            heads = (a.heads.src_head_start, a.heads.num_heads)
            digest = gather_hashed(self.pool, first_page, a.num_pages, *heads, key, out)
            if seal is not None:
                xor_keystream(seal, a.room, a.chunk, a.nonce, out, out)
            return digest_tag(key, a.room, a.chunk, a.nonce, digest, a.nbytes)
        block = self._private_block(first_page, a.num_pages, a.heads, a.nbytes)
        tag = block_tag(self.verify_writes, key, a.room, a.chunk, a.nonce, block)
        if out is not None and seal is not None:
            xor_keystream(seal, a.room, a.chunk, a.nonce, block, out)
        elif out is not None:
            out.copy_(block)
        return tag

    def _fused(self, *flat: torch.Tensor) -> bool:
        """The tag's hash rides in the gather itself (a CUDA pool, "mac"): the words hashed
        are the words read from the pool, which is on no engine then (`SourceRuns`)."""
        return self.verify_writes == "mac" and fused_tag_possible(self.pool, *flat)

    def _private_block(self, first_page: int, num_pages: int, heads, nbytes: int) -> torch.Tensor:
        """A writer block (`heads`: a HeadSlice) gathered from the pool into memory of this
        process alone."""
        block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        gather(self.pool, first_page, num_pages, heads.src_head_start, heads.num_heads, block)
        wait_for_stream(self.device)
        return block

    def _gathers_done(self) -> None:
        while self.gathers and self.gathers[0][0].done():
            job, a = self.gathers.popleft()
            checksum = job.result()  # a failed kernel is a bug: raise it here, in the loop
            key = (a.room, a.chunk, a.decode_rank)
            if checksum and key in self.slots:
                self.checksums[key] = checksum
            self._feed(GatherDone(*key))
            abandoned = self.slots.pop(key, None)  # no Write took it: its room failed meanwhile
            if abandoned is not None:
                self.checksums.pop(key, None)
                self._release_slot(abandoned)
                self._retry_gathers()

    def _write(self, a: Write) -> None:
        peer = self.peers[rank_name("decode", a.decode_rank)]
        slot = self.slots.pop((a.room, a.chunk, a.decode_rank))
        checksum = self.checksums.pop((a.room, a.chunk, a.decode_rank), 0)
        local = int(self.send_buf.data_ptr()) + slot[0]
        remote = int(peer.extra["ring_addr"]) + a.dst_offset
        done = WriteDone(a.room, a.chunk, a.decode_rank, checksum=checksum)
        release = partial(self._release_slot, slot)
        try:  # the block reaches the engine for this write only (_release_slot ends it)
            block = self.send_buf[slot[0] : slot[0] + slot[1]]
            self.exposed[slot[0]] = self.transport.register(block, source=True)
        except TransferError as exc:
            self._post_failed(done, release, exc)
            return
        self._post(peer.agent, [(local, remote, a.nbytes)], done, release)

    def _release_slot(self, slot: tuple[int, int]) -> None:
        """A send-buffer block is free again: off the engine (if its write registered it),
        then back to the arena. A deregistration the engine refuses leaves the block
        registered (logged), never the rank stopped."""
        region = self.exposed.pop(slot[0], None)
        if region is not None:
            try:
                self.transport.deregister(region)
            except TransferError as exc:
                log.warning("%s: send-buffer block stays registered: %s", self.name, exc)
        self.arena.free(*slot)

    def _slice_write(self, a: SliceWrite) -> None:
        peer = self.peers[rank_name("decode", a.decode_rank)]
        build = partial(
            slice_ops,
            self.g,
            self.local,
            a.decode_rank % self.g.decode_tp,
            self.pool.desc,
            self.runtime.page_base(a.room) + a.src_page,
            PoolDesc.from_wire(peer.extra["kv_pool"]),
            a.dst_page_base + a.page_start,
            a.num_pages,
        )
        tag = 0
        first = self.runtime.page_base(a.room) + a.src_page
        key = self._tag_key(a.decode_rank)
        if key is not None:  # the slice the decode will check, as it leaves the pool
            tag = self._pool_tag(a, first, key)
        done = WriteDone(a.room, a.chunk, a.decode_rank, checksum=tag)
        try:  # the pages reach the engine after the tag, for this write only
            token = self.sources.open(first, a.num_pages)
        except TransferError as exc:
            self._post_failed(done, None, exc)
            return
        self._post(peer.agent, build, done, partial(self.sources.close, token))

    # --- posting (hardware.posting) ---------------------------------------------------------
    # "lane" (the default, the behaviour before the option): the loop thread builds the ops
    #   (the slice path's numpy arrays, then a Python list) and write() checks them against
    #   the registered regions; the engine's descriptors (NIXL get_xfer_descs +
    #   initialize_xfer) are made on the peer's lane thread, with transfer().
    # "loop": all the descriptor work on the loop thread, NIXL's descriptors too (as
    #   SGLang's NIXL backend at PR #22536, [engine] preset sglang-nixl): it delays the
    #   loop's next forward, poll and message; transfer() stays on the lane (on RDMA it
    #   returns at once, on loopback CMA it copies the bytes). NIXL only: Mooncake makes
    #   no descriptors apart from its transfer call, so there "loop" is "lane".
    # "worker": the loop hands the write to one posting thread that builds, checks and
    #   posts (as sglang-nixl-prepped's transfer worker); the loop takes the handle back.
    def _post_job(self, agent: str, ops) -> XferHandle:
        """Build the ops (a callable: the slice path's) and post them, on this thread."""
        name, t0 = threading.current_thread().name, time.perf_counter()
        try:
            return self.transport.write(agent, ops().tuples() if callable(ops) else ops)
        finally:
            self.posted_on[name] += 1
            self.post_s[name] += time.perf_counter() - t0

    def _post(self, agent: str, ops, done: WriteDone, release: Callable[[], None]) -> None:
        if self.post_thread is not None:  # hardware.posting = "worker"
            job = self.post_thread.submit(self._post_job, agent, ops)
            job.add_done_callback(self._wake)
            self.posts.append((job, done, release))
            return
        try:
            handle = self._post_job(agent, ops)
        except TransferError as exc:
            self._post_failed(done, release, exc)
            return
        self._posted(handle, done, release)

    def _posts_done(self) -> None:
        """The posting thread's finished posts, in order: their handles to poll."""
        while self.posts and self.posts[0][0].done():
            job, done, release = self.posts.popleft()
            try:
                handle = job.result()  # a failed slice_ops is a bug: raised here, in the loop
            except TransferError as exc:
                self._post_failed(done, release, exc)
                continue
            self._posted(handle, done, release)

    def _post_failed(
        self, done: WriteDone, release: Callable[[], None] | None, exc: Exception
    ) -> None:
        if release is not None:
            release()
        self._feed(WriteDone(done.room, done.chunk, done.decode_rank, ok=False, error=str(exc)))

    def _posted(self, handle: XferHandle, done: WriteDone, release: Callable[[], None]) -> None:
        self.pending.append(_Pending(handle, done, release))
        # NIXL's CMA writes complete inside write(): report them now rather than a loop
        # turn (up to BUSY_POLL_S of waiting for messages) later.
        self._poll_transfers()

    def _report_extra(self) -> dict[str, Any]:
        return {
            "posting": {
                "mode": self.posting,
                "loop_thread": threading.current_thread().name,  # the report is the loop's
                "threads": dict(self.posted_on),  # thread name -> writes it built and posted
                "seconds": {k: round(v, 6) for k, v in self.post_s.items()},
                # NIXL descriptors made on the posting thread (not the lane)
                "prepared_inline": getattr(self.transport, "prepared_inline", 0),
            }
        }

    def _poll_transfers(self) -> None:
        if not self.pending:
            return
        still, finished = [], []
        for p in self.pending:
            try:
                if self.transport.poll(p.handle):
                    finished.append((p, None))
                else:
                    still.append(p)
            except TransferError as exc:
                finished.append((p, str(exc)))
        self.pending = still
        for p, error in finished:
            p.release()
            done = (
                p.done
                if error is None
                else WriteDone(p.done.room, p.done.chunk, p.done.decode_rank, False, error)
            )
            self._feed(done)
        if finished:
            self._retry_gathers()

    def _retry_gathers(self) -> None:
        """Send-buffer space was freed: start the gathers that waited for it."""
        retry = list(self.waiting_gathers)
        self.waiting_gathers.clear()
        for a in retry:  # in order; those that still do not fit queue up again
            self._gather(a)

    _EXECUTORS = {
        Forward: _forward,
        Gather: _gather,
        Write: _write,
        SliceWrite: _slice_write,
    }
