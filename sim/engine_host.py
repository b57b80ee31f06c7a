"""The serving engine's prefill host (`[engine] preset = NAME`), as simulated resources.

kvstage's own posting model (sim/links.py) gives every rank a private posting thread;
a serving engine does its descriptor work where its code does it (presets and sources:
shared/scenario/engines.py). Per prefill rank (one process, as in SGLang and vLLM):

- `Gil`: the process's interpreter lock, a processor shared fairly by the threads that
  run Python at that moment (sim/host.py `CpuShare` with one "core"): two threads that
  both run Python each go at half speed (CPython hands the lock over every switch
  interval, so over a burst each gets about half). Work that releases the lock (a
  C++ post, a verbs call) runs at full speed beside it.
- `Threads`: k threads that take bursts from one FIFO (a single thread: k = 1; a
  ThreadPoolExecutor: k > 1). A burst is (seconds holding the GIL, seconds without
  it, then a callback): one SimPy event per (request, resource) burst, never one per
  descriptor, so the event count per request stays flat.
- the scheduler thread's loop (`EngineForward`): schedule a batch (the waiting chunks
  up to the batch token budget, one chunk per room), launch its forward (Python,
  `launch_us`, plus `poll_us` per room whose transfers are in flight: NixlKVSender.poll
  checks each handle), the GPU runs it, then the batch's finished chunks are sent.
  Without overlap the next launch waits for that send work on the scheduler thread;
  with overlap (`overlap = true`) batch k+1 is launched before batch k's results are
  processed, so only work beyond one forward is exposed.
- where the descriptor work runs (`EngineHost.write`): on the scheduler thread
  (`post_on = "scheduler"`: it delays the next launch and everyone behind it), or handed
  to a transfer queue's worker(s) (`"worker"`: the scheduler pays `enqueue_us`), the
  queue chosen by the destination ranks as SGLang shards by destination sessions.
  After the post the bytes go through the NIC fabric with the profile's bandwidth and
  message rate, its posting costs left out (the engine's post replaces them).

- the request's own path (`request_us`): HTTP, tokenization, detokenization and
  streaming, a delay from the request's arrival (on record: a decode `arrive` row) to
  its room opening, paid by every request alike; no resource is held.

The GPU model only (links.host_model = "gpu"; with "cpu-loop" the preset is not used);
decode ranks are unchanged; with [cluster] fold the folded ranks' ghost writes start when
the simulated rank's call is issued, without its descriptor delay.
Deterministic: bursts in submission order, SimPy's clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import simpy

from kvstage.shared.events import Forward, SliceWrite, Write, WriteDone
from kvstage.shared.scenario.engines import EnginePreset
from kvstage.shared.serving.compute import prefill_forward_s
from kvstage.sim.forward import GroupForward, _GroupChunk
from kvstage.sim.host import CpuShare

if TYPE_CHECKING:
    from kvstage.shared.runtime import RankRuntime
    from kvstage.sim.driver import Simulation

__all__ = ["EngineForward", "EngineHost", "Gil", "Threads"]


def Gil(env: simpy.Environment) -> CpuShare:  # noqa: N802 (a resource, named as one)
    """One process's interpreter lock: one 'core' shared fairly by the Python bursts."""
    return CpuShare(env, 1.0)


