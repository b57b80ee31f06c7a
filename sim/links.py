"""Network model: NICs whose bandwidth and message rate concurrent transfers share
max-min fairly, and the posting ranks' engine threads.

A transfer of B bytes as R work requests (one batch call of the engine) has three
phases, in this order:

1. posting: ``per_batch_s + R * per_request_s`` of CPU on the posting rank: building
   the request (descriptors, or indices into descriptor lists prepared once) and
   posting its work requests. With ``post_threads = k > 0`` and a ``poster`` (the
   rank) every rank has k posting threads: a batch waits, in arrival order, for the
   first thread free and holds it for its whole posting time, so the batches of one
   rank queue behind each other (k = 1: posting serialises per rank); ranks never
   wait for each other (each is its own process with its own cores). With
   ``post_threads = 0`` (or no poster) every batch posts at once, in parallel.
2. NIC: a *flow* that occupies the sending NIC's send side and the receiving NIC's
   receive side (full duplex: the two sides are independent resources), capped by
   the path's ``bandwidth_bytes_s``. A NIC side processes work requests one after
   another; a request of s bytes occupies it for max(s / bandwidth, 1 / message
   rate). So the flow needs ``work = max(B, R * W)`` bytes of NIC time, with
   ``W = src NIC bandwidth / message_rate`` the NIC time of one minimal request
   expressed in bytes; large writes (B >= R * W) are unaffected by the message rate,
   small ones (a slice write: R requests of a few hundred bytes) cost R / message
   rate. Rates (in NIC-time bytes per second) are the max-min fair allocation over
   all active flows and are recomputed whenever a flow starts or ends; with every
   flow bottlenecked on one NIC this is processor sharing, so concurrent batches
   through one NIC queue for its message rate exactly as they do for its bandwidth.
   A slice write of 100,000 requests is still one flow: no per-request events.
3. latency: ``latency_s`` once, for the last byte to land and the completion to
   be seen.

So one transfer alone takes ``latency + per_batch + R * per_request + max(B, R * W) /
min(bandwidth, NIC bandwidths)``, and two equal message-bound batches through one
NIC both finish after ``post + 2 R / message_rate``.

Control messages (STAGING_REQ, WATERMARK, ...) are tiny: they do not compete for
bandwidth and are modeled as a plain delay of the profile's control latency,
``Fabric.message(latency_s)``.

Efficiency. Max-min rates depend only on a flow's (sender, receiver, path cap), so
flows with the same triple form a *class* that shares one rate; each class keeps
a virtual clock of the bytes every member has received so far, and its members
finish in order of their target on that clock (the usual processor-sharing
trick). A flow start/end therefore costs O(classes in the touched connected
component of the NIC-side graph), not O(flows): many rooms between the same
prefill and decode ranks cost as much as one. One timeout, armed for the earliest
class finish and superseded through a versioned token, drives all completions.
A posting thread is a number (the time it is free again), so posting costs no
events beyond the one timeout of each transfer. All iteration is over
insertion-ordered containers keyed by sequence numbers, so the same inputs give
the same event order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Generator
from typing import Any

import simpy

from kvstage.shared.scenario import LinkNumbers

# A flow with this few bytes left (absolute, or relative to its size) completes:
# rate*dt arithmetic leaves float dust that must not become an event of its own.
_BYTE_EPS_ABS = 1e-6
_BYTE_EPS_REL = 1e-9
# Finishes within this relative window of now are one event: now + (finish - now)
# is not always == finish in floating point.
_TIME_EPS_REL = 1e-12
_INF = math.inf


class _Poster:
    """One rank's posting threads: the time each is free again (no events)."""

    __slots__ = ("free_at",)

    def __init__(self, threads: int) -> None:
        self.free_at = [0.0] * threads

    def reserve(self, now: float, duration: float) -> float:
        """Book ``duration`` on the first thread free (lowest index on ties); the end time."""
        free_at = self.free_at
        i = 0 if len(free_at) == 1 else min(range(len(free_at)), key=free_at.__getitem__)
        start = free_at[i]
        end = (now if now > start else start) + duration
        free_at[i] = end
        return end


