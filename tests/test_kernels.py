"""hw.kvpool and hw.kernels on CPU: every byte of a room lands in the right head slice.

For each TP geometry the prefill pools are filled with the pattern, moved to fresh
decode pools by staging (gather -> region -> scatter) or by the slice path (slice_ops
-> memmove), and verified bit for bit; then deliberate mistakes must be caught.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
import torch

import kvstage.hw.rank.kernels as kernels
import kvstage.hw.rank.kvpool as kvpool
from kvstage.hw.rank.kernels import SliceOps, apply_ops, gather, scatter, slice_ops
from kvstage.hw.rank.kvpool import (
    KVPool,
    PoolDesc,
    expected_pattern,
    fill_pattern,
    room_salt,
    verify,
)
from kvstage.shared.layout import DTYPE_BYTES, Geometry, StagingLayout, owned_heads
from kvstage.shared.pages import PageAllocator

LAYERS = 3
HEAD_DIM = 8
PAGE_SIZE = 4
POOL_PAGES = 8
ROOM_PAGES = 3
ROOM = "room-7"
PREFIX = 2 * PAGE_SIZE  # the room starts at this prompt position
SENTINEL = 0xA5

# (prefill_tp, decode_tp, total_kv_heads)
GEOMETRIES = {
    "fan-in P2->D1": (2, 1, 8),
    "fan-in P4->D2": (4, 2, 8),
    "fan-in P8->D2": (8, 2, 8),
    "fan-out P1->D2": (1, 2, 8),
    "fan-out P2->D4": (2, 4, 8),
    "fan-out P2->D8": (2, 8, 8),
    "replication P16->D4 H8": (16, 4, 8),
    "replication P4->D2 H2": (4, 2, 2),
    "replication P2->D8 H4 (GQA)": (2, 8, 4),
    "equal P4->D4": (4, 4, 8),
}


def _fp8_ok() -> bool:
    try:
        torch.zeros(4, dtype=torch.float8_e4m3fn).view(torch.uint8)
    except (AttributeError, RuntimeError, TypeError):
        return False
    return True


DTYPES = [
    "bf16",
    "fp16",
    "fp32",
    pytest.param("fp8", marks=pytest.mark.skipif(not _fp8_ok(), reason="no fp8")),
]


def geometry(p: int, d: int, h: int, dtype: str) -> Geometry:
    return Geometry(p, d, h, LAYERS, HEAD_DIM, DTYPE_BYTES[dtype], PAGE_SIZE)


class Cluster:
    """Prefill pools holding one room, and helpers to build decode pools."""

    def __init__(self, g: Geometry, dtype: str) -> None:
        self.g = g
        self.dtype = dtype
        self.prefill: list[KVPool] = []
        for r in range(g.prefill_tp):
            pool = KVPool(LAYERS, POOL_PAGES, PAGE_SIZE, g.prefill_heads, HEAD_DIM, dtype)
            pages = PageAllocator(POOL_PAGES)
            pages.alloc(1)  # so the room does not start at page 0: page offsets matter
            self.src_page = pages.alloc(ROOM_PAGES)
            fill_pattern(
                pool,
                self.src_page,
                ROOM_PAGES,
                ROOM,
                PREFIX,
                list(owned_heads(g.prefill_tp, r, g.total_kv_heads)),
            )
            self.prefill.append(pool)

    def decode_pool(self) -> tuple[KVPool, int]:
        pool = KVPool(
            LAYERS,
            POOL_PAGES,
            PAGE_SIZE,
            self.g.decode_heads,
            HEAD_DIM,
            self.dtype,
            fill_byte=SENTINEL,
        )
        pages = PageAllocator(POOL_PAGES)
        pages.alloc(4)
        return pool, pages.alloc(ROOM_PAGES)

    def decode_heads(self, d: int) -> list[int]:
        return list(owned_heads(self.g.decode_tp, d, self.g.total_kv_heads))

    def stage(
        self, d: int, layout: StagingLayout | None = None
    ) -> tuple[torch.Tensor, StagingLayout]:
        """Gather every writer's block into one staging region for decode rank d."""
        layout = layout or self.g.staging_layout(d, ROOM_PAGES)
        # The region sits at an odd-ish offset of a larger buffer, like a ring allocation.
        buf = torch.full((layout.region_bytes + 64,), SENTINEL, dtype=torch.uint8)
        region = buf[32 : 32 + layout.region_bytes]
        for b in layout.blocks:
            hs = b.heads
            gather(
                self.prefill[b.prefill_rank],
                self.src_page,
                ROOM_PAGES,
                hs.src_head_start,
                hs.num_heads,
                region[b.offset : b.offset + b.nbytes],
            )
        return region, layout

    def room_bytes(self) -> int:
        return (
            2
            * LAYERS
            * ROOM_PAGES
            * PAGE_SIZE
            * self.g.decode_heads
            * HEAD_DIM
            * DTYPE_BYTES[self.dtype]
        )


