"""The state of a prefill rank's rooms: per room, per decode rank it writes to (a
*target*), per chunk. `CHUNK_TRANSITIONS` is the chunk's diagram as code (see
shared/prefill.py); any other move raises `LocalProtocolError`.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from dataclasses import dataclass, field
from enum import Enum

from kvstage.shared.layout import Chunk, HeadSlice
from kvstage.shared.machine import LocalProtocolError
from kvstage.shared.protocol import StagingRsp


class ChunkState(Enum):
    """Where one chunk stands toward one decode rank (a target)."""

    WAITING = "waiting"
    WM_WAIT = "wm_wait"
    GATHERING = "gathering"
    WRITING = "writing"
    SLICE_WRITING = "slice_writing"
    WRITTEN = "written"
    FAILED = "failed"


CHUNK_TRANSITIONS: dict[ChunkState, frozenset[ChunkState]] = {
    ChunkState.WAITING: frozenset(
        {ChunkState.WM_WAIT, ChunkState.GATHERING, ChunkState.SLICE_WRITING}
    ),
    ChunkState.WM_WAIT: frozenset({ChunkState.GATHERING}),
    ChunkState.GATHERING: frozenset({ChunkState.WRITING}),
    ChunkState.WRITING: frozenset({ChunkState.WRITTEN, ChunkState.FAILED}),
    ChunkState.SLICE_WRITING: frozenset({ChunkState.WRITTEN, ChunkState.FAILED}),
    ChunkState.WRITTEN: frozenset(),
    ChunkState.FAILED: frozenset(),
}
# a gather or write of the chunk is under way: its memory is in use
IN_FLIGHT = frozenset({ChunkState.GATHERING, ChunkState.WRITING, ChunkState.SLICE_WRITING})


@dataclass(slots=True)
class Target:
    decode_rank: int
    writer: int
    heads: HeadSlice
    rsp: dict[int, StagingRsp] = field(default_factory=dict)
    dst_page_base: int | None = None
    state: dict[int, ChunkState] = field(default_factory=dict)  # absent: WAITING
    since: dict[int, float] = field(default_factory=dict)  # chunk -> when its current state began
    written: int = 0  # chunks WRITTEN
    done: bool = False  # WRITER_DONE sent
    done_sent: float = 0.0
    done_acked: bool = False
    unacked: dict[int, float] = field(default_factory=dict)  # chunk -> CHUNK_READY last sent
    checksums: dict[int, int] = field(default_factory=dict)  # chunk -> its written block's
    nonce: int = 0  # the room nonce of the decode's BOOTSTRAP (or ABORT); 0: none yet

    @property
    def delivered(self) -> bool:
        """The decode confirmed every CHUNK_READY and the WRITER_DONE of this target."""
        return self.done_acked and not self.unacked

    def get(self, chunk: int) -> ChunkState:
        return self.state.get(chunk, ChunkState.WAITING)

    def move(self, chunk: int, new: ChunkState, now: float) -> None:
        """Move `chunk` to `new`; a move the diagram does not have is a local bug."""
        old = self.state.get(chunk, ChunkState.WAITING)
        if new not in CHUNK_TRANSITIONS[old]:
            raise LocalProtocolError(
                f"chunk {chunk} to decode rank {self.decode_rank}: {old.value} -> {new.value} is not a legal move"
            )
        self.state[chunk] = new
        self.since[chunk] = now
        if new is ChunkState.WRITTEN:
            self.written += 1

    def chunks_in(self, *states: ChunkState) -> list[int]:
        return sorted(c for c, st in self.state.items() if st in states)


@dataclass(slots=True)
class Draining:
    """A failed room whose gathers/writes are still in flight: its decode ranks are told
    (ABORT) and its pages released only once they all reported back, or the grace passed."""

    pending: set[tuple[int, int]]  # (decode rank, chunk) still in flight
    targets: list[int]
    reason: str
    until: float  # the grace: given up then, writes unconfirmed
    nonces: dict[int, int] = field(default_factory=dict)  # decode rank -> room nonce


@dataclass(slots=True)
class PrefillRoom:
    room: int
    prefix_pages: int
    chunks: list[Chunk]
    targets: dict[int, Target]
    computed: set[int] = field(default_factory=set)
    deadline: float = 0.0
    retries: int = 0  # consecutive re-requests that brought nothing new
    last_retry: float = -1.0


class LiveGrants:
    """The regions one decode rank granted this writer that it cannot have freed yet:
    answered (STAGING_RSP) and not yet said written (CHUNK_READY), in a room still live
    here. A decode frees a region only after its scatter, and scatters only after every
    writer's CHUNK_READY, so each of these is still live in its ring. Two rules follow:

    - no two of them overlap in one round (a ring places a round's regions one after
      another; a later round may overlap an earlier one's, which the watermark orders);
    - the decode's watermark cannot have passed the oldest of them (`oldest`).
    """

    __slots__ = ("_by_key", "_rounds", "_heap")

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, int], tuple[int, int, int]] = {}  # (room, chunk) -> region
        self._rounds: dict[int, list[tuple[int, int]]] = {}  # round -> sorted (offset, end)
        self._heap: list[tuple[int, int, int, int]] = []  # (round, offset, room, chunk), lazy

    def overlapping(self, round: int, offset: int, end: int) -> tuple[int, int] | None:
        """A live region of `round` that [offset, end) overlaps, or None."""
        spans = self._rounds.get(round)
        if not spans:
            return None
        i = bisect_left(spans, (offset, end))
        for j in (i - 1, i):
            if 0 <= j < len(spans) and spans[j][0] < end and offset < spans[j][1]:
                return spans[j]
        return None

    def add(self, room: int, chunk: int, round: int, offset: int, end: int) -> None:
        self._by_key[(room, chunk)] = (round, offset, end)
        spans = self._rounds.setdefault(round, [])
        spans.insert(bisect_left(spans, (offset, end)), (offset, end))
        heapq.heappush(self._heap, (round, offset, room, chunk))

    def discard(self, room: int, chunk: int) -> None:
        region = self._by_key.pop((room, chunk), None)
        if region is None:
            return
        round, offset, end = region
        spans = self._rounds[round]
        del spans[bisect_left(spans, (offset, end))]
        if not spans:
            del self._rounds[round]

    def oldest(self) -> tuple[int, int] | None:
        """(round, offset) of the oldest live region: no true watermark is past it."""
        heap, live = self._heap, self._by_key
        while heap:
            round, offset, room, chunk = heap[0]
            region = live.get((room, chunk))
            if region is not None and region[:2] == (round, offset):
                return round, offset
            heapq.heappop(heap)
        return None
