"""Rank mapping, head slices, chunk grid and staging layout (shared/layout.py)."""

from __future__ import annotations

import itertools

import pytest

from kvstage.shared.layout import (
    Geometry,
    LayoutError,
    chunk_grid,
    head_slice,
    room_pages,
    staging_address,
    targets_of,
    writers_of,
)


def test_worked_example_fan_in_p8_d2():
    assert writers_of(1, 8, 2).index(5) == 1
    assert head_slice(8, 2, 5, 1, 8).dst_head_start == 1


def test_worked_example_fan_out_p2_d8():
    assert writers_of(6, 2, 8) == [1]
    hs = head_slice(2, 8, 1, 6, 8)
    assert (hs.src_head_start, hs.num_heads) == (2, 1)


def test_worked_example_replication_p16_d4():
    assert writers_of(0, 16, 4) == [0, 1, 2, 3]
    assert head_slice(16, 4, 0, 0, 8).dst_head_start == 0
    assert head_slice(16, 4, 1, 0, 8).dst_head_start == 0
    assert head_slice(16, 4, 2, 0, 8).dst_head_start == 1
    assert head_slice(16, 4, 3, 0, 8).dst_head_start == 1


def test_worked_example_gqa_h4_p2_d8():
    for d in (0, 1):
        assert writers_of(d, 2, 8) == [0]
        hs = head_slice(2, 8, 0, d, 4)
        assert (hs.src_head_start, hs.num_heads) == (0, 1)


def _owned(tp: int, rank: int, heads: int) -> set[int]:
    """Independent ownership: split heads evenly, or replicate each over tp/heads ranks."""
    if tp <= heads:
        per = heads // tp
        return set(range(rank * per, rank * per + per))
    return {rank * heads // tp}


VALUES = (1, 2, 4, 8, 16)


@pytest.mark.parametrize("P,D,H", list(itertools.product(VALUES, VALUES, VALUES)))
def test_every_decode_rank_gets_exactly_its_heads(P, D, H):
    g = Geometry(P, D, H, layers=2, head_dim=4, dtype_bytes=2, page_size=4)
    for d in range(D):
        want = _owned(D, d, H)
        got: set[int] = set()
        dst_cover: dict[int, set[int]] = {}
        for p in writers_of(d, P, D):
            assert d in targets_of(p, P, D)
            hs = head_slice(P, D, p, d, H)
            src_local = sorted(_owned(P, p, H))
            assert 0 <= hs.src_head_start and hs.src_head_start + hs.num_heads <= len(src_local)
            assert 0 <= hs.dst_head_start and hs.dst_head_start + hs.num_heads <= g.decode_heads
            dst_local = sorted(want)
            for i in range(hs.num_heads):
                global_head = src_local[hs.src_head_start + i]
                # the head lands where the decode rank keeps that same global head
                assert dst_local[hs.dst_head_start + i] == global_head
                got.add(global_head)
                dst_cover.setdefault(hs.dst_head_start + i, set()).add(global_head)
        assert got == want, (P, D, H, d)
        # writers' blocks never overlap in the staging region
        layout = g.staging_layout(d, 3)
        spans = sorted((b.offset, b.offset + b.nbytes) for b in layout.blocks)
        for (_a0, a1), (b0, _b1) in zip(spans, spans[1:], strict=False):
            assert a1 <= b0
        assert spans[-1][1] == layout.region_bytes


@pytest.mark.parametrize(
    "P,D,H", [(3, 2, 8), (8, 6, 8), (4, 2, 6), (2, 4, 6), (0, 2, 8), (2, 2, 0)]
)
def test_bad_tp_rejected_with_reason(P, D, H):
    with pytest.raises(LayoutError) as exc:
        Geometry(P, D, H, layers=1, head_dim=1, dtype_bytes=2, page_size=1)
    assert "must" in str(exc.value)


def test_chunk_grid():
    chunks = chunk_grid(num_pages=1100, page_size=16, chunked_prefill_size=8192)
    assert [(c.index, c.page_start, c.num_pages) for c in chunks] == [
        (0, 0, 512),
        (1, 512, 512),
        (2, 1024, 76),
    ]
    assert chunk_grid(0, 16) == []
    # grid of at least one page even when chunked_prefill_size < page_size
    assert [c.num_pages for c in chunk_grid(3, 64, 16)] == [1, 1, 1]


def test_prefix_not_page_aligned_is_refused():
    assert room_pages(100, 32, 16) == 5
    with pytest.raises(LayoutError, match="not a multiple of page_size"):
        room_pages(100, 30, 16)


def test_staging_address_formula():
    g = Geometry(4, 2, 8, layers=3, head_dim=8, dtype_bytes=2, page_size=4)
    layout = g.staging_layout(1, 2)
    T, heads = 8, 2
    assert staging_address(g, layout, 1, 1, 2, 5, 1) == (
        layout.blocks[1].offset + (1 * 3 + 2) * T * heads * 8 * 2 + (5 * heads + 1) * 8 * 2
    )


def test_bytes_and_pool_capacity_llama70b_p8_d2():
    g = Geometry(8, 2, 8, layers=80, head_dim=128, dtype_bytes=2, page_size=16)
    assert g.kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2
    assert g.chunk_bytes() == 8192 * 2 * 80 * 4 * 128 * 2
    assert g.pool_chunks(4096 << 20) == 3


def test_slice_requests_counted_by_hand():
    # P4->D2, H=8: writer rows (2 heads) are part of a decode row (4 heads): per token
    g = Geometry(4, 2, 8, layers=3, head_dim=8, dtype_bytes=2, page_size=4)
    assert g.slice_requests(0, 0, num_pages=5) == 2 * 3 * 5 * 4
    # equal TP: whole rows on both sides, one request per page, layer, K/V
    g = Geometry(4, 4, 8, layers=3, head_dim=8, dtype_bytes=2, page_size=4)
    assert g.slice_requests(1, 1, num_pages=5) == 2 * 3 * 5
