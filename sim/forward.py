"""Executors of the prefill forward in simulated time.

The runtimes decide what to compute and in which order (`Forward` actions, in
arrival order, chunk by chunk); these only decide how long it takes:

- `GroupForward` (the GPU model): the prefill TP group computes together, one forward
  at a time, on one stream. The chunks waiting for the stream share a forward as
  SGLang's scheduler packs prompts (shared/serving/prefill_batch.py: in the runtime's
  order while their computed tokens fit chunked_prefill_size, a full chunk alone); a
  forward's duration comes from the model (shared/serving/compute.py
  `packed_forward_s`: one chunk alone is `chunk_forward_s`), each chunk's attention
  over the context before it (chunked prefill). Every chunk of a forward gets its
  ForwardStarted (a room's first chunk) at the forward's start and its ForwardDone at
  its end. Every rank of the group asks for the same chunk; the first request plans
  it, the others join it.
- `PipelineForward` (the GPU model with `prefill.pp` > 1): the same, through the
  instance's pipeline stages, forwards in flight across them.
- `HostFills` (the cpu-loop host model): as in hardware mode, each prefill rank fills
  its own chunks' KV pattern on its own loop, one chunk per loop turn.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstage.shared.events import Forward, ForwardDone, ForwardStarted
from kvstage.shared.layout import room_pages
from kvstage.shared.runtime import RankRuntime
from kvstage.shared.serving.compute import chunk_forward_s, packed_forward_s
from kvstage.shared.serving.pipeline import stage_step_s
from kvstage.shared.serving.prefill_batch import OpenForward
from kvstage.shared.trace import TraceRecord
from kvstage.sim.gpu import SerialStream

if TYPE_CHECKING:
    from kvstage.sim.driver import Simulation


@dataclass(slots=True)
class _GroupChunk:
    """One chunk's forward on the group stream, and the ranks waiting for it."""

    start: float
    ranks: list[RankRuntime] = field(default_factory=list)
    started: bool = False  # chunk 0 only: the room opened
    done: bool = False
    delivered: int = 0
    last: bool = False  # the room's last chunk, whose end streams the first token


@dataclass(slots=True)
class _Packed:
    """One forward on the group stream and the chunks packed into it; it takes more
    chunks (prefill_batch.py `OpenForward`) until it starts, or one does not fit."""

    start: float
    end: float
    rule: OpenForward
    keys: list[tuple[int, int]] = field(default_factory=list)
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (tokens computed, context)
    took: float = 0.0  # its duration
    version: int = 0  # of its end event: a chunk that joins moves the end


