"""The simulated cluster on the wall clock: requests in, tokens out at their simulated times.

`RealtimeCluster` owns an `OnlineSimulation` (sim/online.py) whose clock is "seconds
since the server started": a pacing task sleeps until the next simulated event is due
on the wall clock (or a request arrives), then handles every event due by now. A
request is injected at the simulated time of its arrival on the wall clock, and each
token the decode batch produces goes to the request's queue at once, where its HTTP
handler takes it and sends it. So a token leaves the server at its simulated time plus
the server's own lag (the pacing task's wake-up and the handler's turn on the event
loop), which each request records (`Served.sent_late_s`).

Everything runs on one asyncio event loop: the simulation is never touched from two
threads.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from kvstage.serve.timeline import Served
from kvstage.shared.scenario import Scenario
from kvstage.sim.driver import SimResult
from kvstage.sim.online import OnlineSimulation

__all__ = ["RealtimeCluster"]


class RealtimeCluster:
    """See the module docstring. `on_done(served)` is called once a request's last token
    has been sent."""

    def __init__(self, scenario: Scenario, on_done: Callable[[Served], None]) -> None:
        self.sim = OnlineSimulation(scenario, self._token)
        self._on_done = on_done
        self._t0 = time.monotonic()
        self._served: dict[int, Served] = {}
        self._queues: dict[int, asyncio.Queue[tuple[int, float]]] = {}
        self._wake = asyncio.Event()
        self.in_flight = 0

    def sim_now(self) -> float:
        """The wall clock in simulated seconds (seconds since the server started)."""
        return time.monotonic() - self._t0

    async def pace(self) -> None:
        """Keep the simulated clock on the wall clock, forever (cancel to stop)."""
        while True:
            wait = self.sim.next_event_at() - self.sim_now()
            if wait > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(
                        self._wake.wait(), timeout=None if math.isinf(wait) else wait
                    )
                except TimeoutError:
                    pass
                continue
            self.sim.advance(self.sim_now())
            await asyncio.sleep(0)  # let the handlers send what became due

    def submit(
        self, endpoint: str, prompt_tokens: int, output_tokens: int
    ) -> tuple[Served, asyncio.Queue[tuple[int, float]]]:
        """A request arrives now: its record and the queue its tokens come on, as
        (index from 1, simulated time). Raises RequestRefused (sim/online.py)."""
        self.sim.advance(self.sim_now())
        room = self.sim.inject(prompt_tokens, output_tokens)
        req = self.sim.requests[room]
        served = Served(room, endpoint, req.prompt_tokens, output_tokens, req.arrival_s)
        self._served[room] = served
        queue: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
        self._queues[room] = queue
        self.in_flight += 1
        self._wake.set()  # the pacer looks again: the request has events now
        return served, queue

    def sent(self, served: Served, sim_time: float) -> None:
        """The handler sent the token produced at `sim_time`."""
        served.sent_late_s.append(self.sim_now() - sim_time)
        if len(served.sent_late_s) == served.output_tokens:
            self._finish(served)

    def abandon(self, served: Served) -> None:
        """The client went away: the request runs on in the simulation (an engine
        without aborts), its tokens go nowhere."""
        if served.room not in self._served or served.abandoned:
            return
        served.abandoned = True
        if served.done:
            self._finish(served)

    def _finish(self, served: Served) -> None:
        self.in_flight -= 1
        del self._served[served.room], self._queues[served.room]
        self._on_done(served)

    def close(self) -> SimResult:
        """Stop taking requests; run what is in flight to its end in simulated time (not
        paced) and return the run's result."""
        return self.sim.close()

    def _token(self, room: int, k: int, sim_time: float) -> None:
        served = self._served[room]
        served.token_s.append(sim_time)
        if not served.abandoned:
            self._queues[room].put_nowait((k, sim_time))
        elif served.done:
            self._finish(served)