class _Port:
    """One direction (send or receive) of a NIC: a capacity shared by its flows."""

    __slots__ = ("name", "capacity", "classes", "nflows", "order", "mark", "dmark",
                 "residual", "n", "ver")  # fmt: skip

    def __init__(self, name: str, capacity: float, order: int) -> None:
        self.name = name
        self.capacity = capacity
        self.classes: dict[int, _Class] = {}  # by class seq; insertion order is deterministic
        self.nflows = 0  # active flows through this side
        self.order = order  # stable tie-break in the water-filling heap
        self.mark = 0  # component-search epoch (avoids a visited set per search)
        self.dmark = 0  # water-filling "needs a new heap entry" epoch
        # Water-filling scratch: capacity left, unfrozen flows, heap-entry version.
        self.residual = 0.0
        self.n = 0
        self.ver = 0


class Nic:
    """A network port of ``bandwidth_bytes_s`` bytes/s per direction (full duplex)."""

    __slots__ = ("name", "bandwidth_bytes_s", "send", "recv", "bytes_sent", "bytes_received")

    def __init__(self, name: str, bandwidth_bytes_s: float, order: int) -> None:
        self.name = name
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self.send = _Port(f"{name}.tx", bandwidth_bytes_s, 2 * order)
        self.recv = _Port(f"{name}.rx", bandwidth_bytes_s, 2 * order + 1)
        self.bytes_sent = 0
        self.bytes_received = 0

    def __repr__(self) -> str:
        return f"Nic({self.name!r}, {self.bandwidth_bytes_s:g} B/s)"


# One flow inside a class: (target on the class clock, flow id, NIC-time bytes it needs,
# bytes it moves, done event). The work is the bytes unless the message rate binds.
_Member = tuple[float, int, float, int, simpy.Event]


class _Class:
    """Active flows with the same (sender, receiver, path cap): one shared rate.

    ``served`` is the bytes each member has received since the class was created,
    exact as of time ``t0``; it advances at ``rate``. A member completes when
    ``served`` reaches its target.
    """

    __slots__ = ("seq", "key", "src", "dst", "sp", "rp", "cap", "members", "rate", "served",
                 "t0", "version", "mark", "new_rate", "dirty")  # fmt: skip

    def __init__(self, seq: int, key: tuple[int, int, float], src: Nic, dst: Nic,
                 cap: float, now: float) -> None:  # fmt: skip
        self.seq = seq
        self.key = key
        self.src = src
        self.dst = dst
        self.sp = src.send  # the two sides it loads, hoisted for the hot loops
        self.rp = dst.recv
        self.cap = cap
        self.members: list[_Member] = []  # heap by (target, flow id)
        self.rate = 0.0
        self.served = 0.0
        self.t0 = now
        self.version = 0  # bumps on every reschedule; older timer-heap entries are stale
        self.mark = 0
        self.new_rate = -1.0
        self.dirty = False  # membership changed: its next finish must be recomputed

    def settle(self, now: float) -> None:
        self.served += self.rate * (now - self.t0)
        self.t0 = now


def _cap_order(c: _Class) -> tuple[float, int]:
    return (c.cap, c.seq)


