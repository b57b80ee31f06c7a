"""Progress for a log: one line per quarter of the work, or per minute, with an ETA.

Off a terminal a progress bar prints nothing useful (or control characters), and a
long plan or sweep would be silent for minutes. `ProgressLog(jobs, work, emit)` takes
the planned simulations and their work (requests to simulate, so that the long last
windows of successive halving weigh what they cost), and `advance(n)` after each
simulation of n requests, and `finish()` at the end; it emits "planning: 12/40 simulations, 31% of the work,
1 min 5 s elapsed, ETA 2 min 24 s" when the work crosses a quarter, and at most
`every_s` (60 s) after the last line otherwise. The ETA assumes the rest runs at the
pace so far (elapsed x remaining / done work).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["ProgressLog", "duration"]


def duration(s: float) -> str:
    """`42 s`, `3 min 5 s`, `1 h 2 min`."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"


class ProgressLog:
    """See the module docstring; `clock` is for tests (default time.monotonic)."""

    def __init__(
        self,
        jobs: int,
        work: float,
        emit: Callable[[str], None],
        *,
        what: str = "planning",
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.jobs, self.work, self.emit, self.what = jobs, max(work, 1e-9), emit, what
        self.every_s, self.clock = every_s, clock
        self.t0 = self.last = clock()
        self.done_jobs, self.done_work, self.quarter = 0, 0.0, 0

    def advance(self, work: float, jobs: int = 1) -> None:
        self.done_jobs += jobs
        self.done_work += work
        now = self.clock()
        share = min(1.0, self.done_work / self.work)
        quarter = int(share * 4 + 1e-9)
        if quarter > self.quarter or now - self.last >= self.every_s:
            self.quarter = max(self.quarter, quarter)
            self.last = now
            self.emit(self.line(now, share))

    def finish(self) -> None:
        """The closing line ("done") unless the last one said it: the planned work is an
        estimate (successive halving does not know its survivors in advance)."""
        if self.done_work < self.work:
            self.work, self.jobs = max(self.done_work, 1e-9), self.done_jobs
            self.last = self.clock()
            self.emit(self.line(self.last, 1.0))

    def line(self, now: float, share: float) -> str:
        elapsed = now - self.t0
        eta = elapsed * (1 - share) / share if share > 0 else float("inf")
        jobs = max(self.jobs, self.done_jobs)  # a search may run more than it planned
        tail = "done" if share >= 1 else f"ETA {duration(eta)}"
        return (
            f"{self.what}: {self.done_jobs}/{jobs} simulations, {share:.0%} of the work, "
            f"{duration(elapsed)} elapsed, {tail}"
        )
