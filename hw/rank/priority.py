"""Scheduling classes of a rank's threads: the rank loop and its ZMQ I/O threads above
everything else (LoopPriority), the write path below them and above the gathers, scatters
and fills (WritePriority). Used by hw/rank/process.py while its loop runs; measured in
benchmarks/hw_loop.py and benchmarks/hw_transfer.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

# KVSTAGE_LOOP_RT: the scheduling class of the rank loop's thread and the ZMQ I/O threads
# that carry its control frames (LoopPriority): "rr:N" / "fifo:N" (real-time, priority N),
# "nice:N" (N < 0), "0" (normal scheduling, as every other thread of the rank).
LOOP_RT_ENV = "KVSTAGE_LOOP_RT"
LOOP_RT_DEFAULT = "rr:10"
# KVSTAGE_LOOP_RT_IO=0: raise the loop thread only, not the ZMQ I/O threads (for measuring)
LOOP_RT_IO_ENV = "KVSTAGE_LOOP_RT_IO"
# KVSTAGE_WRITE_RT: the class of the transfer engine's own threads (WritePriority), in the
# same forms; "0": normal. KVSTAGE_WRITE_RT_LANES: the transport's write lanes too: "slots"
# (while each batch is copied, if it gets one of the host's write slots: WriteSlots), "1"
# (for the whole run), "0" (never).
WRITE_RT_ENV = "KVSTAGE_WRITE_RT"
WRITE_RT_DEFAULT = "rr:5"
WRITE_RT_LANES_ENV = "KVSTAGE_WRITE_RT_LANES"
WRITE_RT_LANES_DEFAULT = "0"
# KVSTAGE_WRITE_SLOTS_DIR: where the host's write slots live (one lock file each); every
# rank of the host must use the same
WRITE_SLOTS_DIR_ENV = "KVSTAGE_WRITE_SLOTS_DIR"
WRITE_SLOTS_DIR = "/dev/shm/kvstage-write-slots"
_OFF = ("", "0", "off", "normal")


class ThreadPriority:
    """One scheduling class (`spec`: "rr:N", "fifo:N", "nice:N" or "0") and the threads of
    this process moved into it, until `restore`. Never raises: a class the host refuses (no
    privilege, a cgroup without real-time runtime) leaves the thread in the normal one."""

    def __init__(self, spec: str) -> None:
        self.spec = spec.strip().lower()
        self._raised: list[int] = []  # thread ids moved out of the normal class

    def set_thread(self, tid: int) -> str:
        """Move thread `tid` into the class, unrecorded (the caller puts it back with
        `lower`). Returns the class it got ("rr:10", "normal", "normal (rr:10 refused: ...)")."""
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
        return f"{kind}:{n}"

    def raise_thread(self, tid: int) -> str:
        """Move thread `tid` into the class until `restore`; the class it got (set_thread)."""
        got = self.set_thread(tid)
        if not got.startswith("normal"):
            self._raised.append(tid)
        return got

    def raise_threads(self, tids: list[int]) -> int:
        """Move each of `tids` that still runs into the class; how many were moved."""
        return sum(not self.raise_thread(tid).startswith("normal") for tid in tids)

    def restore(self) -> None:
        """Back to normal scheduling (the work they were raised for is over)."""
        for tid in self._raised:
            lower(tid)
        self._raised.clear()


def lower(tid: int) -> None:
    """Thread `tid` back to normal scheduling (nice 0)."""
    try:
        _set_class(tid, "nice", 0)
    except OSError:
        pass  # that thread ended


def write_slot_count() -> int:
    """How many write lanes of the host may copy in the write class at once: all cores
    but one, which stays for the normal threads (at least one)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