class Fabric:
    """All NICs of a simulated cluster and the flows between them."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.nics: dict[str, Nic] = {}
        self.bytes_moved = 0  # bytes of completed byte phases
        self.transfers_done = 0
        self.messages_sent = 0
        self.max_residual_bytes = 0.0  # largest |bytes left| at a completion (float dust)
        self._active = 0
        self._classes: dict[tuple[int, int, float], _Class] = {}
        self._next_flow = 0
        self._next_class = 0
        self._timers: list[tuple[float, int, int, _Class]] = []  # (finish, seq, version, class)
        self._epoch = 0
        self._pending: list[_Port] = []  # sides touched by starts not yet re-rated
        self._flush_armed = False
        self._armed_at = math.inf
        self._timer_token = 0
        self._posters: dict[Any, _Poster] = {}

    # -- public API ---------------------------------------------------------

    def add_nic(self, name: str, bandwidth_bytes_s: float) -> Nic:
        """Register a NIC of ``bandwidth_bytes_s`` bytes/s in each direction."""
        if name in self.nics:
            raise ValueError(f"duplicate NIC name {name!r}")
        if not (bandwidth_bytes_s > 0 and math.isfinite(bandwidth_bytes_s)):
            raise ValueError(f"NIC bandwidth must be finite and > 0, got {bandwidth_bytes_s}")
        nic = Nic(name, float(bandwidth_bytes_s), len(self.nics))
        self.nics[name] = nic
        return nic

    def transfer(self, src: Nic, dst: Nic, nbytes: int, params: LinkNumbers,
                 requests: int = 1, poster: Any = None) -> simpy.Process:  # fmt: skip
        """Move ``nbytes`` from ``src`` to ``dst`` as ``requests`` work requests of one batch
        call; the event's value is the finish time (s).

        ``poster``: a hashable naming the posting rank; with ``params.post_threads > 0`` the
        batch queues for that rank's posting threads.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if requests < 0:
            raise ValueError(f"requests must be >= 0, got {requests}")
        return self.env.process(self._transfer(src, dst, nbytes, params, requests, poster))

    def message(self, latency_s: float) -> simpy.Timeout:
        """A control message: a fixed delay, it does not compete for bandwidth."""
        self.messages_sent += 1
        return self.env.timeout(latency_s)

    @property
    def active_flows(self) -> int:
        """Transfers currently in their byte phase."""
        return self._active

    def rates(self) -> list[tuple[str, str, float]]:
        """(src NIC, dst NIC, rate) per active flow, grouped by path in order of first use.

        The rate is in NIC-time bytes per second: bytes/s, unless the flow is bound by the
        message rate (then its bytes move at rate * bytes / work)."""
        self._flush(None)  # settle starts of this instant first; the allocation is the same
        return [(c.src.name, c.dst.name, c.rate)
                for c in self._classes.values() for _ in c.members]  # fmt: skip

    def check_invariants(self, rel: float = 1e-9) -> None:
        """Assert feasibility and max-min optimality of the current rates (for tests).

        Max-min fair <=> every flow is at its cap, or crosses a saturated side on
        which no other flow has a higher rate (its bottleneck).
        """
        self._flush(None)
        ports: dict[int, _Port] = {}
        for c in self._classes.values():
            for p in (c.sp, c.rp):
                ports[p.order] = p
        load = {o: sum(len(c.members) * c.rate for c in p.classes.values())
                for o, p in ports.items()}  # fmt: skip
        for o, p in ports.items():
            assert load[o] <= p.capacity * (1 + rel), f"{p.name} over capacity: {load[o]}"
            assert p.nflows == sum(len(c.members) for c in p.classes.values())
        assert self._active == sum(len(c.members) for c in self._classes.values())
        for c in self._classes.values():
            assert c.members, "empty class left registered"
            assert c.rate > 0, f"{c.src.name}->{c.dst.name} has no rate"
            assert c.rate <= c.cap * (1 + rel), f"{c.src.name}->{c.dst.name} above its cap"
            if c.rate >= c.cap * (1 - rel):
                continue
            ok = False
            for p in (c.sp, c.rp):
                saturated = load[p.order] >= p.capacity * (1 - rel)
                if saturated and all(d.rate <= c.rate * (1 + rel) for d in p.classes.values()):
                    ok = True
            assert ok, f"{c.src.name}->{c.dst.name} has no bottleneck"

    # -- transfer process ---------------------------------------------------

    def _transfer(self, src: Nic, dst: Nic, nbytes: int, params: LinkNumbers,
                  requests: int, poster: Any) -> Generator[simpy.Event, Any, float]:  # fmt: skip
        env = self.env
        posting = requests * params.per_request_s + (params.per_batch_s if requests else 0.0)
        if posting > 0:
            if params.post_threads and poster is not None:
                lanes = self._posters.get(poster)
                if lanes is None or len(lanes.free_at) != params.post_threads:
                    lanes = self._posters[poster] = _Poster(params.post_threads)
                now = env.now
                yield env.timeout(lanes.reserve(now, posting) - now)
            else:
                yield env.timeout(posting)
        work = float(nbytes)
        if requests and params.message_rate != _INF:
            # Each request occupies a NIC side for at least 1 / message_rate.
            work = max(work, requests * src.bandwidth_bytes_s / params.message_rate)
        if work > 0:
            yield self._start_flow(src, dst, nbytes, work, params.bandwidth_bytes_s)
        if params.latency_s > 0:
            yield env.timeout(params.latency_s)
        self.transfers_done += 1
        return env.now

    # -- flows and rates ----------------------------------------------------

    def _start_flow(self, src: Nic, dst: Nic, nbytes: int, work: float, cap: float) -> simpy.Event:
        now = self.env.now
        sp, rp = src.send, dst.recv
        key = (sp.order, rp.order, cap)
        c = self._classes.get(key)
        if c is None:
            self._next_class += 1
            c = _Class(self._next_class, key, src, dst, cap, now)
            self._classes[key] = c
            sp.classes[c.seq] = c
            rp.classes[c.seq] = c
        else:
            c.settle(now)
        done = self.env.event()
        self._next_flow += 1
        heapq.heappush(c.members, (c.served + work, self._next_flow, work, nbytes, done))
        c.dirty = True
        sp.nflows += 1
        rp.nflows += 1
        self._active += 1
        # Rates are recomputed once for all starts of this instant (writers of one
        # chunk start together): a zero-delay flush runs after the events already
        # queued for now. Until then the new flow moves nothing, for zero time.
        self._pending.append(sp)
        self._pending.append(rp)
        if not self._flush_armed:
            self._flush_armed = True
            self.env.timeout(0).callbacks.append(self._flush)
        return done

    def _flush(self, _ev: simpy.Event | None) -> None:
        if _ev is not None:
            self._flush_armed = False
        if self._pending:
            seeds, self._pending = self._pending, []
            self._reallocate(seeds)

    def _reallocate(self, seeds: list[_Port]) -> None:
        """Recompute rates on the components of ``seeds``; complete drained flows."""
        while seeds:
            drained = self._waterfill(seeds)
            seeds = self._complete(drained, force_head=False) if drained else []
        self._arm()

    def _component(self, seeds: list[_Port]) -> tuple[list[_Port], list[_Class]]:
        self._epoch += 1
        ep = self._epoch
        ports: list[_Port] = []
        classes: list[_Class] = []
        for p in seeds:
            if p.mark != ep:
                p.mark = ep
                ports.append(p)
        for p in ports:  # grows while iterating: breadth-first search
            for c in p.classes.values():
                if c.mark != ep:
                    c.mark = ep
                    classes.append(c)
                    q = c.rp if c.sp is p else c.sp
                    if q.mark != ep:
                        q.mark = ep
                        ports.append(q)
        return ports, classes

    def _waterfill(self, seeds: list[_Port]) -> list[_Class]:
        """Progressive filling on the touched component; returns classes with drained heads.

        Documented algorithm (max-min fair water-filling), kept in one piece because it
        is the simulator's hot loop.

        Computes: the max-min fair rate of every class in the connected component of the
        NIC-side graph reachable from ``seeds`` (ports are the vertices, classes the
        edges). The resources are the ports (one direction of a NIC, ``capacity`` bytes/s
        shared by its ``nflows`` flows) and each flow's path cap (``_Class.cap``, a private
        link of every member). All members of a class get the same rate, so a class of
        ``m`` members loads each of its two ports with ``m * rate``. The result is the
        allocation in which no flow can get faster without slowing a flow that is no
        faster than it.

        Steps (progressive filling: raise all unfrozen flows' rates together, freeze flows
        as their bottleneck fills):

        1. ``_component`` collects the ports and classes of the component (BFS).
        2. Each port starts with ``residual = capacity`` and ``n = nflows`` unfrozen flows;
           its fair share ``residual / n`` goes into a lazy min-heap keyed by
           (share, port order, version); a port's entries with an old version are stale
           and are skipped when they reach the top. Classes with a finite path cap are
           sorted by cap (``_cap_order``).
        3. While a class is unfrozen: let ``share`` be the least fair share on the heap
           (infinity if none).

           a. If the smallest cap of an unfrozen capped class is ``<= share``, the fill
              level reaches that cap first: the class is frozen at its cap, ``m * cap`` is
              taken from both of its ports and their new shares are pushed.
           b. Otherwise the port with the least share saturates: each of its unfrozen
              classes is frozen at ``share``, ``m * share`` is taken from the other port of
              each, and every touched port gets a new version and heap entry. Shares of
              the other ports can only grow, so the fill level never goes down.

           Residuals are clamped at 0 against floating-point dust.
        4. Each class whose rate or members changed is settled to ``now`` (its virtual
           clock of bytes served), takes its new rate and a new version; if its head
           member has no bytes left (within the byte / time tolerances) it is returned as
           drained, else a timer for the head's finish is pushed.

        Complexity: with ``P`` ports and ``C`` classes in the component, every class is
        frozen once and each freeze pushes at most two heap entries, so the filling is
        O((P + C) log(P + C)), plus O(C log C) for the cap sort and O(C log T) for the
        timer pushes (``T`` pending timers). It depends on the number of classes, not
        of flows.
        """
        ports, classes = self._component(seeds)
        if not classes:
            return []
        heappush, heappop = heapq.heappush, heapq.heappop
        # Lazy min-heap of each side's fair share of what is left: (share, order, ver, port).
        heap: list[tuple[float, int, int, _Port]] = []
        for p in ports:
            p.residual = cap = p.capacity
            p.n = n = p.nflows
            p.ver = 0
            if n:
                heap.append((cap / n, p.order, 0, p))
        heapq.heapify(heap)
        capped: list[_Class] = []
        for c in classes:
            c.new_rate = -1.0
            if c.cap != _INF:
                capped.append(c)
        # A path cap is a private link of each member; visit caps in ascending order.
        capped.sort(key=_cap_order)
        ci, ncapped = 0, len(capped)
        left = len(classes)
        ep = self._epoch
        while left:
            while heap[0][2] != heap[0][3].ver if heap else False:
                heappop(heap)
            while ci < ncapped and capped[ci].new_rate >= 0:
                ci += 1
            share = heap[0][0] if heap else _INF
            if ci < ncapped and capped[ci].cap <= share:
                # The fill level reached this path cap before any side saturated.
                c = capped[ci]
                c.new_rate = rate = c.cap
                left -= 1
                m = len(c.members)
                for q in (c.sp, c.rp):
                    q.residual -= m * rate
                    q.n -= m
                    q.ver += 1
                    if q.n:
                        heappush(heap, (max(q.residual, 0.0) / q.n, q.order, q.ver, q))
                continue
            # The side with the least fair share saturates: its unfrozen flows all get
            # exactly that share, and the other sides' shares can only grow.
            p = heappop(heap)[3]
            ep += 1
            touched: list[_Port] = []
            for c in p.classes.values():
                if c.new_rate < 0:
                    c.new_rate = share
                    left -= 1
                    q = c.rp if c.sp is p else c.sp
                    m = len(c.members)
                    q.residual -= m * share
                    q.n -= m
                    if q.dmark != ep:
                        q.dmark = ep
                        touched.append(q)
            p.n = 0
            p.ver += 1
            for q in touched:
                q.ver += 1
                if q.n:
                    heappush(heap, (max(q.residual, 0.0) / q.n, q.order, q.ver, q))
        self._epoch = ep

        now = self.env.now
        time_tol = _TIME_EPS_REL * max(1.0, abs(now))
        timers = self._timers
        drained: list[_Class] = []
        for c in classes:
            if c.new_rate == c.rate and not c.dirty:
                continue  # same rate, same members: its scheduled finish still holds
            c.settle(now)
            c.rate = rate = c.new_rate
            c.dirty = False
            c.version += 1
            target, _, work, _, _ = c.members[0]
            bytes_left = target - c.served
            if bytes_left <= max(_BYTE_EPS_ABS, _BYTE_EPS_REL * work, rate * time_tol):
                drained.append(c)
                continue
            heappush(timers, (now + bytes_left / rate, c.seq, c.version, c))
        return drained

    def _complete(self, classes: list[_Class], force_head: bool) -> list[_Port]:
        """Finish the drained members of ``classes``; return the sides to re-rate.

        ``force_head``: the timer said the head is due, so it completes even if float
        error left it a hair over the byte tolerance (else the wake-up could repeat
        forever at the same instant).
        """
        now = self.env.now
        time_tol = _TIME_EPS_REL * max(1.0, abs(now))
        seeds: list[_Port] = []
        for c in classes:
            c.settle(now)
            c.version += 1
            c.dirty = True
            members = c.members
            force = force_head
            while members:
                target, _, work, nbytes, done = members[0]
                bytes_left = target - c.served
                tol = max(_BYTE_EPS_ABS, _BYTE_EPS_REL * work, c.rate * time_tol)
                if bytes_left > tol and not force:
                    break
                force = False
                heapq.heappop(members)
                self.max_residual_bytes = max(self.max_residual_bytes, abs(bytes_left))
                c.sp.nflows -= 1
                c.rp.nflows -= 1
                self._active -= 1
                c.src.bytes_sent += nbytes
                c.dst.bytes_received += nbytes
                self.bytes_moved += nbytes
                done.succeed(now)
            if not members:
                del self._classes[c.key]
                del c.sp.classes[c.seq]
                del c.rp.classes[c.seq]
            seeds.append(c.sp)
            seeds.append(c.rp)
        return seeds

    # -- the completion timer -----------------------------------------------

    def _arm(self) -> None:
        """Make sure a wake-up is pending at or before the earliest finish."""
        timers = self._timers
        while timers and timers[0][2] != timers[0][3].version:
            heapq.heappop(timers)
        if len(timers) > 4 * len(self._classes) + 1024:
            # Reschedules leave stale entries behind; drop them before they pile up.
            timers[:] = [e for e in timers if e[2] == e[3].version]
            heapq.heapify(timers)
        if not timers or timers[0][0] >= self._armed_at:
            return
        self._armed_at = timers[0][0]
        self._timer_token += 1
        token = self._timer_token
        timer = self.env.timeout(max(0.0, self._armed_at - self.env.now))
        timer.callbacks.append(lambda _ev: self._on_timer(token))

    def _on_timer(self, token: int) -> None:
        if token != self._timer_token:
            return  # superseded by an earlier wake-up that was armed later
        self._armed_at = math.inf
        now = self.env.now
        horizon = now + _TIME_EPS_REL * max(1.0, abs(now))
        timers = self._timers
        due: list[_Class] = []
        while timers and timers[0][0] <= horizon:
            _, _, version, c = heapq.heappop(timers)
            if version == c.version:
                due.append(c)
        if due:
            seeds = self._complete(due, force_head=True)
            if self._pending:  # starts of this instant: re-rate them in the same pass
                seeds += self._pending
                self._pending = []
            self._reallocate(seeds)
        else:
            self._arm()
