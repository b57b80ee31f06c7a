"""Host model (opt-in, `links.host_model = "cpu-loop"`): ranks as hardware mode's processes.

In hardware mode on one host every rank is one process (hw/rank/process.py) with:
- a loop thread that handles each delivered event (a message, a completion) in turn
  and posts the writes; while work runs elsewhere it polls for completions every
  `loop_poll` seconds (it wakes at once for a message); in a real-time class by
  default (`loop_rt`: it takes a core the moment it has work);
- a forward thread (prefill ranks): the pattern fill of one chunk after the other, at
  a lower CPU priority (nice `forward_nice`, hw/rank/prefill.py);
- a copy thread: gathers (prefill) or scatters (decode), in order.
P + D such processes share the host's few cores with each other, with their engines'
own threads and with whatever else runs on the host. The default simulator models
independent GPU streams and a fixed control latency instead; this module adds:

- `CpuShare`: the cores shared among the runnable jobs, weighted fair (as Linux's CFS:
  a nice level is a 1.25x weight step), at most one core per job, with steady users
  beside them: each rank's engine threads (`engine_thread_cores`) and other processes
  (`background_cores`). Every job that starts or ends changes the others' rates: CPU
  sharing that changes over time.
- `Worker`: one thread of a rank: its jobs run one at a time, each as a CPU job of
  its weight (`submit`, `run_next`), or as a wait that takes no CPU (`wait`).
- `HostModel`: per rank a loop, a copy thread and (prefill) a forward thread; events
  reach the rank through its loop (`deliver`: `event_s` of loop CPU each); work done
  on a thread is handled by the loop at its next turn (`offload`: half a poll period
  later on average, then one event).
- `fill_alone`: the hw forward alone, a pattern fill of the chunk's KV bytes.

All numbers come from `kvstage calibrate` (profile fields, shared/scenario
HOST_FIELDS). Deterministic: SimPy's clock, jobs in submission order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial

import simpy

from kvstage.shared.scenario import HostNumbers, LinkNumbers

NICE_STEP = 1.25  # CFS: one nice level is about 1.25x less (more) CPU weight
# A real-time thread runs whenever it has work, ahead of every CFS thread: as a weight
# so large that its fair part is always a whole core (only real-time threads, more of
# them than cores, share a core among themselves).
RT_WEIGHT = 1e12
# A real-time class below the loop's (the write path's threads): ahead of every CFS
# thread, behind the loop.
RT_LOW_WEIGHT = 1e6
_DONE_S = 1e-12  # work left below this: the job is done (float rounding)


def nice_weight(nice: float) -> float:
    """CPU weight of a thread at `nice` relative to nice 0 (CFS)."""
    return NICE_STEP**-nice


def steady_load(host: HostNumbers, ranks: int) -> list[tuple[float, float]]:
    """(weight, cores) of the host's steady CPU users besides the ranks' loops and
    threads: every rank's engine threads (weight 1: they mostly sleep, and CFS lets a
    sleeper take what it asks) and other processes (`background_cores` busy threads)."""
    out = [(1.0, host.engine_thread_cores)] * ranks if host.engine_thread_cores > 0 else []
    if host.background_cores > 0:
        out.append((max(1.0, host.background_cores), host.background_cores))
    return out


def fill_alone(host: HostNumbers, nbytes: int) -> float:
    """Seconds of one hw-mode prefill forward (pattern fill) of `nbytes` KV bytes alone,
    as the probe timed it (HostModel.fill stretches it by the in-run fill_scale)."""
    return host.fill_latency_s + nbytes / host.fill_bandwidth_bytes_s


def split_work(alone: float, scale: float, cpu_scale: float) -> tuple[float, float]:
    """(CPU seconds, seconds without a core) of a step of `alone` seconds alone, stretched
    `scale` times among busy ranks: all of it CPU where its CPU was not measured
    (cpu_scale 0); else alone x cpu_scale of CPU and the rest of the stretch, if any,
    spent waiting (for the interpreter lock, or a lower nice level's turn)."""
    if cpu_scale <= 0:
        return alone * scale, 0.0
    return alone * cpu_scale, alone * max(0.0, scale - cpu_scale)


def scaled_link(link: LinkNumbers, factor: float) -> LinkNumbers:
    """The link with every write taking `factor` times as long (write_scale)."""
    if factor == 1.0:
        return link
    return replace(
        link,
        bandwidth_bytes_s=link.bandwidth_bytes_s / factor,
        latency_s=link.latency_s * factor,
        per_request_s=link.per_request_s * factor,
        per_batch_s=link.per_batch_s * factor,
        message_rate=link.message_rate / factor,
    )


class _Job:
    __slots__ = ("left", "weight", "rate", "fn", "args")

    def __init__(self, work: float, weight: float, fn: Callable, args: tuple) -> None:
        self.left = work
        self.weight = weight
        self.rate = 0.0
        self.fn = fn
        self.args = args


def share(capacity: float, jobs: Iterable[tuple[float, float]]) -> list[float]:
    """Weighted fair shares of `capacity` cores among (weight, most cores it can use)
    jobs (water filling: a job that cannot use its fair part leaves the rest to the
    others), in the order of `jobs`."""
    js = list(jobs)
    rates = [0.0] * len(js)
    cap, total = capacity, sum(w for w, _ in js)
    for i in sorted(range(len(js)), key=lambda k: js[k][1] / js[k][0]):
        w, most = js[i]
        r = cap * w / total if total > 0 else 0.0
        if r < most:  # this and every job that could use more get their proportional part
            for k in range(len(js)):
                if rates[k] == 0.0:
                    rates[k] = cap * js[k][0] / total
            return rates
        rates[i] = most
        cap -= most
        total -= w
    return rates


class CpuShare:
    """The host's cores shared among runnable jobs (see the module docstring).

    `run(work, weight, fn, *args)`: a job of `work` CPU seconds, at most one core;
    fn(*args) is called when it is done. `steady`: (weight, cores) users that never
    end (engine threads, other processes). Rates are recomputed whenever a job starts
    or ends.
    """

    __slots__ = ("env", "cores", "_steady", "_jobs", "_last", "_gen", "cpu_s")

    def __init__(
        self, env: simpy.Environment, cores: float, steady: Iterable[tuple[float, float]] = ()
    ) -> None:
        self.env = env
        self.cores = cores
        self._steady = [(w, c) for w, c in steady if c > 0]
        self._jobs: list[_Job] = []
        self._last = 0.0
        self._gen = 0
        self.cpu_s = 0.0  # CPU seconds of work done

    @property
    def running(self) -> int:
        return len(self._jobs)

    def rates(self) -> list[float]:
        """The running jobs' current rates (cores), in start order."""
        return [j.rate for j in self._jobs]

    def run(self, work: float, weight: float, fn: Callable, *args) -> None:
        self._advance()
        self._jobs.append(_Job(work, weight, fn, args))
        self.cpu_s += work
        self._schedule()

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        if dt > 0:
            for j in self._jobs:
                j.left -= j.rate * dt
        self._last = now

    def _schedule(self) -> None:
        self._gen += 1
        jobs = self._jobs
        if not jobs:
            return
        rates = share(self.cores, [*((j.weight, 1.0) for j in jobs), *self._steady])
        for j, r in zip(jobs, rates, strict=False):
            j.rate = r
        nxt = min(max(0.0, j.left) / j.rate for j in jobs)
        self.env.timeout(nxt).callbacks.append(partial(self._fire, self._gen))

    def _fire(self, gen: int, _ev=None) -> None:
        if gen != self._gen:  # the rates changed since: a later timeout decides
            return
        self._advance()
        done = [j for j in self._jobs if j.left <= _DONE_S]
        self._jobs = [j for j in self._jobs if j.left > _DONE_S]
        self._schedule()
        for j in done:  # in start order
            j.fn(*j.args)


def _noop() -> None:
    pass


class Worker:
    """One thread of a rank: jobs run one at a time, as CPU jobs of its weight.

    A job is (work, fn, args, on_cpu): the worker is busy until `work` CPU seconds
    are done on the shared cores (or, not on_cpu, `work` seconds have passed), then
    calls fn(*args) and starts the next job. `submit` queues behind everything;
    `run_next` puts a job at the front (work the running handler started
    synchronously). `busy_s` and `jobs` count what ran.
    """

    __slots__ = ("env", "cpu", "weight", "_queue", "_busy", "busy_s", "jobs")

    def __init__(self, env: simpy.Environment, cpu: CpuShare, weight: float = 1.0) -> None:
        self.env = env
        self.cpu = cpu
        self.weight = weight
        self._queue: deque[tuple[float, Callable, tuple, bool]] = deque()
        self._busy = False
        self.busy_s = 0.0
        self.jobs = 0

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, work: float, fn: Callable, *args) -> None:
        self._queue.append((work, fn, args, True))
        if not self._busy:
            self._start()

    def run_next(self, work: float, fn: Callable, *args) -> None:
        self._queue.appendleft((work, fn, args, True))
        if not self._busy:
            self._start()

    def wait(self, seconds: float) -> None:
        """Keep the worker away for `seconds` without using CPU (a late start)."""
        self._queue.append((seconds, _noop, (), False))
        if not self._busy:
            self._start()

    def _start(self) -> None:
        work, fn, args, on_cpu = self._queue.popleft()
        self._busy = True
        self.jobs += 1
        if on_cpu:
            self.busy_s += work
            self.cpu.run(work, self.weight, self._end, fn, args)
        else:
            self.env.timeout(work).callbacks.append(partial(self._end, fn, args))

    def _end(self, fn: Callable, args: tuple, _ev=None) -> None:
        # The job's effect happens while the worker still counts as busy, so whatever it
        # starts synchronously (run_next) goes first; then the next job starts.
        fn(*args)
        self._busy = False
        if self._queue:
            self._start()


