"""The rank runtime's KV page allocator and pool sizing (shared/pages.py)."""

from __future__ import annotations

import pytest

from kvstage.shared.layout import Geometry
from kvstage.shared.pages import PageAllocator, PoolFullError, kv_pool_pages
from kvstage.shared.workload import Request


def test_allocator_first_fit_merge_and_full() -> None:
    pages = PageAllocator(10)
    a, b, c = pages.alloc(3), pages.alloc(3), pages.alloc(4)
    assert (a, b, c) == (0, 3, 6)
    with pytest.raises(PoolFullError, match="need 1 contiguous pages"):
        pages.alloc(1)
    pages.free(b, 3)
    assert pages.alloc(2) == 3  # first fit, inside the freed run
    pages.free(a, 3)
    with pytest.raises(PoolFullError, match="largest free run is 3"):
        pages.alloc(4)
    pages.free(3, 2)  # merges with [0,3) and [5,6) into [0,6)
    assert pages.alloc(6) == 0
    with pytest.raises(ValueError, match="does not match a live allocation"):
        pages.free(6, 3)
    pages.free(0, 6)
    pages.free(c, 4)
    assert pages.free_pages == 10 and pages.alloc(10) == 0 and pages.live == 1
    with pytest.raises(ValueError):
        pages.alloc(0)


def test_pool_sizing_fits_everything_when_small_and_never_less_than_one_room() -> None:
    g = Geometry(2, 1, 8, 2, 16, 2, 16)  # P2 -> D1, 8 heads, 2 layers, head_dim 16, bf16, page 16
    reqs = [Request(i, 0.0, 160, 16) for i in range(4)]
    # prefill holds the whole prompt (10 pages), decode what is transferred (9 pages)
    assert kv_pool_pages(g, "prefill", reqs, 1 << 30) == 40
    assert kv_pool_pages(g, "decode", reqs, 1 << 30) == 36
    # a budget of one byte still holds the largest room
    assert kv_pool_pages(g, "prefill", reqs, 1) == 10
    # a budget in between: as many pages as it holds
    page_bytes = 2 * 2 * 16 * g.decode_heads * 16 * 2
    assert kv_pool_pages(g, "decode", reqs, 20 * page_bytes) == 20
