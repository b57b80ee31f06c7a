"""Run the rank runtimes in simulated time.

The driver is a clock and executors, and decides nothing: every rank is a
`shared.runtime.RankRuntime` (its machine, its workload, its faults, its memory),
and this module turns the runtimes' actions into modeled durations — control
messages over the control latency, bulk and slice writes through the max-min fair
NIC fabric, gathers and scatters on in-order GPU streams, prefill forwards on the TP
group's stream (sim/forward.py) — and reports completions back as events. With the
opt-in host model (`links.host_model = "cpu-loop"`, sim/host.py) every rank is
instead a hardware-mode process: deliveries take turns on its loop, pattern-fill
forwards and gathers / scatters run on its threads, all on the host's shared
cores. Callbacks on SimPy timeouts carry the work (not one process per action),
which keeps the event loop lean; SimPy orders same-time events by insertion, so a
run is a deterministic function of scenario and seed.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from heapq import heappush

import simpy
from simpy.events import NORMAL

from kvstage.shared.admission import Limits, admit
from kvstage.shared.cluster import Router, Sessions, cluster_sessions, simulated_pipeline_problem
from kvstage.shared.events import (
    Arrive,
    Die,
    Forward,
    Gather,
    GatherDone,
    Generate,
    PeerLost,
    PeerRejoined,
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
from kvstage.shared.invariants import InvariantChecker, Violation
from kvstage.shared.liveness import PEER_TIMEOUT_S
from kvstage.shared.runtime import (
    RankResult,
    RankRuntime,
    merge_failures,
    protocol_config,
    sum_counts,
)
from kvstage.shared.scenario import Scenario
from kvstage.shared.serving.decode_model import DecodeModel
from kvstage.shared.serving.gpus import efficiency, side_gpu
from kvstage.shared.serving.memory import cache_blocks, side_memory
from kvstage.shared.trace import TraceRecord
from kvstage.shared.workload import Request, generate_requests
from kvstage.sim.cluster import LiveLoads, cluster_nics
from kvstage.sim.decode_batch import DecodeBatches
from kvstage.sim.engine_host import EngineHost
from kvstage.sim.fold import Fold
from kvstage.sim.forward import GroupForward, HostFills, PipelineForward
from kvstage.sim.gpu import GpuParams, SerialStream, copy_time
from kvstage.sim.host import HostModel, scaled_link
from kvstage.sim.links import Fabric

_INF = float("inf")
_TICK = Tick()


@contextmanager
def gc_paused() -> Iterator[None]:
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
    events: int  # events handled by the rank machines (as in hardware mode)
    sim_time_s: float
    wall_s: float
    rooms_done: int
    rooms_failed: int
    failures: dict[int, str] = field(default_factory=dict)
    ranks: list[RankResult] = field(default_factory=list)
    # room -> why the engine refused it at admission (shared/admission.py): never served
    rejected: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def faults_injected(self) -> dict[str, int]:
        return sum_counts(r.faults_injected for r in self.ranks)


class Simulation:
    """One scenario, simulated once. `run()` returns a `SimResult`."""

    def __init__(
        self,
        scenario: Scenario,
        *,
        check: bool = True,
        progress: Callable[[int, int], None] | None = None,
        shard: tuple[frozenset[int], frozenset[int]] | None = None,
        workload: tuple[list[Request], Sessions, Router] | None = None,
        generate: bool | None = None,
        control: Callable[[Simulation, float], None] | None = None,
        interval: float = math.inf,
    ) -> None:
        """`shard`: (prefill instances, decode instances) of one independent group
        (sim/shard.py): only its ranks and its rooms are simulated. `workload`: the
        scenario's requests, sessions and router when the caller has them already (every
        group of a sharded run shares them; static routes are only read). `generate`:
        whether the decode side generates tokens (None: when a request has output
        tokens; sim/online.py says True, its requests coming later). `control`: called
        as control(simulation, now) every `interval` simulated seconds while requests
        are still to arrive (an autoscaler: it opens and closes instances to routing
        through `loads.closed`, kvstage/explore/autoscale_disagg.py)."""
        self.scenario = scenario
        self.shard = shard
        self.control, self.interval = control, interval
        problem = simulated_pipeline_problem(scenario)
        if problem:
            raise ValueError(problem)
        self.geometry = g = scenario.geometry()
        self.env = simpy.Environment()
        self.config = protocol_config(scenario)
        if workload is None:
            requests = generate_requests(scenario)
            # ranks are global across instances (shared/cluster.py): instance * TP + local rank
            workload = (requests, *cluster_sessions(scenario, requests))
        self.requests, self.sessions, self.router = workload
        if shard is not None:  # the group's rooms (routes are static and stay within it)
            self.requests = [r for r in self.requests if self.sessions.route(r.room)[0] in shard[0]]
        # the decode side: KV capacity always when given; generation when requests have output
        self.decode_model = DecodeModel(scenario)
        generate = any(r.output_tokens for r in self.requests) if generate is None else generate
        ss, workload = self.sessions, self._admit(generate)
        # [cluster] fold: one rank stands for its symmetric peers (sim/fold.py); the
        # others are None here and never simulated
        self.fold = Fold(self) if scenario.cluster.fold else None
        fold = self.fold
        self._build_ranks(workload, generate)
        decode_per_instance = g.decode_tp if fold is None else len(g.targets(0))
        self.batches = DecodeBatches(
            self, self.decode_model, decode_per_instance, ss.decode_instances
        )
        self.runtimes = tuple(rt for rt in (*self.prefill, *self.decode) if rt is not None)
        # what a load-aware router sees of every instance, kept current (sim/cluster.py)
        self.loads = (
            None
            if self.router.static
            else LiveLoads(self.router, self.prefill, g.prefill_ranks, self.decode, g.decode_tp)
        )
        self._ended = 0  # rooms ended, counted at each decode instance's first rank
        # a load-aware router gives ranks their rooms as they arrive: a rank with no
        # room yet is settled, so the run cannot end before the last arrival
        self._arrivals_left = len(self.requests)
        self._by_room: dict[int, Request] | None = None  # `request_of`, made when first asked
        self.records: list[TraceRecord] = []
        self.checker = InvariantChecker(self.config.path) if check else None
        self.progress = progress
        self._settled: set[RankRuntime] = set()  # runtimes settled after their last event
        self._all_done = self.env.event()
        self._tick_at: dict[RankRuntime, float] = {}  # runtime -> earliest Tick scheduled for it
        self._keep_record = self._keep
        self._observe = self.checker.observe if self.checker is not None else None
        self._build_hardware()
        # how events reach a runtime: directly (GPU model) or through its rank loop
        self._deliver = self._feed
        if self.host is not None:
            self._build_host()
        else:  # one forward stream per prefill instance
            ranks = g.prefill_ranks if self.fold is None else 1
            forward = GroupForward if g.prefill_pp == 1 else PipelineForward
            self.group_forwards = [forward(self, ranks) for _ in range(ss.prefill_instances)]
            if self.engine is not None:  # [engine]: its scheduler loops (sim/engine_host.py)
                self.group_forwards = self.engine.forwards(ranks)

    def _build_ranks(self, workload: list[Request], generate: bool) -> None:
        """Each rank's runtime, None for a rank of another shard or one a fold stands
        for; each gets its instance's rooms (a runtime filtering every request of a
        large cluster would cost ranks x requests)."""
        s, g, ss, fold, shard = self.scenario, self.geometry, self.sessions, self.fold, self.shard
        mine = _by_instance(workload, ss)
        pi = shard[0] if shard is not None else range(ss.prefill_instances)
        di = shard[1] if shard is not None else range(ss.decode_instances)

        def runtime(role: str, rank: int, tp: int, instances, **kw) -> RankRuntime | None:
            if rank // tp not in instances or (fold is not None and not fold.simulated(role, rank)):
                return None
            return RankRuntime(s, role, rank, requests=mine[role, rank // tp], sessions=ss, **kw)

        blocks = cache_blocks(s)  # each prefill instance's prefix cache
        self.prefill = [
            runtime("prefill", r, g.prefill_ranks, pi, cache_blocks=blocks)
            for r in range(ss.prefill_ranks)
        ]
        pages = self.decode_model.capacity_pages
        self.decode = [
            runtime("decode", d, g.decode_tp, di, generate=generate, kv_pages=pages)
            for d in range(ss.decode_ranks)
        ]

    def _admit(self, generate: bool) -> list[Request]:
        """The requests the ranks get up front (a static router's; a load-aware one hands
        them out on arrival): not those the engines refuse before any work (a prompt
        beyond the model's context, KV no rank's pool can ever hold), which never reach
        a rank and are kept in `rejected`; the run goes on without them."""
        self.limits = engine_limits(self.scenario, generate, self.decode_model.capacity_pages)
        admitted, self.rejected = admit(self.requests, self.limits)
        return admitted if self.router.static else []

    # --- models ---------------------------------------------------------------------
    def _build_hardware(self) -> None:
        s, g = self.scenario, self.geometry
        lk = s.links.resolved()
        self.control_latency = lk.control_latency_s
        # copy kernels: gathers on the prefill GPU, scatters on the decode GPU; a
        # calibrated host's copy numbers (the profile's) stand in for both
        eff = efficiency(s)
        self.gather_gpu, self.scatter_gpu = (
            GpuParams(
                mem_bandwidth_Bps=lk.mem_bandwidth_bytes_s
                or side_gpu(s, side).hbm_Bps * eff.copy_hbm,
                launch_s=eff.kernel_launch_s if lk.kernel_launch_s is None else lk.kernel_launch_s,
            )
            for side in ("prefill", "decode")
        )
        self.write_link = lk.link  # the numbers bulk and slice writes take
        self.fabric = Fabric(self.env)
        bw = lk.link.bandwidth_bytes_s
        if not self.sessions.single:
            self.prefill_nic, self.decode_nic = cluster_nics(
                self.fabric, s, self.sessions, lk, self.shard
            )
        elif lk.placement == "intra":
            # same node: every GPU has its own NVLink port
            self.prefill_nic = [
                self.fabric.add_nic(f"prefill{p}-nvlink", bw) for p in range(g.prefill_ranks)
            ]
            self.decode_nic = [
                self.fabric.add_nic(f"decode{d}-nvlink", bw) for d in range(g.decode_tp)
            ]
        else:
            # different nodes: gpus_per_nic GPUs share one RDMA NIC on each side
            per = lk.gpus_per_nic
            pn = [
                self.fabric.add_nic(f"prefill-nic{i}", bw)
                for i in range(-(-g.prefill_ranks // per))
            ]
            dn = [self.fabric.add_nic(f"decode-nic{i}", bw) for i in range(-(-g.decode_tp // per))]
            self.prefill_nic = [pn[p // per] for p in range(g.prefill_ranks)]
            self.decode_nic = [dn[d // per] for d in range(g.decode_tp)]
        ss = self.sessions
        self.gather_stream = [SerialStream() for _ in range(ss.prefill_ranks)]
        self.scatter_stream = [SerialStream() for _ in range(ss.decode_ranks)]
        self.host = lk.host  # None: GPU model; else the cpu-loop host model (sim/host.py)
        # one kernel launch per writer block when a decode rank scatters a chunk
        self._scatter_launches = [len(g.writers(d % g.decode_tp)) for d in range(ss.decode_ranks)]
        # [engine] (GPU model only): the serving engine's prefill host (sim/engine_host.py)
        preset = s.engine.resolved()
        self.engine = EngineHost(self, preset) if preset and self.host is None else None

    def _build_host(self) -> None:
        """The cpu-loop host model: per rank a loop and worker threads on shared cores."""
        self.hostm = HostModel(self.env, self.host, self.runtimes, self.prefill)
        self.loops = self.hostm.loops
        self.control_latency *= self.host.control_scale  # a message among busy ranks
        self.write_link = scaled_link(
            self.write_link, self.host.write_scale
        )  # a write among busy ranks
        for rt in self.prefill:  # a late session's loop starts late
            if rt.join_at:
                self.loops[rt].wait(rt.join_at)
        self.forwards = HostFills(self)
        self._deliver = self._loop_deliver

    # --- scheduling helpers ---------------------------------------------------------------
    # Callbacks are `functools.partial`s of bound methods (built in C, no closure
    # frame per event); SimPy calls them with the event, which the targets accept
    # as a trailing, ignored `_ev` argument.
    def _at(self, delay: float, fn: Callable, *args) -> None:
        self.env.timeout(delay).callbacks.append(partial(fn, *args))

    def _keep(self, record: TraceRecord) -> None:
        """Keep a record, after the decode steps planned to end before now
        (sim/decode_batch.py: a batch's steps between two changes are one event)."""
        if self.batches.due < self.env._now:
            self.batches.flush(self.env._now)
        self.records.append(record)

    def _feed(self, rt: RankRuntime, event, _ev=None) -> None:
        now = self.env.now
        keep, observe = self._keep_record, self._observe
        for a in rt.handle(event, now):
            if type(a) is Record:  # about half of all actions: handled inline
                keep(a.record)
                if observe is not None:
                    observe(a.record)
            else:
                self._carry(rt, a, now)
        if self.loads is not None:  # a load-aware router: this instance's load may have moved
            self.loads.touch(rt)
        if rt.settled:
            self._settled.add(rt)
            if len(self._settled) == len(self.runtimes):
                self._maybe_end()
        else:
            self._settled.discard(rt)
        wake = rt.next_wakeup
        if wake is not None and wake < self._tick_at.get(rt, _INF):
            self._tick_at[rt] = wake
            self._at(max(0.0, wake - now), self._tick, rt, wake)

    def _loop_deliver(self, rt: RankRuntime, event, _ev=None) -> None:
        """Host model: the event waits for its turn on the rank's loop, then is handled."""
        self.hostm.deliver(rt, self._feed, event)

    def _tick(self, rt: RankRuntime, when: float, _ev=None) -> None:
        if self._tick_at.get(rt) == when:
            del self._tick_at[rt]
        if not self._all_done.triggered:
            self._feed(rt, _TICK)

    # --- actions ------------------------------------------------------------------------
    def _carry(self, rt: RankRuntime, a, now: float) -> None:
        """Carry out one action other than a Record (which `_feed` keeps inline)."""
        kind = type(a)
        if kind is Send:
            dest = (
                self.prefill[a.dest.rank] if a.dest.role == "prefill" else self.decode[a.dest.rank]
            )
            if dest is None:
                return  # a folded rank: not simulated
            ev = self.env.timeout(self.control_latency)
            ev.callbacks.append(partial(self._deliver, dest, a.msg))
            if self.fold is not None and rt.role == "prefill":
                for msg in self.fold.mirrors(a.msg, a.dest.rank):  # as the folded writers send it
                    ev.callbacks.append(partial(self._deliver, dest, msg))
        elif kind is Forward:
            if self.host is not None:
                self.forwards.submit(rt, a, now)
            else:
                self.group_forwards[rt.instance].submit(rt, a, now)
        elif kind is Gather:
            self._gather(rt, a, now)
        elif kind is Write or kind is SliceWrite:
            requests = 1 if kind is Write else a.requests
            if self.host is not None and self.host.write_on_cpu:
                self._write_on_cpu(rt, a, requests)
                return
            if self.engine is not None:  # posted where the serving engine posts
                self.engine.write(rt, a, requests)
                if self.fold is not None:
                    self.fold.ghost_writes(rt, a, requests)
                return
            ev = self.fabric.transfer(  # the scenario's link numbers: engine posting + NIC message rate
                self.prefill_nic[rt.rank],
                self.decode_nic[a.decode_rank],
                a.nbytes,
                self.write_link,
                requests,
                poster=rt.rank,
            )
            ev.callbacks.append(
                partial(self._deliver, rt, WriteDone(a.room, a.chunk, a.decode_rank))
            )
            if self.fold is not None:
                self.fold.ghost_writes(rt, a, requests)
        elif kind is Scatter:
            self._scatter(rt, a, now)
        elif kind is RoomDone:
            self._room_finished(rt)
        elif kind is RoomFailed:
            self._room_finished(rt)
            self.batches.room_failed(rt, a.room)
        elif kind is Generate:
            self.batches.submit(rt, a, now)
        elif kind is Die:
            self._die(rt, a)
        # Verify (hardware only: sim runtimes do not verify) and nothing else reach here

    def _write_on_cpu(self, rt: RankRuntime, a, requests: int) -> None:
        """Host memory over loopback: the engine copies the bytes on a CPU thread of the
        writer (one lane per peer), so a write shares the cores with every other
        thread; alone it takes the link's time."""
        lk = self.write_link
        alone = (
            lk.latency_s
            + requests * lk.per_request_s
            + (lk.per_batch_s if requests else 0.0)
            + a.nbytes / lk.bandwidth_bytes_s
        )
        self.hostm.write(
            rt, a.decode_rank, alone, self._deliver, rt, WriteDone(a.room, a.chunk, a.decode_rank)
        )

    def _gather(self, rt: RankRuntime, a: Gather, now: float) -> None:
        dur = copy_time(self.gather_gpu, a.nbytes)
        done = GatherDone(a.room, a.chunk, a.decode_rank)
        if self.host is not None:  # on the rank's copy thread; its loop reports it
            self.hostm.copy(rt, dur, self._feed, done)
            return
        end = self.gather_stream[rt.rank].reserve(now, dur)
        self._at(end - now, self._feed, rt, done)

    def _scatter(self, rt: RankRuntime, a: Scatter, now: float) -> None:
        dur = copy_time(self.scatter_gpu, a.nbytes, launches=self._scatter_launches[rt.rank])
        done = ScatterDone(a.room, a.chunk)
        if self.host is not None:  # on the rank's copy thread; its loop reports it
            self.hostm.copy(rt, dur, self._feed, done)
            return
        end = self.scatter_stream[rt.rank].reserve(now, dur)
        self._at(end - now, self._feed, rt, done)

    def _die(self, rt: RankRuntime, a: Die) -> None:
        """The runtime stopped; its peers' failure detectors declare it lost after the
        heartbeat timeout of hardware mode (shared/liveness.py)."""
        ss = self.sessions
        if rt.role == "prefill":
            peers = [self.decode[d] for d in ss.all_targets(rt.rank)]
        else:
            peers = [self.prefill[p] for p in ss.all_writers(rt.rank)]
        peers = [peer for peer in peers if peer is not None]
        lost = PeerLost(rt.role, rt.rank, a.reason, rt.incarnation)
        for peer in peers:
            self._at(
                PEER_TIMEOUT_S, self._feed, peer, lost
            )  # silent that long: lost, as in hardware
        if rt.restart_after_s is not None:  # faults: kill restart_after_s
            self._at(rt.restart_after_s, self._restart, rt)

    def _restart(self, rt: RankRuntime, _ev=None) -> None:
        """A killed prefill rank starts again as its next incarnation (hardware mode: it
        re-registers with the rendezvous, which tells its decode peers): each peer names
        the first room it has not seen arrive and serves the rank's rooms from there on
        (PeerRejoined); the new incarnation serves the rooms from the smallest of those
        (RankRuntime.restart). Rooms that already arrived from there on reach it now."""
        peers = [self.decode[d] for d in self.sessions.all_targets(rt.rank)]
        peers = [peer for peer in peers if peer is not None and not peer.dead]
        incarnation = rt.incarnation + 1
        first = min((peer.next_room for peer in peers), default=len(self.requests))
        for peer in peers:
            self._feed(peer, PeerRejoined(rt.role, rt.rank, incarnation, peer.next_room))
        if self.checker is not None:
            self.checker.retire(rt.role, rt.rank)  # its lost incarnation's rooms are not its to end
        rt.restart(incarnation, first, self.env.now)
        if self.loads is not None:
            self.loads.touch(rt)
        arrived = len(self.requests) - self._arrivals_left  # rooms are numbered in arrival order
        for req in rt.requests:
            if req.room >= arrived:
                break
            self._feed(rt, Arrive(req))
        self._feed(rt, _TICK)

    # --- the end of the run ----------------------------------------------------------------
    def _maybe_end(self) -> None:
        """The run ends when every runtime is settled (the runtimes say when)."""
        if (
            not self._all_done.triggered
            and not self._arrivals_left
            and all(rt.settled for rt in self.runtimes)
        ):
            self._all_done.succeed()

    def _room_finished(self, rt: RankRuntime) -> None:
        if rt.role == "decode" and rt.rank % self.geometry.decode_tp == 0:
            self._ended += 1
            if self.progress is not None:
                self.progress(self._ended, len(self.requests))

    # --- workload -----------------------------------------------------------------------
    def request_of(self, room: int) -> Request:
        """The request of `room` (rooms need not be the requests' indices in a shard)."""
        if self._by_room is None:
            self._by_room = {r.room: r for r in self.requests}
        return self._by_room[room]

    def _arrive(self, index: int, req: Request, _ev=None) -> None:
        if req.room in self.rejected:  # refused at admission: no rank ever sees it
            self._arrivals_left -= 1
            self._ended += 1
            if self.progress is not None:
                self.progress(self._ended, len(self.requests))
            self._maybe_end()
            return
        prefill, decode = self.prefill, self.decode
        if not self.sessions.single:
            prefill, decode = self._route(index, req)
        if self.fold is not None:
            prefill, decode = [rt for rt in prefill if rt], [rt for rt in decode if rt]
        delay = self.engine.request_s if self.engine is not None else 0.0
        if delay:  # the serving stack's own path first: the arrival is on record now
            now = self.env.now
            for rt in decode:
                self._keep_record(TraceRecord("decode", rt.rank, "arrive", now, now, room=req.room))
            self._at(delay, self._open, req, prefill, decode)
        else:
            self._open(req, prefill, decode)

    def _open(self, req: Request, prefill: list, decode: list, _ev=None) -> None:
        self._arrivals_left -= 1
        arrive = Arrive(req)
        for rt in decode:
            self._deliver(rt, arrive)
        if self._local(req):  # prefilled on its decode instance: no prefill rank sees it
            return
        for rt in prefill:  # queues the forwards; no loop turn of its own
            self._feed(rt, arrive)

    def _local(self, req: Request) -> bool:
        """Conditional disaggregation (`cluster.max_local_prefill_length`)."""
        return self.scenario.cluster.prefills_locally(req.prompt_tokens, req.prefix_tokens)

    def _schedule_arrival(self, k: int) -> None:
        """Put the k-th arrival (in time order) on the event queue, as if every arrival
        had been scheduled before the run started.

        Scheduling them all up front made the queue hold every future request, so each
        event's push and pop cost log(requests) over an ever larger heap (most of what
        made a 64-instance cluster dearer per request than one instance). One at a time,
        the queue holds one arrival; the heap key gives it the place it had: time, then
        NORMAL priority, then an insertion number below every other event's (arrival k
        of n gets k - n), so same-time events run in the same order as before.
        """
        index = self._arrival_order[k]
        ev = simpy.Event(self.env)
        ev._ok, ev._value = True, None  # triggered, as a Timeout is
        ev.callbacks.append(partial(self._arrive_next, k))
        next(self.env._eid)  # SimPy's count of events scheduled stays the count of events
        heappush(
            self.env._queue, (self.requests[index].arrival_s, NORMAL, k - len(self.requests), ev)
        )

    def _arrive_next(self, k: int, _ev=None) -> None:
        if k + 1 < len(self._arrival_order):
            self._schedule_arrival(k + 1)
        index = self._arrival_order[k]
        self._arrive(index, self.requests[index])

    def _route(self, index: int, req: Request) -> tuple[list[RankRuntime], list[RankRuntime]]:
        """The ranks of the instances serving the request; a load-aware router decides
        now, from what it sees of every instance, and the ranks learn the room."""
        ss, g = self.sessions, self.geometry
        if self.loads is not None:
            ss.routes[req.room] = self.loads.route(req)
        pi, di = ss.route(req.room)
        n = g.prefill_ranks
        prefill = [rt for rt in self.prefill[pi * n : (pi + 1) * n] if rt]
        decode = [rt for rt in self.decode[di * g.decode_tp : (di + 1) * g.decode_tp] if rt]
        if self.loads is not None:
            for rt in (*prefill, *decode):  # a local room is no prefill rank's (`assign`)
                rt.assign(req)
                self.loads.touch(rt)
        return prefill, decode

    # --- run --------------------------------------------------------------------------------
    def _start_runtimes(self) -> None:
        for rt in self.runtimes:  # faults that act before any event (a late join, a kill)
            wake = rt.next_wakeup
            if wake is not None:
                self._tick_at[rt] = wake
                self._at(wake, self._tick, rt, wake)
        # a runtime no event ever reaches (a load-aware router sent it no room) is
        # settled all along: count it, or the run could never end
        self._settled.update(rt for rt in self.runtimes if rt.settled)

    def run(self) -> SimResult:
        wall = time.perf_counter()
        self._arrival_order = sorted(
            range(len(self.requests)), key=lambda i: self.requests[i].arrival_s
        )
        if self.requests:
            self._schedule_arrival(0)
            if self.control is not None:
                self.env.process(self._control_loop())
        self._start_runtimes()
        if self.requests:
            with gc_paused():
                self._run_to_the_end()
        return self.result(wall)

    def _control_loop(self):
        """control(self, now) every `interval` while requests are still to arrive (its
        pending timeout does not hold the run open: the run ends on `_all_done`)."""
        while self._arrivals_left:
            yield self.env.timeout(self.interval)
            self.control(self, self.env.now)  # type: ignore[misc]

    def result(self, wall: float) -> SimResult:
        """The run's result once it ended (`wall`: perf_counter() when it started)."""
        sim_time = self.env.now
        violations: list[Violation] = []
        if self.checker is not None:
            used = {rt.rank: rt.machine.ring.used_bytes for rt in self.decode if rt and not rt.dead}
            dead = {(rt.role, rt.rank) for rt in self.runtimes if rt.dead}
            violations = self.checker.finish(sim_time, used, ignore_ranks=dead)
        ranks = [rt.result() for rt in self.runtimes]
        return SimResult(
            scenario=self.scenario,
            requests=self.requests,
            records=self.records,
            violations=violations,
            events=sum(r.events for r in ranks),
            sim_time_s=sim_time,
            wall_s=time.perf_counter() - wall,
            rooms_done=sum(
                min(rt.machine.rooms_done + rt.local_done for rt in group)
                for group in self._decode_groups()
            ),
            rooms_failed=sum(
                max(rt.machine.rooms_failed for rt in group) for group in self._decode_groups()
            ),
            failures=merge_failures(ranks),
            ranks=ranks,
            rejected=dict(self.rejected),
        )

    def _run_to_the_end(self) -> None:
        """Run until every runtime settled; a run that stops with work left (nothing
        scheduled, some rank still holding rooms) raises Stalled, naming what waits."""
        try:
            self.env.run(until=self._all_done)
        except RuntimeError as exc:
            if self._all_done.triggered or "No scheduled events left" not in str(exc):
                raise
            raise Stalled(self.stall_diagnosis()) from None

    def stall_diagnosis(self) -> str:
        """One line: when the run stalled, and per rank not settled what it waits for."""
        held = [f"{rt.name}: {rt.holding()}" for rt in self.runtimes if not rt.settled]
        left = f"; {self._arrivals_left} arrival(s) not delivered" if self._arrivals_left else ""
        return (
            f"the simulation stalled at {self.env.now:.3f}s with work left (nothing more can "
            f"happen){left}: " + " | ".join(held)
        )

    def _decode_groups(self) -> list[list[RankRuntime]]:
        tp = self.geometry.decode_tp
        groups = [
            [rt for rt in self.decode[i : i + tp] if rt] for i in range(0, len(self.decode), tp)
        ]
        return [group for group in groups if group]


class Stalled(RuntimeError):
    """The simulation ran out of events with work left: the message says what waits."""


def engine_limits(scenario: Scenario, generate: bool, decode_pages: int | None = None) -> Limits:
    """What a simulated instance admits (shared/admission.py): the model's context length,
    and the KV pools of the serving model: a decode rank's (DecodeModel, the pages its
    runtime allocates) and a prefill rank's (shared/serving/memory.py)."""
    page = scenario.decode.page_size
    prefill_tokens = side_memory(scenario, "prefill").kv_tokens
    return Limits(
        page_size=page,
        context_tokens=scenario.model.context_tokens,
        decode_pages=DecodeModel(scenario).capacity_pages if decode_pages is None else decode_pages,
        prefill_pages=prefill_tokens // page if prefill_tokens > 0 else None,
        output_in_pages=generate,
    )


def _by_instance(requests: list[Request], ss) -> dict[tuple[str, int], list[Request]]:
    """The requests each prefill and decode instance serves, in order (static routes)."""
    out: dict[tuple[str, int], list[Request]] = {
        ("prefill", i): [] for i in range(ss.prefill_instances)
    }
    out.update({("decode", j): [] for j in range(ss.decode_instances)})
    for req in requests:
        pi, di = ss.route(req.room)
        out["prefill", pi].append(req)
        out["decode", di].append(req)
    return out


def simulate(scenario: Scenario, **kw) -> SimResult:
    return Simulation(scenario, **kw).run()
