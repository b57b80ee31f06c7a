"""Rank mapping, head slices, chunk grid and staging layout (shared/layout.py)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from kvstage.shared.layout import (
    Geometry,
    LayoutError,
    chunk_grid,
    head_slice,
    room_pages,
    stage_layer_ranges,
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


# --------------------------------------------------------------------------- pipeline stages

PIPELINES = [(p, d, pp) for p, d in ((1, 1), (2, 4), (4, 2), (8, 2), (2, 8), (16, 4))
             for pp in (1, 2, 3, 4)]  # fmt: skip


def _pp(p: int, d: int, pp: int, attention: str = "mha") -> Geometry:
    heads = 1 if attention == "mla" else 8
    return Geometry(p, d, heads, 10, 2, 1, 4, 16, attention, prefill_pp=pp)


def test_stage_layer_ranges_cover_every_layer_once_as_sglang_splits():
    assert [len(r) for r in stage_layer_ranges(61, 4)] == [15, 15, 15, 16]
    for layers, pp in itertools.product((1, 10, 61, 80, 126), (1, 2, 3, 4, 8)):
        if pp > layers:
            with pytest.raises(LayoutError, match="prefill_pp"):
                stage_layer_ranges(layers, pp)
            continue
        got = [x for r in stage_layer_ranges(layers, pp) for x in r]
        assert got == list(range(layers))


def _elements(g: Geometry, decode_rank: int) -> tuple[int, Counter]:
    """(region bytes, how often each (K/V, layer, token, decode head) is written) of one
    chunk of 3 pages, every element's address checked to be in the region and unique."""
    lay = g.staging_layout(decode_rank, 3)
    seen: set[int] = set()
    written: Counter = Counter()
    for w, b in enumerate(lay.blocks):
        assert b.writer == w and g.writer_layers(b.prefill_rank) == range(
            b.layer_start, b.layer_start + b.num_layers
        )
        assert b.offset == (lay.blocks[w - 1].offset + lay.blocks[w - 1].nbytes if w else 0)
        for kv, layer, tok, h in itertools.product(
            range(g.kv_factor), g.writer_layers(b.prefill_rank), range(lay.num_tokens),
            range(b.heads.num_heads),
        ):  # fmt: skip
            at = staging_address(g, lay, w, kv, layer, tok, h)
            assert 0 <= at < lay.region_bytes and at not in seen
            seen.add(at)
            written[kv, layer, tok, b.heads.dst_head_start + h] += 1
    assert len(seen) * g.head_dim * g.dtype_bytes == lay.region_bytes  # covered once
    return lay.region_bytes, written


@pytest.mark.parametrize(("p", "d", "pp"), PIPELINES)
def test_stage_blocks_cover_the_region_exactly_once(p, d, pp):
    g, flat = _pp(p, d, pp), _pp(p, d, 1)
    for dr in range(d):
        assert len(g.staging_layout(dr, 3).blocks) == pp * len(flat.writers(dr))
        # the same bytes per decode rank, and every element written as often as without
        # stages: the stages' layers together are the model's
        assert _elements(g, dr) == _elements(flat, dr)
        assert set(_elements(g, dr)[1]) == set(
            itertools.product(range(g.kv_factor), range(10), range(12), range(g.decode_heads))
        )


@pytest.mark.parametrize(("p", "d", "pp"), PIPELINES)
def test_a_stage_rank_pairs_like_its_tp_rank(p, d, pp):
    g, flat = _pp(p, d, pp), _pp(p, d, 1)
    assert g.prefill_ranks == p * pp
    for r in range(p * pp):
        assert g.targets(r) == flat.targets(r % p)
        for dr in g.targets(r):
            assert g.head_slice(r, dr) == flat.head_slice(r % p, dr)
            assert g.writers(dr).count(r) == 1
    for dr in range(d):
        want = sum(flat.slice_requests(w, dr, 3) for w in flat.writers(dr))
        assert sum(g.slice_requests(w, dr, 3) for w in g.writers(dr)) == want
    with pytest.raises(LayoutError, match="out of range"):
        g.targets(p * pp)


def test_mla_stages_each_send_their_latent_layers():
    g = _pp(4, 2, 2, "mla")
    assert g.writers(1) == [1, 5] and g.targets(5) == [1] and g.targets(6) == []
    lay = g.staging_layout(1, 2)
    assert [(b.layer_start, b.num_layers) for b in lay.blocks] == [(0, 5), (5, 5)]
    assert lay.region_bytes == _pp(4, 2, 1, "mla").staging_layout(1, 2).region_bytes
    with pytest.raises(LayoutError, match="in each stage"):
        g.head_slice(2, 1)
    with pytest.raises(LayoutError, match="not in writer 0's block"):
        staging_address(g, lay, 0, 0, 5, 0, 0)