class GroupForward:
    """The GPU model: one forward stream for one prefill instance's TP group."""

    def __init__(self, sim: Simulation, ranks: int) -> None:
        self.sim = sim
        self.ranks = ranks  # the group's TP size: every rank asks for every chunk
        self.stream = SerialStream()
        self._chunks: dict[tuple[int, int], _GroupChunk] = {}
        self._open: _Packed | None = None  # the last forward, while it may take chunks

    def submit(self, rt: RankRuntime, f: Forward, now: float) -> None:
        key = (f.room, f.chunk)
        job = self._chunks.get(key)
        if job is None:
            job = self._chunks[key] = self._plan(key, f, now)
        else:  # a rank asking late (a late session) finds what the group already did
            if f.chunk == 0 and job.started:
                self.sim._at(0.0, self.sim._feed, rt, ForwardStarted(*key))
            if self._done_for(rt, key, job):
                self.sim._at(0.0, self._deliver_done, rt, key)
                return
        job.ranks.append(rt)

    def _done_for(self, rt: RankRuntime, key: tuple[int, int], job: _GroupChunk) -> bool:
        """Whether the chunk's forward is done for this rank (the whole group's)."""
        return job.done

    def _plan(self, key: tuple[int, int], f: Forward, now: float) -> _GroupChunk:
        sim = self.sim
        g = sim.geometry
        computed = f.computed
        fwd = self._open
        if fwd is not None and fwd.start >= now and fwd.rule.takes(f.room, computed):
            return self._join(fwd, key, f, now)
        self._open = None  # a chunk that does not fit closes the open forward
        start = self.stream.free_at(now)
        job = _GroupChunk(start, last=self._streams_first(f))
        if f.chunk == 0:  # the room opens when its first chunk's forward starts
            sim._at(start - now, self._started, key)
        if computed > 0:  # cached tokens are not computed
            forward = chunk_forward_s(
                sim.scenario, f.tokens, f.cached_tokens, f.page_start, g.page_size
            )
            end = self.stream.reserve(now, forward)
            fwd = self._open = _Packed(start, end, OpenForward(g.chunk_tokens), took=forward)
            fwd.rule.add(f.room, computed)
            fwd.keys.append(key)
            fwd.chunks.append((computed, f.context(g.page_size)))
            sim._at(end - now, self._forward_done, fwd, 0)
        else:  # a room (or a chunk of a cached prefix) with nothing to compute
            sim._at(start - now, self._done, key)
        return job

    def _join(self, fwd: _Packed, key: tuple[int, int], f: Forward, now: float) -> _GroupChunk:
        """Chunk `f` packed into the open forward `fwd` (not started, or starting now):
        the forward takes longer, its end event moves."""
        sim, g = self.sim, self.sim.geometry
        computed = f.computed
        fwd.rule.add(f.room, computed)
        fwd.keys.append(key)
        fwd.chunks.append((computed, f.context(g.page_size)))
        job = _GroupChunk(fwd.start, last=self._streams_first(f))
        if f.chunk == 0:
            sim._at(fwd.start - now, self._started, key)
        took = packed_forward_s(sim.scenario, fwd.chunks)
        fwd.end = self.stream.retime_last(fwd.end, fwd.took, fwd.start, took)
        fwd.took = took
        fwd.version += 1
        sim._at(fwd.end - now, self._forward_done, fwd, fwd.version)
        return job

    def _forward_done(self, fwd: _Packed, version: int, _ev=None) -> None:
        if version != fwd.version:
            return  # a chunk joined after this end was planned: the forward ends later
        if self._open is fwd:
            self._open = None
        for key in fwd.keys:
            self._done(key)

    def _streams_first(self, f: Forward) -> bool:
        """Whether this chunk's end streams the room's first token: decode.first_token is
        "prefill" and it is the room's last chunk (the decode holds the prompt's pages
        from `f.page_start`, the chunk's own, to the prompt's end)."""
        sim = self.sim
        if sim.scenario.decode.first_token != "prefill":
            return False
        req = sim.request_of(f.room)
        g = sim.geometry
        return f.page_start + f.num_pages >= room_pages(req.prompt_tokens, 0, g.page_size)

    def _started(self, key: tuple[int, int], _ev=None) -> None:
        job = self._chunks[key]
        job.started = True
        for rt in job.ranks:
            self.sim._feed(rt, ForwardStarted(*key))

    def _done(self, key: tuple[int, int], _ev=None) -> None:
        job = self._chunks[key]
        job.done = True
        if job.last and job.ranks:  # decode.first_token = "prefill": the token goes out now
            now = self.sim.env.now
            rank = job.ranks[0].rank
            self.sim._keep_record(
                TraceRecord("prefill", rank, "first_token", now, now, room=key[0], chunk=key[1])
            )
        for rt in list(job.ranks):
            self._deliver_done(rt, key)

    def _deliver_done(self, rt: RankRuntime, key: tuple[int, int], _ev=None) -> None:
        job = self._chunks[key]
        self.sim._feed(rt, ForwardDone(key[0], key[1], job.start))
        job.delivered += 1
        if job.delivered == self.ranks:
            del self._chunks[key]


