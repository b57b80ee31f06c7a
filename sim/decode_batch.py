"""Continuous batching at each decode instance, in simulated time.

A room is ready for the batch once every rank of the instance has its KV (each rank's
runtime hands out a `Generate` after its RoomDone). It joins at a step boundary when
there is a slot; that moment is its first token at the client: as in SGLang's PD
decode, the prefill samples the first token and ships it with the KV, and the decode
streams it when the request enters its running batch (docs/metrics.md). It then gets
one token per step, N - 1 steps for N output tokens (with speculative decoding,
`decode.speculative.accept_length` tokens a step on average: ceil((N - 1) / accept_length)
steps), and leaves after its last one,
when every rank hears `GenerateDone` (with the time it joined) and frees the room's
pages. Each step is traced as a `decode_step` row at the instance's first simulated
rank (`requests`: the batch), whose lengths are the rooms' inter-token gaps. A step's
time comes from `shared.serving.decode_model.DecodeModel`: the
weights plus the KV of everyone in the batch, read once, or its FLOPs, whichever is
longer. Rooms join at step boundaries, as in an engine's scheduler, and at most
`decode.max_running_requests` run at once: the others wait, in arrival order, for a
room to finish (SGLang's --max-running-requests, vLLM's max_num_seqs).

Cost per step is O(1) plus O(log n) per room that finishes: the batch keeps its KV
total incrementally and its rooms in a heap by the step they finish at, so a long
run with large batches stays cheap.

Steps in one event (`jump`). Between two moments that change a batch -- a room joins
(at the step boundary after every rank handed it out) or one finishes (known since it
joined) -- the batch's size is fixed and its KV grows by size x tokens_per_step a step,
so each step's time is known beforehand. The batch plans the steps up to its next
finish (`_plan`: each step's end, the same sums in the same order as the step-by-step
loop makes them, so the same floats), puts one event at the last end, and keeps each
step's row when it is due; a room handed out meanwhile cuts the plan at the first
boundary at or after now (`_cut`), where it joins as before. Rows keep their place
among every other record: the driver calls `flush(now)` before it keeps a record,
which keeps the planned rows that ended before now. A record at the very instant a
step ends is taken to come first (the step-by-step order of two events at one time
depends on when each was scheduled). With `on_tokens` (an online run streams each
step's tokens) the batch steps one event a step, as it does with `jump = False`
(tests/test_decode_jump.py compares the two record for record).

Prompts prefilled here (conditional disaggregation, `cluster.max_local_prefill_length`:
a `Generate` with `local_tokens`). Such a room takes a slot when one is free, as a
room joining does, and holds it while its prompt is computed: each step spends the
token budget (`prefill.chunked_prefill_size`) on the decoding rooms' tokens first and
on the prompts in arrival order after, cut into chunks (SGLang's mixed chunk, vLLM's
scheduler; kvstage/sim/colocated.py does the same), and takes `mixed_step_s`'s time
for both (shared/serving/mixed.py, on a scenario whose prefill side is this side's TP
and GPU). The step that computes a prompt's last chunk is its first token: it joins
the batch at that boundary. While any prompt is in the steps, the batch steps one
event a step; a step that only prefilled has no `decode_step` row.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import count
from typing import TYPE_CHECKING

import simpy
from simpy.events import NORMAL

from kvstage.shared.events import Generate, GenerateDone
from kvstage.shared.runtime import RankRuntime
from kvstage.shared.serving.decode_model import DecodeModel
from kvstage.shared.serving.mixed import mixed_step_s
from kvstage.shared.trace import TraceRecord
from kvstage.sim.colocated import colocated_scenario

if TYPE_CHECKING:
    from kvstage.sim.driver import Simulation

__all__ = ["DecodeBatches"]


@dataclass(slots=True)
class _Batch:
    steps: int = 0  # steps taken so far
    kv_tokens: float = 0.0  # KV of every room in the batch, in tokens
    size: int = 0
    stepping: bool = False
    rank: int = -1  # the instance's first simulated decode rank (its step rows' rank)
    step_start: float = 0.0
    # (tokens to generate, room, context tokens, ranks, handed out at, tokens to prefill here)
    joining: list[tuple[int, int, int, list[RankRuntime], float, int]] = field(default_factory=list)
    # conditional disaggregation: rooms prefilled here, each holding a slot:
    # [(tokens, room, context, ranks, handed out at, local tokens), computed so far]
    prefilling: list[list] = field(default_factory=list)
    pieces: list[tuple[list, int]] = field(default_factory=list)  # the step's (room, tokens)
    prefilled: list[tuple[int, int, int, list[RankRuntime], float, int]] = field(
        default_factory=list
    )  # their prompt computed at the last step's end: they join first
    # (finish step, room, KV tokens added while in the batch, ranks, joined at)
    finishing: list[tuple[int, int, float, list[RankRuntime], float]] = field(default_factory=list)
    # the plan (steps in one event): each planned step's end, the rows kept so far, the
    # plan's number (rows due from an older plan are stale) and its event's (likewise)
    ends: list[float] = field(default_factory=list)
    kept: int = 0
    plan: int = 0
    event: int = 0


class DecodeBatches:
    """One continuous batch per decode instance."""

    def __init__(self, sim: Simulation, model: DecodeModel, decode_tp: int, instances: int) -> None:
        self.sim = sim
        self.model = model
        self.tp = decode_tp
        self._batches = [_Batch() for _ in range(instances)]
        self._ready: dict[int, list[RankRuntime]] = {}  # room -> ranks whose KV is in
        self._abandoned: set[int] = set()  # rooms that failed at a rank of their instance
        self.peak_batch = 0  # the most rooms any instance ran in one step
        self.per_step = model.scenario.decode.tokens_per_step  # tokens a room gains a step
        # called with the rooms that got a token and the time: at each step's end, and
        # as rooms join (their first token, the prefill's) (sim/online.py streams
        # them); None in an offline run
        self.on_tokens: Callable[[list[int], float], None] | None = None
        self.jump = True  # steps in one event while nothing changes (module docstring)
        # conditional disaggregation: a local prompt's chunks are priced on this side's
        # GPUs (the scenario with its prefill side set to the decode side's TP and GPU)
        s = model.scenario
        self._budget = s.prefill.chunked_prefill_size
        self._local_s = (
            colocated_scenario(s, s.decode.tp, s.cluster.decode_instances, s.decode.ep)
            if s.cluster.max_local_prefill_length is not None
            else s
        )
        # every plan's next row due: (end, order, batch, plan, row); `due` the earliest
        self._rows: list[tuple[float, int, _Batch, int, int]] = []
        self._order = count()
        self.due = math.inf

    def submit(self, rt: RankRuntime, g: Generate, now: float) -> None:
        if g.room in self._abandoned:  # failed at another rank: nothing to generate
            self.sim._deliver(rt, GenerateDone(g.room, now))
            return
        ranks = self._ready.setdefault(g.room, [])
        ranks.append(rt)
        if len(ranks) < self.tp:
            return
        del self._ready[g.room]
        batch = self._batches[rt.instance]
        entry = (g.output_tokens, g.room, g.context_tokens, ranks, now, g.local_tokens)
        batch.joining.append(entry)
        if not batch.stepping:
            self._step(batch)
        elif batch.ends and len(batch.joining) <= self._free_slots(batch):
            self._cut(batch, now)  # it joins at the next boundary: the plan ends there

    def _free_slots(self, batch: _Batch) -> int:
        """Slots for rooms to join: the rooms prefilled here hold theirs already."""
        return max(
            0, self.model.max_batch - batch.size - len(batch.prefilling) - len(batch.prefilled)
        )

    def room_failed(self, rt: RankRuntime, room: int) -> None:
        """A decode rank failed the room: ranks that already hold its KV stop waiting."""
        if rt.role != "decode":
            return
        self._abandoned.add(room)
        for other in self._ready.pop(room, []):
            self.sim._deliver(other, GenerateDone(room, self.sim.env.now))

    def _step(self, batch: _Batch) -> None:
        room_for = self._free_slots(batch)
        now = self.sim.env.now
        taken, batch.joining = batch.joining[:room_for], batch.joining[room_for:]
        joins = batch.prefilled + [j for j in taken if not j[5]]
        batch.prefilled = []
        batch.prefilling += [[j, j[2] - j[5]] for j in taken if j[5]]  # from its cached prefix
        if self.on_tokens is not None and joins:
            self.on_tokens([j[1] for j in joins], now)
        for tokens, room, context, ranks, _ready, _local in joins:
            if batch.rank < 0:
                batch.rank = min(rt.rank for rt in ranks)
            if tokens <= 1:  # its one token came with the KV: streamed as it joins, done
                for rt in ranks:
                    self.sim._deliver(rt, GenerateDone(room, now))
                continue
            # its first token (from the prefill) is out now; N - 1 tokens follow, one a
            # step or accept_length a step (decode.speculative)
            left = tokens - 1
            steps = math.ceil(left / self.per_step) if self.per_step != 1.0 else left
            added = context + steps * self.per_step  # what this room adds to kv_tokens
            heapq.heappush(batch.finishing, (batch.steps + steps, room, added, ranks, now))
            batch.kv_tokens += context
            batch.size += 1
        if not batch.size and not batch.prefilling:
            batch.stepping = False
            return
        batch.stepping = True
        self.peak_batch = max(self.peak_batch, batch.size)
        batch.step_start = now
        if batch.prefilling:  # prompt chunks in this step (conditional disaggregation)
            self.sim._at(self._mixed_step_s(batch), self._stepped, batch)
            return
        if self.jump and self.on_tokens is None:
            self._plan(batch, now)
            return
        step = self.model.step_time_s(batch.kv_tokens, batch.size)
        self.sim._at(step, self._stepped, batch)

    def _mixed_step_s(self, batch: _Batch) -> float:
        """The step's prompt chunks in the token budget the decodes leave (one token each,
        counted first, as SGLang's mixed chunk and vLLM's scheduler do), oldest prompt
        first, and the step's time with them (shared/serving/mixed.py)."""
        left = self._budget - batch.size
        batch.pieces = []
        for p in batch.prefilling:
            if left <= 0:
                break
            take = min(left, p[0][2] - p[1])
            batch.pieces.append((p, take))
            left -= take
        pieces = [(take, p[1]) for p, take in batch.pieces]
        return mixed_step_s(self._local_s, self.model, batch.size, batch.kv_tokens, pieces)

    def _stepped(self, batch: _Batch, _ev=None) -> None:
        if batch.size:  # a step that only prefilled has no decode row
            self.sim._keep_record(
                TraceRecord(
                    "decode",
                    batch.rank,
                    "decode_step",
                    batch.step_start,
                    self.sim.env.now,
                    requests=batch.size,
                )
            )
        batch.steps += 1
        if self.on_tokens is not None:
            self.on_tokens([f[1] for f in batch.finishing], self.sim.env.now)
        batch.kv_tokens += batch.size * self.per_step  # every room's KV grew
        if batch.pieces:
            for p, take in batch.pieces:
                p[1] += take
            batch.prefilled += [p[0] for p in batch.prefilling if p[1] >= p[0][2]]
            batch.prefilling = [p for p in batch.prefilling if p[1] < p[0][2]]
            batch.pieces = []
        self._leave(batch)
        self._step(batch)

    def _leave(self, batch: _Batch) -> None:
        """The rooms whose last step this was leave the batch."""
        while batch.finishing and batch.finishing[0][0] <= batch.steps:
            _, room, added, ranks, joined = heapq.heappop(batch.finishing)
            batch.size -= 1
            batch.kv_tokens -= added  # the context it joined with plus its tokens
            for rt in ranks:
                self.sim._deliver(rt, GenerateDone(room, joined))

    # --- steps in one event (module docstring) ---------------------------------------
    def _plan(self, batch: _Batch, now: float) -> None:
        """Plan the steps up to the batch's next finish and schedule the last one's end."""
        size, step_time_s = batch.size, self.model.step_time_s
        inc = size * self.per_step
        kv, t, ends = batch.kv_tokens, now, []
        for _ in range(batch.finishing[0][0] - batch.steps):
            t += step_time_s(kv, size)  # added to the step's start as SimPy adds a delay
            ends.append(t)
            kv += inc
        batch.ends, batch.kept = ends, 0
        batch.plan += 1
        self._due_row(batch)
        self._schedule(batch, ends[-1])

    def _schedule(self, batch: _Batch, at: float) -> None:
        """The plan's event at `at` exactly (as `env.schedule` queues one; a Timeout would
        add a delay to now, rounding), superseding any earlier one of the batch."""
        batch.event += 1
        env = self.sim.env
        ev = simpy.Event(env)
        ev._ok, ev._value = True, None  # triggered, as a Timeout is
        ev.callbacks.append(partial(self._planned, batch, batch.event))
        heapq.heappush(env._queue, (at, NORMAL, next(env._eid), ev))

    def _cut(self, batch: _Batch, now: float) -> None:
        """A room waits to join: the plan ends at the first step boundary at or after now."""
        j = bisect_left(batch.ends, now) + 1
        if j < len(batch.ends):
            del batch.ends[j:]
            self._schedule(batch, batch.ends[-1])

    def _due_row(self, batch: _Batch) -> None:
        if batch.kept < len(batch.ends):
            end = batch.ends[batch.kept]
            heapq.heappush(self._rows, (end, next(self._order), batch, batch.plan, batch.kept))
            self.due = min(self.due, end)

    def _keep_row(self, batch: _Batch) -> None:
        """The batch's next planned step as its `decode_step` row."""
        i = batch.kept
        start = batch.step_start if i == 0 else batch.ends[i - 1]
        self.sim.records.append(
            TraceRecord(
                "decode", batch.rank, "decode_step", start, batch.ends[i], requests=batch.size
            )
        )
        batch.kept = i + 1
        self._due_row(batch)

    def flush(self, now: float) -> None:
        """Keep every planned row that ended before `now`, in time order (the driver calls
        this before keeping a record)."""
        rows = self._rows
        while rows and rows[0][0] < now:
            _, _, batch, plan, i = heapq.heappop(rows)
            if plan == batch.plan and i == batch.kept and i < len(batch.ends):
                self._keep_row(batch)
        self.due = rows[0][0] if rows else math.inf

    def _planned(self, batch: _Batch, event: int, _ev=None) -> None:
        """The plan's last step ended: its rows, then what the step-by-step loop does at
        that step's end (the finishing rooms leave, the waiting join)."""
        if event != batch.event:
            return  # a plan cut short: its new end has its own event
        self.flush(self.sim.env.now)  # rows of every batch that ended before now
        while batch.kept < len(batch.ends):  # this one's, to its last
            self._keep_row(batch)
        k = len(batch.ends)
        inc = batch.size * self.per_step
        for _ in range(k):
            batch.kv_tokens += inc  # as each step adds it (the same float sums)
        batch.steps += k
        batch.ends, batch.kept = [], 0
        batch.plan += 1  # its rows still queued are stale
        self._leave(batch)
        self._step(batch)