class Threads:
    """k threads taking bursts from one FIFO; each burst holds the GIL for its first
    part (run on `gil`, shared with the process's other Python), then runs its second
    part without it, then calls fn(*args)."""

    __slots__ = ("env", "gil", "k", "_queue", "idle", "busy_s", "bursts")

    def __init__(self, env: simpy.Environment, gil: CpuShare, k: int = 1) -> None:
        self.env = env
        self.gil = gil
        self.k = k
        self._queue: deque[tuple[float, float, Callable, tuple]] = deque()
        self.idle = k
        self.busy_s = 0.0  # seconds of bursts alone (the GIL share can stretch them)
        self.bursts = 0

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, gil_s: float, free_s: float, fn: Callable, *args) -> None:
        self._queue.append((gil_s, free_s, fn, args))
        if self.idle:
            self._start()

    def _start(self) -> None:
        gil_s, free_s, fn, args = self._queue.popleft()
        self.idle -= 1
        self.bursts += 1
        self.busy_s += gil_s + free_s
        if gil_s > 0:
            self.gil.run(gil_s, 1.0, self._released, free_s, fn, args)
        else:
            self._released(free_s, fn, args)

    def _released(self, free_s: float, fn: Callable, args: tuple) -> None:
        self.env.timeout(free_s).callbacks.append(partial(self._end, fn, args))

    def _end(self, fn: Callable, args: tuple, _ev=None) -> None:
        fn(*args)
        self.idle += 1
        if self._queue:
            self._start()


class _Rank:
    """One prefill rank's process: its GIL, scheduler thread, transfer queues."""

    __slots__ = ("gil", "scheduler", "queues", "inflight")

    def __init__(self, env: simpy.Environment, p: EnginePreset) -> None:
        self.gil = Gil(env)
        self.scheduler = Threads(env, self.gil, 1)
        workers = p.queues if p.post_on == "worker" else 0
        self.queues = [Threads(env, self.gil, max(1, p.pool)) for _ in range(workers)]
        self.inflight: dict[int, int] = {}  # room -> transfers posted, not yet done


class EngineHost:
    """Every simulated prefill rank's engine host (see the module docstring)."""

    def __init__(self, sim: Simulation, preset: EnginePreset) -> None:
        self.sim = sim
        self.p = preset
        env = sim.env
        self.ranks: dict[RankRuntime, _Rank] = {
            rt: _Rank(env, preset) for rt in sim.prefill if rt is not None
        }
        # the engine's post replaces the transfer engine's posting model; the NIC's
        # bandwidth and message rate stay (sim/links.py)
        self.link = replace(sim.write_link, per_request_s=0.0, per_batch_s=0.0, post_threads=0)
        # per request, before its room opens (the serving stack outside the forward)
        self.request_s = preset.request_us * 1e-6
        g = sim.geometry
        self._block_descs = g.kv_factor * g.layers  # per page, head-major blocks

    def forwards(self, ranks: int) -> list[EngineForward]:
        """One scheduler loop per prefill instance, over its simulated ranks' threads."""
        sim, tp = self.sim, self.sim.geometry.prefill_tp
        out = []
        for i in range(sim.sessions.prefill_instances):
            mine = [rt for rt in sim.prefill[i * tp : (i + 1) * tp] if rt is not None]
            out.append(EngineForward(sim, ranks, self, [self.ranks[rt] for rt in mine]))
        return out

    # --- descriptors ----------------------------------------------------------------
    def descriptors(self, a: Write | SliceWrite, requests: int) -> int:
        """Descriptors of one transfer call: one bulk block, the layout's slice requests,
        or one per (page, layer, K/V) for a head-major block layout."""
        if type(a) is Write or self.p.granularity == "layout":
            return requests
        return self._block_descs * a.num_pages

    def write(self, rt: RankRuntime, a: Write | SliceWrite, requests: int) -> None:
        """A transfer call from `rt`: its descriptor work where the engine does it, then
        the bytes through the fabric, then WriteDone on the rank."""
        p, rank = self.p, self.ranks[rt]
        n = self.descriptors(a, requests)
        nic_requests = requests if type(a) is Write or p.granularity == "layout" else n
        gil_s, free_s = p.split(n)
        rank.inflight[a.room] = rank.inflight.get(a.room, 0) + 1
        post = (self._post, rt, rank, a, nic_requests)
        if not rank.queues:  # synchronously, on the scheduler thread
            rank.scheduler.submit(gil_s, free_s, *post)
            return
        targets = self.sim.sessions.targets(a.room, rt.rank)
        q = rank.queues[sum(targets) % len(rank.queues)]
        rank.scheduler.submit(p.enqueue_us * 1e-6, 0.0, q.submit, gil_s, free_s, *post)

    def _post(self, rt: RankRuntime, rank: _Rank, a, requests: int) -> None:
        sim = self.sim
        ev = sim.fabric.transfer(
            sim.prefill_nic[rt.rank], sim.decode_nic[a.decode_rank], a.nbytes, self.link, requests
        )
        ev.callbacks.append(partial(self._written, rt, rank, a))

    def _written(self, rt: RankRuntime, rank: _Rank, a, _ev=None) -> None:
        left = rank.inflight[a.room] - 1
        if left:
            rank.inflight[a.room] = left
        else:
            del rank.inflight[a.room]
        self.sim._deliver(rt, WriteDone(a.room, a.chunk, a.decode_rank))

    # --- the loop's launch ------------------------------------------------------------
    def launch(self, ranks: list[_Rank], fn: Callable, *args) -> None:
        """Every rank's scheduler schedules and launches the batch (Python, holding the
        GIL: launch_us plus poll_us per room in flight); fn(*args) once all have."""
        if not ranks:
            self.sim._at(0.0, fn, *args)
            return
        left = [len(ranks)]

        def one() -> None:
            left[0] -= 1
            if not left[0]:
                fn(*args)

        for r in ranks:
            work = (self.p.launch_us + self.p.poll_us * len(r.inflight)) * 1e-6
            r.scheduler.submit(work, 0.0, one)


