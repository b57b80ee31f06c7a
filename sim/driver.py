"""Run the shared state machines in simulated time.

The driver has no protocol logic: it feeds events into `shared/` machines and
turns their actions into modeled durations — control messages over the control
latency, bulk and slice writes through the max-min fair NIC fabric, gathers and
scatters on in-order GPU streams, prefill forwards from model FLOPs. Completions
come back as events. With the opt-in host model (`links.host_model = "cpu-loop"`,
sim/host.py) every rank is instead one single-threaded loop, as in hardware mode:
deliveries, gathers, scatters and per-rank pattern-fill forwards take turns on it,
slowed by the host's CPU sharing. Callbacks on SimPy timeouts carry the work (not
one process per action), which keeps the event loop lean; SimPy orders same-time events by
insertion, so a run is a deterministic function of scenario and seed.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import simpy
from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import (
    AbortRoom,
    ChunkComputed,
    Gather,
    GatherDone,
    OpenRoom,
    PeerLost,
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
from kvstage.shared.invariants import InvariantChecker, Violation
from kvstage.shared.machine import ProtocolConfig
from kvstage.shared.prefill import PrefillMachine
from kvstage.shared.scenario import Scenario
from kvstage.shared.trace import TraceRecord
from kvstage.shared.workload import Request, generate_requests
from kvstage.sim.gpu import GpuParams, SerialStream, copy_time
from kvstage.sim.host import RankLoop, cpu_scale, fill_time
from kvstage.sim.links import Fabric, LinkParams

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
    faults_injected: dict[str, int] = field(default_factory=dict)

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
        # fault injection: decisions come from the seeded shared plan, in event order
        self.faults = FaultPlan(scenario.faults, scenario.workload.seed)
        self._message_faults = scenario.faults.any_message_fault
        self._late = {m: self.faults.session_delay_s(m.rank) for m in self.prefill}
        self._late = {m: t for m, t in self._late.items() if t > 0}
        self._dead: set[object] = set()
        self._ending = False
        # how events reach a machine: directly (GPU model) or through its rank loop
        self._deliver = self._feed
        if self.host is not None:
            self._build_host()

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
        self.host = lk.host  # None: GPU model; else the cpu-loop host model (sim/host.py)
        # one kernel launch per writer block when a decode rank scatters a chunk
        self._scatter_launches = [len(g.writers(d)) for d in range(g.decode_tp)]

    def _build_host(self) -> None:
        """The cpu-loop host model: one loop per rank, CPU sharing as a static slowdown."""
        g, h = self.geometry, self.host
        self.cpu_scale = scale = cpu_scale(h, g.prefill_tp + g.decode_tp)
        self.event_s = h.event_s * scale
        self.loops = {m: RankLoop(self.env) for m in (*self.prefill, *self.decode)}
        for m, start in self._late.items():  # a late session's loop starts late
            self.loops[m].submit(start, _noop)
        # each prefill rank fills its own chunks (hw forward), one per loop turn
        self._fill_bytes_per_token = 2 * g.layers * g.prefill_heads * g.head_dim * g.dtype_bytes
        self._fills: dict[object, deque] = {m: deque() for m in self.prefill}  # [req, chunks, opened]
        self._filling: dict[object, bool] = dict.fromkeys(self.prefill, False)
        self._deliver = self._loop_deliver

    # --- scheduling helpers ---------------------------------------------------------------
    # Callbacks are `functools.partial`s of bound methods (built in C, no closure
    # frame per event); SimPy calls them with the event, which the targets accept
    # as a trailing, ignored `_ev` argument.
    def _at(self, delay: float, fn: Callable, *args) -> None:
        self.env.timeout(delay).callbacks.append(partial(fn, *args))

    def _feed(self, machine, event, _ev=None) -> None:
        now = self.env.now
        if self._late or self._dead:
            if machine in self._dead:
                return  # a killed rank hears nothing
            start = self._late.get(machine)
            if start is not None:
                if now < start:  # a late session: everything waits until it joins
                    self._at(start - now, self._feed, machine, event)
                    return
                del self._late[machine]
        self.events += 1
        keep, observe = self._keep_record, self._observe
        for a in machine.handle(event, now):
            if type(a) is Record:  # about half of all actions: handled inline
                keep(a.record)
                if observe is not None:
                    observe(a.record)
            else:
                self._carry(machine, a, now)
        if self._ending:
            self._maybe_end()
        deadline = machine.next_deadline
        if deadline is not None and deadline < self._tick_at.get(machine, _INF):
            self._tick_at[machine] = deadline
            self._at(max(0.0, deadline - now), self._tick, machine, deadline)

    def _loop_deliver(self, machine, event, _ev=None) -> None:
        """Host model: the event waits for its turn on the rank's loop, then is handled."""
        self.loops[machine].submit(self.event_s, self._feed, machine, event)

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
            if not self._message_faults:
                self.env.timeout(self.control_latency).callbacks.append(partial(self._deliver, dest, a.msg))
                return
            for d in self.faults.on_send(a.msg):
                self._at(self.control_latency + d.extra_delay_s, self._deliver, dest, d.msg)
        elif kind is Gather:
            if self.faults.abort_at(a.room, "gather"):
                self._abort(machine, a.room, "fault injection: aborted at gather")
                self._at(0.0, self._feed, machine, GatherDone(a.room, a.chunk, a.decode_rank))
                return
            dur = copy_time(self.gpu, a.nbytes)
            if self.host is not None:  # synchronous on the rank's loop, right after this handler
                done = GatherDone(a.room, a.chunk, a.decode_rank)
                self.loops[machine].run_next(dur * self.cpu_scale + self.event_s, self._feed, machine, done)
                return
            end = self.gather_stream[machine.rank].reserve(now, dur)
            self._at(end - now, self._feed, machine, GatherDone(a.room, a.chunk, a.decode_rank))
        elif kind is Write or kind is SliceWrite:
            requests = 1 if kind is Write else a.requests
            ev = self.fabric.transfer(
                self.prefill_nic[machine.rank], self.decode_nic[a.decode_rank], a.nbytes, self.link, requests
            )
            ev.callbacks.append(partial(self._deliver, machine, WriteDone(a.room, a.chunk, a.decode_rank)))
            if self.faults.abort_at(a.room, "write"):
                # every prefill rank aborts the room with its first write in flight
                for m in self.prefill:
                    self._abort(m, a.room, "fault injection: aborted mid-transfer (write in flight)")
        elif kind is Scatter:
            dur = copy_time(self.gpu, a.nbytes, launches=self._scatter_launches[machine.rank])
            stall = self.faults.scatter_stall_s(a.room, a.chunk)
            if self.host is not None:
                # synchronous on the rank's loop; a stalled completion is delivered later
                done = ScatterDone(a.room, a.chunk)
                loop_s = dur * self.cpu_scale + self.event_s
                if stall:
                    self.loops[machine].run_next(loop_s, self._at, stall, self._deliver, machine, done)
                else:
                    self.loops[machine].run_next(loop_s, self._feed, machine, done)
            else:
                dur += stall
                end = self.scatter_stream[machine.rank].reserve(now, dur)
                self._at(end - now, self._feed, machine, ScatterDone(a.room, a.chunk))
            if self.faults.abort_at(a.room, "scatter"):
                for m in self.decode:
                    self._abort(m, a.room, "fault injection: aborted while scattering")
        elif kind is RoomDone or kind is RoomFailed:
            if kind is RoomFailed:
                self._failures.setdefault(a.room, a.reason)
            self._room_finished(machine)

    def _abort(self, machine, room: int, reason: str) -> None:
        """A local abort, delivered after the current event (never re-entrantly)."""
        self._at(0.0, self._feed, machine, AbortRoom(room, reason))

    def _kill(self, role: str, rank: int, detect_s: float, _ev=None) -> None:
        """The rank stops hearing anything; after `detect_s` its peers learn it is gone."""
        victim = self.prefill[rank] if role == "prefill" else self.decode[rank]
        if victim in self._dead:
            return
        self._dead.add(victim)
        self.faults.count(f"kill:{role}")
        if victim.rooms_done + victim.rooms_failed < len(self.requests):
            self._rank_finished()  # it will never end its rooms; do not wait for it
        g = self.geometry
        peers = [self.decode[d] for d in g.targets(rank)] if role == "prefill" else [self.prefill[p] for p in g.writers(rank)]
        lost = PeerLost(role, rank, f"{role} rank {rank} was killed at {self.env.now:.3f}s (fault injection)")
        for m in peers:
            self._at(detect_s, self._feed, m, lost)

    def _rank_finished(self) -> None:
        self._ranks_done += 1
        self._maybe_end()

    def _maybe_end(self) -> None:
        """End when every rank ended every room and nothing is left in quarantine or
        draining (a failed room's regions come back a little after the room ends)."""
        if self._ranks_done < len(self.prefill) + len(self.decode) or self._all_done.triggered:
            return
        if all(m.settled for m in (*self.prefill, *self.decode) if m not in self._dead):
            self._all_done.succeed()
        else:
            self._ending = True

    def _room_finished(self, machine) -> None:
        """Count rooms ended per rank; the run ends when every rank ended every room."""
        n = machine.rooms_done + machine.rooms_failed
        if n == len(self.requests) and machine not in self._dead:
            self._rank_finished()
        if self.progress is not None and machine.role == "decode" and machine.rank == 0:
            self.progress(n, len(self.requests))

    # --- workload -----------------------------------------------------------------------
    def _arrive(self, req: Request, _ev=None) -> None:
        if self.host is not None:
            self._arrive_host(req)
            return
        now = self.env.now
        for m in self.decode:
            self._feed(m, OpenRoom(req.room, req.prompt_tokens, req.prefix_tokens, dst_page_base=0))
        if self.faults.abort_at(req.room, "open"):
            for m in self.decode:
                self._abort(m, req.room, "fault injection: aborted at open")
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

    def _arrive_host(self, req: Request) -> None:
        """Host model: each decode loop opens the room on its next turn; each prefill
        rank queues the request and fills its chunks itself, one per loop turn."""
        for m in self.decode:
            self._deliver(m, OpenRoom(req.room, req.prompt_tokens, req.prefix_tokens, dst_page_base=0))
        if self.faults.abort_at(req.room, "open"):
            for m in self.decode:  # right after the room opened on that loop, as in hw
                self._deliver(m, AbortRoom(req.room, "fault injection: aborted at open"))
        g = self.geometry
        pages = max(0, -(-(req.prompt_tokens - req.prefix_tokens) // g.page_size))
        chunks = list(g.chunks(pages))
        for m in self.prefill:
            self._fills[m].append([req, deque(chunks), False])
            if not self._filling[m]:
                self._filling[m] = True
                self.loops[m].submit(0.0, self._fill_turn, m)

    def _fill_turn(self, m) -> None:
        """One prefill loop turn of the forward: open the next room if needed (its
        STAGING_REQs go out), then fill one chunk; the next chunk's turn queues behind
        whatever reached the loop meanwhile."""
        queue = self._fills[m]
        while queue:
            entry = queue[0]
            req, chunks, opened = entry
            if not opened:
                entry[2] = True
                self._feed(m, OpenRoom(req.room, req.prompt_tokens, req.prefix_tokens))
            if chunks:
                c = chunks.popleft()
                if not chunks:
                    queue.popleft()
                tokens = c.num_pages * self.geometry.page_size
                dur = fill_time(self.host, tokens * self._fill_bytes_per_token) * self.cpu_scale
                self.loops[m].run_next(dur + self.event_s, self._filled, m, req.room, c.index, self.env.now)
                return
            queue.popleft()  # a room without chunks: nothing to fill
        self._filling[m] = False

    def _filled(self, m, room: int, chunk: int, start: float) -> None:
        self._feed(m, ChunkComputed(room, chunk, start))
        if self._fills[m]:
            self.loops[m].submit(0.0, self._fill_turn, m)
        else:
            self._filling[m] = False

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
        for k in self.scenario.faults.kill:
            self._at(k.at_s, self._kill, k.role, k.rank, 2 * self.control_latency + 0.05)
        if self.requests:
            with _gc_paused():
                self.env.run(until=self._all_done)
        sim_time = self.env.now
        violations: list[Violation] = []
        if self.checker is not None:
            used = {m.rank: m.ring.used_bytes for m in self.decode if m not in self._dead}
            dead = {(m.role, m.rank) for m in self._dead}
            violations = self.checker.finish(sim_time, used, ignore_ranks=dead)
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
            faults_injected=dict(self.faults.injected),
        )


def _noop() -> None:
    pass


def simulate(scenario: Scenario, **kw) -> SimResult:
    return Simulation(scenario, **kw).run()
