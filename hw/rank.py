"""One rank process of hardware mode: the shared state machine moving real bytes.

Like the simulator, this driver holds no protocol logic. It replays the scenario's
workload on the wall clock, feeds events into the rank's `shared/` machine and
carries out its actions for real: protocol messages over ZMQ, bulk writes and
slice-path descriptor lists through NIXL or Mooncake, gather and scatter as torch
kernels, and — on the decode — a bit-exact check of every room it completes.

Single-threaded by design: the loop polls transfer handles and the control socket
in turn, so the machine is only ever touched from one thread.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import os
import signal
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from kvstage.hw.control import ControlPlane, RankInfo, RendezvousClient, rank_name
from kvstage.hw.kernels import gather, scatter, slice_ops
from kvstage.hw.kvpool import KVPool, PoolDesc, PoolFullError, fill_pattern, verify
from kvstage.hw.transport import TransferError, XferHandle, make_transport
from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import (
    AbortRoom,
    ChunkComputed,
    Gather,
    GatherDone,
    OpenRoom,
    Record,
    RoomDone,
    RoomFailed,
    Scatter,
    ScatterDone,
    Send,
    SliceWrite,
    Tick,
    Write,
    WriteDone,
)
from kvstage.shared.faults import FaultPlan
from kvstage.shared.layout import LayoutError, owned_heads, room_pages
from kvstage.shared.machine import ProtocolConfig
from kvstage.shared.prefill import PrefillMachine
from kvstage.shared.scenario import Scenario
from kvstage.shared.trace import TRACE_FIELDS, TraceRecord
from kvstage.shared.workload import Request, generate_requests

log = logging.getLogger("kvstage.hw.rank")

# Idle poll interval while transfers are in flight (they complete asynchronously).
BUSY_POLL_S = 0.001
IDLE_POLL_S = 0.05
# A failed room's pages are reused only after this long: a peer's write that was
# still in flight must not land in another room's pages.
PAGE_QUARANTINE_S = 2.0


class RankError(RuntimeError):
    pass


def _shift_dst_heads(layout, decode_heads: int):
    """Test-only corruption (faults.corrupt_dst_head): land every block one head off,
    to prove that verification catches a wrong head offset."""
    blocks = []
    for b in layout.blocks:
        room = decode_heads - b.heads.num_heads + 1
        shifted = dataclasses.replace(b.heads, dst_head_start=(b.heads.dst_head_start + 1) % max(1, room))
        blocks.append(dataclasses.replace(b, heads=shifted))
    return dataclasses.replace(layout, blocks=tuple(blocks))


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


@dataclass
class _PrefillRoom:
    req: Request
    first_page: int
    total_pages: int
    chunks: list = field(default_factory=list)


@dataclass
class _Pending:
    handle: XferHandle
    done: WriteDone
    slot: tuple[int, int] | None  # send-buffer bytes to release


class RankProcess:
    def __init__(
        self,
        scenario: Scenario,
        role: str,
        rank: int,
        rendezvous: str,
        *,
        backend: str | None = None,
        device: str | None = None,
        verify_mode: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        if role not in ("prefill", "decode"):
            raise RankError(f"role {role!r} not allowed (allowed: prefill, decode)")
        self.s = scenario
        self.role = role
        self.rank = rank
        self.name = rank_name(role, rank)
        self.g = g = scenario.geometry()
        self.backend = backend or scenario.hardware.backend
        self.device = device or scenario.hardware.device
        self.verify_mode = verify_mode or scenario.hardware.verify
        self.config = ProtocolConfig(path=scenario.transfer.path, room_timeout_s=scenario.transfer.room_timeout_s)
        self.requests = generate_requests(scenario)
        self.records: list[TraceRecord] = []
        self.failures: dict[int, str] = {}
        self.bytes_verified = 0
        self.bytes_wrong = 0
        self.rooms_verified = 0
        self.wrong_rooms: list[int] = []
        self.rendezvous_address = rendezvous
        self.host = host
        if role == "prefill":
            if not 0 <= rank < g.prefill_tp:
                raise RankError(f"prefill rank {rank} out of range 0..{g.prefill_tp - 1}")
            self.machine = PrefillMachine(rank, g, self.config)
            heads = g.prefill_heads
            self.global_heads = list(owned_heads(g.prefill_tp, rank, g.total_kv_heads))
        else:
            if not 0 <= rank < g.decode_tp:
                raise RankError(f"decode rank {rank} out of range 0..{g.decode_tp - 1}")
            self.machine = DecodeMachine(rank, g, scenario.pool_bytes, self.config)
            heads = g.decode_heads
            self.global_heads = list(owned_heads(g.decode_tp, rank, g.total_kv_heads))
        self.pool = KVPool(g.layers, self._pool_pages(), g.page_size, heads, g.head_dim,
                           scenario.model.dtype, device=self.device)
        self.transport = make_transport(self.backend, f"kvstage-{self.name}-{os.getpid()}", self.device)
        self.transport.register(self.pool.tensor)
        if role == "prefill":
            self.send_buf = torch.zeros(self._send_buffer_bytes(), dtype=torch.uint8, device=self.device)
            self.transport.register(self.send_buf)
            self.arena = ByteArena(self.send_buf.numel())
            self.ring_buf = None
        else:
            self.ring_buf = torch.zeros(max(1, scenario.pool_bytes), dtype=torch.uint8, device=self.device)
            self.transport.register(self.ring_buf)
            self.send_buf = None
        self.control = ControlPlane(host)
        # runtime state
        self.pending: list[_Pending] = []
        self.waiting_gathers: deque[Gather] = deque()
        self.slots: dict[tuple[int, int, int], tuple[int, int]] = {}  # (room, chunk, d) -> (start, n)
        self.forward_queue: deque[Request] = deque()
        self.open_queue: deque[Request] = deque()  # decode: waiting for KV pages
        self.prefill_rooms: dict[int, _PrefillRoom] = {}
        self.decode_rooms: dict[int, tuple[Request, int, int]] = {}  # room -> (req, first_page, pages)
        self.quarantine: deque[tuple[float, int, int]] = deque()  # (release time, first page, pages)
        # the chunk being 'computed': (job, not before, room, chunk, start)
        self.compute: tuple[Future, float, int, int, float] | None = None
        self.compute_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-forward")
        self.verify_queue: deque[int] = deque()
        self.faults = FaultPlan(scenario.faults, scenario.workload.seed, stream=(role == "decode") * 4096 + rank)
        self.delayed: list[tuple[float, int, str, Any]] = []  # (due, seq, peer, msg): delayed sends
        self.delayed_events: list[tuple[float, int, Any]] = []  # (due, seq, event): stalled scatters
        self._seq = 0
        kill = [k for k in scenario.faults.kill if k.role == role and k.rank == rank]
        self.kill_at = kill[0].at_s if kill else None

    # --- sizing -----------------------------------------------------------------------
    def _pool_pages(self) -> int:
        g = self.g
        if self.role == "prefill":
            pages = [-(-r.prompt_tokens // g.page_size) for r in self.requests]
        else:
            pages = []
            for r in self.requests:
                try:
                    pages.append(room_pages(r.prompt_tokens, r.prefix_tokens, g.page_size))
                except LayoutError:
                    pages.append(0)
        # Room for every request at once when that is small; otherwise a window of
        # the largest rooms (rooms wait for pages when it is full).
        budget = int(os.environ.get("KVSTAGE_KV_POOL_MB", "512")) << 20
        page_bytes = 2 * g.layers * g.page_size * (g.prefill_heads if self.role == "prefill" else g.decode_heads) * g.head_dim * g.dtype_bytes
        total = sum(pages)
        biggest = max(pages, default=1)
        return max(1, biggest, min(total, budget // max(1, page_bytes)))

    def _send_buffer_bytes(self) -> int:
        g = self.g
        full = max(g.block_bytes(g.grid_pages * g.page_size, g.head_slice(self.rank, d).num_heads) for d in g.targets(self.rank))
        return full * 4 * len(g.targets(self.rank))

    # --- life cycle ---------------------------------------------------------------------
    def run(self, rendezvous_timeout_s: float = 60.0) -> dict[str, Any]:
        client = RendezvousClient(self.rendezvous_address)
        extra = {"kv_pool": self.pool.desc.to_wire()}
        if self.ring_buf is not None:
            extra["ring_addr"] = int(self.ring_buf.data_ptr())
        me = RankInfo(self.role, self.rank, self.control.address, self.transport.agent_name,
                      self.transport.metadata(), extra)
        table, t0 = client.hello(me, rendezvous_timeout_s)
        self._connect(table)
        error = ""
        try:
            self._loop(t0)
        except Exception as exc:  # report, don't hang the run
            error = f"{self.name}: {type(exc).__name__}: {exc}"
            log.error("%s\n%s", error, traceback.format_exc())
        report = self._report(error)
        client.report(report, timeout_s=max(60.0, self.config.room_timeout_s * 2))
        client.close()
        self.close()
        return report

    def _connect(self, table: dict[str, RankInfo]) -> None:
        self.peers = table
        g = self.g
        if self.role == "prefill":
            for d in g.targets(self.rank):
                info = table[rank_name("decode", d)]
                self.control.connect(info.name, info.control)
                self.transport.add_peer(info.agent, info.metadata)
        else:
            for p in g.writers(self.rank):
                info = table[rank_name("prefill", p)]
                self.control.connect(info.name, info.control)

    def close(self) -> None:
        self.compute_thread.shutdown(wait=True, cancel_futures=True)
        try:
            self.transport.close()
        finally:
            self.control.close()

    # --- the loop -----------------------------------------------------------------------
    def _finished(self) -> bool:
        m = self.machine
        return (
            m.rooms_done + m.rooms_failed >= len(self.requests)
            and not self.pending
            and not self.open_queue
            and not self.verify_queue
            and not self.delayed  # messages held back by fault injection are still owed
            and not self.delayed_events
            and not getattr(m, "_draining", None)
            and not getattr(m, "_quarantine", None)
        )

    def _loop(self, t0: float) -> None:
        self.t0 = t0
        arrivals = deque(self.requests)
        hard_deadline = (arrivals[-1].arrival_s if arrivals else 0) + self.config.room_timeout_s * 3 + 30
        # a late session (fault injection) joins the run delay_s after everyone else
        t_start = t0 + (self.faults.session_delay_s(self.rank) if self.role == "prefill" else 0.0)
        while time.time() < t_start:
            time.sleep(min(0.01, max(0.0, t_start - time.time())))
        while not self._finished():
            now = self.now()
            if now > hard_deadline:
                raise RankError(f"{self.name}: run did not finish within {hard_deadline:.0f}s "
                                f"({self.machine.rooms_done} done, {self.machine.rooms_failed} failed of {len(self.requests)})")
            if self.kill_at is not None and now >= self.kill_at:
                log.warning("%s: fault injection: killing this rank at %.3fs", self.name, now)
                os.kill(os.getpid(), signal.SIGKILL)
            self._flush_delayed(now)
            while arrivals and arrivals[0].arrival_s <= now:
                self._arrive(arrivals.popleft())
            self._progress_local()
            self._poll_transfers()
            deadline = self.machine.next_deadline
            if deadline is not None and deadline <= self.now():
                self._feed(Tick())
            busy = bool(self.pending or self.waiting_gathers or self.compute or self.forward_queue
                        or self.delayed or self.delayed_events
                        or any(pr.chunks for pr in self.prefill_rooms.values()))
            wait = BUSY_POLL_S if busy else IDLE_POLL_S
            if arrivals:
                wait = min(wait, max(0.0, arrivals[0].arrival_s - self.now()))
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - self.now()))
            if self.verify_queue and not busy:
                wait = 0.0
            messages = self.control.receive(wait)
            for msg in messages:
                self._feed(msg)
            if self.verify_queue and not messages and not self.pending:
                self._verify_one()

    def now(self) -> float:
        return time.time() - self.t0

    def _feed(self, event) -> None:
        now = self.now()
        for action in self.machine.handle(event, now):
            self._carry(action)

    # --- workload -----------------------------------------------------------------------
    def _arrive(self, req: Request) -> None:
        if self.role == "decode":
            self.open_queue.append(req)
        else:
            self.forward_queue.append(req)

    def _progress_local(self) -> None:
        now = self.now()
        while self.quarantine and self.quarantine[0][0] <= now:
            _, first, n = self.quarantine.popleft()
            self.pool.free(first, n)
        if self.role == "decode":
            self._open_decode_rooms()
        else:
            self._forward()

    def _open_decode_rooms(self) -> None:
        while self.open_queue:
            req = self.open_queue[0]
            try:
                pages = room_pages(req.prompt_tokens, req.prefix_tokens, self.g.page_size)
            except LayoutError:
                pages = 0  # the machine fails the room with the reason
            first = 0
            if pages:
                try:
                    first = self.pool.alloc(pages)
                except PoolFullError:
                    return  # wait for a room to finish
            self.open_queue.popleft()
            if pages:
                self.decode_rooms[req.room] = (req, first, pages)
            self._feed(OpenRoom(req.room, req.prompt_tokens, req.prefix_tokens, dst_page_base=first))
            if self.faults.abort_at(req.room, "open"):
                self._feed(AbortRoom(req.room, "fault injection: aborted at open"))

    def _forward(self) -> None:
        """The prefill forward: one chunk at a time, filling the KV pattern as its 'compute'."""
        g = self.g
        if self.compute is not None:
            job, done_at, room, chunk, start = self.compute
            if not job.done() or self.now() < done_at:
                return
            self.compute = None
            job.result()  # a failed fill is a bug: raise it here, in the loop
            self._feed(ChunkComputed(room, chunk, start))
        while self.compute is None:
            # next chunk of the room being computed, else open the next request
            for pr in self.prefill_rooms.values():
                if pr.chunks:
                    break
            else:
                pr = None
            if pr is None:
                if not self.forward_queue:
                    return
                req = self.forward_queue[0]
                total = -(-req.prompt_tokens // g.page_size)
                try:
                    first = self.pool.alloc(total)
                except PoolFullError:
                    return
                self.forward_queue.popleft()
                try:
                    pages = room_pages(req.prompt_tokens, req.prefix_tokens, g.page_size)
                    chunks = list(g.chunks(pages))
                except LayoutError:
                    chunks = []
                self.prefill_rooms[req.room] = _PrefillRoom(req, first, total, chunks)
                self._feed(OpenRoom(req.room, req.prompt_tokens, req.prefix_tokens))
                if self.machine.is_finished(req.room):
                    # failed at open (misaligned prefix) or aborted before it opened
                    self._release_room(req.room, failed=True)
                continue
            c = pr.chunks.pop(0)
            start = self.now()
            prefix_pages = pr.req.prefix_tokens // g.page_size
            # The 'forward' (pattern fill) runs on the compute thread, like a kernel on
            # a GPU stream: torch releases the GIL, so the loop keeps answering messages
            # and polling transfers meanwhile. One chunk at a time, in order.
            job = self.compute_thread.submit(
                fill_pattern, self.pool, pr.first_page + prefix_pages + c.page_start, c.num_pages,
                pr.req.room, (prefix_pages + c.page_start) * g.page_size, self.global_heads,
            )
            delay = self.s.forward_time_s(c.num_pages * g.page_size) if self.s.hardware.forward_delay else 0.0
            self.compute = (job, start + delay, pr.req.room, c.index, start)
            return

    # --- actions --------------------------------------------------------------------------
    def _carry(self, a) -> None:
        kind = type(a)
        if kind is Record:
            self.records.append(a.record)
        elif kind is Send:
            peer = rank_name(a.dest.role, a.dest.rank)
            for d in self.faults.on_send(a.msg):
                if d.extra_delay_s > 0:
                    self._seq += 1
                    heapq.heappush(self.delayed, (self.now() + d.extra_delay_s, self._seq, peer, d.msg))
                else:
                    self.control.send(peer, d.msg)
        elif kind is Gather:
            self._gather(a)
        elif kind is Write:
            self._write(a)
        elif kind is SliceWrite:
            self._slice_write(a)
        elif kind is Scatter:
            self._scatter(a)
        elif kind is RoomDone:
            self._room_done(a.room)
        elif kind is RoomFailed:
            self.failures.setdefault(a.room, a.reason)
            self._release_room(a.room, failed=True)

    def _gather(self, a: Gather) -> None:
        pr = self.prefill_rooms.get(a.room)
        if pr is None:
            return
        if self.faults.abort_at(a.room, "gather"):
            self._feed(AbortRoom(a.room, "fault injection: aborted at gather"))
            self._feed(GatherDone(a.room, a.chunk, a.decode_rank))  # nothing left in flight
            return
        slot = self.arena.alloc(a.nbytes)
        if slot is None:
            self.waiting_gathers.append(a)  # retried when a write frees send-buffer space
            return
        out = self.send_buf[slot : slot + a.nbytes]
        gather(self.pool, pr.first_page + a.src_page, a.num_pages, a.heads.src_head_start, a.heads.num_heads, out)
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.slots[(a.room, a.chunk, a.decode_rank)] = (slot, a.nbytes)
        self._feed(GatherDone(a.room, a.chunk, a.decode_rank))

    def _write(self, a: Write) -> None:
        peer = self.peers[rank_name("decode", a.decode_rank)]
        slot = self.slots.pop((a.room, a.chunk, a.decode_rank))
        local = int(self.send_buf.data_ptr()) + slot[0]
        remote = int(peer.extra["ring_addr"]) + a.dst_offset
        self._post(peer.agent, [(local, remote, a.nbytes)], WriteDone(a.room, a.chunk, a.decode_rank), slot)
        if self.faults.abort_at(a.room, "write"):
            self._feed(AbortRoom(a.room, "fault injection: aborted mid-transfer (write in flight)"))

    def _slice_write(self, a: SliceWrite) -> None:
        pr = self.prefill_rooms.get(a.room)
        if pr is None:
            return
        peer = self.peers[rank_name("decode", a.decode_rank)]
        ops = slice_ops(self.g, self.rank, a.decode_rank, self.pool.desc, pr.first_page + a.src_page,
                        PoolDesc.from_wire(peer.extra["kv_pool"]), a.dst_page_base + a.page_start, a.num_pages)
        self._post(peer.agent, ops.tuples(), WriteDone(a.room, a.chunk, a.decode_rank), None)

    def _post(self, agent: str, ops, done: WriteDone, slot) -> None:
        try:
            handle = self.transport.write(agent, ops)
        except TransferError as exc:
            if slot:
                self.arena.free(*slot)
            self._feed(WriteDone(done.room, done.chunk, done.decode_rank, ok=False, error=str(exc)))
            return
        self.pending.append(_Pending(handle, done, slot))

    def _poll_transfers(self) -> None:
        if not self.pending:
            return
        still = []
        finished = []
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
            if p.slot:
                self.arena.free(*p.slot)
            done = p.done if error is None else WriteDone(p.done.room, p.done.chunk, p.done.decode_rank, False, error)
            self._feed(done)
        if finished and self.waiting_gathers:
            retry = list(self.waiting_gathers)
            self.waiting_gathers.clear()
            for a in retry:  # in order; those that still do not fit queue up again
                self._gather(a)

    def _scatter(self, a: Scatter) -> None:
        region = self.ring_buf[a.offset : a.offset + a.nbytes]
        layout = self.g.staging_layout(self.rank, a.num_pages)
        if self.faults.config.corrupt_dst_head:
            layout = _shift_dst_heads(layout, self.g.decode_heads)
        scatter(self.pool, a.dst_page_base + a.page_start, a.num_pages, region, layout)
        if self.device == "cuda":
            torch.cuda.synchronize()
        stall = self.faults.scatter_stall_s(a.room, a.chunk)
        if stall:
            self._seq += 1
            heapq.heappush(self.delayed_events, (self.now() + stall, self._seq, ScatterDone(a.room, a.chunk)))
        else:
            self._feed(ScatterDone(a.room, a.chunk))
        if self.faults.abort_at(a.room, "scatter"):
            self._feed(AbortRoom(a.room, "fault injection: aborted while scattering"))

    def _flush_delayed(self, now: float) -> None:
        while self.delayed and self.delayed[0][0] <= now:
            _, _, peer, msg = heapq.heappop(self.delayed)
            self.control.send(peer, msg)
        while self.delayed_events and self.delayed_events[0][0] <= now:
            _, _, event = heapq.heappop(self.delayed_events)
            self._feed(event)

    def _room_done(self, room: int) -> None:
        if self.role == "decode" and room in self.decode_rooms and self.verify_mode != "off":
            # Checked when the loop is idle, so verification never delays the protocol;
            # the room's pages stay allocated until then.
            self.verify_queue.append(room)
            return
        self._release_room(room, failed=False)

    def _verify_one(self) -> None:
        room = self.verify_queue.popleft()
        req, first, pages = self.decode_rooms[room]
        checked, wrong = verify(self.pool, first, pages, room, req.prefix_tokens, self.global_heads,
                                sample=self.verify_mode == "sample")
        self.bytes_verified += checked
        self.bytes_wrong += wrong
        self.rooms_verified += 1
        if wrong:
            self.wrong_rooms.append(room)
        self._release_room(room, failed=False)

    def _release_room(self, room: int, failed: bool) -> None:
        if self.role == "decode":
            entry = self.decode_rooms.pop(room, None)
            if entry is not None:
                self._free_pages(entry[1], entry[2], failed)
        else:
            pr = self.prefill_rooms.pop(room, None)
            if pr is not None:
                self._free_pages(pr.first_page, pr.total_pages, failed)

    def _free_pages(self, first: int, n: int, failed: bool) -> None:
        if failed:
            self.quarantine.append((self.now() + PAGE_QUARANTINE_S, first, n))
        else:
            self.pool.free(first, n)

    # --- report ---------------------------------------------------------------------------
    def _report(self, error: str) -> dict[str, Any]:
        m = self.machine
        ring_used = m.ring.used_bytes if self.role == "decode" else 0
        return {
            "role": self.role,
            "rank": self.rank,
            "error": error,
            "rooms_done": m.rooms_done,
            "rooms_failed": m.rooms_failed,
            "failures": {str(k): v for k, v in self.failures.items()},
            "bytes_verified": self.bytes_verified,
            "bytes_wrong": self.bytes_wrong,
            "rooms_verified": self.rooms_verified,
            "wrong_rooms": self.wrong_rooms,
            "ring_used": ring_used,
            "dropped": m.dropped,
            "malformed": self.control.malformed,
            "requests_posted": self.transport.requests_posted,
            "faults_injected": self.faults.injected,
            "records": [[getattr(r, f) for f in TRACE_FIELDS] for r in self.records],
        }
