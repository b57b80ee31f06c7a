"""The rank runtime: everything between one rank's state machine and its driver.

One model, two clocks (SimPy's `Environment` / `RealtimeEnvironment`): the simulator
and a hardware rank process both wrap each rank's `PrefillMachine` or
`DecodeMachine` in a `RankRuntime` and only keep time and carry actions out. The
runtime decides, identically in both modes:

- arrivals: a request becomes OpenRoom when its pages fit (the decode opens it on
  arrival; the prefill when the forward of its first chunk starts); the queue, the
  pages and the prefix cache are its admission part (shared/admission.py
  `RankAdmission`), sized by the driver: the runtime reads no file and imports neither
  the serving model nor the workload generator;
- the order of prefill forwards: requests in arrival order, chunks in order, one at
  a time (`Forward` actions, which the driver runs in the order given);
- the fault plan of this rank, drawn from the scenario seed and this rank's identity
  (message drop / duplicate / delay, abort at a phase, a stalled scatter, a late
  session, a kill), so a scenario injects the same faults on the same ranks in both
  modes;
- a killed rank's next incarnation (`restarted`): a prefill rank started again
  serves the rooms from the first one its decode peers had not yet seen arrive when
  they learnt of the rejoin (`next_room`, PeerRejoined); the rooms before it were the
  lost incarnation's (failed, or done before the crash);
- delayed deliveries (held here, released when due) and deferred completions;
- when a room's KV pages may be reused (on the machine's `ReleaseRoom`, after the
  forwards writing them and the verification reading them ended);
- when this rank is finished (`settled`), and the rank's part of the run result.

The h11 rule for errors: a driver's misuse (a completion for work never handed out)
raises `LocalProtocolError` at once; a peer's bad message is the machine's to drop, count
and trace.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstage.shared.admission import RankAdmission
from kvstage.shared.capability import Capabilities
from kvstage.shared.cluster import Sessions
from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import (
    AbortRoom,
    Action,
    Arrive,
    CheckSlice,
    ChunkComputed,
    Die,
    Event,
    Forward,
    ForwardDone,
    ForwardStarted,
    Gather,
    GatherDone,
    Generate,
    GenerateDone,
    OpenRoom,
    Record,
    ReleaseRoom,
    RoomDone,
    RoomFailed,
    Scatter,
    ScatterDone,
    Send,
    SliceChecked,
    SliceWrite,
    Tick,
    Verify,
    VerifyDone,
    Write,
    WriteDone,
)
from kvstage.shared.faults import FaultPlan
from kvstage.shared.layout import LayoutError, room_pages
from kvstage.shared.machine import LocalProtocolError, ProtocolConfig
from kvstage.shared.pages import decode_room_pages
from kvstage.shared.prefill import PrefillMachine
from kvstage.shared.protocol import MESSAGE_TYPES, StagingRsp
from kvstage.shared.request import Request
from kvstage.shared.serving.prefix_cache import PrefixCache, cached_in_chunk
from kvstage.shared.trace import TraceRecord

if TYPE_CHECKING:  # a loaded scenario is handed in: no loader, no serving model here
    from kvstage.shared.scenario import Scenario

ROLES = ("prefill", "decode")
# peer messages that name a room
_ROOM_MESSAGES = frozenset(t for t in MESSAGE_TYPES if "room" in t.__dataclass_fields__)
# trace rows for messages about rooms outside the workload; past this only counted
MAX_FOREIGN_TRACED = 1000
# completions of work the runtime handed out (a restarted one drops its predecessor's)
_COMPLETIONS = frozenset(
    {
        ForwardStarted,
        ForwardDone,
        GatherDone,
        WriteDone,
        ScatterDone,
        SliceChecked,
        VerifyDone,
        GenerateDone,
    }
)


def rank_name(role: str, rank: int) -> str:
    return f"{role}{rank}"


def fault_stream(role: str, rank: int) -> int:
    """The fault plan's random stream of one rank: the same in both modes."""
    return (role == "decode") * 4096 + rank


