"""Paged synthetic KV pools and the bit-exact verification pattern (hardware mode).

A `KVPool` is one rank's KV cache: per layer a K and a V buffer of shape
[num_pages * page_size, heads, head_dim]. All of it lives in ONE contiguous tensor
shaped [2, layers, tokens, heads, head_dim] (K/V-major) so a transfer engine can
register the whole pool as a single memory region. An MLA model has one plane, the
latent (`kv_planes=1`, heads 1, head_dim = latent width): [1, layers, tokens, 1, latent].

The pattern gives every element a value that depends on (room, layer, K/V, GLOBAL
head, token position in the prompt, element index): a 32-bit hash per row
(K/V, layer, position, head) spread over the row's elements (see `pattern_bits`),
stored through an integer view of the dtype's bits, never as a float, so no rounding or NaN canonicalisation can make equal bytes compare unequal
(or the reverse). Bytes moved into the wrong head, layer, K/V half, token or page
therefore show up as wrong bytes in `verify`.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Scenario dtype name -> (torch dtype, same-width integer dtype used for its bits).
DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "bf16": (torch.bfloat16, torch.int16),
    "fp16": (torch.float16, torch.int16),
    "fp32": (torch.float32, torch.int32),
    "fp8": (torch.float8_e4m3fn, torch.uint8),
}

_M32 = 0xFFFFFFFF
# Hash multipliers are odd (so multiplication is a bijection mod 2^32) and below 2^31,
# so a product with a 32-bit value stays below 2^63: int64 never overflows, on any
# device, and the hash is identical on CPU and CUDA.
_MUL1 = 0x7FEB352D
_MUL2 = 0x2C1B3C6D
_C_KVL = 0x1B873593
_C_POS = 0x27D4EB2F
_C_HEAD = 0x165667B1
_C_ELEM = 0x61C88647

# Elements per fill/verify step: bounds the temporaries (a few dtype-sized copies plus
# int64 row hashes) so a 32k-token room of a 70B model does not need gigabytes of
# scratch memory, while steps stay large enough that per-op overhead does not matter.
_STEP_ELEMS = 1 << 23


def resolve_dtype(dtype: str | torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(torch dtype, integer bits dtype) for a scenario dtype name or a torch dtype."""
    if isinstance(dtype, str):
        try:
            return DTYPES[dtype]
        except KeyError:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None
    for pair in DTYPES.values():
        if pair[0] == dtype:
            return pair
    raise ValueError(f"unsupported KV dtype {dtype}; allowed: {sorted(DTYPES)}")