class EngineForward(GroupForward):
    """One prefill instance's scheduler loop: batches of waiting chunks, each launched
    by the ranks' scheduler threads, computed on the group's stream, then sent."""

    def __init__(self, sim: Simulation, ranks: int, host: EngineHost, threads: list[_Rank]):
        super().__init__(sim, ranks)
        self.host = host
        self.threads = threads
        p = host.p
        budget = p.batch_tokens
        self.budget = sim.scenario.geometry().chunk_tokens if budget is None else budget
        self.limit = 2 if p.overlap else 1  # batches launched and not yet done
        self._pending: deque[tuple[tuple[int, int], Forward]] = deque()
        self._launching = False
        self._inflight = 0
        self.batches = 0

    def _plan(self, key: tuple[int, int], f: Forward, now: float) -> _GroupChunk:
        self._pending.append((key, f))
        self._pump()
        return _GroupChunk(now)

    def _pump(self) -> None:
        if self._launching or not self._pending or self._inflight >= self.limit:
            return
        self._launching = True
        self.host.launch(self.threads, self._launched)

    def _take(self) -> list[tuple[tuple[int, int], Forward]]:
        """The next batch: waiting chunks in order, up to the token budget (the first
        always), at most one chunk of a room (its next chunk is the next batch's)."""
        pending, batch, rooms, tokens = self._pending, [], set(), 0
        while pending:
            key, f = pending[0]
            if batch and (not self.budget or f.room in rooms or tokens + f.tokens > self.budget):
                break
            pending.popleft()
            batch.append((key, f))
            rooms.add(f.room)
            tokens += f.tokens if f.num_pages else 0
        return batch

    def _launched(self, _ev=None) -> None:
        self._launching = False
        batch = self._take()
        sim, now = self.sim, self.sim.env.now
        self._inflight += 1
        self.batches += 1
        start = self.stream.free_at(now)
        tokens = sum(f.tokens for _, f in batch if f.num_pages)
        end = self.stream.reserve(now, prefill_forward_s(sim.scenario, tokens)) if tokens else start
        for key, f in batch:
            self._chunks[key].start = start
            if f.chunk == 0:
                sim._at(start - now, self._started, key)
        sim._at(end - now, self._batch_done, [key for key, _ in batch])
        self._pump()

    def _batch_done(self, keys: list[tuple[int, int]], _ev=None) -> None:
        self._inflight -= 1
        for key in keys:
            self._done(key)
        self._pump()