class HostFills:
    """The host model: each prefill rank fills its chunks on its forward thread, in
    order; its loop starts each fill and reports it done (as hw/rank/prefill.py)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        g = sim.geometry
        self._bytes_per_token = g.block_bytes(1, g.prefill_heads)
        self._queue: dict[RankRuntime, deque[Forward]] = {rt: deque() for rt in sim.prefill}
        self._filling: dict[RankRuntime, bool] = dict.fromkeys(sim.prefill, False)

    def submit(self, rt: RankRuntime, f: Forward, now: float) -> None:
        self._queue[rt].append(f)
        if not self._filling[rt]:
            self._filling[rt] = True
            self.sim.loops[rt].submit(0.0, self._turn, rt)

    def _turn(self, rt: RankRuntime) -> None:
        """On the rank's loop: start the next chunk (its room opens, its STAGING_REQs go
        out) and hand its fill to the forward thread."""
        sim, queue = self.sim, self._queue[rt]
        while queue:
            f = queue.popleft()
            if not rt.forward_wanted(f):  # its room failed before its turn
                sim._feed(rt, ForwardDone(f.room, f.chunk, sim.env.now))
                continue
            start = sim.env.now
            sim._feed(rt, ForwardStarted(f.room, f.chunk))
            if not f.num_pages:  # nothing to fill
                sim._feed(rt, ForwardDone(f.room, f.chunk, start))
                continue
            host = sim.hostm
            host.fill(rt, f.tokens * self._bytes_per_token, self._filled, (f, start))
            return
        self._filling[rt] = False

    def _filled(self, rt: RankRuntime, done: tuple[Forward, float], _ev=None) -> None:
        """On the rank's loop, at its turn after the fill ended: report it, start the next."""
        f, start = done
        self.sim._feed(rt, ForwardDone(f.room, f.chunk, start))
        self._turn(rt)


@dataclass(slots=True)
class _Staged:
    """One forward through the pipeline stages and the chunks packed into it; it takes
    more chunks until it enters stage 0, or one does not fit."""

    t0: float  # when it was planned
    rule: OpenForward | None  # None: nothing to compute, it takes no chunk
    before: list[float]  # each stage's free time before it was reserved
    spans: list[tuple[float, float]] = field(default_factory=list)  # (begin, end) a stage
    keys: list[tuple[int, int]] = field(default_factory=list)
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (tokens computed, context)
    step: float = 0.0  # its stage-step
    stages_done: int = 0
    version: int = 0  # of its stage-done events: a chunk that joins moves them