def untouched_outside(pool: KVPool, first_page: int, num_pages: int) -> bool:
    """No byte outside the room's pages was written."""
    b = pool.bytes
    t0, t1 = first_page * PAGE_SIZE, (first_page + num_pages) * PAGE_SIZE
    return bool((b[:, :, :t0] == SENTINEL).all() and (b[:, :, t1:] == SENTINEL).all())


# --- addresses -------------------------------------------------------


def test_addresses_match_tensor_layout() -> None:
    pool = KVPool(3, 4, 2, 5, 6, "bf16")
    assert pool.tensor.shape == (2, 3, 8, 5, 6) and pool.tensor.is_contiguous()
    assert pool.nbytes == pool.tensor.numel() * 2 and pool.token_bytes_per_head == 12
    for kv, layer, token, head in [(0, 0, 0, 0), (1, 2, 7, 4), (0, 1, 3, 2), (1, 0, 5, 1)]:
        elem = pool.tensor[kv, layer, token, head]
        assert pool.addr(kv, layer, token, head) == elem.data_ptr()
    assert PoolDesc.from_wire(pool.desc.to_wire()) == pool.desc
    assert pool.desc.nbytes == pool.nbytes


def test_kernels_reject_mismatched_buffers() -> None:
    g = geometry(4, 2, 8, "bf16")
    c = Cluster(g, "bf16")
    with pytest.raises(ValueError, match="writer block needs"):
        gather(c.prefill[0], c.src_page, ROOM_PAGES, 0, 2, torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="outside"):
        gather(c.prefill[0], c.src_page, ROOM_PAGES, 1, 2, torch.zeros(10, dtype=torch.uint8))
    region, layout = c.stage(0)
    pool, first = c.decode_pool()
    with pytest.raises(ValueError, match="layout is for"):
        scatter(pool, first, ROOM_PAGES - 1, region, layout)
    other = Geometry(4, 2, 8, LAYERS + 1, HEAD_DIM, 2, PAGE_SIZE).staging_layout(0, ROOM_PAGES)
    with pytest.raises(ValueError):
        scatter(pool, first, ROOM_PAGES, torch.zeros(other.region_bytes, dtype=torch.uint8), other)
    bad_desc = dataclasses.replace(pool.desc, heads=1)
    with pytest.raises(ValueError, match="does not match the geometry"):
        slice_ops(g, 0, 0, c.prefill[0].desc, c.src_page, bad_desc, first, ROOM_PAGES)


# --- the pattern ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_pattern_rows_unique_across_all_coordinates(dtype: str) -> None:
    """Every (K/V, layer, token, head) row differs, so swapping any two is detected."""
    pool = KVPool(4, 4, 4, 8, HEAD_DIM, dtype)
    exp = expected_pattern(pool, 4, ROOM, 0, list(range(8)))
    rows = exp.view(torch.uint8).reshape(-1, HEAD_DIM * pool.elem_bytes)
    assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]
    # Another room, or the same heads in another order, gives different bytes.
    assert not torch.equal(
        exp.view(torch.uint8),
        expected_pattern(pool, 4, "other", 0, list(range(8))).view(torch.uint8),
    )
    perm = expected_pattern(pool, 4, ROOM, 0, [1, 0, 2, 3, 4, 5, 6, 7])
    assert not torch.equal(exp.view(torch.uint8), perm.view(torch.uint8))
    assert room_salt(ROOM) == room_salt("room-7") != room_salt(7)


