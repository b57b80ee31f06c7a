"""The state of a decode rank's rooms: per room, its writers, chunks and regions.

`DECODE_TRANSITIONS` is a chunk's diagram as code (see shared/decode.py, which owns
the machine that drives these records); any other move raises `LocalProtocolError`.
A failed room's regions wait in `Quarantine` until its writers confirmed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvstage.shared.layout import Chunk
from kvstage.shared.machine import LocalProtocolError
from kvstage.shared.protocol import ChunkReady, StagingReq, WriterDone
from kvstage.shared.ring import Allocation

# REQs kept per room before it opens: enough for every writer and chunk of any real
# room, bounded so that a peer's garbage cannot grow memory without limit.
MAX_EARLY_REQS = 1 << 14


class DecodeChunk(Enum):
    COLLECTING = "collecting"
    SCATTERING = "scattering"
    COMPLETE = "complete"


DECODE_TRANSITIONS: dict[DecodeChunk, frozenset[DecodeChunk]] = {
    DecodeChunk.COLLECTING: frozenset({DecodeChunk.SCATTERING, DecodeChunk.COMPLETE}),
    DecodeChunk.SCATTERING: frozenset({DecodeChunk.COMPLETE}),
    DecodeChunk.COMPLETE: frozenset(),
}


@dataclass(slots=True)
class DecodeRoom:
    room: int
    created: float
    writers: list[int]  # the (global) prefill ranks writing this room here: its sessions
    chunks: list[Chunk] | None = None  # known once opened
    dst_page_base: int = 0
    allocs: dict[int, Allocation | None] = field(default_factory=dict)  # None = OVERSIZED
    deadline: float = 0.0
    retries: int = 0
    early: list[StagingReq | ChunkReady | WriterDone] = field(
        default_factory=list
    )  # before the open
    asked: dict[int, set[int]] = field(default_factory=dict)  # chunk -> writers that sent REQ
    arrived: dict[int, set[int]] = field(default_factory=dict)  # chunk -> writers
    first_arrival: dict[int, float] = field(default_factory=dict)
    state: dict[int, DecodeChunk] = field(default_factory=dict)  # absent: COLLECTING
    complete: int = 0  # chunks COMPLETE
    writers_done: dict[int, int] = field(default_factory=dict)  # writer -> num_chunks claimed
    # chunk -> writer -> (prefill rank, write tag, nonce) of the block, from its first
    # CHUNK_READY
    checksums: dict[int, dict[int, tuple[int, int, int]]] = field(default_factory=dict)


def move_chunk(room: DecodeRoom, chunk: int, new: DecodeChunk) -> None:
    old = room.state.get(chunk, DecodeChunk.COLLECTING)
    if new not in DECODE_TRANSITIONS[old]:
        raise LocalProtocolError(
            f"room {room.room} chunk {chunk}: {old.value} -> {new.value} is not a legal move"
        )
    room.state[chunk] = new
    if new is DecodeChunk.COMPLETE:
        room.complete += 1


def chunk_state(room: DecodeRoom, chunk: int) -> DecodeChunk:
    return room.state.get(chunk, DecodeChunk.COLLECTING)


@dataclass(slots=True)
class InFlightScatter:
    alloc_id: int
    start: float


@dataclass(slots=True)
class Quarantine:
    """A failed room whose memory stays out of reuse until its writers confirmed."""

    held: list[tuple[int, int]]  # (chunk, allocation id) of staging regions not yet freed
    waiting: set[int]  # prefill ranks that have not confirmed the abort
    until: float  # the grace: released then even without every confirmation
    # a lost writer's room that holds staging regions: its regions may hold the ring's
    # watermark back for the whole grace, so the other rooms' clocks stop meanwhile
    fenced: bool = False