class PipelineForward(GroupForward):
    """The GPU model of a prefill instance in pipeline stages (`prefill.pp` > 1): a
    forward goes through the stages in turn, each stage one forward at a time, one
    stage-step each (shared/serving/pipeline.py `stage_step_s`: the slowest stage's
    share of the forward and the hand-off); stage s's ranks get a chunk's ForwardDone
    when stage s is done with its forward, and stage 0 takes the next forward as soon
    as it is free, so forwards are in flight across the stages: a prompt of n equal
    chunks ends after n + pp - 1 steps. The chunks waiting for stage 0 share a forward
    by the group forward's rule (shared/serving/prefill_batch.py), as SGLang's pipeline
    scheduler builds each micro-batch with the same prefill adder."""

    def __init__(self, sim: Simulation, ranks: int) -> None:
        super().__init__(sim, ranks)
        g = sim.geometry
        self.tp = g.prefill_tp
        self.stages = [self.stream] + [SerialStream() for _ in range(g.prefill_pp - 1)]
        self._of: dict[tuple[int, int], _Staged] = {}
        self._staged: _Staged | None = None  # the last forward, while it may take chunks

    def _stage(self, rt: RankRuntime) -> int:
        return (rt.rank % self.ranks) // self.tp

    def _done_for(self, rt: RankRuntime, key: tuple[int, int], job: _GroupChunk) -> bool:
        """Whether the rank's stage is done with the chunk."""
        return self._stage(rt) < self._of[key].stages_done

    def _plan(self, key: tuple[int, int], f: Forward, now: float) -> _GroupChunk:
        sim, g = self.sim, self.sim.geometry
        computed = f.computed
        fwd = self._staged
        if fwd is not None and fwd.spans[0][0] >= now and fwd.rule.takes(f.room, computed):
            return self._join_staged(fwd, key, f, now)
        self._staged = None  # a chunk that does not fit closes the open forward
        start = self.stream.free_at(now)
        job = _GroupChunk(start, last=self._streams_first(f))
        if f.chunk == 0:  # the room opens when its first chunk enters stage 0
            sim._at(start - now, self._started, key)
        step = 0.0
        if computed > 0:  # cached tokens are not computed
            forward = chunk_forward_s(
                sim.scenario, f.tokens, f.cached_tokens, f.page_start, g.page_size
            )
            step = stage_step_s(sim.scenario, forward, computed)
        before = [stream.free_at(0.0) for stream in self.stages]
        fwd = _Staged(now, OpenForward(g.chunk_tokens) if computed > 0 else None, before)
        t = now
        for stream in self.stages:
            begin = stream.free_at(t)
            t = stream.reserve(t, step) if step else begin
            fwd.spans.append((begin, t))
        fwd.step = step
        self._add(fwd, key, f, computed)
        if fwd.rule is not None:
            self._staged = fwd
        for s, (_, end) in enumerate(fwd.spans):
            sim._at(end - now, self._stage_done, fwd, s, 0)
        return job

    def _add(self, fwd: _Staged, key: tuple[int, int], f: Forward, computed: int) -> None:
        fwd.keys.append(key)
        self._of[key] = fwd
        if fwd.rule is not None:
            fwd.rule.add(f.room, computed)
            fwd.chunks.append((computed, f.context(self.sim.geometry.page_size)))

    def _join_staged(
        self, fwd: _Staged, key: tuple[int, int], f: Forward, now: float
    ) -> _GroupChunk:
        """Chunk `f` packed into the open forward `fwd` (not yet in stage 0, or entering
        it now): its stage-step grows, its spans and stage-done events move."""
        sim = self.sim
        computed = f.computed
        self._add(fwd, key, f, computed)
        job = _GroupChunk(fwd.spans[0][0], last=self._streams_first(f))
        if f.chunk == 0:
            sim._at(fwd.spans[0][0] - now, self._started, key)
        forward = packed_forward_s(sim.scenario, fwd.chunks)
        step = stage_step_s(sim.scenario, forward, sum(t for t, _ in fwd.chunks))
        spans, t = [], fwd.t0
        for stream, free, (_, end) in zip(self.stages, fwd.before, fwd.spans, strict=True):
            begin = max(free, t)
            t = stream.retime_last(end, fwd.step, begin, step)
            spans.append((begin, t))
        fwd.spans, fwd.step = spans, step
        fwd.version += 1
        for s, (_, end) in enumerate(spans):
            sim._at(end - now, self._stage_done, fwd, s, fwd.version)
        return job

    def _stage_done(self, fwd: _Staged, stage: int, version: int, _ev=None) -> None:
        if version != fwd.version:
            return  # a chunk joined after this was planned: the stage ends later
        fwd.stages_done = stage + 1
        last = stage == len(self.stages) - 1
        if stage == 0 and self._staged is fwd:
            self._staged = None
        for key in list(fwd.keys):
            job = self._chunks[key]
            if last:
                job.done = True
                if job.last and job.ranks:  # decode.first_token = "prefill": out of the last stage
                    now = self.sim.env.now
                    self.sim._keep_record(
                        TraceRecord(
                            "prefill", job.ranks[0].rank, "first_token", now, now,
                            room=key[0], chunk=key[1],
                        )
                    )  # fmt: skip
            for rt in [r for r in job.ranks if self._stage(r) == stage]:
                self._deliver_done(rt, key)

    def _deliver_done(self, rt: RankRuntime, key: tuple[int, int], _ev=None) -> None:
        job = self._chunks[key]
        fwd = self._of[key]
        begin = fwd.spans[self._stage(rt)][0]
        self.sim._feed(rt, ForwardDone(key[0], key[1], begin))
        job.delivered += 1
        if job.delivered == self.ranks:
            del self._chunks[key], self._of[key]
