"""What the prefill and decode state machines have in common.

Both keep rooms with deadlines, remember finished rooms so late messages are
ignored safely, and emit trace records stamped with the driver's `now`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from enum import StrEnum

from kvstage.shared.events import Action, Peer, Record
from kvstage.shared.layout import Geometry
from kvstage.shared.trace import TraceRecord


class LocalProtocolError(RuntimeError):
    """The driver misused a machine or runtime: an impossible local event, such as a
    completion of work never handed out. Raised at once (a peer's bad message never
    raises: it is dropped, counted and traced)."""


class TransferPath(StrEnum):
    """How a chunk's KV reaches the decode: one bulk write per writer block into the
    staging ring (then a scatter), or the baseline of one small write per head slice."""

    STAGING = "staging"
    SLICE = "slice"


PATHS = tuple(p.value for p in TransferPath)
# trace rows of dropped messages per peer; past this only the count grows
MAX_DROPS_TRACED = 1000


@dataclass(frozen=True, slots=True)
class ProtocolConfig:
    """Protocol knobs shared by every rank of a run."""

    path: TransferPath = TransferPath.STAGING
    room_timeout_s: float = 60.0
    # After a room fails, its staging regions stay out of reuse until every writer
    # confirmed (by its own ABORT, sent once its in-flight writes finished) or this
    # long: a write still in flight must never land on a region handed out again.
    abort_grace_s: float = 5.0
    # A prefill re-sends, every retry_s, STAGING_REQ for chunks with no answer or stuck
    # behind the watermark (a lost RSP or WATERMARK: the decode replays its answer and
    # its current watermark) and CHUNK_READY / WRITER_DONE not yet acknowledged, until
    # the room ends. The wait doubles while the decode stays silent, up to a cap, and
    # resets when it answers. None: 1 s, or an eighth of a short room timeout, so that
    # a room survives a few lost messages within its timeout.
    retry_s: float | None = None
    max_backoff_doublings: int = 4  # the wait between re-sends grows to at most 16 x retry_s
    # Rooms remembered as finished, so that late or duplicate messages about them
    # are dropped instead of resurrecting state. Oldest forgotten first.
    finished_memory: int = 1 << 16
    # Hardware, transfer.verify_writes: a slice-path (or OVERSIZED) chunk is checked in
    # the KV pages against its writers' tags (CheckSlice) before it counts as complete.
    # The simulator moves no bytes, so it checks nothing: False there.
    check_slice_writes: bool = False

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(
                f"transfer path {self.path!r} not allowed (allowed: {', '.join(PATHS)})"
            )
        object.__setattr__(self, "path", TransferPath(self.path))
        if self.retry_s is None:
            object.__setattr__(self, "retry_s", min(1.0, self.room_timeout_s / 8))
        if not self.room_timeout_s > 0:
            raise ValueError(f"room_timeout_s must be > 0, got {self.room_timeout_s}")


class MachineBase:
    """Room bookkeeping shared by `PrefillMachine` and `DecodeMachine`."""

    role = ""
    peer_role = ""  # the other side: where this machine's messages go

    def __init__(self, rank: int, geometry: Geometry, config: ProtocolConfig) -> None:
        self.rank = rank
        self.geometry = geometry
        self.config = config
        self._deadlines: list[tuple[float, int]] = []  # (deadline, room), lazy deletion
        self._finished: dict[int, bool] = {}  # room -> True if done, False if failed
        self.dead_peers: dict[tuple[str, int], str] = {}  # (role, rank) -> why
        self.rooms_done = 0
        self.rooms_failed = 0
        self.dropped = 0
        self._drops_traced: dict[int, int] = {}  # peer rank (-1: unknown) -> dropped rows traced
        self._peers: dict[int, Peer] = {}

    def _peer(self, rank: int) -> Peer:
        """The destination `rank` on the other side (immutable, so built once per rank)."""
        peer = self._peers.get(rank)
        if peer is None:
            peer = self._peers[rank] = Peer(self.peer_role, rank)
        return peer

    # --- trace ------------------------------------------------------------------
    def _record(self, out: list[Action], phase: str, start: float, end: float, **kw) -> None:
        out.append(Record(TraceRecord(self.role, self.rank, phase, start, end, **kw)))

    def _drop(
        self,
        out: list[Action],
        now: float,
        why: str,
        room: int = -1,
        chunk: int = -1,
        peer: int = -1,
    ) -> None:
        """A message that cannot apply: count it, trace it (up to a limit per peer, so
        a flood of garbage cannot grow the trace without bound), change nothing."""
        self.dropped += 1
        traced = self._drops_traced.get(peer, 0)
        if traced > MAX_DROPS_TRACED:
            return
        self._drops_traced[peer] = traced + 1
        if traced == MAX_DROPS_TRACED:
            why = f"{MAX_DROPS_TRACED} messages dropped from this peer: further drops are counted, not traced"
        self._record(out, "dropped", now, now, room=room, chunk=chunk, peer=peer, detail=why)

    # --- room lifetime ----------------------------------------------------------
    def _arm_deadline(self, room: int, now: float, after: float | None = None) -> float:
        deadline = now + (self.config.room_timeout_s if after is None else after)
        heapq.heappush(self._deadlines, (deadline, room))
        return deadline

    def _finish(self, room: int, ok: bool) -> None:
        self._finished[room] = ok
        if ok:
            self.rooms_done += 1
        else:
            self.rooms_failed += 1
        if len(self._finished) > self.config.finished_memory:
            self._finished.pop(next(iter(self._finished)))

    def is_finished(self, room: int) -> bool:
        return room in self._finished

    def _expired(self, now: float) -> list[int]:
        """Rooms whose deadline passed (the caller checks they are still live)."""
        rooms = []
        while self._deadlines and self._deadlines[0][0] <= now:
            rooms.append(heapq.heappop(self._deadlines)[1])
        return rooms

    def _deadline_due(self, now: float) -> bool:
        """A deadline passed: cheap enough to ask after every event."""
        return bool(self._deadlines) and self._deadlines[0][0] <= now

    @property
    def next_deadline(self) -> float | None:
        """When the driver should Tick next for timeouts to fire on time."""
        return self._deadlines[0][0] if self._deadlines else None
