"""Torch gather / scatter between paged KV pools and staging regions, and slice-path ops.

Everything here copies bytes, never floats: pools and staging buffers are accessed
through uint8 (or a wider integer) views, so NaN payloads and fp8 values move bit
for bit. The same code runs on CPU and CUDA tensors.

Staging writer block layout (docs/design.md, "Staging region"; shared.layout.staging_address):
[K layer 0..L-1, V layer 0..L-1] x [T tokens][heads][head_dim]. A KV pool is
[2, L, tokens, heads, head_dim] (hw.kvpool.KVPool), so a writer block is exactly the
pool slice [:, :, pages, heads] made contiguous: one copy_ moves all layers and both
K and V.

MLA (Geometry.kv_factor 1): the pool has one plane, the latent, as one "head" of
width latent ([1, L, tokens, 1, latent]); every op here follows the pool's or the
geometry's plane count, so the latent moves once per token per layer.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from kvstage.hw.rank import nhash
from kvstage.hw.rank.kvpool import KVPool, PoolDesc
from kvstage.shared.layout import Geometry, StagingLayout

log = logging.getLogger(__name__)

# Widest integer dtype per element width: copying 8-byte words instead of bytes lets
# the copy kernel move larger units on both CPU and CUDA.
_WORD_DTYPES: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def _word(row_bytes: int, *flat: torch.Tensor) -> tuple[int, torch.dtype]:
    """Widest word that divides a head row and keeps every given tensor's start aligned."""
    for size, dtype in _WORD_DTYPES:
        if row_bytes % size == 0 and all(
            t.storage_offset() % size == 0 and t.data_ptr() % size == 0 for t in flat
        ):
            return size, dtype
    return 1, torch.uint8


def _pool_words(pool: KVPool, dtype: torch.dtype, size: int) -> torch.Tensor:
    """The pool as [kv_planes, L, tokens, heads, row_words] of `dtype`."""
    return pool.bytes.view(dtype).view(
        pool.kv_planes, pool.layers, pool.num_tokens, pool.heads, pool.token_bytes_per_head // size
    )


def _check_flat(buf: torch.Tensor, what: str, pool: KVPool) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"{what} must be a flat contiguous uint8 tensor, got {buf.dtype} {tuple(buf.shape)}"
        )
    if buf.device != pool.device:
        raise ValueError(f"{what} is on {buf.device}, the pool on {pool.device}")


def _check_heads(pool: KVPool, start: int, num: int, what: str) -> None:
    if num < 1 or start < 0 or start + num > pool.heads:
        raise ValueError(
            f"{what} heads [{start}, {start + num}) outside the pool's {pool.heads} heads"
        )


def block_bytes(pool: KVPool, num_pages: int, num_heads: int) -> int:
    """Bytes of one writer block of `num_pages` pages and `num_heads` heads from this pool."""
    return (
        pool.kv_planes
        * pool.layers
        * num_pages
        * pool.page_size
        * num_heads
        * pool.token_bytes_per_head
    )


def _check_block(
    pool: KVPool,
    first_page: int,
    num_pages: int,
    head_start: int,
    num_heads: int,
    block: torch.Tensor | None,
    side: str,
) -> None:
    """A writer block's pages and heads inside the pool, and `block` (if any) a flat
    uint8 tensor of exactly its size."""
    pool.check_pages(first_page, num_pages)
    _check_heads(pool, head_start, num_heads, side)
    if block is None:
        return
    _check_flat(block, "out" if side == "source" else "block", pool)
    need = block_bytes(pool, num_pages, num_heads)
    if block.numel() != need:
        what = "out" if side == "source" else "the block"
        raise ValueError(f"{what} holds {block.numel()} bytes, the writer block needs {need}")


def gather(
    pool: KVPool,
    first_page: int,
    num_pages: int,
    src_head_start: int,
    num_heads: int,
    out: torch.Tensor,
) -> None:
    """Copy a room's pages, heads [src_head_start, +num_heads), all layers, K and V, into `out`.

    `out` is the flat uint8 slice of a (registered) staging buffer holding exactly one
    writer block; after the copy it holds [K/V][layer][token][head][head_dim].
    """
    _check_block(pool, first_page, num_pages, src_head_start, num_heads, out, "source")
    ps = pool.page_size
    size, dtype = _word(pool.token_bytes_per_head, out)
    src = _pool_words(pool, dtype, size)[
        :,
        :,
        first_page * ps : (first_page + num_pages) * ps,
        src_head_start : src_head_start + num_heads,
    ]
    out.view(dtype).view(src.shape).copy_(src)


