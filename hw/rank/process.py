"""One rank process of hardware mode: the rank runtime on the wall clock, moving real bytes.

Like the simulator, this driver decides nothing. The rank's `RankRuntime` (shared/)
owns the workload, the fault plan, the KV pages, the release of memory and when the
rank is finished; this process keeps the wall clock, delivers arrivals, messages and
completions to it, and carries out its actions for real: protocol messages over ZMQ,
bulk writes and slice-path descriptor lists through NIXL or Mooncake, forwards
(pattern fills), gathers and scatters as torch kernels, and bit-exact verification.
`PrefillRank` (hw/rank/prefill.py) and `DecodeRank` (hw/rank/decode.py) hold what
differs by role.

Single-threaded by design: only the loop touches the runtime. Heavy work runs on worker
threads (fills, gathers, scatters, verification) and transfer lanes (hw/transport/base.py);
each sets the control plane's waker when it finishes, so the loop blocks on its socket
and that waker together instead of polling (only NIXL writes left in flight by
transfer() are polled, every BUSY_POLL_S).
The loop thread and the ZMQ I/O threads run in a real-time class
(LoopPriority) so that a message wakes them at once on cores the workers keep busy; the
transfer engine's threads in one below it (WritePriority), ahead of gathers and fills.

Restart and rejoin: a prefill rank process started again while its run goes on
registers with the rendezvous under its new control plane's incarnation (newer than
its predecessor's); the rendezvous tells its decode peers, each of which points its
control connection at the new address, raises the control plane's replay floor to the
new incarnation and its key (the old process's late frames fail from then on), watches the
rank again and feeds its runtime PeerRejoined with the first room it has not seen
arrive. The new process gets the smallest of those and serves its rooms from there on
(its runtime is built with `first_room`); the rooms before it were its predecessor's
(failed by the peers, or done). It loads its decode peers' transfer metadata afresh,
as any starting prefill rank does; a decode rank loads no prefill rank's metadata
(writes are one-sided, from the prefill), so it has no old agent to forget.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
import traceback
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvstage.hw.control.plane import LOOP_STATS_ENV, ControlPlane, rank_name
from kvstage.hw.control.rendezvous import RANK_BEAT_S, ClockOffset, RankInfo, RendezvousClient
from kvstage.hw.launch.launcher import check_launcher
from kvstage.hw.rank.cipher import warm_device_cipher
from kvstage.hw.rank.kernels import warm_hashed_moves
from kvstage.hw.rank.kvpool import KVPool
from kvstage.hw.rank.priority import LoopPriority, WritePriority, thread_ids
from kvstage.hw.transport import affinity
from kvstage.hw.transport.base import make_transport
from kvstage.hw.transport.jobcpu import JobCpu
from kvstage.hw.transport.nic import counter_delta, read_counters
from kvstage.hw.transport.placement import transport_options
from kvstage.shared.admission import admit, context_limits
from kvstage.shared.capability import Capabilities
from kvstage.shared.cluster import hardware_sessions
from kvstage.shared.events import (
    Arrive,
    Die,
    PeerLost,
    PeerRejoined,
    Record,
    RoomDone,
    RoomFailed,
    Send,
    Tick,
)
from kvstage.shared.layout import owned_heads
from kvstage.shared.liveness import HEARTBEAT_S, PEER_TIMEOUT_S, PeerWatch
from kvstage.shared.pages import kv_pool_pages
from kvstage.shared.protocol import Heartbeat
from kvstage.shared.runtime import RankRuntime
from kvstage.shared.scenario import Scenario
from kvstage.shared.serving.memory import cache_blocks
from kvstage.shared.trace import TRACE_FIELDS, TraceRecord
from kvstage.shared.workload import generate_requests

log = logging.getLogger("kvstage.hw.rank.process")

# Poll interval while transfers that signal no completion (NIXL) are in flight; all
# other executor work wakes the loop when it finishes (ControlPlane.waker).
BUSY_POLL_S = 0.001
IDLE_POLL_S = 0.05
# The interpreter asks a thread holding the GIL to hand it over after this long (Python's
# default: 5 ms). A rank's worker threads run torch glue between kernels; with the default
# a message that woke the loop could wait 5 ms for the lock, every time.
SWITCH_INTERVAL_S = float(os.environ.get("KVSTAGE_SWITCH_INTERVAL_US", "500")) * 1e-6
# KVSTAGE_LOOP_STATS=DIR: each rank writes its LoopClock figures to DIR/<rank>.json and
# its control plane's stamps, with one ("h", time) per message as the loop starts handling
# it, to DIR/<rank>.msgs (benchmarks/hw_loop.py reads them). LOOP_STATS_ENV: hw/control/plane.py.
# What a finished rank tells the rendezvous it may be silent for while its report goes out.
REPORT_QUIET_S = 120.0


class RankError(RuntimeError):
    pass


class LoopClock:
    """Where a rank loop's time goes: blocked in a turn (a message that arrives then waits
    until the turn ends, as does a finished transfer or kernel) or waiting on its socket
    and waker (ready to answer at once)."""

    def __init__(self) -> None:
        self.started = self._turn_start = time.perf_counter()
        self.sched = "normal"  # the loop thread's scheduling class (LoopPriority)
        self.lane_sched = self.engine_sched = (
            "normal"  # the write lanes' and engine's (WritePriority)
        )
        self.waited_s = 0.0
        self.turns: list[float] = []  # each turn's length, s

    def wait(self, control: ControlPlane, timeout_s: float) -> bool:
        """`control.wait(timeout_s)`, timed."""
        t = time.perf_counter()
        self.turns.append(t - self._turn_start)
        ready = control.wait(timeout_s)
        self._turn_start = end = time.perf_counter()
        self.waited_s += end - t
        return ready

    def figures(self) -> dict[str, float]:
        total = time.perf_counter() - self.started
        turns = sorted(self.turns) or [0.0]
        return {
            "loop_sched": self.sched,
            "lane_sched": self.lane_sched,
            "engine_sched": self.engine_sched,
            "loop_s": total,
            "waited_s": self.waited_s,
            "blocked_share": 1 - self.waited_s / total if total else 0.0,
            "turns": len(self.turns),
            "turn_p50_s": turns[len(turns) // 2],
            "turn_p99_s": turns[min(len(turns) - 1, int(0.99 * len(turns)))],
            "turn_max_s": turns[-1],
        }

    def dump(self, name: str, stamps: list | None = None) -> None:
        """Write the figures to $KVSTAGE_LOOP_STATS/<name>.json (and `stamps`, the control
        plane's, to <name>.msgs) when that is set."""
        folder = os.environ.get(LOOP_STATS_ENV)
        if folder:
            Path(folder, f"{name}.json").write_text(json.dumps(self.figures()))
            if stamps is not None:
                Path(folder, f"{name}.msgs").write_text(json.dumps(stamps))


class RankProcess:
    """What every rank process has: the runtime, a KV pool, a transport, a control
    plane and the loop. Subclasses execute the role's actions (`_EXECUTORS`)."""

    role = ""
    _EXECUTORS: dict[type, Any] = {}

    def __init__(
        self,
        scenario: Scenario,
        rank: int,
        rendezvous: str,
        *,
        backend: str | None = None,
        device: str | None = None,
        verify_mode: str | None = None,
        host: str = "127.0.0.1",
        clock_skew_s: float = 0.0,
        credential: bytes = b"",
    ) -> None:
        self.s, self.credential = scenario, credential
        self.rank = rank
        self.name = rank_name(self.role, rank)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.g = g = scenario.geometry()
        requests = generate_requests(scenario)
        # rank is global across instances (shared/cluster.py); the geometry takes `local`
        self.sessions, _ = hardware_sessions(scenario, requests)
        n = self.sessions.ranks(self.role)
        if not 0 <= rank < n:
            raise RankError(f"{self.role} rank {rank} out of range 0..{n - 1}")
        tp = self.sessions.tp(self.role)
        self.local = self.sessions.local(self.role, rank)
        self.backend = backend or scenario.hardware.backend
        self.device = device or scenario.hardware.device
        self.verify_mode = verify_mode or scenario.hardware.verify
        # the rooms routed to this rank's instance: its workload, and what its KV pool holds
        served = admit(requests, context_limits(scenario))[0]  # less refusals (shared/admission.py)
        self.mine = mine = [r for r in served if self.sessions.serves(self.role, rank, r.room)]
        self.pages = pages = kv_pool_pages(g, self.role, mine, scenario.hardware.kv_pool_mb << 20)
        self.runtime = RankRuntime(
            scenario,
            self.role,
            rank,
            requests=mine,
            kv_pages=pages,
            cache_blocks=cache_blocks(scenario),
            verify=self.verify_mode != "off",
            sessions=self.sessions,
            check_writes=scenario.transfer.verify_writes != "none",
            # a decode's nonces under a key of this process alone (shared/capability.py)
            capabilities=Capabilities(secrets.token_bytes(32)) if self.role == "decode" else None,
        )
        self.records: list[TraceRecord] = []
        self.rendezvous_address = rendezvous
        self.host = host
        self.global_heads = list(owned_heads(tp, self.local, g.total_kv_heads))
        heads = g.prefill_heads if self.role == "prefill" else g.decode_heads
        self.pool = KVPool(
            g.layers,
            pages,
            g.page_size,
            heads,
            g.head_dim,
            scenario.model.dtype,
            kv_planes=g.kv_factor,
            device=self.device,
        )
        # clock_skew_s: an artificial error of this rank's clock (tests: the offset measured
        # at the rendezvous must undo it); clock_offset_s: that measured offset
        self.clock_skew_s = clock_skew_s
        self.clock: ClockOffset | None = None
        self.clock_offset_s = 0.0
        self.ceiling: dict[str, Any] = {}  # the bandwidth probe's figures (prefill ranks)
        self.nic_before: dict[str, dict[str, int]] | None = None
        before = set(thread_ids())
        self.transport = make_transport(
            self.backend,
            f"kvstage-{self.name}-{os.getpid()}",
            self.device,
            **transport_options(scenario.hardware, self.backend, host),
        )
        self._register_memory()
        self.write_priority = WritePriority()  # the write path's class, while the loop runs
        self.write_priority.engine = [
            t for t in thread_ids() if t not in before
        ]  # the engine started them
        self.transport.on_lane_start = self.write_priority.lane_started
        self.job_cpu = JobCpu()  # what the heavy jobs cost in CPU (summary.json job_cpu)
        self.transport.job_cpu = self.job_cpu
        self.transport.lane_guard = self.write_priority.lane_batch  # KVSTAGE_WRITE_RT_LANES=slots
        self.control = ControlPlane(host, name=self.name, role=self.role)
        if self.transport.signals_completion:
            self.transport.on_complete = self.control.waker.set
        self.loop_clock = LoopClock()
        self.priority = LoopPriority()  # the loop's scheduling class, while it runs
        self.peers: dict[str, RankInfo] = {}
        self.client: RendezvousClient | None = None
        self.t0 = 0.0
        self._next_alive = 0.0

    @property
    def on_cuda(self) -> bool:
        return str(self.device).startswith("cuda")

    # --- role hooks ------------------------------------------------------------------
    def _register_memory(self) -> None:
        """Register what the engine moves bytes from or into (before the engine's threads
        are told from the others: a first registration may start some). A prefill's KV
        pool is the source of its slice writes."""
        self.transport.register(self.pool.tensor)

    def _rank_extra(self) -> dict[str, Any]:
        """What peers need to know about this rank's memory (the rendezvous carries it),
        and the form of its write tags (hw/rank/writemac.py: a GPU block's "mac" is
        hashed on the device, a host block's on the host)."""
        return {"kv_pool": self.pool.desc.to_wire(), "tag_form": self._tag_form()}

    def _tag_form(self) -> str:
        return "device" if self.pool.bytes.is_cuda else "host"

    def _check_tag_forms(self, table: dict[str, RankInfo]) -> None:
        """Writer and decode must tag a block by the same form, or every tagged block
        fails: refuse the run at the table, naming the ranks and their memory."""
        if self.s.transfer.verify_writes != "mac":
            return
        mine = self._tag_form()
        other = "decode" if self.role == "prefill" else "prefill"
        for info in table.values():
            theirs = info.extra.get("tag_form", mine)
            if info.role == other and theirs != mine:
                raise RankError(
                    f"{self.name} keeps its KV in {mine} memory and {info.name} in {theirs} "
                    f'memory: their write tags (transfer.verify_writes = "mac") would never '
                    f"match. Run every rank on one kind of device (--device), or set "
                    f'transfer.verify_writes = "checksum" (one form on both)'
                )

    def _connect_peers(self, table: dict[str, RankInfo]) -> None:
        raise NotImplementedError

    def _progress(self) -> None:
        """Executor work that is not an action: forwards running, transfers completing."""

    def _wait_s(self) -> float:
        """How long the loop may block on its socket before it must look at executor work
        again. Work that wakes the loop when it finishes (worker threads, engines that
        `signals_completion`) needs no polling: IDLE_POLL_S then."""
        return IDLE_POLL_S

    def _wake(self, _job: Future | None = None) -> None:
        """A worker's job finished (a Future's done callback, on the worker thread):
        wake the loop's poll, so it reports the result now rather than a poll later."""
        self.control.waker.set()

    def _report_extra(self) -> dict[str, Any]:
        return {}

    def _probe(self, probe: dict[str, float]) -> dict[str, Any]:
        """The bandwidth probe before t0 (hw/transport/bandwidth.py): only prefill ranks write."""
        return {}

    def _still_held(self) -> list[str]:
        """Executor resources still taken once the runtime settled (a leak, if any)."""
        return []

    # --- life cycle -----------------------------------------------------------------------
    def run(
        self, rendezvous_timeout_s: float = 60.0, register_at: float | None = None
    ) -> dict[str, Any]:
        """Register, run, report. `register_at` (epoch s): not before then (a rank the
        launcher started again after its fault killed it waits for its restart time)."""
        client = self.client = RendezvousClient(
            self.rendezvous_address, watch=check_launcher, credential=self.credential
        )
        client.on_wait = lambda note: print(f"{self.name}: {note}", file=sys.stderr, flush=True)
        if self.s.transfer.verify_writes == "mac":
            warm_hashed_moves(self.pool)  # Triton's compiles before the run (a GPU pool)
        if self.s.transfer.ring_cipher != "none":
            warm_device_cipher(self.pool.device)  # the same for the write cipher
        while register_at is not None and time.time() < register_at:
            check_launcher()
            time.sleep(min(0.1, max(0.0, register_at - time.time())))
        # a rank registered under this name already (this is a restart): take a newer
        # incarnation than it, whatever this host's clock says
        known = client.incarnations(rendezvous_timeout_s).get(self.name)
        if known is not None and known >= self.control.incarnation:
            self.control.renew_incarnation(known + 1)
        me = RankInfo(
            self.role,
            self.rank,
            self.control.address,
            self.transport.agent_name,
            self.transport.metadata(),
            {
                **self._rank_extra(),
                "affinity": affinity.current(),
            },  # its NIC (hw/transport/affinity.py)
            self.control.incarnation,
            self.control.identity.public.hex(),
        )
        table, t0 = client.hello(me, rendezvous_timeout_s)
        self.t0 = t0
        # trace times are on the launcher's clock: measure this clock's offset to it, now
        # that every rank is registered and quiet (before t0, half a second away)
        self.clock = client.clock_offset(
            samples=16, clock=self.wall, timeout_s=rendezvous_timeout_s
        )
        # Correct only an offset the measurement can tell from zero: ranks sharing one
        # clock (one host) keep it exactly, instead of each taking its own estimation
        # error (up to half a round trip), which would reorder their trace by as much.
        if abs(self.clock.offset_s) > self.clock.uncertainty_s:
            self.clock_offset_s = self.clock.offset_s
        if client.rejoin is not None:
            self._rejoin(client.rejoin)
        self.peers = table
        self._check_tag_forms(table)
        self._connect_peers(table)
        self.control.gate.seal()  # every peer's key admitted: any other is refused at once
        if client.probe is not None and client.rejoin is None:  # a rejoin finds the rings in use
            self.ceiling = self._probe(client.probe)
        self.nic_before = read_counters()
        error = ""
        try:
            self._loop(t0)
            held = self._still_held()
            if held:
                raise RankError(
                    f"{self.name}: finished with resources still taken: {'; '.join(held)}"
                )
        except Exception as exc:  # report, don't hang the run
            error = f"{self.name}: {type(exc).__name__}: {exc}"
            log.error("%s\n%s", error, traceback.format_exc())
        self.priority.restore()
        self.write_priority.restore()
        client.alive(quiet_s=REPORT_QUIET_S)  # building and sending a long trace takes a while
        report = self._report(error)
        client.report(
            report,
            timeout_s=max(60.0, self.runtime.config.room_timeout_s * 2),
            serve=None if error else self._serve_late,
        )
        client.close()
        self.close()
        return report

    def _rejoin(self, rejoin: dict[str, Any]) -> None:
        """This process rejoined a run under way, replacing the rank's lost incarnation:
        it serves the rooms from the rendezvous' first_room on (None: none)."""
        first = rejoin.get("first_room")
        first_room = (
            int(first) if first is not None else max((r.room for r in self.mine), default=-1) + 1
        )
        self.runtime = RankRuntime(
            self.s,
            self.role,
            self.rank,
            requests=self.mine,
            kv_pages=self.pages,
            cache_blocks=cache_blocks(self.s),
            verify=self.verify_mode != "off",
            sessions=self.sessions,
            check_writes=self.s.transfer.verify_writes != "none",
            first_room=first_room,
            started_at=self.now(),
            incarnation=self.control.incarnation,
        )
        log.warning(
            "%s: rejoined the run as incarnation %d, serving rooms from %d (%d of its rooms)",
            self.name,
            self.control.incarnation,
            first_room,
            len(self.runtime.requests),
        )

    def close(self) -> None:
        try:
            self.transport.close()
        finally:
            self.control.close()

    # --- the loop ---------------------------------------------------------------------------
    def _peers(self) -> list[tuple[str, int]]:
        """The ranks this one exchanges messages with: (role, rank)."""
        return self.sessions.peers(self.role, self.rank)

    def _heartbeat(self) -> None:
        now = self.now()
        if now < self._next_beat:
            return
        self._next_beat = now + HEARTBEAT_S
        self._rendezvous_turn()
        for role, rank in self._peers():
            if (role, rank) in self.watch.lost:
                continue
            if self.role == "prefill":
                beat = Heartbeat(self.rank, rank, False)
            else:
                beat = Heartbeat(rank, self.rank, True)
            self.control.send(rank_name(role, rank), beat)

    def _rendezvous_turn(self) -> None:
        """Tell the rendezvous this rank is alive (every RANK_BEAT_S), and act on what it
        told this rank (a peer that rejoined)."""
        client = self.client
        if client is None:
            return
        mono = time.monotonic()
        if mono >= self._next_alive:
            self._next_alive = mono + RANK_BEAT_S
            m = self.runtime.machine
            client.alive(rooms=(m.rooms_done + m.rooms_failed, len(self.runtime.requests)))
        for notice in client.poll_notices():
            if notice.get("kind") == "rejoin":
                info = RankInfo.from_json(notice["rank"])
                client.ack_rejoin(info.name, info.incarnation, self._peer_rejoined(info))

    def _peer_rejoined(self, info: RankInfo) -> int | None:
        """A peer restarted and rejoined as `info`: talk to its new process, drop the old
        one's late frames, watch it again, and give the runtime PeerRejoined. Returns
        the first room the new incarnation serves here (None: not a peer of this rank)."""
        peer = (info.role, info.rank)
        if peer not in self.watch:
            return None
        old = self.peers.get(info.name)
        if old is not None and info.incarnation <= old.incarnation:
            return None  # not newer than the one known
        self.peers[info.name] = info
        self.control.connect(info.name, info.control, info.identity)  # the old one's frames fail
        first = self.runtime.next_room
        log.warning(
            "%s: %s rejoined as incarnation %d (was %s): it serves rooms from %d here",
            self.name,
            info.name,
            info.incarnation,
            old.incarnation if old else "?",
            first,
        )
        self.watch.rejoined(peer, self.now())
        self._feed(PeerRejoined(info.role, info.rank, info.incarnation, first))
        return first

    def _receive(self, wait: float) -> bool:
        """Messages in: every one is a sign of life of its sender; heartbeats stop here."""
        messages = self.control.drain() if self.loop_clock.wait(self.control, wait) else []
        now = self.now()
        stamps = self.control.stamps
        for msg in messages:
            if stamps is not None:
                stamps.append(("h", time.time()))
            if self.role == "prefill":
                self.watch.heard(("decode", msg.decode_rank), now)
            else:
                self.watch.heard(("prefill", msg.prefill_rank), now)
            if type(msg) is not Heartbeat:
                self._feed(msg)
        for role, rank in self.watch.newly_lost(self.now()):
            log.warning("%s: %s%d silent for %.1fs: lost", self.name, role, rank, PEER_TIMEOUT_S)
            info = self.peers.get(rank_name(role, rank))
            self._feed(
                PeerLost(
                    role,
                    rank,
                    f"{role} rank {rank} stopped answering "
                    f"(no heartbeat for {PEER_TIMEOUT_S:.0f}s)",
                    info.incarnation if info is not None else -1,
                )
            )
        return bool(messages)

    def _loop(self, t0: float) -> None:
        self.t0 = t0
        self.watch = PeerWatch(self._peers(), PEER_TIMEOUT_S, self.now())
        self.loop_clock = LoopClock()  # the loop's own time, without the start-up before it
        self.loop_clock.sched = self.priority.apply()
        lanes, tr = self.write_priority, self.transport
        lanes.apply(
            engine_ok=tr.engine_threads_block, lanes_ok=tr.lanes_block, engine_alone=tr.engine_alone
        )
        self._next_beat = 0.0
        rt = self.runtime
        arrivals = deque(rt.requests)  # the rooms routed to this instance
        last = arrivals[-1].arrival_s if arrivals else 0.0
        hard_deadline = last + rt.join_at + rt.config.room_timeout_s * 3 + 30
        while not rt.settled:
            check_launcher()  # a rank ends with its launcher
            now = self.now()
            if now > hard_deadline:
                raise RankError(
                    f"{self.name}: run did not finish within {hard_deadline:.0f}s "
                    f"({rt.machine.rooms_done} done, {rt.machine.rooms_failed} failed "
                    f"of {len(rt.requests)}; still {rt.holding()})"
                )
            while arrivals and arrivals[0].arrival_s <= now:
                self._feed(Arrive(arrivals.popleft()))
            self._progress()
            wake = rt.next_wakeup
            if wake is not None and wake <= self.now():
                self._feed(Tick())
            wait = self._wait_s()
            for t in (arrivals[0].arrival_s if arrivals else None, rt.next_wakeup):
                if t is not None:
                    wait = min(wait, max(0.0, t - self.now()))
            self._heartbeat()
            self._receive(min(wait, HEARTBEAT_S))
        clock = self.loop_clock
        clock.lane_sched, clock.engine_sched = lanes.lanes, lanes.engine_sched
        clock.dump(self.name, self.control.stamps)

    def _serve_late(self) -> None:
        """After this rank finished: answer what peers still send (acknowledgements they
        wait for, ABORTs of failed rooms) until every rank has finished."""
        self._heartbeat()  # still here: peers that run on must not think this rank died
        self._receive(0.02)

    def wall(self) -> float:
        """This rank's own wall clock (with the test-only skew)."""
        return time.time() + self.clock_skew_s

    def now(self) -> float:
        """Seconds since the run start, on the launcher's clock."""
        return self.wall() + self.clock_offset_s - self.t0

    def _feed(self, event, now: float | None = None) -> None:
        """`event` to the runtime at `now` (default: this moment)."""
        for action in self.runtime.handle(event, self.now() if now is None else now):
            self._carry(action)

    def _carry(self, a) -> None:
        kind = type(a)
        if kind is Record:
            self.records.append(a.record)
        elif kind is Send:
            self.control.send(rank_name(a.dest.role, a.dest.rank), a.msg)
        elif kind is RoomDone or kind is RoomFailed:
            pass  # the runtime keeps the outcome
        elif kind is Die:
            log.warning("%s: %s", self.name, a.reason)
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            execute = self._EXECUTORS.get(kind)
            if execute is None:
                raise RankError(f"{self.name}: no executor for {kind.__name__}")
            execute(self, a)

    # --- report -------------------------------------------------------------------------------
    def _report(self, error: str) -> dict[str, Any]:
        report = self.runtime.result().to_wire()
        report.update(
            {
                "error": error,
                **self.control.counters(),  # malformed, unauthenticated, oversize, replayed
                "requests_posted": self.transport.requests_posted,
                "host": self.host,
                "device": str(self.device),
                **(self.clock.to_wire() if self.clock else {}),
                "clock_applied_s": self.clock_offset_s,  # 0 when the offset was within its uncertainty
                "loop_sched": self.loop_clock.sched,  # the loop thread's scheduling class
                "lane_sched": self.loop_clock.lane_sched,  # the write lanes' class (WritePriority)
                "engine_sched": self.loop_clock.engine_sched,  # the transfer engine's threads' class
                "job_cpu": self.job_cpu.to_wire(),  # CPU of fills, gathers, scatters, lane copies (hw/transport/jobcpu.py)
                "transport_used": self.transport.used(),  # what the engine chose (hw/transport/used.py)
                "affinity": affinity.current(),  # its GPU, NUMA node and NIC (hw/transport/affinity.py)
                "ceiling": self.ceiling,  # prefill: each decode peer's raw write ceiling (hw/transport/bandwidth.py)
                # bytes each NIC of this rank's host (its network namespace) moved while it ran
                "nic": counter_delta(self.nic_before, read_counters())
                if self.nic_before is not None
                else {},
                "hostname": socket.gethostname(),
                "cpu_s": round(
                    sum(os.times()[:2]), 4
                ),  # this process's CPU (conditions: not "others")
                "records": [[getattr(r, f) for f in TRACE_FIELDS] for r in self.records],
            }
        )
        report.update(self._report_extra())
        return report
