"""The state of a prefill rank's rooms: per room, per decode rank it writes to (a
*target*), per chunk. `CHUNK_TRANSITIONS` is the chunk's diagram as code (see
shared/prefill.py); any other move raises `LocalProtocolError`.
"""

from __future__ import annotations

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
