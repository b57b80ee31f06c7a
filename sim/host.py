"""Host model (opt-in, `links.host_model = "cpu-loop"`): ranks as single-threaded loops.

In hardware mode on one host (hw/rank.py) every rank is ONE Python loop: it fills a
prefill chunk (the 'forward', one chunk per loop turn), runs gather and scatter as
synchronous kernels, polls transfer completions and handles control messages, all
in turn. Nothing of a rank runs concurrently, and P + D such processes, plus each
transfer engine's own threads, share the host's few cores. The default simulator
models independent GPU streams and a fixed control latency instead; this module adds
what the loop changes:

- `RankLoop`: one in-order loop per rank. A delivered event (message, write
  completion, chunk computed) is a job of `event_s`; a gather / scatter / fill is a
  job of its own duration. Work a handler starts synchronously (a gather or scatter
  the machine asked for) runs right after the handler, before events that queued
  meanwhile (`run_next`); everything else queues behind (`submit`).
- `cpu_scale`: the host's CPU sharing as a static slowdown of loop work,
  max(1, demand / cores) with demand = (P + D) rank loops + (P + D) * engine thread
  cores: every rank process keeps a loop runnable (busy polling) and its engine
  burns `engine_thread_cores` on its own; C cores shared fairly stretch loop work by
  demand / C when demand exceeds C.
- `fill_time`: the hw forward, a pattern fill of the chunk's KV bytes on the rank.

All numbers come from `kvstage calibrate` (profile fields, shared/scenario.py
HOST_FIELDS). Deterministic: jobs run in submission order on SimPy's clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial

import simpy

from kvstage.shared.scenario import HostNumbers


def cpu_scale(host: HostNumbers, ranks: int) -> float:
    """Static processor-sharing slowdown of loop work: max(1, demand / cores), demand =
    `ranks` loops + `ranks` * engine thread cores."""
    demand = ranks * (1.0 + host.engine_thread_cores)
    return max(1.0, demand / host.cores)


def fill_time(host: HostNumbers, nbytes: int) -> float:
    """Seconds of one hw-mode prefill forward (pattern fill) of `nbytes` KV bytes,
    before CPU sharing."""
    return host.fill_latency_s + nbytes / host.fill_bandwidth_bytes_s


class RankLoop:
    """One rank's single-threaded loop: jobs run one at a time.

    A job is (duration, fn, args): the loop is busy for `duration` seconds, then
    calls fn(*args) and starts the next job. `submit` queues behind everything;
    `run_next` puts a job at the front (work the running handler started
    synchronously). `busy_s` and `jobs` count what ran.
    """

    __slots__ = ("env", "_queue", "_busy", "busy_s", "jobs")

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self._queue: deque[tuple[float, Callable, tuple]] = deque()
        self._busy = False
        self.busy_s = 0.0
        self.jobs = 0

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, duration: float, fn: Callable, *args) -> None:
        self._queue.append((duration, fn, args))
        if not self._busy:
            self._start()

    def run_next(self, duration: float, fn: Callable, *args) -> None:
        self._queue.appendleft((duration, fn, args))
        if not self._busy:
            self._start()

    def _start(self) -> None:
        duration, fn, args = self._queue.popleft()
        self._busy = True
        self.busy_s += duration
        self.jobs += 1
        self.env.timeout(duration).callbacks.append(partial(self._end, fn, args))

    def _end(self, fn: Callable, args: tuple, _ev=None) -> None:
        # The job's effect happens while the loop still counts as busy, so whatever it
        # starts synchronously (run_next) goes first; then the next job starts.
        fn(*args)
        self._busy = False
        if self._queue:
            self._start()
