"""What a rank's heavy jobs cost it in CPU, beside how long they took: per kind of job
(fill, gather, scatter, and NIXL's write, whose lane copies the bytes itself), the
count, the CPU seconds of the thread that ran them (time.thread_time), their wall
seconds and their bytes. summary.json's job_cpu; `kvstage calibrate` turns the CPU
into the host model's fill/copy/write CPU (kvstage/calibrate/inrun.py): in a busy rank
a job's wall time is its CPU plus time without a core or without the interpreter lock,
and only the CPU part loads the host's other ranks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class JobCpu:
    """Thread-safe totals per kind of job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}  # kind -> [n, cpu_s, wall_s, bytes]

    def add(self, kind: str, cpu_s: float, wall_s: float, nbytes: int) -> None:
        with self._lock:
            t = self._totals.setdefault(kind, [0, 0.0, 0.0, 0])
            t[0] += 1
            t[1] += cpu_s
            t[2] += wall_s
            t[3] += nbytes

    def wrap(self, kind: str, fn: Callable[..., Any], nbytes: int) -> Callable[..., Any]:
        """`fn` timed in CPU and wall time on whichever thread runs it."""

        def timed(*args: Any, **kw: Any) -> Any:
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.add(kind, time.thread_time() - cpu0, time.perf_counter() - wall0, nbytes)

        return timed

    def to_wire(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {
                k: {"n": int(n), "cpu_s": c, "wall_s": w, "bytes": int(b)}
                for k, (n, c, w, b) in sorted(self._totals.items())
            }


def merge(reports: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Several ranks' job_cpu summed per kind."""
    out: dict[str, dict[str, float]] = {}
    for r in reports:
        for kind, t in (r or {}).items():
            o = out.setdefault(kind, {"n": 0, "cpu_s": 0.0, "wall_s": 0.0, "bytes": 0})
            for key in o:
                o[key] += t.get(key, 0)
    return out
