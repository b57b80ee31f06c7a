"""Run the shared state machines in simulated time.

The driver has no protocol logic: it feeds events into `shared/` machines and
turns their actions into modeled durations — control messages over the control
latency, bulk and slice writes through the max-min fair NIC fabric, gathers and
scatters on in-order GPU streams, prefill forwards from model FLOPs. Completions
come back as events. Callbacks on SimPy timeouts carry the work (not one process
per action), which keeps the event loop lean; SimPy orders same-time events by
insertion, so a run is a deterministic function of scenario and seed.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import simpy

from shared.decode import DecodeMachine
from shared.events import (
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
from shared.invariants import InvariantChecker, Violation
from shared.machine import ProtocolConfig
from shared.prefill import PrefillMachine
from shared.scenario import Scenario
from shared.trace import TraceRecord
from shared.workload import Request, generate_requests
from sim.gpu import GpuParams, SerialStream, copy_time
from sim.links import Fabric, LinkParams

_INF = float("inf")
_TICK = Tick()


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Suspend the cyclic garbage collector for the event loop.

    A run allocates millions of short-lived objects (events, actions, records) and
    keeps every trace record, so the collector repeatedly traverses an ever larger
    heap (12% of the CPU time of a 1,000-request run, growing with the run) for
    nothing: the loop creates no reference cycles, everything it drops is freed by
    reference counting. The previous state is restored on exit, even on an exception.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class SimResult:
    scenario: Scenario
    requests: list[Request]
    records: list[TraceRecord]
    violations: list[Violation]
    events: int
    sim_time_s: float
    wall_s: float
    rooms_done: int
    rooms_failed: int
    failures: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations


class Simulation:
    """One scenario, simulated once. `run()` returns a `SimResult`."""

    def __init__(
        self,
        scenario: Scenario,
        *,
        check: bool = True,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.scenario = scenario
        self.geometry = g = scenario.geometry()
        self.env = simpy.Environment()
        self.config = ProtocolConfig(
            path=scenario.transfer.path, room_timeout_s=scenario.transfer.room_timeout_s
        )
        self.prefill = [PrefillMachine(r, g, self.config) for r in range(g.prefill_tp)]
        self.decode = [DecodeMachine(d, g, scenario.pool_bytes, self.config) for d in range(g.decode_tp)]
        self.requests = generate_requests(scenario)
        self.records: list[TraceRecord] = []
        self.checker = InvariantChecker(self.config.path) if check else None
        self.progress = progress
        self.events = 0
        self._failures: dict[int, str] = {}
        self._ranks_done = 0
        self._all_done = self.env.event()
        self._tick_at: dict[object, float] = {}  # machine -> earliest Tick scheduled for it
        self._keep_record = self.records.append
        self._observe = self.checker.observe if self.checker is not None else None
        self._build_hardware()

    # --- models ---------------------------------------------------------------------
    def _build_hardware(self) -> None:
        s, g = self.scenario, self.geometry
        lk = s.links.resolved()
        self.control_latency = lk.control_latency_s
        self.gpu = GpuParams(mem_bandwidth_Bps=lk.mem_bandwidth_bytes_s, launch_s=lk.kernel_launch_s)
        self.link = LinkParams(lk.link.bandwidth_bytes_s, lk.link.latency_s, lk.link.per_request_s)
        self.fabric = Fabric(self.env)
        bw = lk.link.bandwidth_bytes_s
        if lk.placement == "intra":
            # same node: every GPU has its own NVLink port
            self.prefill_nic = [self.fabric.add_nic(f"prefill{p}-nvlink", bw) for p in range(g.prefill_tp)]
            self.decode_nic = [self.fabric.add_nic(f"decode{d}-nvlink", bw) for d in range(g.decode_tp)]
        else:
            # different nodes: gpus_per_nic GPUs share one RDMA NIC on each side
            per = lk.gpus_per_nic
            pn = [self.fabric.add_nic(f"prefill-nic{i}", bw) for i in range(-(-g.prefill_tp // per))]
            dn = [self.fabric.add_nic(f"decode-nic{i}", bw) for i in range(-(-g.decode_tp // per))]
            self.prefill_nic = [pn[p // per] for p in range(g.prefill_tp)]
            self.decode_nic = [dn[d // per] for d in range(g.decode_tp)]
        self.gather_stream = [SerialStream() for _ in range(g.prefill_tp)]
        self.scatter_stream = [SerialStream() for _ in range(g.decode_tp)]
        self.forward_stream = SerialStream()  # the prefill TP group computes one chunk at a time
        # one kernel launch per writer block when a decode rank scatters a chunk
        self._scatter_launches = [len(g.writers(d)) for d in range(g.decode_tp)]

    # --- scheduling helpers ---------------------------------------------------------------
    # Callbacks are `functools.partial`s of bound methods (built in C, no closure
    # frame per event); SimPy calls them with the event, which the targets accept
    # as a trailing, ignored `_ev` argument.
    def _at(self, delay: float, fn: Callable, *args) -> None:
        self.env.timeout(delay).callbacks.append(partial(fn, *args))

    def _feed(self, machine, event, _ev=None) -> None:
        self.events += 1
        now = self.env.now
        keep, observe = self._keep_record, self._observe
        for a in machine.handle(event, now):
            if type(a) is Record:  # about half of all actions: handled inline
                keep(a.record)
                if observe is not None:
                    observe(a.record)
            else:
                self._carry(machine, a, now)
        deadline = machine.next_deadline
        if deadline is not None and deadline < self._tick_at.get(machine, _INF):
            self._tick_at[machine] = deadline
            self._at(max(0.0, deadline - now), self._tick, machine, deadline)

    def _tick(self, machine, when: float, _ev=None) -> None:
        if self._tick_at.get(machine) == when:
            del self._tick_at[machine]
        if not self._all_done.triggered:
            self._feed(machine, _TICK)

    # --- actions ------------------------------------------------------------------------
    def _carry(self, machine, a, now: float) -> None:
        """Carry out one action other than a Record (which `_feed` keeps inline)."""
        kind = type(a)
        if kind is Send:
            dest = self.prefill[a.dest.rank] if a.dest.role == "prefill" else self.decode[a.dest.rank]
            self.env.timeout(self.control_latency).callbacks.append(partial(self._feed, dest, a.msg))
        elif kind is Gather:
            dur = copy_time(self.gpu, a.nbytes)
            end = self.gather_stream[machine.rank].reserve(now, dur)
            self._at(end - now, self._feed, machine, GatherDone(a.room, a.chunk, a.decode_rank))
        elif kind is Write or kind is SliceWrite:
            requests = 1 if kind is Write else a.requests
            ev = self.fabric.transfer(
                self.prefill_nic[machine.rank], self.decode_nic[a.decode_rank], a.nbytes, self.link, requests
            )
            ev.callbacks.append(partial(self._feed, machine, WriteDone(a.room, a.chunk, a.decode_rank)))
        elif kind is Scatter:
            dur = copy_time(self.gpu, a.nbytes, launches=self._scatter_launches[machine.rank])
            end = self.scatter_stream[machine.rank].reserve(now, dur)
            self._at(end - now, self._feed, machine, ScatterDone(a.room, a.chunk))
        elif kind is RoomDone or kind is RoomFailed:
            if kind is RoomFailed:
                self._failures.setdefault(a.room, a.reason)
            self._room_finished(machine)

    def _room_finished(self, machine) -> None:
        """Count rooms ended per rank; the run ends when every rank ended every room."""
        n = machine.rooms_done + machine.rooms_failed
        if n == len(self.requests):
            self._ranks_done += 1
            if self._ranks_done == len(self.prefill) + len(self.decode) and not self._all_done.triggered:
                self._all_done.succeed()
        if self.progress is not None and machine.role == "decode" and machine.rank == 0:
            self.progress(n, len(self.requests))

    # --- workload -----------------------------------------------------------------------
    def _arrive(self, req: Request, _ev=None) -> None:
        now = self.env.now
        for m in self.decode:
            self._feed(m, OpenRoom(req.room, req.prompt_tokens, req.prefix_tokens, dst_page_base=0))
        # The prefill TP group takes requests in arrival order, one chunk at a time;
        # its room opens (and asks for staging) when its forward starts.
        g = self.geometry
        pages = max(0, -(-(req.prompt_tokens - req.prefix_tokens) // g.page_size))
        chunks = g.chunks(pages)
        start = self.forward_stream.free_at(now)
        self._at(start - now, self._open_prefill, req)
        for c in chunks:
            tokens = c.num_pages * g.page_size
            chunk_start = self.forward_stream.free_at(now)
            end = self.forward_stream.reserve(now, self.scenario.forward_time_s(tokens))
            self._at(end - now, self._computed, req.room, c.index, chunk_start)

    def _open_prefill(self, req: Request, _ev=None) -> None:
        for m in self.prefill:
            self._feed(m, OpenRoom(req.room, req.prompt_tokens, req.prefix_tokens))

    def _computed(self, room: int, chunk: int, start: float, _ev=None) -> None:
        for m in self.prefill:
            self._feed(m, ChunkComputed(room, chunk, start))

    # --- run --------------------------------------------------------------------------------
    def run(self) -> SimResult:
        wall = time.perf_counter()
        for req in self.requests:
            self._at(req.arrival_s, self._arrive, req)
        if self.requests:
            with _gc_paused():
                self.env.run(until=self._all_done)
        sim_time = self.env.now
        violations: list[Violation] = []
        if self.checker is not None:
            used = {m.rank: m.ring.used_bytes for m in self.decode}
            violations = self.checker.finish(sim_time, used)
        return SimResult(
            scenario=self.scenario,
            requests=self.requests,
            records=self.records,
            violations=violations,
            events=self.events,
            sim_time_s=sim_time,
            wall_s=time.perf_counter() - wall,
            rooms_done=min(m.rooms_done for m in self.decode),
            rooms_failed=max(m.rooms_failed for m in self.decode),
            failures=self._failures,
        )


def simulate(scenario: Scenario, **kw) -> SimResult:
    return Simulation(scenario, **kw).run()