def scatter(
    pool: KVPool,
    first_page: int,
    num_pages: int,
    region: torch.Tensor,
    layout: StagingLayout,
) -> None:
    """Copy every writer block of a chunk's staging region into the decode pool's pages.

    `region` is the flat uint8 staging region of this chunk (starting at the region's
    offset in the ring, at least layout.region_bytes long). Each block lands at its
    dst heads [dst_head_start, +num_heads); replicated writers carrying the same head
    land on the same bytes with identical data, so their order does not matter.
    """
    pool.check_pages(first_page, num_pages)
    _check_flat(region, "region", pool)
    ps = pool.page_size
    if layout.num_tokens != num_pages * ps:
        raise ValueError(
            f"layout is for {layout.num_tokens} tokens, {num_pages} pages hold {num_pages * ps}"
        )
    if region.numel() < layout.region_bytes:
        raise ValueError(
            f"region holds {region.numel()} bytes, the layout needs {layout.region_bytes}"
        )
    tokens = slice(first_page * ps, (first_page + num_pages) * ps)
    for block in layout.blocks:
        hs = block.heads
        _check_heads(pool, hs.dst_head_start, hs.num_heads, f"writer {block.writer} destination")
        need = block_bytes(pool, num_pages, hs.num_heads)
        if block.nbytes != need:
            raise ValueError(
                f"writer {block.writer} block is {block.nbytes} bytes, this pool's geometry "
                f"makes it {need}: layout and pool do not match"
            )
    if _scatter_tiled(pool, tokens, region, layout):
        return
    for block in layout.blocks:
        hs = block.heads
        src = region[block.offset : block.offset + block.nbytes]
        size, dtype = _word(pool.token_bytes_per_head, src)
        dst = _pool_words(pool, dtype, size)[
            :, :, tokens, hs.dst_head_start : hs.dst_head_start + hs.num_heads
        ]
        dst.copy_(src.view(dtype).view(dst.shape))


# --- the write tag inside the move (hw/rank/nhash.py) ----------------------------


# Tests only: "1" runs the tag-carrying moves on host pools too, under Triton's
# interpreter (with TRITON_INTERPRET=1), so that a whole hardware run exercises the GPU
# path's code where no GPU is (tests/test_nhash.py). Slow; never set in production.
HOST_KERNEL_ENV = "KVSTAGE_TAG_KERNEL_ON_HOST"


def fused_tag_possible(pool: KVPool, *flat: torch.Tensor) -> bool:
    """Whether the pool's gathers and scatters can carry the write tag's hash in their own
    pass: a CUDA pool, Triton importable, head rows and buffers in whole 32-bit words."""
    return (
        (pool.bytes.is_cuda or os.environ.get(HOST_KERNEL_ENV) == "1")
        and nhash.kernel_ready()
        and pool.token_bytes_per_head % 4 == 0
        and all(t.numel() % 4 == 0 and t.data_ptr() % 4 == 0 for t in flat)
    )


def warm_hashed_moves(pool: KVPool) -> None:
    """Compile the moves that carry the write tag (gather into a buffer, gather to hash
    only, scatter) on a scratch pool of the same rows, so that Triton's compiles happen
    before the run, not in its first chunks. A no-op where they cannot run."""
    if not fused_tag_possible(pool):
        return
    scratch = KVPool(
        pool.layers,
        1,
        pool.page_size,
        pool.heads,
        pool.head_dim,
        pool.dtype,
        device=pool.device,
        kv_planes=pool.kv_planes,
    )
    scratch.bytes.copy_(torch.randint(0, 256, scratch.bytes.shape, dtype=torch.uint8))
    block = torch.zeros(block_bytes(scratch, 1, 1), dtype=torch.uint8, device=pool.device)
    key = bytes(32)
    try:
        got = gather_hashed(scratch, 0, 1, 0, 1, key, block)
        gather_hashed(scratch, 0, 1, 0, 1, key)
        scatter_hashed(scratch, 0, 1, block, 0, 1, key).cpu()
        if not torch.equal(got.cpu(), nhash.nh_torch(block, key).cpu()):
            raise RuntimeError("its digest differs from the torch form's on this GPU")
    except Exception as exc:  # a GPU or Triton it does not run on: the torch form instead
        nhash.refuse_kernel(f"{type(exc).__name__}: {exc}")
        log.warning(
            "the write tag's Triton kernel does not run here (%s): tags are hashed by the "
            "torch form, with private copies",
            nhash._refused,
        )