def protocol_config(scenario: Scenario, check_slice_writes: bool = False) -> ProtocolConfig:
    """The protocol's knobs from the scenario; `check_slice_writes`: hardware mode's
    slice-path write tags (transfer.verify_writes), which the simulator does not check."""
    return ProtocolConfig(
        path=scenario.transfer.path,
        room_timeout_s=scenario.transfer.room_timeout_s,
        check_slice_writes=check_slice_writes,
    )


@dataclass(slots=True)
class RankResult:
    """One rank's part of the run result (summary.json sums and lists these)."""

    role: str
    rank: int
    rooms_done: int
    rooms_failed: int
    failures: dict[int, str]
    dropped: int
    events: int
    faults_injected: dict[str, int]
    ring_used: int  # decode: staging bytes still held at the end (0 = no leak)
    died: bool
    prompt_tokens: int = 0  # prefill: prompt tokens of the rooms it scheduled
    cached_tokens: int = 0  # prefill: of those, served from its prefix cache

    @property
    def name(self) -> str:
        return rank_name(self.role, self.rank)

    def to_wire(self) -> dict:
        d = {f: getattr(self, f) for f in self.__slots__}
        d["failures"] = {str(k): v for k, v in self.failures.items()}
        return d

    @classmethod
    def from_wire(cls, d: dict) -> RankResult:
        d = dict(d)
        d["failures"] = {int(k): v for k, v in d["failures"].items()}
        return cls(**{f: d[f] for f in cls.__slots__})


def merge_failures(ranks: list[RankResult]) -> dict[int, str]:
    """Why each failed room failed, over the whole run: the first reason in rank order,
    decode ranks first (the room is the decode's to finish), then prefill ranks."""
    merged: dict[int, str] = {}
    for r in sorted(ranks, key=lambda r: (r.role != "decode", r.rank)):
        for room, reason in r.failures.items():
            merged.setdefault(room, reason)
    return dict(sorted(merged.items()))


def sum_counts(counts) -> dict[str, int]:
    """Per-rank counters (e.g. faults injected) summed over ranks, keys sorted."""
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return dict(sorted(total.items()))


@dataclass(slots=True)
class _RoomMemory:
    """A room's local KV pages and who still uses them."""

    request: Request
    first_page: int
    num_pages: int
    forwards: int = 0  # prefill: forwards handed out and not yet done
    verifying: bool = False  # decode: a Verify handed out and not yet done
    generating: bool = False  # decode: in the instance's batch, generating its output
    released: bool = False  # the machine said nothing else touches the pages
    opened: bool = False  # prefill: OpenRoom given to the machine
    open_only: bool = False  # prefill: a room with nothing to compute (one empty Forward)


@dataclass(slots=True)
class _Timer:
    due: float
    seq: int
    action: Send | Scatter | CheckSlice | None = None  # handed to the driver when due
    event: Event | None = None  # fed to the machine when due

    def __lt__(self, other: _Timer) -> bool:
        return (self.due, self.seq) < (other.due, other.seq)


@dataclass(slots=True)
class _Owed:
    """Completions the driver owes, by kind: a completion not owed is a driver bug."""

    counts: dict[tuple, int] = field(default_factory=dict)

    def add(self, key: tuple) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def settle(self, key: tuple) -> None:
        n = self.counts.get(key, 0)
        if n <= 0:
            raise LocalProtocolError(
                f"completion {key} for work that was never handed out (or reported twice)"
            )
        if n == 1:
            del self.counts[key]
        else:
            self.counts[key] = n - 1

    def __bool__(self) -> bool:
        return bool(self.counts)


def _some(items, n: int = 5) -> str:
    """A few of a collection's items (sorted), for a message."""
    items = sorted(items)
    more = f", ... ({len(items)} in all)" if len(items) > n else ""
    return "(" + ", ".join(map(str, items[:n])) + more + ")"


