"""The decode-side staging pool: a ring with rounds, overcommit and a watermark.

The decode hands out regions in assignment order; a region may be placed over
bytes that are still live from the previous round (overcommit), and the prefill
only writes it once the watermark says those bytes were scattered and freed
(`is_ready`). Live allocations form a queue ordered by (round, offset), so the
watermark is the queue's head; frees out of order are marked and popped lazily,
which keeps `free` O(1) amortised however many allocations are live.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple


class WatermarkPos(NamedTuple):
    """(round, tail): every byte before `tail` in `round`, and all earlier rounds, is free."""

    round: int
    tail: int


@dataclass(frozen=True, slots=True)
class Allocation:
    id: int
    offset: int
    round: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.offset


def is_ready(round: int, end: int, watermark: WatermarkPos) -> bool:
    """May a region (round, ending at `end`) be written, given a watermark view?

    Round 0 overwrites nothing. A region of round r overwrites bytes of round r-1,
    which are free once the watermark reached round r, or reached `end` in r-1.
    """
    if round == 0:
        return True
    if round - 1 < watermark.round:
        return True
    return round - 1 == watermark.round and end <= watermark.tail


class StagingRing:
    """Allocator of one decode rank's staging pool of `size_bytes` bytes."""

    def __init__(self, size_bytes: int) -> None:
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise ValueError(f"staging ring size must be a non-negative int, got {size_bytes!r}")
        self.size = size_bytes
        self._round = 0
        self._head = 0
        self._next_id = 0
        self._queue: deque[Allocation] = deque()  # live + freed-not-yet-popped, in order
        self._live: dict[int, Allocation] = {}
        self._used = 0

    # --- queries -----------------------------------------------------------------
    @property
    def watermark(self) -> WatermarkPos:
        if self._queue:
            oldest = self._queue[0]
            return WatermarkPos(oldest.round, oldest.offset)
        return WatermarkPos(self._round, self._head)

    @property
    def used_bytes(self) -> int:
        """Bytes held by live allocations (occupancy, not the span they cover)."""
        return self._used

    @property
    def live_count(self) -> int:
        return len(self._live)

    @property
    def empty(self) -> bool:
        return not self._live

    @property
    def head(self) -> WatermarkPos:
        return WatermarkPos(self._round, self._head)

    def get(self, alloc_id: int) -> Allocation | None:
        return self._live.get(alloc_id)

    def live(self) -> list[Allocation]:
        return [a for a in self._queue if a.id in self._live]

    # --- mutations -----------------------------------------------------------------
    def assign(self, nbytes: int) -> Allocation | None:
        """Place `nbytes`; None means OVERSIZED (it can never fit)."""
        if nbytes < 0:
            raise ValueError(f"cannot assign a negative size ({nbytes})")
        if nbytes > self.size:
            return None
        if self._head + nbytes > self.size:
            self._round += 1
            self._head = 0
        alloc = Allocation(self._next_id, self._head, self._round, self._head + nbytes)
        self._next_id += 1
        self._head = alloc.end
        self._queue.append(alloc)
        self._live[alloc.id] = alloc
        self._used += nbytes
        return alloc

    def free(self, alloc_id: int) -> bool:
        """Release an allocation; unknown or double frees are no-ops (returns False)."""
        alloc = self._live.pop(alloc_id, None)
        if alloc is None:
            return False
        self._used -= alloc.nbytes
        queue, live = self._queue, self._live
        while queue and queue[0].id not in live:
            queue.popleft()
        if not live and self._head > 0:
            # The ring just became empty: restart at 0 in a new round, so the
            # watermark sent after this free, (round + 1, 0), already makes any next
            # region writable. Staying in the old round, a region larger than the
            # old head would wait for a watermark that never comes (pool 100:
            # assign 60, free, assign 70).
            self._round += 1
            self._head = 0
            queue.clear()
        return True