@dataclass(frozen=True, slots=True)
class PoolDesc:
    """What a peer needs to compute addresses inside a pool: sent in handshake metadata."""

    base_addr: int
    layers: int
    num_tokens: int
    heads: int
    head_dim: int
    elem_bytes: int
    page_size: int
    kv_planes: int = 2  # K and V; 1 for an MLA latent

    @property
    def token_bytes_per_head(self) -> int:
        return self.head_dim * self.elem_bytes

    @property
    def num_pages(self) -> int:
        return self.num_tokens // self.page_size

    @property
    def nbytes(self) -> int:
        return (
            self.kv_planes * self.layers * self.num_tokens * self.heads * self.token_bytes_per_head
        )

    def addr(self, kv: int, layer: int, token: int, head: int) -> int:
        """Absolute address of element 0 of (K/V, layer, token, head)."""
        row = ((kv * self.layers + layer) * self.num_tokens + token) * self.heads + head
        return self.base_addr + row * self.token_bytes_per_head

    def page_runs(self, first_page: int, num_pages: int) -> list[tuple[int, int]]:
        """The bytes of pages [first_page, first_page + num_pages), every head: one
        (address, nbytes) run per (K/V, layer), in address order."""
        tokens = num_pages * self.page_size
        n = tokens * self.heads * self.token_bytes_per_head
        first = first_page * self.page_size
        return [
            (self.addr(kv, layer, first, 0), n)
            for kv in range(self.kv_planes)
            for layer in range(self.layers)
        ]

    def to_wire(self) -> dict[str, int]:
        return {
            "base_addr": self.base_addr,
            "layers": self.layers,
            "num_tokens": self.num_tokens,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "elem_bytes": self.elem_bytes,
            "page_size": self.page_size,
            "kv_planes": self.kv_planes,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> PoolDesc:
        # kv_planes may be absent (a peer from before MLA): its default, K and V, applies
        return cls(**{k: int(data[k]) for k in cls.__slots__ if k in data or k != "kv_planes"})


class KVPool:
    """One rank's paged KV cache: a [kv_planes, layers, tokens, heads, head_dim] tensor
    (kv_planes 2: K and V; 1: an MLA latent) + page allocator."""

    def __init__(
        self,
        layers: int,
        num_pages: int,
        page_size: int,
        heads: int,
        head_dim: int,
        dtype: str | torch.dtype = "bf16",
        device: str | torch.device = "cpu",
        fill_byte: int | None = 0,
        kv_planes: int = 2,
    ) -> None:
        if kv_planes not in (1, 2):
            raise ValueError(
                f"kv_planes must be 2 (K and V) or 1 (an MLA latent), got {kv_planes!r}"
            )
        for name, value in (
            ("layers", layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("heads", heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.layers = layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.heads = heads
        self.head_dim = head_dim
        self.kv_planes = kv_planes
        self.dtype, self.bits_dtype = resolve_dtype(dtype)
        self.num_tokens = num_pages * page_size
        shape = (kv_planes, layers, self.num_tokens, heads, head_dim)
        # Allocate as bytes and view as the dtype: every later access goes through bit
        # views. fill_byte lets a test start from a sentinel (to see stray writes);
        # None skips the fill for large pools that are overwritten anyway.
        elem = torch.empty((), dtype=self.dtype).element_size()
        raw = torch.empty(
            (kv_planes, layers, self.num_tokens, heads, head_dim * elem),
            dtype=torch.uint8,
            device=device,
        )
        if fill_byte is not None:
            raw.fill_(fill_byte)
        self.tensor: torch.Tensor = raw.view(self.dtype).view(shape)
        self.elem_bytes = elem

    # --- views and addresses ---------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def bits(self) -> torch.Tensor:
        """The pool as its same-width integer dtype, [kv_planes, L, tokens, heads, head_dim]."""
        return self.tensor.view(self.bits_dtype)

    @property
    def bytes(self) -> torch.Tensor:
        """The pool as bytes, [kv_planes, L, tokens, heads, head_dim * elem_bytes]."""
        return self.tensor.view(torch.uint8)

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.elem_bytes

    @property
    def token_bytes_per_head(self) -> int:
        return self.head_dim * self.elem_bytes

    @property
    def desc(self) -> PoolDesc:
        return PoolDesc(
            base_addr=self.data_ptr,
            layers=self.layers,
            num_tokens=self.num_tokens,
            heads=self.heads,
            head_dim=self.head_dim,
            elem_bytes=self.elem_bytes,
            page_size=self.page_size,
            kv_planes=self.kv_planes,
        )

    def addr(self, kv: int, layer: int, token: int, head: int) -> int:
        """Absolute address of element 0 of (K/V, layer, token, head)."""
        return self.desc.addr(kv, layer, token, head)

    def check_pages(self, first_page: int, num_pages: int) -> None:
        if num_pages < 0 or first_page < 0 or first_page + num_pages > self.num_pages:
            raise ValueError(
                f"pages [{first_page}, {first_page + num_pages}) outside the pool "
                f"(0..{self.num_pages - 1})"
            )

    def __repr__(self) -> str:
        return (
            f"KVPool(layers={self.layers}, pages={self.num_pages}x{self.page_size}, "
            f"heads={self.heads}, head_dim={self.head_dim}, kv_planes={self.kv_planes}, "
            f"dtype={self.dtype}, device={self.device})"
        )


# --- the pattern ---------------------------------------------------------------


def room_salt(room: int | str) -> int:
    """A stable 32-bit salt for a room id (Python's hash() is randomised per process)."""
    digest = hashlib.blake2b(repr(room).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection on [0, 2^32) held in int64 (xorshift-multiply, lowbias32 shape).

    Being a bijection, distinct inputs never collide before truncation to the dtype
    width; in-place ops keep the peak memory at two tensors.
    """
    x = x ^ (x >> 16)
    x.mul_(_MUL1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16)
    return x


_BITS_WIDTH: dict[torch.dtype, int] = {torch.int16: 16, torch.int32: 32, torch.uint8: 8}


def _as_bits(u: torch.Tensor, bits_dtype: torch.dtype) -> torch.Tensor:
    """Unsigned values in [0, 2^w) (int64) -> the w-bit integer with that bit pattern.

    Done by arithmetic (two's complement folding), not by an overflowing cast, so it is
    defined behaviour on every device.
    """
    width = _BITS_WIDTH[bits_dtype]
    if bits_dtype == torch.uint8:
        return u.to(torch.uint8)
    half = 1 << (width - 1)
    return (((u + half) & ((1 << width) - 1)) - half).to(bits_dtype)


def row_hashes(
    layers: int, positions: torch.Tensor, global_heads: Sequence[int], salt: int, kv_planes: int = 2
) -> torch.Tensor:
    """32-bit hash per (K/V, layer, position, global head): int64 [kv_planes, layers, T, heads].

    Nested: each stage adds one coordinate and re-mixes, so the value depends on all
    of them and two different rows collide only with probability ~2^-32. An MLA
    latent (kv_planes 1) hashes like the K plane of the same geometry.
    """
    device = positions.device
    pos = positions.to(torch.int64)
    heads = torch.as_tensor(list(global_heads), dtype=torch.int64, device=device)
    kvl = torch.arange(kv_planes * layers, dtype=torch.int64, device=device)  # kv * layers + layer
    h = _mix32((kvl * _C_KVL + salt) & _M32).view(kv_planes, layers, 1, 1)
    h = _mix32((h + pos.view(1, 1, -1, 1) * _C_POS) & _M32)
    return _mix32((h + heads.view(1, 1, 1, -1) * _C_HEAD) & _M32)


def pattern_bits(
    layers: int,
    positions: torch.Tensor,
    global_heads: Sequence[int],
    head_dim: int,
    bits_dtype: torch.dtype,
    salt: int,
    kv_planes: int = 2,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The pattern for the given prompt positions: [kv_planes, layers, T, heads, head_dim] bits,
    written into `out` when given (a pool view: the fill writes its pages in one pass).

    Element e of a row is w-bit window (e mod 32/w) of the row's 32-bit hash, XORed
    with a per-(room, e) mask. So every row of at least 32/w elements carries its whole
    row hash (rows stay distinct: any swap of two rows is visible), and the per-element
    work is one narrow-integer XOR instead of an int64 hash, which is what makes
    filling and verifying large pools fast on CPUs.
    """
    width = _BITS_WIDTH[bits_dtype]
    h = row_hashes(layers, positions, global_heads, salt, kv_planes)
    e = torch.arange(head_dim, dtype=torch.int64, device=h.device)
    mask = _as_bits(_mix32((e * _C_ELEM + salt) & _M32) & ((1 << width) - 1), bits_dtype)
    if out is None:
        out = torch.empty((*h.shape, head_dim), dtype=bits_dtype, device=h.device)
    _write_pattern(out, h, mask)
    return out


def _write_pattern(out: torch.Tensor, h: torch.Tensor, mask: torch.Tensor) -> None:
    """out[..., e] = window (e mod 32/w) of the row's hash ^ mask[e], in one pass over
    `out` (a fresh tensor, or a pool view whose last dimension is contiguous)."""
    width = _BITS_WIDTH[out.dtype]
    per_row = 32 // width
    head_dim = out.shape[-1]
    if _words_fit(out, head_dim * width // 8, per_row):
        # The 32/w windows of a row hash, laid out little-endian, are the hash's own 32
        # bits: a row is that word repeated, XOR the mask. So write 8-byte words, each
        # the hash twice (row-sized work), against the mask's words: one full-size op.
        twice = (
            _as_bits(h, torch.int32)
            .unsqueeze(-1)
            .expand(*h.shape, 2)
            .contiguous()
            .view(torch.int64)
        )
        torch.bitwise_xor(twice, mask.view(torch.int64), out=out.view(torch.int64))
        return
    shifts = torch.arange(min(per_row, head_dim), dtype=torch.int64, device=h.device) * width
    windows = _as_bits((h.unsqueeze(-1) >> shifts) & ((1 << width) - 1), out.dtype)
    full = windows.repeat(*([1] * (windows.dim() - 1)), -(-head_dim // windows.shape[-1]))[
        ..., :head_dim
    ]
    torch.bitwise_xor(full, mask, out=out)


def _words_fit(out: torch.Tensor, row_bytes: int, per_row: int) -> bool:
    """Whether `out` can be written as int64 words of repeated row hashes."""
    ratio = 8 // out.element_size()
    return (
        sys.byteorder == "little"
        and out.shape[-1] % per_row == 0
        and row_bytes % 8 == 0
        and out.stride(-1) == 1
        and out.storage_offset() % ratio == 0
        and all(st % ratio == 0 for st in out.stride()[:-1])
    )


def _check_heads(pool: KVPool, global_head_of_local: Sequence[int]) -> None:
    if len(global_head_of_local) != pool.heads:
        raise ValueError(
            f"global_head_of_local has {len(global_head_of_local)} entries, pool has "
            f"{pool.heads} heads"
        )


def _token_steps(pool: KVPool, num_tokens: int) -> Iterator[tuple[int, int]]:
    """[t0, t1) token ranges whose pattern fits in _STEP_ELEMS elements."""
    per_token = pool.kv_planes * pool.layers * pool.heads * pool.head_dim
    step = max(1, _STEP_ELEMS // per_token)
    for t0 in range(0, num_tokens, step):
        yield t0, min(num_tokens, t0 + step)


def _positions(pool: KVPool, token_offset: int, t0: int, t1: int) -> torch.Tensor:
    return torch.arange(token_offset + t0, token_offset + t1, dtype=torch.int64, device=pool.device)


def fill_pattern(
    pool: KVPool,
    first_page: int,
    num_pages: int,
    room: int | str,
    token_offset: int,
    global_head_of_local: Sequence[int],
) -> None:
    """Write the room's pattern into pages [first_page, first_page + num_pages) of a prefill pool.

    `token_offset` is the prompt position of the first page's first token, so a room
    whose decode side caches a prefix carries the pattern of the right positions.
    """
    pool.check_pages(first_page, num_pages)
    _check_heads(pool, global_head_of_local)
    salt = room_salt(room)
    base = first_page * pool.page_size
    bits = pool.bits
    for t0, t1 in _token_steps(pool, num_pages * pool.page_size):
        pos = _positions(pool, token_offset, t0, t1)
        pattern_bits(
            pool.layers,
            pos,
            global_head_of_local,
            pool.head_dim,
            pool.bits_dtype,
            salt,
            pool.kv_planes,
            out=bits[:, :, base + t0 : base + t1],
        )  # straight into the pool


def expected_pattern(
    pool: KVPool,
    num_pages: int,
    room: int | str,
    token_offset: int,
    global_head_of_local: Sequence[int],
) -> torch.Tensor:
    """The room's expected KV for `num_pages` pages, [kv_planes, L, T, heads, head_dim], pool dtype."""
    _check_heads(pool, global_head_of_local)
    pos = _positions(pool, token_offset, 0, num_pages * pool.page_size)
    bits = pattern_bits(
        pool.layers,
        pos,
        global_head_of_local,
        pool.head_dim,
        pool.bits_dtype,
        room_salt(room),
        pool.kv_planes,
    )
    return bits.view(pool.dtype)


def _sample_pages(num_pages: int, max_pages: int = 8) -> list[int]:
    """First, last and evenly spread pages: catches page offset and ordering errors cheaply."""
    if num_pages <= max_pages:
        return list(range(num_pages))
    step = (num_pages - 1) / (max_pages - 1)
    return sorted({round(i * step) for i in range(max_pages)})


def verify(
    pool: KVPool,
    first_page: int,
    num_pages: int,
    room: int | str,
    token_offset: int,
    global_head_of_local: Sequence[int],
    sample: bool = False,
) -> tuple[int, int]:
    """Compare a decode pool's room pages with the pattern: (bytes_checked, bytes_wrong).

    `sample=True` checks only a few whole pages (all layers, K/V and heads) — a cheap
    check for large runs; the full check compares every byte.
    """
    pool.check_pages(first_page, num_pages)
    _check_heads(pool, global_head_of_local)
    salt = room_salt(room)
    row_bytes = pool.token_bytes_per_head
    pool_bytes = pool.bytes
    ps = pool.page_size
    base = first_page * ps
    checked = 0
    wrong = torch.zeros((), dtype=torch.int64, device=pool.device)
    if sample:
        # At most 8 page slices; index_select over the token dim is far slower on CPU.
        steps: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                pool_bytes[:, :, base + p * ps : base + (p + 1) * ps],
                _positions(pool, token_offset, p * ps, (p + 1) * ps),
            )
            for p in _sample_pages(num_pages)
        ]
    else:
        steps = [
            (pool_bytes[:, :, base + t0 : base + t1], _positions(pool, token_offset, t0, t1))
            for t0, t1 in _token_steps(pool, num_pages * ps)
        ]
    word = next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)
    word_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    for actual, pos in steps:
        exp = pattern_bits(
            pool.layers,
            pos,
            global_head_of_local,
            pool.head_dim,
            pool.bits_dtype,
            salt,
            pool.kv_planes,
        )
        exp_bytes = exp.view(torch.uint8).view(*exp.shape[:-1], row_bytes)
        checked += exp_bytes.numel()
        # Compare whole words first (the common, all-correct case is 8x fewer compares);
        # count exact wrong bytes only where a word differs.
        if torch.equal(actual.view(word_dtype), exp_bytes.view(word_dtype)):
            continue
        wrong += (actual != exp_bytes).sum()
    return checked, int(wrong.item())