class HostModel:
    """Every rank as hardware mode's process: a loop, a copy thread and (prefill) a
    forward thread, all on one `CpuShare` of the host."""

    def __init__(
        self, env: simpy.Environment, host: HostNumbers, runtimes: Iterable, prefill: Iterable
    ) -> None:
        runtimes = list(runtimes)
        self.env = env
        self.host = host
        self.cpu = CpuShare(env, host.cores, steady_load(host, len(runtimes)))
        self.event_s = host.event_s
        self.event_wait_s = host.event_s * (host.event_scale - 1.0)  # loop time beyond its CPU
        self.notice_s = host.loop_poll_s / 2  # a completion waits for the loop's next turn
        loop_weight = RT_WEIGHT if host.loop_rt else 1.0
        self.loops = {rt: Worker(env, self.cpu, loop_weight) for rt in runtimes}
        self.copies = {rt: Worker(env, self.cpu) for rt in runtimes}
        fw = nice_weight(host.forward_nice)
        self.forwards = {rt: Worker(env, self.cpu, fw) for rt in prefill if rt is not None}
        # (rank, peer, k) -> thread k of the write lane to that peer (write_on_cpu)
        self.lanes: dict[tuple, Worker] = {}

    def deliver(self, rt, fn: Callable, event) -> None:
        """An event reaches the rank: handled on its loop, in turn: `event_s` of CPU
        after `event_wait_s` of loop time without a core."""
        loop = self.loops[rt]
        if self.event_wait_s > 0:
            loop.wait(self.event_wait_s)
        loop.submit(self.event_s, fn, rt, event)

    def offload(self, worker: Worker, rt, work: float, fn: Callable, event) -> None:
        """`work` CPU seconds on one of the rank's threads; its loop handles `event`
        (fn(rt, event)) at its next turn after the work is done."""
        worker.submit(work, self._noticed, rt, fn, event)

    def copy(self, rt, seconds: float, fn: Callable, event) -> None:
        """A gather or scatter of `seconds` (alone, calibrated) on the rank's copy thread,
        plus the rank's own CPU per copy (copy_op_s: hand-off, glue, completion)."""
        h = self.host
        self._stretched(
            self.copies[rt], rt, seconds + h.copy_op_s, h.copy_scale, h.copy_cpu_scale, fn, event
        )

    def fill(self, rt, nbytes: int, fn: Callable, event) -> None:
        """A forward's pattern fill of `nbytes` on the rank's forward thread."""
        h = self.host
        self._stretched(
            self.forwards[rt], rt, fill_alone(h, nbytes), h.fill_scale, h.fill_cpu_scale, fn, event
        )

    def _stretched(
        self, worker: Worker, rt, alone: float, scale: float, cpu_scale: float, fn: Callable, event
    ) -> None:
        """A step of `alone` seconds alone, stretched by its in-run factor (split_work),
        offloaded to `worker`."""
        work, wait = split_work(alone, scale, cpu_scale)
        if wait > 0:
            worker.wait(wait)
        self.offload(worker, rt, work, fn, event)

    def write(self, rt, peer: int, seconds: float, fn: Callable, *args) -> None:
        """A write of `seconds` (alone) to `peer` on the rank's lane for that peer, a
        CPU thread (write_on_cpu), and as long on each of the engine's other threads it
        keeps busy (write_cpu_threads: a socket's receiving end); fn(*args) once all
        are done."""
        h = self.host
        threads = h.write_cpu_threads
        left = [threads]
        wait = 0.0
        if h.write_cpu_scale > 0:  # seconds is the write's alone time times write_scale
            seconds, wait = split_work(seconds / h.write_scale, h.write_scale, h.write_cpu_scale)

        def one_done() -> None:
            left[0] -= 1
            if not left[0]:
                fn(*args)

        for k in range(threads):
            lane = self.lanes.get((rt, peer, k))
            if lane is None:
                lane = self.lanes[(rt, peer, k)] = Worker(
                    self.env, self.cpu, RT_LOW_WEIGHT if h.write_rt else 1.0
                )
            if wait > 0:
                lane.wait(wait)
            lane.submit(seconds, one_done)

    def _noticed(self, rt, fn: Callable, event) -> None:
        if self.notice_s > 0:
            self.env.timeout(self.notice_s).callbacks.append(
                partial(self._deliver_ev, rt, fn, event)
            )
        else:
            self.deliver(rt, fn, event)

    def _deliver_ev(self, rt, fn: Callable, event, _ev=None) -> None:
        self.deliver(rt, fn, event)