def reference_value(
    layers: int,
    kv: int,
    layer: int,
    pos: int,
    head: int,
    e: int,
    head_dim: int,
    room: int | str,
    width: int,
) -> int:
    """The pattern spelled out with Python ints: the unsigned w-bit value of one element."""
    m32 = 0xFFFFFFFF

    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * kvpool._MUL1) & m32
        x ^= x >> 15
        x = (x * kvpool._MUL2) & m32
        return x ^ (x >> 16)

    salt = room_salt(room)
    h = mix(((kv * layers + layer) * kvpool._C_KVL + salt) & m32)
    h = mix((h + pos * kvpool._C_POS) & m32)
    h = mix((h + head * kvpool._C_HEAD) & m32)
    mask = (1 << width) - 1
    window = (h >> (width * (e % min(32 // width, head_dim)))) & mask
    return window ^ (mix((e * kvpool._C_ELEM + salt) & m32) & mask)


# Rows of a multiple of 8 bytes are written as 8-byte words of repeated row hashes
# (bf16 8, fp32 4, fp8 16), the others element by element (fp8 3, fp16 5, bf16 6).
@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    [("bf16", 8), ("fp32", 4), ("fp8", 3), ("fp16", 5), ("fp8", 16), ("bf16", 6)],
)
def test_pattern_matches_python_reference(dtype: str, head_dim: int) -> None:
    """Same bits as a pure-Python spec: no device- or overflow-dependent arithmetic."""
    if dtype == "fp8" and not _fp8_ok():
        pytest.skip("no fp8")
    layers, heads = 3, [5, 2]
    pool = KVPool(layers, 4, 2, 2, head_dim, dtype)
    fill_pattern(pool, 1, 2, ROOM, 100, heads)
    width = 8 * pool.elem_bytes
    raw = pool.bytes
    for kv, layer, token, local, e in [
        (0, 0, 2, 0, 0),
        (1, 2, 5, 1, head_dim - 1),
        (1, 1, 3, 0, 1),
        (0, 2, 4, 1, 2 % head_dim),
    ]:
        got = raw[kv, layer, token, local, e * pool.elem_bytes : (e + 1) * pool.elem_bytes]
        value = int.from_bytes(bytes(got.tolist()), "little")
        want = reference_value(
            layers, kv, layer, 100 + token - 2, heads[local], e, head_dim, ROOM, width
        )
        assert value == want
    assert verify(pool, 1, 2, ROOM, 100, heads)[1] == 0


def test_pattern_is_bit_exact_and_step_independent(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 pattern holds NaN bit patterns; filling in small steps gives the same bytes."""
    heads = [3, 4]
    whole = KVPool(2, 6, 4, 2, HEAD_DIM, "fp32")
    fill_pattern(whole, 1, 5, 11, 40, heads)
    assert torch.isnan(whole.tensor).any()  # bit patterns survive as-is
    monkeypatch.setattr(kvpool, "_STEP_ELEMS", 100)
    stepped = KVPool(2, 6, 4, 2, HEAD_DIM, "fp32")
    fill_pattern(stepped, 1, 5, 11, 40, heads)
    assert torch.equal(whole.bytes, stepped.bytes)
    assert verify(stepped, 1, 5, 11, 40, heads) == (2 * 2 * 20 * 2 * HEAD_DIM * 4, 0)
    exp = expected_pattern(whole, 5, 11, 40, heads)
    assert torch.equal(
        exp.view(torch.uint8), whole.bytes[:, :, 4:24].reshape(exp.view(torch.uint8).shape)
    )


# --- end to end: staging and slice path ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", list(GEOMETRIES.values()), ids=list(GEOMETRIES))
def test_staging_end_to_end(tp: tuple[int, int, int], dtype: str) -> None:
    g = geometry(*tp, dtype)
    c = Cluster(g, dtype)
    for d in range(g.decode_tp):
        region, layout = c.stage(d)
        pool, first = c.decode_pool()
        scatter(pool, first, ROOM_PAGES, region, layout)
        assert verify(pool, first, ROOM_PAGES, ROOM, PREFIX, c.decode_heads(d)) == (
            c.room_bytes(),
            0,
        )
        checked, wrong = verify(
            pool, first, ROOM_PAGES, ROOM, PREFIX, c.decode_heads(d), sample=True
        )
        assert wrong == 0 and checked > 0
        assert untouched_outside(pool, first, ROOM_PAGES)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", list(GEOMETRIES.values()), ids=list(GEOMETRIES))
def test_slice_path_end_to_end(tp: tuple[int, int, int], dtype: str) -> None:
    g = geometry(*tp, dtype)
    c = Cluster(g, dtype)
    for d in range(g.decode_tp):
        pool, first = c.decode_pool()
        for p in g.writers(d):
            src = c.prefill[p]
            ops = slice_ops(g, p, d, src.desc, c.src_page, pool.desc, first, ROOM_PAGES)
            assert len(ops) == g.slice_requests(p, d, ROOM_PAGES)
            hs = g.head_slice(p, d)
            assert ops.total_bytes == g.block_bytes(ROOM_PAGES * PAGE_SIZE, hs.num_heads)
            apply_ops(ops, src.tensor, pool.tensor)
        assert verify(pool, first, ROOM_PAGES, ROOM, PREFIX, c.decode_heads(d)) == (
            c.room_bytes(),
            0,
        )
        assert untouched_outside(pool, first, ROOM_PAGES)


def test_slice_ops_shapes_and_transport_forms() -> None:
    g = geometry(4, 4, 8, "bf16")  # equal TP: whole pages per request
    c = Cluster(g, "bf16")
    pool, first = c.decode_pool()
    ops = slice_ops(g, 1, 1, c.prefill[1].desc, c.src_page, pool.desc, first, ROOM_PAGES)
    assert g.slice_contiguous_pages(1, 1) and len(ops) == 2 * LAYERS * ROOM_PAGES
    assert ops.tuples()[0] == (
        c.prefill[1].addr(0, 0, c.src_page * PAGE_SIZE, 0),
        pool.addr(0, 0, first * PAGE_SIZE, 0),
        int(ops.nbytes[0]),
    )
    descs = ops.descs("dst", device_id=3)
    assert descs.shape == (len(ops), 3) and descs.dtype == np.uint64
    assert (descs[:, 0] == ops.dst.astype(np.uint64)).all() and (descs[:, 2] == 3).all()
    assert len(slice_ops(g, 1, 1, c.prefill[1].desc, c.src_page, pool.desc, first, 0)) == 0
    g2 = geometry(8, 2, 8, "bf16")  # fan-in: per-token requests
    assert not g2.slice_contiguous_pages(0, 0)
    assert (
        len(
            slice_ops(
                g2,
                0,
                0,
                KVPool(LAYERS, 8, PAGE_SIZE, 1, HEAD_DIM).desc,
                0,
                KVPool(LAYERS, 8, PAGE_SIZE, 4, HEAD_DIM).desc,
                0,
                5,
            )
        )
        == 2 * LAYERS * 5 * PAGE_SIZE
    )


def test_apply_ops_refuses_out_of_bounds() -> None:
    a = torch.zeros(64, dtype=torch.uint8)
    b = torch.zeros(64, dtype=torch.uint8)
    ops = SliceOps(np.array([a.data_ptr() + 60]), np.array([b.data_ptr()]), np.array([8]))
    with pytest.raises(ValueError, match="source"):
        apply_ops(ops, a, b)
    assert not b.any()


# --- mistakes are caught -----------------------------------------------------------


def staged_and_verified(
    c: Cluster,
    d: int,
    layout: StagingLayout,
    region: torch.Tensor,
    first_shift: int = 0,
    token_offset: int = PREFIX,
) -> int:
    pool, first = c.decode_pool()
    scatter(pool, first + first_shift, ROOM_PAGES, region, layout)
    return verify(pool, first, ROOM_PAGES, ROOM, token_offset, c.decode_heads(d))[1]


def test_wrong_dst_head_start_is_caught() -> None:
    c = Cluster(geometry(4, 2, 8, "bf16"), "bf16")
    region, layout = c.stage(0)
    assert staged_and_verified(c, 0, layout, region) == 0
    a, b = layout.blocks
    swapped = dataclasses.replace(
        layout,
        blocks=(
            dataclasses.replace(
                a, heads=dataclasses.replace(a.heads, dst_head_start=b.heads.dst_head_start)
            ),
            dataclasses.replace(
                b, heads=dataclasses.replace(b.heads, dst_head_start=a.heads.dst_head_start)
            ),
        ),
    )
    assert staged_and_verified(c, 0, swapped, region) > 0


@pytest.mark.parametrize("tp", [(4, 2, 8), (2, 1, 8), (8, 1, 8)])
def test_fan_in_scatter_in_one_copy_matches_per_block(
    tp: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writer blocks that tile the decode heads in order are scattered in one copy: the
    same bytes land as with one copy per block, and nothing outside the room."""
    c = Cluster(geometry(*tp, "bf16"), "bf16")
    region, layout = c.stage(0)
    pool, first = c.decode_pool()
    tokens = slice(first * pool.page_size, (first + ROOM_PAGES) * pool.page_size)
    assert kernels._scatter_tiled(pool, tokens, region, layout)  # this layout takes the fused path
    assert verify(pool, first, ROOM_PAGES, ROOM, PREFIX, c.decode_heads(0)) == (c.room_bytes(), 0)
    assert untouched_outside(pool, first, ROOM_PAGES)
    monkeypatch.setattr(kernels, "_scatter_tiled", lambda *a: False)
    per_block, _ = c.decode_pool()
    scatter(per_block, first, ROOM_PAGES, region, layout)
    assert torch.equal(per_block.bytes, pool.bytes)


def test_wrong_writer_offset_is_caught() -> None:
    c = Cluster(geometry(4, 2, 8, "bf16"), "bf16")
    layout = c.g.staging_layout(1, ROOM_PAGES)
    a, b = layout.blocks
    # Each writer's gather lands in the other's slot.
    swapped = dataclasses.replace(
        layout,
        blocks=(dataclasses.replace(a, offset=b.offset), dataclasses.replace(b, offset=a.offset)),
    )
    region, _ = c.stage(1, swapped)
    assert staged_and_verified(c, 1, layout, region) > 0


def test_wrong_page_kv_layer_and_token_are_caught() -> None:
    c = Cluster(geometry(2, 4, 8, "fp32"), "fp32")
    region, layout = c.stage(2)
    assert staged_and_verified(c, 2, layout, region, first_shift=1) > 0  # off by a page
    half = layout.region_bytes // 2
    kv_swapped = torch.cat([region[half:], region[:half]])
    assert staged_and_verified(c, 2, layout, kv_swapped) > 0  # K and V exchanged
    per_layer = half // LAYERS
    layers_swapped = torch.cat(
        [region[per_layer : 2 * per_layer], region[:per_layer], region[2 * per_layer :]]
    )
    assert staged_and_verified(c, 2, layout, layers_swapped) > 0  # layers 0 and 1 exchanged
    row = c.g.decode_heads * HEAD_DIM * 4
    tokens_swapped = torch.cat([region[row : 2 * row], region[:row], region[2 * row :]])
    assert staged_and_verified(c, 2, layout, tokens_swapped) > 0  # tokens 0 and 1 exchanged
    one_byte = region.clone()
    one_byte[-1] ^= 1
    assert staged_and_verified(c, 2, layout, one_byte) == 1


def test_prefix_shift_is_caught() -> None:
    c = Cluster(geometry(2, 2, 8, "bf16"), "bf16")
    region, layout = c.stage(0)
    assert staged_and_verified(c, 0, layout, region, token_offset=PREFIX) == 0
    assert staged_and_verified(c, 0, layout, region, token_offset=0) > 0
    assert staged_and_verified(c, 0, layout, region, token_offset=PREFIX + PAGE_SIZE) > 0


def test_sampled_verify_sees_first_and_last_page() -> None:
    pool = KVPool(2, 40, 4, 2, HEAD_DIM, "bf16")
    fill_pattern(pool, 0, 40, ROOM, 0, [0, 1])
    full = verify(pool, 0, 40, ROOM, 0, [0, 1])
    checked, wrong = verify(pool, 0, 40, ROOM, 0, [0, 1], sample=True)
    assert wrong == 0 and 0 < checked < full[0]
    for token in (0, 39 * 4 + 3):
        ctypes.memset(pool.addr(1, 1, token, 1), 0, 2)
        assert verify(pool, 0, 40, ROOM, 0, [0, 1], sample=True)[1] > 0
        fill_pattern(pool, 0, 40, ROOM, 0, [0, 1])