class WriteSlots:
    """`count` slots shared by every process of the host: slot i is an exclusive flock on
    the file slot-<i> in `directory`. Each acquire opens a fresh descriptor (flock belongs
    to the open file, so two lanes of one process never share a slot) and never waits; the
    kernel drops the lock when the descriptor closes, or its process dies."""

    def __init__(self, directory: str | Path | None = None, count: int | None = None) -> None:
        self.directory = Path(directory or os.environ.get(WRITE_SLOTS_DIR_ENV) or WRITE_SLOTS_DIR)
        self.count = write_slot_count() if count is None else max(1, count)
        self._paths = [str(self.directory / f"slot-{i}") for i in range(self.count)]

    def prepare(self) -> None:
        """Create the directory and the slot files, usable by every user; OSError if not."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # another user's directory: theirs to set
            self.directory.chmod(0o1777)
        for path in self._paths:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o666)
            os.close(fd)

    def acquire(self) -> int | None:
        """A free slot's descriptor (close it, `release`, to free the slot), or None when
        every slot is held or a slot file cannot be opened."""
        start = threading.get_native_id() % self.count  # holders spread over the slots
        for i in range(self.count):
            try:
                fd = os.open(self._paths[(start + i) % self.count], os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held (EWOULDBLOCK)
                os.close(fd)
                continue
            return fd
        return None

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)


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
    threads) and, with KVSTAGE_WRITE_RT_LANES=1 or slots, the transport's write lanes (where
    NIXL's CMA copy runs, in transfer()). Below the loop's class (LOOP_RT_DEFAULT), so a control
    message still preempts a write.

    The lanes stay normal by default: raised, they kept both cores from the normal threads
    and the loop waited 0.5 s at a time, not for a CPU: most likely for the interpreter
    lock, which those threads hold between kernels (gathers, fills). Measured
    (benchmarks/hw_transfer.py, hw_loop.py): NIXL lanes at rr:5 cut the staging write time
    from 0.43-0.65 s to 0.23 s, but the P2->D1 control delivery p99 went from 1.5 ms to
    515 ms (not seen again on 2026-12-01: 1.3-1.7 ms in 3 runs, 1.4 ms with 2 or 4 busy
    loops beside). KVSTAGE_WRITE_RT_LANES=slots bounds it: a lane is raised only while it copies
    a batch and holds one of the host's max(1, cores - 1) write slots (WriteSlots, shared
    by every rank), so one core always stays for the normal threads; a lane without a slot
    copies at normal scheduling, never waits. Measured on the 2-core host, 6 runs each way
    interleaved, load 0.1-2.5: NIXL staging 0.44-0.47 s -> 0.26-0.34 s (stg/raw 0.47-0.53
    -> 0.64-0.82, 5 of 6 over 0.7; sl/stg 3.9-4.4 -> 5.2-7.0), p2d1 delivery p99 1.4-3.4 ->
    1.4-1.9 ms (4-5 runs, one with 4 busy loops beside). Opt-in all the same: the 2 cores' work is only reordered. The gathers
    and the decode's scatters (normal threads) take what the writes gave up (per-phase
    span sums: writes 240-500 -> 130-250 ms per prefill rank, decode scatter 320-430 ->
    660-1140 ms), the last room ends as late (0.60-0.65 s either way) and the staging room
    p50 rose (212-254 -> 244-323 ms).
    The engine's threads never take the interpreter lock (Mooncake staging 1.0-1.5 s ->
    0.55-0.72 s, delivery p99 unchanged). NIXL's engine threads are raised only with its
    lanes (Transport.engine_alone: they share UCX's worker lock; raised alone, the staging
    write time went from 0.44 s to 5.2 s); with "slots", for the batches that hold one.
    Only threads that block: a real-time thread that spun would starve the threads it waits
    for. NIXL's progress thread spins when its delay is 0 (Transport.engine_threads_block);
    Mooncake's lanes spin in get_batch_transfer_status (Transport.lanes_block; raised,
    they starved the engine threads that move the bytes and a slice run stalled)."""

    def __init__(self, spec: str | None = None, slots: WriteSlots | None = None) -> None:
        super().__init__(os.environ.get(WRITE_RT_ENV, WRITE_RT_DEFAULT) if spec is None else spec)
        self.engine: list[int] = []  # the engine's threads (set by the rank)
        self._engine_sched = "normal"
        self.slots = slots  # the host's write slots ("slots" mode; made at apply if None)
        self.batches_raised = self.batches_normal = 0  # "slots": batches copied in the class / not
        self._lanes = "none started"  # the class the write lanes got (mode "always")
        self._mode = "off"  # the lanes: "off", "always", "slots"
        self._engine_per_batch = False  # "slots" and engine_alone False: the engine goes with them
        self._lock = threading.Lock()
        self._holders = 0  # this process's lanes holding a slot now
        self._engine_up_now = False  # the engine's threads raised for them

    @property
    def lanes(self) -> str:
        """The class the write lanes got ("rr:5", "normal (left out)", "rr:5 per batch, 1 host
        slot (40 raised, 3 normal)")."""
        if self._mode != "slots":
            return self._lanes
        n = self.slots.count if self.slots else 0
        return (
            f"{self.spec} per batch, {n} host slot{'s' if n != 1 else ''} "
            f"({self.batches_raised} raised, {self.batches_normal} normal)"
        )

    @property
    def engine_sched(self) -> str:
        """The class the engine's threads got ("rr:5 (2 of 2 threads)", "normal (left out)",
        "rr:5 per batch, with the lanes (2 threads, 40 batches)"; "normal (no batch raised)"
        where they would have gone with lanes that copied nothing in the class)."""
        if not self._engine_per_batch:
            return self._engine_sched
        if not self.batches_raised:
            return "normal (no batch raised)"
        return f"{self.spec} per batch, with the lanes ({len(self.engine)} threads, {self.batches_raised} batches)"

    def apply(
        self, engine_ok: bool = True, lanes_ok: bool = True, engine_alone: bool = True
    ) -> None:
        """The loop starts: raise the engine's threads (unless `engine_ok` is False, or
        `engine_alone` is and the lanes stay normal) and, after KVSTAGE_WRITE_RT_LANES (and
        `lanes_ok`), every lane that starts from now on ("1") or each batch a lane copies
        while it holds a host write slot ("slots", with the engine's threads where they
        may not go alone)."""
        setting = os.environ.get(WRITE_RT_LANES_ENV, WRITE_RT_LANES_DEFAULT).strip().lower()
        if lanes_ok and setting == "1":
            self._mode = "always"
        elif lanes_ok and setting == "slots":
            self._mode = self._prepare_slots()  # or "off", saying why
        else:
            self._mode, self._lanes = "off", "normal (left out)"
        self._engine_per_batch = self._mode == "slots" and engine_ok and not engine_alone
        if self.spec in _OFF:
            self._engine_sched = "normal"
        elif self._engine_per_batch:
            pass  # raised with each batch (lane_batch)
        elif not engine_ok or not (engine_alone or self._mode == "always"):
            self._engine_sched = "normal (left out)"
        elif self.engine:
            moved = self.raise_threads(self.engine)
            self._engine_sched = (
                f"{self.spec} ({moved} of {len(self.engine)} threads)"
                if moved
                else f"normal ({self.spec} refused)"
            )

    def _prepare_slots(self) -> str:
        if self.spec in _OFF:
            self._lanes = "normal"
            return "off"
        try:
            self.slots = self.slots or WriteSlots()
            self.slots.prepare()
        except OSError as exc:
            self._lanes = f"normal (write slots unavailable: {exc})"
            return "off"
        return "slots"

    def lane_started(self) -> None:
        """Transport.on_lane_start: raise the calling lane thread (while the loop runs)."""
        if self._mode == "always":
            self._lanes = self.raise_thread(threading.get_native_id())

    @contextlib.contextmanager
    def lane_batch(self) -> Iterator[None]:
        """Transport.lane_guard, around each batch a lane copies: in "slots" mode, with a
        free host slot, the lane (and the engine's threads, where they go with it) in the
        class until the batch ends; without one, as it is (it never waits for a slot)."""
        fd = self.slots.acquire() if self._mode == "slots" and self.slots else None
        if fd is None:
            if self._mode == "slots":
                with self._lock:
                    self.batches_normal += 1
            yield
            return
        tid, raised = threading.get_native_id(), False
        try:
            got = self.set_thread(tid)
            if got.startswith("normal"):  # refused: no further tries
                self._mode, self._lanes = "off", got
            else:
                raised = True
                self._engine_up()
            yield
        finally:
            if raised:
                self._engine_down()
                lower(tid)
            self.slots.release(fd)

    def _engine_up(self) -> None:
        with self._lock:
            self.batches_raised += 1
            self._holders += 1
            if self._holders == 1 and self._engine_per_batch:
                self._engine_up_now = True
                for t in self.engine:
                    self.set_thread(t)

    def _engine_down(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._engine_up_now:  # even where the loop ended meanwhile
                self._engine_up_now = False
                for t in self.engine:
                    lower(t)

    def restore(self) -> None:
        """The loop ended: every thread back to normal, no lane raised from now on (a batch
        in flight lowers its own on its end)."""
        self._lanes, self._engine_sched = self.lanes, self.engine_sched
        self._mode, self._engine_per_batch = "off", False
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