def gather_hashed(
    pool: KVPool,
    first_page: int,
    num_pages: int,
    src_head_start: int,
    num_heads: int,
    key: bytes,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gather` into `out` (None: nowhere, the hash only) and the NH digest of the
    writer block (hw/rank/nhash.py) in the same pass, each pool word read once: the
    digest of exactly the bytes gathered, as (chunks, KEYS) int64 on the pool's device.
    Needs `fused_tag_possible`."""
    return _hashed_move(pool, first_page, num_pages, src_head_start, num_heads, out, key)


def scatter_hashed(
    pool: KVPool,
    first_page: int,
    num_pages: int,
    block: torch.Tensor,
    dst_head_start: int,
    num_heads: int,
    key: bytes,
) -> torch.Tensor:
    """Scatter one writer block into the pool's pages, heads [dst_head_start,
    +num_heads), and return the NH digest of the bytes it wrote, in the same pass (each
    block word read once, so a block a peer writes meanwhile is hashed as it landed).
    Needs `fused_tag_possible`."""
    return _hashed_move(pool, first_page, num_pages, dst_head_start, num_heads, block, key, True)


def _hashed_move(
    pool: KVPool,
    first_page: int,
    num_pages: int,
    head_start: int,
    num_heads: int,
    block: torch.Tensor | None,
    key: bytes,
    scatter: bool = False,
) -> torch.Tensor:
    """The pool's slice of a writer block, moved to or from `block` (flat uint8; None:
    not moved, hashed only) by the NH kernel as it hashes (hw/rank/nhash.py
    `launch_strided`)."""
    side = "destination" if scatter else "source"
    _check_block(pool, first_page, num_pages, head_start, num_heads, block, side)
    ps = pool.page_size
    tokens = slice(first_page * ps, (first_page + num_pages) * ps)
    heads = slice(head_start, head_start + num_heads)
    words = None if block is None else block.view(torch.int32)
    pool_words = _pool_words(pool, torch.int32, 4)
    return nhash.launch_strided(pool_words, words, key, tokens, heads, scatter=scatter)


def _scatter_tiled(
    pool: KVPool, tokens: slice, region: torch.Tensor, layout: StagingLayout
) -> bool:
    """Scatter a region whose writer blocks, back to back from its start, carry the pool's
    heads in order (fan-in without replication, as P4 -> D2) in ONE copy that writes the
    destination pages front to back, all heads of a row together. Per-block copies write
    each row in pieces; measured on CPU (32 layers, 2 blocks of 4 of 8 heads): 1.29x a
    plain copy's time per block, 1.07x in one. False (nothing done) for other layouts."""
    blocks = sorted(layout.blocks, key=lambda b: b.offset)
    n, nh, nbytes = len(blocks), blocks[0].heads.num_heads, blocks[0].nbytes
    if (
        n < 2
        or n * nh != pool.heads
        or any(
            b.offset != i * nbytes or b.nbytes != nbytes or b.heads.dst_head_start != i * nh
            for i, b in enumerate(blocks)
        )
    ):
        return False
    src = region[: n * nbytes]
    size, dtype = _word(pool.token_bytes_per_head, src)
    dst = _pool_words(pool, dtype, size)[:, :, tokens]
    planes, layers, t, _, words = dst.shape
    dst.view(planes, layers, t, n, nh, words).copy_(
        src.view(dtype).view(n, planes, layers, t, nh, words).permute(1, 2, 3, 0, 4, 5)
    )
    return True


# --- the slice path -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SliceOps:
    """Transfer requests of the slice path as three parallel int64 arrays.

    Request i copies nbytes[i] bytes from local (prefill) address src[i] to remote
    (decode) address dst[i]. Arrays rather than a list of tuples: building and handing
    over tens of thousands of requests stays vectorised. A transport consumes them as
    - NIXL: `descs("src", dev)` / `descs("dst", dev)` -> (N, 3) [addr, len, device] arrays
      that `nixl_agent.get_xfer_descs(array, mem_type)` takes directly;
    - Mooncake: `src.tolist()`, `dst.tolist()`, `nbytes.tolist()` for batch_transfer_*;
    - anything else: `tuples()` -> [(src, dst, nbytes), ...].
    """

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def tuples(self) -> list[tuple[int, int, int]]:
        return list(zip(self.src.tolist(), self.dst.tolist(), self.nbytes.tolist(), strict=True))

    def descs(self, side: str, device_id: int = 0) -> np.ndarray:
        """(N, 3) uint64 [address, length, device id] rows for one side ("src" or "dst")."""
        if side not in ("src", "dst"):
            raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
        addrs = self.src if side == "src" else self.dst
        out = np.empty((len(self), 3), dtype=np.uint64)
        out[:, 0] = addrs
        out[:, 1] = self.nbytes
        out[:, 2] = device_id
        return out


def _check_desc(desc: PoolDesc, geometry: Geometry, heads: int, side: str) -> None:
    got = (desc.layers, desc.head_dim, desc.elem_bytes, desc.page_size, desc.heads, desc.kv_planes)
    want = (
        geometry.layers,
        geometry.head_dim,
        geometry.dtype_bytes,
        geometry.page_size,
        heads,
        geometry.kv_factor,
    )
    if got != want:
        raise ValueError(
            f"{side} pool (layers, head_dim, elem_bytes, page_size, heads, kv_planes) = {got} "
            f"does not match the geometry's {want}"
        )


def _check_desc_pages(desc: PoolDesc, first_page: int, num_pages: int, side: str) -> None:
    if first_page < 0 or num_pages < 0 or first_page + num_pages > desc.num_pages:
        raise ValueError(
            f"{side} pages [{first_page}, {first_page + num_pages}) outside the pool "
            f"(0..{desc.num_pages - 1})"
        )


def slice_ops(
    geometry: Geometry,
    prefill_rank: int,
    decode_rank: int,
    src: PoolDesc,
    src_first_page: int,
    dst: PoolDesc,
    dst_first_page: int,
    num_pages: int,
) -> SliceOps:
    """The slice path's requests for one writer and one chunk of `num_pages` pages.

    `src` describes the local prefill pool, `dst` the decode pool as received in the
    peer's metadata, so the prefill computes remote addresses itself. Requests are
    ordered [K/V][layer][page or token], like a staging block (MLA: [layer][page], the
    latent once). One request per
    (page, layer, K/V) when Geometry.slice_contiguous_pages holds (a page of whole token
    rows is one run on both sides), otherwise one per (token, layer, K/V) covering the
    head slice. len(result) == geometry.slice_requests(prefill_rank, decode_rank, num_pages).
    """
    hs = geometry.head_slice(prefill_rank, decode_rank)
    _check_desc(src, geometry, geometry.prefill_heads, "source")
    _check_desc(dst, geometry, geometry.decode_heads, "destination")
    _check_desc_pages(src, src_first_page, num_pages, "source")
    _check_desc_pages(dst, dst_first_page, num_pages, "destination")
    ps = geometry.page_size
    row = geometry.head_token_bytes(1)
    if geometry.slice_contiguous_pages(prefill_rank, decode_rank):
        # Whole token rows: a page is ps consecutive rows on both sides.
        unit_tokens, units, nbytes = ps, num_pages, ps * geometry.head_token_bytes(hs.num_heads)
    else:
        unit_tokens, units, nbytes = 1, num_pages * ps, geometry.head_token_bytes(hs.num_heads)
    kvl = np.arange(geometry.kv_factor * geometry.layers, dtype=np.int64).reshape(
        -1, 1
    )  # kv * L + layer
    tok = np.arange(units, dtype=np.int64).reshape(1, -1) * unit_tokens

    def addrs(desc: PoolDesc, first_page: int, head: int) -> np.ndarray:
        rows = (kvl * desc.num_tokens + first_page * ps + tok) * desc.heads + head
        return (desc.base_addr + rows * row).reshape(-1)

    s = addrs(src, src_first_page, hs.src_head_start)
    d = addrs(dst, dst_first_page, hs.dst_head_start)
    return SliceOps(src=s, dst=d, nbytes=np.full(s.shape, nbytes, dtype=np.int64))


def _tensor_span(t: torch.Tensor) -> tuple[int, int]:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("apply_ops needs contiguous CPU tensors")
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def apply_ops(ops: SliceOps, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Test helper: perform `ops` in-process with memmove, as a transport would.

    Every request is bounds-checked against the two tensors first, so an address bug
    fails the test instead of corrupting the interpreter's memory.
    """
    if len(ops) == 0:
        return
    for name, addrs, tensor in (("source", ops.src, src), ("destination", ops.dst, dst)):
        lo, hi = _tensor_span(tensor)
        bad = (addrs < lo) | (addrs + ops.nbytes > hi) | (ops.nbytes < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"request {i}: {name} [{int(addrs[i]):#x}, +{int(ops.nbytes[i])}) is outside "
                f"the tensor [{lo:#x}, {hi:#x})"
            )
    memmove = ctypes.memmove
    for s, d, n in ops.tuples():
        memmove(d, s, n)


def wait_for_stream(device: torch.device | str) -> None:
    """Block the calling thread until the kernels queued so far on its current CUDA
    stream finished (a no-op on the CPU). An event on that stream, not a device-wide
    synchronize: other streams (the transfer engine's) keep running meanwhile."""
    if str(device).startswith("cuda"):
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()
