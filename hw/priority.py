"""Scheduling classes of a rank's threads: the rank loop and its ZMQ I/O threads above
everything else (LoopPriority), the write path below them and above the gathers, scatters
and fills (WritePriority). Used by hw/rank.py while its loop runs; measured in
benchmarks/hw_loop.py and benchmarks/hw_transfer.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

# KVSTAGE_LOOP_RT: the scheduling class of the rank loop's thread and the ZMQ I/O threads
# that carry its control frames (LoopPriority): "rr:N" / "fifo:N" (real-time, priority N),
# "nice:N" (N < 0), "0" (normal scheduling, as every other thread of the rank).
LOOP_RT_ENV = "KVSTAGE_LOOP_RT"
LOOP_RT_DEFAULT = "rr:10"
# KVSTAGE_LOOP_RT_IO=0: raise the loop thread only, not the ZMQ I/O threads (for measuring)
LOOP_RT_IO_ENV = "KVSTAGE_LOOP_RT_IO"
# KVSTAGE_WRITE_RT: the class of the transfer engine's own threads (WritePriority), in the
# same forms; "0": normal. KVSTAGE_WRITE_RT_LANES=1: the transport's write lanes too.
WRITE_RT_ENV = "KVSTAGE_WRITE_RT"
WRITE_RT_DEFAULT = "rr:5"
WRITE_RT_LANES_ENV = "KVSTAGE_WRITE_RT_LANES"
_OFF = ("", "0", "off", "normal")


class ThreadPriority:
    """One scheduling class (`spec`: "rr:N", "fifo:N", "nice:N" or "0") and the threads of
    this process moved into it, until `restore`. Never raises: a class the host refuses (no
    privilege, a cgroup without real-time runtime) leaves the thread in the normal one."""

    def __init__(self, spec: str) -> None:
        self.spec = spec.strip().lower()
        self._raised: list[int] = []  # thread ids moved out of the normal class

    def raise_thread(self, tid: int) -> str:
        """Move thread `tid` into the class. Returns the class it got ("rr:10", "normal",
        "normal (rr:10 refused: ...)")."""
        if self.spec in _OFF:
            return "normal"
        kind, _, level = self.spec.rpartition(":")
        kind = kind or "rr"
        try:
            if kind not in ("rr", "fifo", "nice"):
                raise ValueError(f"unknown class {kind!r} (rr, fifo, nice)")
            n = int(level)
            _set_class(tid, kind, n)
        except (ValueError, AttributeError, OSError) as exc:
            return f"normal ({self.spec} refused: {exc})"
        self._raised.append(tid)
        return f"{kind}:{n}"

    def raise_threads(self, tids: list[int]) -> int:
        """Move each of `tids` that still runs into the class; how many were moved."""
        return sum(not self.raise_thread(tid).startswith("normal") for tid in tids)

    def restore(self) -> None:
        """Back to normal scheduling (the work they were raised for is over)."""
        for tid in self._raised:
            try:
                _set_class(tid, "nice", 0)
            except OSError:
                pass  # that thread ended
        self._raised.clear()


class LoopPriority(ThreadPriority):
    """Runs the rank loop's thread, which sleeps in poll between short turns, and the ZMQ
    I/O threads that move control frames (which block in epoll) above the rank's copy,
    compute and transfer threads. On a host whose cores those threads keep busy (hardware
    mode on a laptop or CI box: every rank's stand-in compute on a few cores), a control
    message otherwise waits for a CPU at each of the sender's I/O thread, the receiver's
    and the receiver's loop; measured in benchmarks/hw_loop.py. Only these threads: a
    real-time thread that spun would starve its machine, and these all block."""

    def __init__(self, spec: str | None = None) -> None:
        super().__init__(os.environ.get(LOOP_RT_ENV, LOOP_RT_DEFAULT) if spec is None else spec)

    def apply(self) -> str:
        """Raise the calling thread (and the process's ZMQ I/O threads). Returns the class
        the loop got ("rr:10", "nice:-15", "normal", "normal (rr:10 refused: ...)")."""
        got = self.raise_thread(threading.get_native_id())
        if got.startswith("normal"):
            return got
        io = os.environ.get(LOOP_RT_IO_ENV, "1") != "0"
        if io:  # the loop keeps its class where these are refused (a smaller gain alone)
            self.raise_threads(thread_ids("ZMQbg/IO"))
        return got + ("" if io else " (loop only)")


class WritePriority(ThreadPriority):
    """Runs the threads that carry a write's bytes above the rank's gathers, scatters and
    fills, while the loop runs, so a write in flight is not queued behind them on a host
    with few cores: the threads the transfer engine started (Mooncake's workers, which send
    on the prefill side and receive on the decode side; NIXL's UCX progress and async
    threads) and, with KVSTAGE_WRITE_RT_LANES=1, the transport's write lanes (where NIXL's
    CMA copy runs, in transfer()). Below the loop's class (LOOP_RT_DEFAULT), so a control
    message still preempts a write.

    The lanes stay normal by default: raised, they kept both cores from the normal threads
    and the loop waited 0.5 s at a time, not for a CPU: most likely for the interpreter
    lock, which those threads hold between kernels (gathers, fills). Measured (benchmarks/hw_transfer.py, hw_loop.py):
    NIXL lanes at rr:5 cut the staging write time from 0.43-0.65 s to 0.23 s, but the P2->D1
    control delivery p99 went from 1.5 ms to 515 ms. The engine's threads never take that
    lock (Mooncake staging 1.0-1.5 s -> 0.55-0.72 s, delivery p99 unchanged). NIXL's engine
    threads are raised only with its lanes (Transport.engine_alone: they share UCX's worker
    lock; raised alone, the staging write time went from 0.44 s to 5.2 s).
    Only threads that block: a real-time thread that spun would starve the threads it waits
    for. NIXL's progress thread spins when its delay is 0 (Transport.engine_threads_block);
    Mooncake's lanes spin in get_batch_transfer_status (Transport.lanes_block; raised,
    they starved the engine threads that move the bytes and a slice run stalled)."""

    def __init__(self, spec: str | None = None) -> None:
        super().__init__(os.environ.get(WRITE_RT_ENV, WRITE_RT_DEFAULT) if spec is None else spec)
        self.engine: list[int] = []  # the engine's threads (set by the rank)
        self.lanes = "none started"  # the class the write lanes got
        self.engine_sched = "normal"
        self._lanes_on = False

    def apply(self, engine_ok: bool = True, lanes_ok: bool = True, engine_alone: bool = True) -> None:
        """The loop starts: raise the engine's threads (unless `engine_ok` is False, or
        `engine_alone` is and the lanes stay normal) and, with KVSTAGE_WRITE_RT_LANES=1
        (and `lanes_ok`), every lane that starts from now on."""
        self._lanes_on = lanes_ok and os.environ.get(WRITE_RT_LANES_ENV, "0") == "1"
        if not self._lanes_on:
            self.lanes = "normal (left out)"
        if self.spec in _OFF:
            self.engine_sched = "normal"
        elif not engine_ok or not (engine_alone or self._lanes_on):
            self.engine_sched = "normal (left out)"
        elif self.engine:
            moved = self.raise_threads(self.engine)
            self.engine_sched = (f"{self.spec} ({moved} of {len(self.engine)} threads)" if moved
                                 else f"normal ({self.spec} refused)")

    def lane_started(self) -> None:
        """Transport.on_lane_start: raise the calling lane thread (while the loop runs)."""
        if self._lanes_on:
            self.lanes = self.raise_thread(threading.get_native_id())

    def restore(self) -> None:
        self._lanes_on = False
        super().restore()


def _set_class(tid: int, kind: str, level: int) -> None:
    """Put thread `tid` in `kind` at `level` (nice: SCHED_OTHER at that niceness).
    SCHED_RESET_ON_FORK: the threads it starts later (worker pools, transfer lanes, engine
    threads) begin with normal scheduling instead of inheriting its class."""
    if kind == "nice":
        os.sched_setscheduler(tid, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, level)
    else:
        policy = os.SCHED_RR if kind == "rr" else os.SCHED_FIFO
        os.sched_setscheduler(tid, policy | os.SCHED_RESET_ON_FORK, os.sched_param(level))


def thread_ids(prefix: str = "") -> list[int]:
    """This process's threads whose name starts with `prefix` (libzmq names its I/O
    threads ZMQbg/IO/<n>); none off Linux."""
    found = []
    try:
        for task in Path("/proc/self/task").iterdir():
            try:
                if task.joinpath("comm").read_text().startswith(prefix):
                    found.append(int(task.name))
            except (OSError, ValueError):
                pass  # that thread ended
    except OSError:
        pass
    return found
