"""A simulation whose requests arrive while it runs (`kvstage serve`).

`OnlineSimulation` is the scenario's cluster with no workload of its own: `inject`
adds one request at the current simulated time, routed as the offline run routes an
arrival (the static router by arrival index, a load-aware one by the instances' load
now), and `advance` moves the clock forward, handling every event due on the way. The
caller owns the clock (kvstage/serve/ paces it against the wall clock); nothing here
knows about wall time or I/O.

Generation is always modeled (a request brings its own output length), and each token
goes to `on_tokens(room, k, time)`: token k (1-based) of the room reached the client at
that simulated time: the first as the room joins its decode instance's continuous
batch (the prefill's token, streamed by the decode), then one per step, or with
speculative decoding the step's accepted tokens at once (sim/decode_batch.py,
docs/metrics.md).

The run never ends on its own: the server may always receive another request, so the
count of arrivals still to come stays above zero until `close`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvstage.shared.admission import refusal
from kvstage.shared.cluster import cluster_sessions
from kvstage.shared.scenario import Scenario
from kvstage.shared.workload import Request
from kvstage.sim.driver import SimResult, Simulation, gc_paused

__all__ = ["OnlineSimulation", "RequestRefused"]


class RequestRefused(ValueError):
    """A request this cluster refuses at admission; the message says why."""


class OnlineSimulation(Simulation):
    """The scenario's cluster, fed one request at a time (see the module docstring)."""

    def __init__(self, scenario: Scenario, on_tokens: Callable[[int, int, float], None]) -> None:
        sessions, router = cluster_sessions(scenario, [])
        super().__init__(scenario, workload=([], sessions, router), generate=True)
        self._arrivals_left = 1  # the server is open: one more may always come
        self._emit = on_tokens
        self._started = time.perf_counter()
        self._produced: dict[int, int] = {}  # room -> tokens produced so far
        self._steps: dict[int, int] = {}  # room -> decode steps it took
        self.batches.on_tokens = self._tokens
        self._start_runtimes()

    # --- what the server calls -----------------------------------------------------
    def next_event_at(self) -> float:
        """When the next event is due (inf when nothing is scheduled)."""
        return self.env.peek()

    def advance(self, until: float) -> None:
        """Handle every event due before `until` and move the clock to it."""
        if until > self.env.now:
            with gc_paused():
                self.env.run(until=until)

    def inject(self, prompt_tokens: int, output_tokens: int) -> int:
        """A request arrives now; returns its room. Raises `RequestRefused` when an engine
        refuses it at admission, as the offline run would (shared/admission.py: beyond
        the model's context, or KV that can never fit a rank's pool)."""
        s = self.scenario
        page = s.decode.page_size
        prompt = max(1, prompt_tokens)
        prefix = min(s.decode.prefix_tokens, prompt // page * page)
        room = len(self.requests)
        req = Request(room, self.env.now, prompt, prefix, output_tokens)
        why = refusal(req, self.limits)  # what the offline run rejects (shared/admission.py)
        if why is not None:
            raise RequestRefused(why)
        self.requests.append(req)
        self._arrivals_left += 1
        if self.loads is None:  # a static route, decided by arrival index as offline
            ss, g = self.sessions, self.geometry
            if not ss.single:
                ss.routes[room] = self.router.static_route(room)
            pi, di = ss.route(room)
            ranks = (
                *self.prefill[pi * g.prefill_ranks : (pi + 1) * g.prefill_ranks],
                *self.decode[di * g.decode_tp : (di + 1) * g.decode_tp],
            )
            for rt in ranks:
                if rt is not None:
                    rt.assign(req)
        # (a load-aware router routes and assigns in _arrive, as offline)
        self._produced[room] = 0
        self._arrive(room, req)
        return room

    def close(self) -> SimResult:
        """No more requests: run until every one has ended, and return the result."""
        self._arrivals_left -= 1
        self._maybe_end()
        if not self._all_done.triggered:
            with gc_paused():
                self.env.run(until=self._all_done)
        return self.result(self._started)

    # --- internals -----------------------------------------------------------------
    def _tokens(self, rooms: list[int], now: float) -> None:
        """The rooms' tokens that reached the client now: the first as a room joins, then
        per step one, or with speculative decoding (`decode.tokens_per_step` p) as many
        as bring the room to 1 + floor(steps * p), its last step to all N."""
        steps, p, emit = self._steps, self.batches.per_step, self._emit
        for room in rooms:
            n = self.requests[room].output_tokens
            done = self._produced[room]
            if done == 0:  # it joins: the prefill's token
                target = 1
            else:
                steps[room] = steps.get(room, 0) + 1
                target = 1 + steps[room] if p == 1.0 else 1 + math.floor(steps[room] * p + 1e-9)
            for k in range(done + 1, min(n, target) + 1):
                emit(room, k, now)
            self._produced[room] = min(n, target)
