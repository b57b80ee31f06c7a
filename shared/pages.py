"""Paged KV memory of one rank: which pages a room holds, and how many a rank has.

The rank runtime owns this (shared/runtime.py): it admits a room when its pages fit
and releases them when the machine says nothing can touch them any more, in both
modes. Hardware mode backs the pages with a real tensor (hw/rank/kvpool.py); the
simulation runs with `capacity=None` (no limit) until it models KV capacity.
"""

from __future__ import annotations

import bisect

from kvstage.shared.layout import Geometry, LayoutError, room_pages
from kvstage.shared.request import Request


class PoolFullError(RuntimeError):
    """No contiguous run of free pages is long enough."""


class PageAllocator:
    """First-fit allocator of contiguous page runs, with neighbouring free runs merged."""

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_pages = num_pages
        self._free: list[tuple[int, int]] = [(0, num_pages)]  # (start, length), sorted
        self._live: dict[int, int] = {}  # start -> length

    def alloc(self, num_pages: int) -> int:
        """First page of a contiguous run of `num_pages` free pages (first fit)."""
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        for i, (start, length) in enumerate(self._free):
            if length >= num_pages:
                if length == num_pages:
                    del self._free[i]
                else:
                    self._free[i] = (start + num_pages, length - num_pages)
                self._live[start] = num_pages
                return start
        largest = max((length for _, length in self._free), default=0)
        raise PoolFullError(
            f"KV pool full: need {num_pages} contiguous pages, largest free run is {largest} "
            f"({self.free_pages} of {self.num_pages} pages free)"
        )

    def free(self, first_page: int, num_pages: int) -> None:
        """Return an allocation; it must match an `alloc` exactly (a mismatch is a caller bug)."""
        if self._live.get(first_page) != num_pages:
            raise ValueError(
                f"free({first_page}, {num_pages}) does not match a live allocation "
                f"(live: {sorted(self._live.items())[:8]})"
            )
        del self._live[first_page]
        i = bisect.bisect_left(self._free, (first_page, 0))
        self._free.insert(i, (first_page, num_pages))
        # Merge with the right and then the left neighbour so runs stay maximal.
        if i + 1 < len(self._free) and first_page + num_pages == self._free[i + 1][0]:
            self._free[i] = (first_page, num_pages + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == first_page:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    @property
    def free_pages(self) -> int:
        return sum(length for _, length in self._free)

    @property
    def live(self) -> int:
        """Allocations not yet freed."""
        return len(self._live)


def prefill_room_pages(req: Request, page_size: int) -> int:
    """Pages a prefill rank holds for a room: the whole prompt (it computes the prefix too)."""
    return -(-req.prompt_tokens // page_size)


def decode_room_pages(req: Request, page_size: int) -> int:
    """Pages a decode rank holds for a room: what is transferred (0 if the prefix is bad;
    the machine then fails the room with the reason)."""
    try:
        return room_pages(req.prompt_tokens, req.prefix_tokens, page_size)
    except LayoutError:
        return 0


def kv_pool_pages(geometry: Geometry, role: str, requests: list[Request], budget_bytes: int) -> int:
    """How many pages a rank's KV pool gets in hardware mode: room for every request at
    once when that fits the budget, else as many as the budget holds (never fewer than
    the largest room, so every room can run alone)."""
    g = geometry
    if role == "prefill":
        pages = [prefill_room_pages(r, g.page_size) for r in requests]
        heads = g.prefill_heads
    else:
        pages = [decode_room_pages(r, g.page_size) for r in requests]
        heads = g.decode_heads
    page_bytes = g.block_bytes(g.page_size, heads)  # K and V (one latent plane with MLA)
    biggest = max(pages, default=1)
    return max(1, biggest, min(sum(pages), budget_bytes // max(1, page_bytes)))
