"""A zero-latency, randomly ordered world for the shared state machines (tests only).

Every message, local completion and duplicate sits in one bag; each step picks a
random item, so any interleaving the real drivers could produce is reachable from
a seed. A shadow of each decode ring checks safety while it runs.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import (
    ChunkComputed,
    Gather,
    GatherDone,
    OpenRoom,
    Record,
    RoomDone,
    RoomFailed,
    Scatter,
    ScatterDone,
    Send,
    SliceWrite,
    Tick,
    Write,
    WriteDone,
)
from kvstage.shared.layout import Geometry
from kvstage.shared.machine import ProtocolConfig
from kvstage.shared.prefill import PrefillMachine


@dataclass
class World:
    geometry: Geometry
    pool_bytes: int
    seed: int = 0
    dup_p: float = 0.0
    config: ProtocolConfig = field(default_factory=ProtocolConfig)

    def __post_init__(self) -> None:
        g = self.geometry
        self.rng = random.Random(self.seed)
        self.prefill = [PrefillMachine(r, g, self.config) for r in range(g.prefill_tp)]
        self.decode = [
            DecodeMachine(d, g, self.pool_bytes, self.config) for d in range(g.decode_tp)
        ]
        self.bag: list[tuple[str, int, object]] = []  # (role, rank, event)
        self.now = 0.0
        self.records = []
        self.done: dict[tuple[str, int], set[int]] = {}
        self.failed: dict[tuple[str, int], dict[int, str]] = {}
        # shadow of live staging data per decode rank: (room, chunk) -> list of ranges
        self.live_data: list[dict[tuple[int, int], list[tuple[int, int]]]] = [
            {} for _ in range(g.decode_tp)
        ]
        self.region_of: list[dict[tuple[int, int], tuple[int, int]]] = [
            {} for _ in range(g.decode_tp)
        ]
        self.scattered: list[dict[tuple[int, int], int]] = [{} for _ in range(g.decode_tp)]
        # per decode rank: (room, chunk) -> the writers whose block of it was written
        self.wrote: list[dict[tuple[int, int], set[int]]] = [{} for _ in range(g.decode_tp)]
        self.violations: list[str] = []

    def open_room(self, room: int, prompt_tokens: int, prefix_tokens: int = 0) -> None:
        for d in range(self.geometry.decode_tp):
            self.bag.append(
                (
                    "decode",
                    d,
                    OpenRoom(room, prompt_tokens, prefix_tokens, dst_page_base=room * 1000),
                )
            )
        for p in range(self.geometry.prefill_tp):
            self.bag.append(("prefill", p, OpenRoom(room, prompt_tokens, prefix_tokens)))

    def machine(self, role: str, rank: int):
        return self.prefill[rank] if role == "prefill" else self.decode[rank]

    def deliver(self, role: str, rank: int, event) -> None:
        self.now += 1e-3
        if role == "prefill" and isinstance(event, OpenRoom):
            # the forward starts once the request is known; chunks finish in any order here
            pages = -(-(event.prompt_tokens - event.prefix_tokens) // self.geometry.page_size)
            for c in self.geometry.chunks(max(0, pages)):
                self.bag.append(("prefill", rank, ChunkComputed(event.room, c.index)))
        for action in self.machine(role, rank).handle(event, self.now):
            self._carry(role, rank, action)

    def _carry(self, role: str, rank: int, a) -> None:
        if isinstance(a, Send):
            self.bag.append((a.dest.role, a.dest.rank, a.msg))
            if self.dup_p and self.rng.random() < self.dup_p:
                self.bag.append((a.dest.role, a.dest.rank, a.msg))
        elif isinstance(a, Gather):
            self.bag.append((role, rank, GatherDone(a.room, a.chunk, a.decode_rank)))
        elif isinstance(a, Write):
            self._check_write(a)
            self.bag.append((role, rank, WriteDone(a.room, a.chunk, a.decode_rank)))
        elif isinstance(a, SliceWrite):
            self.bag.append((role, rank, WriteDone(a.room, a.chunk, a.decode_rank)))
        elif isinstance(a, Scatter):
            key = (a.room, a.chunk)
            self.scattered[rank][key] = self.scattered[rank].get(key, 0) + 1
            if self.scattered[rank][key] > 1:
                self.violations.append(f"double scatter {key} on decode {rank}")
            missing = set(range(len(self.geometry.writers(rank)))) - self.wrote[rank].get(
                key, set()
            )
            if missing:
                self.violations.append(
                    f"scatter {key} on decode {rank} before writers {missing} wrote"
                )
            self.bag.append((role, rank, ScatterDone(a.room, a.chunk)))
        elif isinstance(a, Record):
            self.records.append(a.record)
            r = a.record
            if r.role == "decode" and r.phase == "scatter":
                self.live_data[r.rank].pop((r.room, r.chunk), None)
            if r.role == "decode" and r.phase == "free":
                # a freed region of a failed room: its bytes no longer matter
                self.live_data[r.rank].pop((r.room, r.chunk), None)
        elif isinstance(a, RoomDone):
            self.done.setdefault((role, rank), set()).add(a.room)
        elif isinstance(a, RoomFailed):
            self.failed.setdefault((role, rank), {})[a.room] = a.reason

    def _check_write(self, a: Write) -> None:
        self.wrote[a.decode_rank].setdefault((a.room, a.chunk), set()).add(a.writer)
        lo, hi = a.dst_offset, a.dst_offset + a.nbytes
        if hi > self.pool_bytes:
            self.violations.append(f"write {a} beyond the pool")
        for key, ranges in self.live_data[a.decode_rank].items():
            if key == (a.room, a.chunk):
                continue
            for x, y in ranges:
                if x < hi and lo < y:
                    self.violations.append(
                        f"write of room {a.room} chunk {a.chunk} [{lo},{hi}) onto live data of {key} [{x},{y})"
                    )
        self.live_data[a.decode_rank].setdefault((a.room, a.chunk), []).append((lo, hi))

    def run(self, max_steps: int = 10**6, drop=None, until_quiet: bool = False) -> None:
        """Deliver in random order. `drop(role, rank, event)` loses a message; with
        `until_quiet`, time then jumps to the next machine deadline (retries,
        timeouts) until no machine has anything left to do."""
        steps = 0
        while True:
            while self.bag:
                steps += 1
                assert steps < max_steps, "no progress: livelock"
                i = self.rng.randrange(len(self.bag))
                self.bag[i], self.bag[-1] = self.bag[-1], self.bag[i]
                role, rank, event = self.bag.pop()
                if drop is not None and drop(role, rank, event):
                    continue
                self.deliver(role, rank, event)
            if not until_quiet:
                return
            pending = [d for m in self.prefill + self.decode if (d := m.next_deadline) is not None]
            live = (
                any(m.live_rooms for m in self.prefill + self.decode)
                or any(m._quarantine for m in self.decode)
                or any(m._draining for m in self.prefill)
            )
            if not pending or not live:
                return
            self.tick_all(max(self.now, min(pending)) + 1e-9)

    def tick_all(self, now: float) -> None:
        self.now = now
        for m in self.prefill + self.decode:
            for action in m.handle(Tick(), now):
                self._carry(m.role, m.rank, action)


def echo(m: DecodeMachine, msg):
    """A writer's CHUNK_READY, WRITER_DONE or ABORT to decode machine `m`, carrying the
    nonce `m` handed that writer (shared/capability.py), as an honest writer sends it."""
    chunk = getattr(msg, "chunk", -1)
    return dataclasses.replace(msg, nonce=m.nonce_for(type(msg), msg.room, chunk, msg.prefill_rank))