class RankRuntime:
    """One rank: its machine, its workload, its faults and its memory. Pure: the driver
    passes `now` with every event and carries out the returned actions."""

    def __init__(
        self,
        scenario: Scenario,
        role: str,
        rank: int,
        *,
        requests: list[Request],
        kv_pages: int | None = None,
        cache_blocks: int = 0,
        verify: bool = False,
        sessions: Sessions | None = None,
        generate: bool = False,
        check_writes: bool = False,
        first_room: int | None = None,
        started_at: float = 0.0,
        incarnation: int = 0,
        capabilities: Capabilities | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r} not allowed (allowed: {', '.join(ROLES)})")
        g = scenario.geometry()
        self.role, self.rank, self.name = role, rank, rank_name(role, rank)
        self.geometry = g
        self.config = protocol_config(scenario, check_writes)
        # rank is global across instances (shared/cluster.py); one instance: the local rank
        self.sessions = sessions or Sessions(g)
        self.instance = self.sessions.instance(role, rank)
        if role == "prefill":
            self.machine: PrefillMachine | DecodeMachine = PrefillMachine(
                rank, g, self.config, scenario.pool_bytes, sessions=self.sessions
            )
        else:
            self.machine = DecodeMachine(
                rank, g, scenario.pool_bytes, self.config, self.sessions, capabilities
            )
        self.scenario = scenario  # below: what a restarted incarnation is built from
        self._given = (requests, kv_pages, cache_blocks, verify, generate, check_writes)
        # A restarted incarnation (first_room given: `restarted`) serves the rooms from
        # first_room on; the rooms before it were its lost predecessor's.
        self.first_room = first_room
        self.incarnation = incarnation
        self._cluster = scenario.cluster  # `local`: rooms no prefill rank serves
        self.requests = self._served(requests)
        # Exact accounting: the rank is finished when each of these rooms ended, by id;
        # a message about any other room is dropped and counted, never progress.
        self._workload = {r.room for r in self.requests}
        self._open_rooms = set(self._workload)
        self.dropped = 0
        self.local_done = 0  # rooms prefilled here (`local`) that ended
        self.verify = verify and role == "decode"
        # decode: model generation (a room's pages then also hold its output tokens and
        # stay taken until its last token); the simulator's decode model says how long
        self.generate = generate and role == "decode"
        faults = scenario.faults
        self.plan = FaultPlan(faults, scenario.workload.seed, stream=fault_stream(role, rank))
        self._message_faults = faults.any_message_fault
        # a late session starts late once; its restarted incarnation joins when it joins
        self.join_at = (
            self.plan.session_delay_s(rank) if role == "prefill" and first_room is None else 0.0
        )
        kills = sorted(
            (k.at_s, k.restart_after_s or 0.0)
            for k in faults.kill
            if k.role == role and k.rank == rank and (first_room is None or k.at_s > started_at)
        )  # a restart takes the later kills only
        self.kill_at: float | None = kills[0][0] if kills else None
        # when the killed rank starts again (faults: kill restart_after_s): the driver restarts it
        self.restart_after_s: float | None = (kills[0][1] or None) if kills else None
        if first_room is not None and any(
            k.restart_after_s for k in faults.kill if k.role == role and k.rank == rank
        ):
            self.plan.count(f"restart:{role}")  # the scenario's restart (not one by hand)
        self.dead = False
        self.events = 0
        self.failures: dict[int, str] = {}
        self._held: list[Event] = []  # events before a late session joined
        self._timers: list[_Timer] = []
        self._seq = 0
        self._owed = _Owed()
        # arrivals wait for KV pages; a prefill's prefix cache: sizes from the driver
        self.admission = RankAdmission(
            role,
            g.page_size,
            kv_pages=kv_pages,
            cache_blocks=cache_blocks,
            output_in_pages=self.generate,
        )
        self._memory: dict[int, _RoomMemory] = {}
        # rooms the machine released before they were admitted here (failed by a peer
        # first): when they are admitted, the machine never touches their memory
        self._released_unadmitted: set[int] = set()
        self._last_arrived = -1  # the newest room that arrived here (room ids follow arrival order)

    def restart(self, incarnation: int, first_room: int, now: float) -> None:
        """Become this rank's next incarnation, started again at `now` after it died:
        everything fresh (machine, memory, fault plan), serving the rooms from
        `first_room` on (the rooms before it were the lost incarnation's: its peers
        failed those, or they were done). No kill fault at or before `now`, no
        late-session delay. The simulator restarts a runtime in place, so that its
        executors (streams, loops) keep their key: a completion of the lost
        incarnation's work that comes in later names a room before `first_room` and
        is dropped, and a message about one is dropped as foreign, as a new process
        would. (Hardware mode builds the new incarnation's runtime with `first_room`.)"""
        requests, kv_pages, cache_blocks, verify, generate, check_writes = self._given
        self.__init__(
            self.scenario,
            self.role,
            self.rank,
            requests=requests,
            kv_pages=kv_pages,
            cache_blocks=cache_blocks,
            verify=verify,
            sessions=self.sessions,
            generate=generate,
            check_writes=check_writes,
            first_room=first_room,
            started_at=now,
            incarnation=incarnation,
        )

    # --- what the driver reads ---------------------------------------------------------
    @property
    def rooms_ended(self) -> int:
        """Rooms of this run's workload that ended here (done or failed)."""
        return len(self._workload) - len(self._open_rooms)

    @property
    def settled(self) -> bool:
        """Finished: every request ended here, nothing in flight, owed or held back.
        A dead rank is settled (it will never do anything again), unless its fault
        restarts it (then its next incarnation has to settle)."""
        if self.dead:
            return self.restart_after_s is None
        return (
            not self._open_rooms
            and self.machine.settled
            and not self._owed
            and not self._timers
            and not self.admission.waiting
            and not self._held
            and not self._memory
        )

    @property
    def next_room(self) -> int:
        """The first room that has not arrived here yet (room ids follow arrival order):
        a peer that rejoins now serves the rooms from this one on (PeerRejoined)."""
        return self._last_arrived + 1

    @property
    def outstanding(self) -> int:
        """Rooms of this rank's workload not yet ended here (what a router balances)."""
        return len(self._open_rooms)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """A prefill's prefix cache (fresh each incarnation); None on a decode rank."""
        return self.admission.prefix_cache

    @property
    def free_kv_pages(self) -> int:
        """Free KV pages (0 when the rank does not model its KV pool)."""
        return self.admission.free_pages

    def holding(self) -> str:
        """What keeps this rank from being settled, in words (for a rank that never ends)."""
        parts = []
        if self._open_rooms:
            parts.append(f"rooms not ended {_some(self._open_rooms)}")
        parts += self.machine.holding()
        if self._owed:
            parts.append(f"completions owed {_some(self._owed.counts)}")
        if self._timers:
            parts.append(f"{len(self._timers)} timer(s), next at {min(self._timers).due:.2f}s")
        waiting = self.admission.holding(_some)
        if waiting:
            parts.append(waiting)
        if self._held:
            parts.append(f"{len(self._held)} event(s) held for a late session")
        if self._memory:
            parts.append(f"KV memory of rooms {_some(self._memory)}")
        return "; ".join(parts) or "nothing"

    @property
    def next_wakeup(self) -> float | None:
        """When the driver must deliver a Tick (timeouts, held messages, faults)."""
        if self.dead:
            return None
        deadline = self.machine.next_deadline
        if not self._timers and not self.join_at and self.kill_at is None:
            return deadline  # the common case, asked after every event: no list built
        times = [deadline] if deadline is not None else []
        if self._timers:
            times.append(self._timers[0].due)
        if self.join_at:
            times.append(self.join_at)
        if self.kill_at is not None:
            times.append(self.kill_at)
        return min(times) if times else None

    def forward_wanted(self, f: Forward) -> bool:
        """Whether a forward handed out is still worth computing: an executor that has
        not started it yet asks, and reports a ForwardDone at once if not (the room
        failed before its turn, as an aborted request leaves the prefill queue)."""
        return self.pages_held(f.room)

    def pages_held(self, room: int) -> bool:
        """Whether `room` still holds its KV pages for work handed out: a room that
        failed lets them go (at once, or once its abort grace is over) whatever it still
        owes, so an executor that has not started a forward or a gather yet asks before
        it reads them, and reports the work done at once if not."""
        mem = self._memory.get(room)
        return mem is not None and not mem.released

    def page_base(self, room: int) -> int:
        """The first local KV page of a room (for gathers, fills and slice writes)."""
        return self._memory[room].first_page

    def result(self) -> RankResult:
        m = self.machine
        return RankResult(
            role=self.role,
            rank=self.rank,
            rooms_done=m.rooms_done,
            rooms_failed=m.rooms_failed,
            failures=dict(self.failures),
            dropped=m.dropped + self.dropped,
            events=self.events,
            faults_injected=dict(self.plan.injected),
            ring_used=m.ring.used_bytes if self.role == "decode" else 0,
            died=self.dead,
            prompt_tokens=self.prefix_cache.stats.prompt_tokens if self.prefix_cache else 0,
            cached_tokens=self.prefix_cache.stats.cached_tokens if self.prefix_cache else 0,
        )

    # --- the one entry point -----------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Action]:
        if self.dead:
            return []
        out: list[Action] = []
        if self.join_at:
            if now < self.join_at:
                if type(event) is not Tick:
                    self._held.append(event)  # a late session hears nothing until it joins
                return out
            self.join_at = 0.0
            held, self._held = self._held, []
            for ev in held:
                self._dispatch(ev, now, out)
        if self.kill_at is not None and now >= self.kill_at:
            self.dead = True
            self.plan.count(f"kill:{self.role}")
            out.append(Die(f"{self.name} killed at {now:.3f}s (fault injection)"))
            return out
        if self._timers:
            self._release_timers(now, out)
        self._dispatch(event, now, out)
        return out

    def _dispatch(self, event: Event, now: float, out: list[Action]) -> None:
        kind = type(event)
        handler = self._LOCAL.get(kind)
        if handler is not None:
            if (
                self.first_room is not None
                and kind in _COMPLETIONS
                and event.room < self.first_room
            ):
                return  # the lost incarnation's work, finishing after the restart
            handler(self, event, now, out)
            return
        if kind in _ROOM_MESSAGES and event.room not in self._workload:
            self._drop_foreign(event, now, out)
            return
        self._feed(event, now, out)
        if kind is StagingRsp and self.plan.abort_at(event.room, "rsp"):
            self._feed(AbortRoom(event.room, "fault injection: aborted at rsp"), now, out)

    # --- the machine and its actions ---------------------------------------------------------
    def _feed(self, event: Event, now: float, out: list[Action]) -> None:
        self.events += 1
        for a in self.machine.handle(event, now):
            route = self._ROUTES.get(type(a))
            if route is None:
                out.append(a)  # records, Room done/failed: the driver only observes them
            else:
                route(self, a, now, out)

    def _route_send(self, a: Send, now: float, out: list[Action]) -> None:
        if not self._message_faults:
            out.append(a)
            return
        for d in self.plan.on_send(a.msg):
            send = a if d.msg is a.msg else Send(a.dest, d.msg)
            if d.extra_delay_s > 0:
                self._hold(now + d.extra_delay_s, action=send)
            else:
                out.append(send)

    def _route_gather(self, a: Gather, now: float, out: list[Action]) -> None:
        if self.plan.abort_at(a.room, "gather"):
            # aborted before the copy: nothing goes in flight
            self._feed(AbortRoom(a.room, "fault injection: aborted at gather"), now, out)
            self._feed(GatherDone(a.room, a.chunk, a.decode_rank), now, out)
            return
        self._owed.add(("gather", a.room, a.chunk, a.decode_rank))
        out.append(a)

    def _route_write(self, a: Write | SliceWrite, now: float, out: list[Action]) -> None:
        self._owed.add(("write", a.room, a.chunk, a.decode_rank))
        out.append(a)
        if self.plan.abort_at(a.room, "write"):
            self._feed(
                AbortRoom(a.room, "fault injection: aborted mid-transfer (write in flight)"),
                now,
                out,
            )

    def _route_scatter(self, a: Scatter, now: float, out: list[Action]) -> None:
        self._owed.add(("scatter", a.room, a.chunk))
        self._start_late(a, now, out)
        if self.plan.abort_at(a.room, "scatter"):
            self._feed(AbortRoom(a.room, "fault injection: aborted while scattering"), now, out)

    def _drop_foreign(self, msg, now: float, out: list[Action]) -> None:
        """A peer's message about a room that is not in this run's workload (or was the
        lost incarnation's, in a restarted one)."""
        self.dropped += 1
        if self.dropped <= MAX_FOREIGN_TRACED:
            if self.first_room is not None and msg.room < self.first_room:
                why = f"a room of this rank's lost incarnation (this one serves rooms from {self.first_room})"
            else:
                why = "not in this run"
            out.append(
                Record(
                    TraceRecord(
                        self.role,
                        self.rank,
                        "dropped",
                        now,
                        now,
                        room=msg.room,
                        detail=f"{type(msg).__name__} for room {msg.room}, {why}",
                    )
                )
            )

    def _route_done(self, a: RoomDone, now: float, out: list[Action]) -> None:
        self._open_rooms.discard(a.room)
        out.append(a)
        mem = self._memory.get(a.room)
        if self.verify and mem is not None and mem.num_pages:
            mem.verifying = True
            self._owed.add(("verify", a.room))
            transferred = decode_room_pages(
                mem.request, self.geometry.page_size
            )  # not the output's pages
            out.append(Verify(a.room, mem.first_page, transferred, mem.request.prefix_tokens))
        if self.generate and mem is not None and mem.request.output_tokens > 0:
            mem.generating = True
            self._owed.add(("generate", a.room))
            out.append(Generate(a.room, mem.request.output_tokens, mem.request.prompt_tokens))

    def _route_failed(self, a: RoomFailed, now: float, out: list[Action]) -> None:
        self._open_rooms.discard(a.room)
        self.failures.setdefault(a.room, a.reason)
        out.append(a)

    def _route_check(self, a: CheckSlice, now: float, out: list[Action]) -> None:
        self._owed.add(("check", a.room, a.chunk))
        self._start_late(a, now, out)

    def _start_late(self, a: Scatter | CheckSlice, now: float, out: list[Action]) -> None:
        """Hand a scatter or slice check to the driver, `faults.late_scatter` late if the
        scenario says so: its bytes wait in memory a peer can write, unchecked."""
        late = self.plan.scatter_delay_s(a.room, a.chunk)
        if late:
            self._hold(now + late, action=a)
        else:
            out.append(a)

    def _route_release(self, a: ReleaseRoom, now: float, out: list[Action]) -> None:
        mem = self._memory.get(a.room)
        if mem is not None:
            mem.released = True
            self._maybe_free(a.room, now, out)
        elif a.room in self._workload:
            self._released_unadmitted.add(a.room)

    _ROUTES = {
        Send: _route_send,
        Gather: _route_gather,
        Write: _route_write,
        SliceWrite: _route_write,
        Scatter: _route_scatter,
        CheckSlice: _route_check,
        RoomDone: _route_done,
        RoomFailed: _route_failed,
        ReleaseRoom: _route_release,
    }

    # --- completions from the driver ------------------------------------------------------------
    def _on_gather_done(self, ev: GatherDone, now: float, out: list[Action]) -> None:
        self._owed.settle(("gather", ev.room, ev.chunk, ev.decode_rank))
        self._feed(ev, now, out)

    def _on_write_done(self, ev: WriteDone, now: float, out: list[Action]) -> None:
        self._owed.settle(("write", ev.room, ev.chunk, ev.decode_rank))
        self._feed(ev, now, out)

    def _on_scatter_done(self, ev: ScatterDone, now: float, out: list[Action]) -> None:
        self._owed.settle(("scatter", ev.room, ev.chunk))
        stall = self.plan.scatter_stall_s(ev.room, ev.chunk)
        if stall:
            self._hold(now + stall, event=ev)  # the completion is seen late
        else:
            self._feed(ev, now, out)

    def _on_slice_checked(self, ev: SliceChecked, now: float, out: list[Action]) -> None:
        self._owed.settle(("check", ev.room, ev.chunk))
        self._feed(ev, now, out)

    def _on_verify_done(self, ev: VerifyDone, now: float, out: list[Action]) -> None:
        self._owed.settle(("verify", ev.room))
        mem = self._memory.get(ev.room)
        if mem is not None:
            mem.verifying = False
            self._maybe_free(ev.room, now, out)

    def _on_generate_done(self, ev: GenerateDone, now: float, out: list[Action]) -> None:
        self._owed.settle(("generate", ev.room))
        mem = self._memory[ev.room]
        out.append(
            Record(
                TraceRecord(
                    self.role,
                    self.rank,
                    "generate",
                    ev.start,
                    now,
                    room=ev.room,
                    requests=mem.request.output_tokens,
                )
            )
        )
        mem.generating = False
        if self.local(mem.request):  # its KV was ready when its first token came out
            self._open_rooms.discard(ev.room)
            self.local_done += 1
            done = TraceRecord(self.role, self.rank, "room_done", ev.start, ev.start, room=ev.room)
            out.append(Record(done))
        self._maybe_free(ev.room, now, out)

    def _on_tick(self, ev: Tick, now: float, out: list[Action]) -> None:
        self._feed(ev, now, out)

    # --- arrivals, admission and forwards -------------------------------------------------------
    def assign(self, request: Request) -> None:
        """A room routed here when it arrived (a load-aware router): part of the
        workload from now on. Call before the room's Arrive and any message about it. A
        room its decode instance prefills (`local`) is no prefill rank's."""
        if self.role == "prefill" and self.local(request):
            return
        if request.room in self._workload:
            raise LocalProtocolError(f"room {request.room} assigned to {self.name} twice")
        self.requests.append(request)
        self._workload.add(request.room)
        self._open_rooms.add(request.room)

    def _on_arrive(self, ev: Arrive, now: float, out: list[Action]) -> None:
        if ev.request.room > self._last_arrived:
            self._last_arrived = ev.request.room
        if self.first_room is not None and ev.request.room < self.first_room:
            return  # the lost incarnation's room
        waiting = self.admission.waiting
        waiting.append(ev.request)
        self._admit(now, out)
        if self.role == "decode" and waiting and waiting[-1] is ev.request:
            # its pages do not fit yet: the arrival is on record, admission waits
            out.append(
                Record(TraceRecord(self.role, self.rank, "arrive", now, now, room=ev.request.room))
            )

    def _admit(self, now: float, out: list[Action]) -> None:
        """Open (decode) or schedule the forwards of (prefill) waiting rooms, in arrival
        order, while their pages fit; the first that does not fit holds the rest."""
        while (taken := self.admission.take()) is not None:
            req, first, n = taken
            self._memory[req.room] = _RoomMemory(req, first, n)
            if self.role == "decode" and self.local(req):
                self._open_local(req, now, out)
            elif self.role == "decode":
                self._open_decode(req, first, now, out)
            else:
                self._schedule_forwards(req, first, out)
            if req.room in self._released_unadmitted:
                self._released_unadmitted.discard(req.room)
                self._memory[req.room].released = True
                self._maybe_free(req.room, now, out)

    def _served(self, requests: list[Request]) -> list[Request]:
        """The rooms routed to this rank's instance (all of them with one instance each),
        from `first_room` on, less those its decode instance prefills (`local`) on a
        prefill rank."""
        first, prefill = self.first_room, self.role == "prefill"
        return [
            r
            for r in requests
            if self.sessions.serves(self.role, self.rank, r.room)
            and (first is None or r.room >= first)
            and not (prefill and self.local(r))
        ]

    def local(self, req: Request) -> bool:
        """Whether the room's prompt is prefilled on its decode instance (conditional
        disaggregation, `cluster.max_local_prefill_length`)."""
        return self._cluster.prefills_locally(req.prompt_tokens, req.prefix_tokens)

    def _open_local(self, req: Request, now: float, out: list[Action]) -> None:
        """A room prefilled here: no writers, no transfer. Its pages are taken (the
        prompt's KV is computed into them); the instance's batch prefills it and then
        generates (`Generate.local_tokens`); at GenerateDone the room is done."""
        mem = self._memory[req.room]
        mem.released = mem.generating = True  # no machine holds the pages: the batch does
        self._owed.add(("generate", req.room))
        out.append(
            Record(TraceRecord(self.role, self.rank, "room_open", now, now, room=req.room, chunk=0))
        )
        local = req.prompt_tokens - req.prefix_tokens
        out.append(Generate(req.room, req.output_tokens, req.prompt_tokens, local))

    def _open_decode(self, req: Request, first: int, now: float, out: list[Action]) -> None:
        self._feed(
            OpenRoom(req.room, req.prompt_tokens, req.prefix_tokens, dst_page_base=first), now, out
        )
        if self.plan.abort_at(req.room, "open"):
            self._feed(AbortRoom(req.room, "fault injection: aborted at open"), now, out)

    def _schedule_forwards(self, req: Request, first: int, out: list[Action]) -> None:
        g = self.geometry
        prefix_pages = req.prefix_tokens // g.page_size
        try:
            chunks = g.chunks(room_pages(req.prompt_tokens, req.prefix_tokens, g.page_size))
        except LayoutError:
            chunks = []  # the machine fails the room at open, with the reason
        mem = self._memory[req.room]
        cached = self.admission.cached_tokens(req)
        if not chunks:  # nothing to compute: the room only opens
            mem.forwards, mem.open_only = 1, True
            self._owed.add(("forward", req.room, 0))
            out.append(Forward(req.room, 0, first, prefix_pages, 0, 0))
            return
        mem.forwards = len(chunks)
        for c in chunks:
            self._owed.add(("forward", req.room, c.index))
            out.append(
                Forward(
                    req.room,
                    c.index,
                    first,
                    prefix_pages + c.page_start,
                    c.num_pages,
                    c.num_pages * g.page_size,
                    cached_in_chunk(
                        cached,
                        (prefix_pages + c.page_start) * g.page_size,
                        c.num_pages * g.page_size,
                    ),
                )
            )

    def _on_forward_started(self, ev: ForwardStarted, now: float, out: list[Action]) -> None:
        if ("forward", ev.room, ev.chunk) not in self._owed.counts:
            raise LocalProtocolError(
                f"ForwardStarted for room {ev.room} chunk {ev.chunk}, never handed out"
            )
        mem = self._memory[ev.room]
        if not mem.opened:
            mem.opened = True
            req = mem.request
            self._feed(OpenRoom(req.room, req.prompt_tokens, req.prefix_tokens), now, out)
            if self.machine.is_finished(req.room):
                # failed at open, or aborted by the decode before it opened here: the
                # machine will never release it again
                mem.released = True

    def _on_forward_done(self, ev: ForwardDone, now: float, out: list[Action]) -> None:
        self._owed.settle(("forward", ev.room, ev.chunk))
        mem = self._memory[ev.room]
        mem.forwards -= 1
        if not mem.open_only:
            self._feed(ChunkComputed(ev.room, ev.chunk, ev.start), now, out)
        self._maybe_free(ev.room, now, out)

    # --- memory ----------------------------------------------------------------------------------
    def _maybe_free(self, room: int, now: float, out: list[Action]) -> None:
        mem = self._memory.get(room)
        if mem is None or not mem.released or mem.forwards > 0 or mem.verifying or mem.generating:
            return
        del self._memory[room]
        if self.admission.pages is not None and mem.num_pages:
            self.admission.free(mem.first_page, mem.num_pages)
            if self.admission.waiting:
                self._admit(now, out)

    # --- held deliveries ---------------------------------------------------------------------------
    def _hold(
        self,
        due: float,
        *,
        action: Send | Scatter | CheckSlice | None = None,
        event: Event | None = None,
    ) -> None:
        self._seq += 1
        heapq.heappush(self._timers, _Timer(due, self._seq, action, event))

    def _release_timers(self, now: float, out: list[Action]) -> None:
        while self._timers and self._timers[0].due <= now:
            t = heapq.heappop(self._timers)
            if t.action is not None:
                out.append(t.action)
            else:
                self._feed(t.event, now, out)

    _LOCAL = {
        Arrive: _on_arrive,
        ForwardStarted: _on_forward_started,
        ForwardDone: _on_forward_done,
        GatherDone: _on_gather_done,
        WriteDone: _on_write_done,
        ScatterDone: _on_scatter_done,
        SliceChecked: _on_slice_checked,
        VerifyDone: _on_verify_done,
        GenerateDone: _on_generate_done,
        Tick: _on_tick,
    }
