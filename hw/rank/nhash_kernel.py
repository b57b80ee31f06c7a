"""The write tag's NH kernel (hw/rank/nhash.py defines the hash), in Triton: its own
module, imported only where a tag is hashed by it, so that a rank on host memory never
imports Triton.

One program hashes one 32 KiB chunk of a writer block, in block order, while it moves
the chunk between the block and a pool's slice [planes, layers, tokens t0.., heads h0..,
words]: SCATTER, block -> pool; else pool -> block (stored if STORE, else hashed only).
Either way the words hashed are the words moved, each read once. A contiguous block is
the slice of a pool of one row (`nhash.launch`). Under TRITON_INTERPRET=1 it runs on CPU
tensors, in numpy: how the tests hold it to the definition without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _div(x, d, d_m, d_s, MAGIC: tl.constexpr):
    """x // d for 0 <= x < 2^31 (uint32 x). MAGIC: by d's magic pair (`nhash.magic`), a
    high multiply, an add and a shift, where a division by a value known only at run
    time costs a GPU tens of instructions (the method PyTorch's IntDivider uses,
    Granlund and Montgomery, PLDI 1994); else one division, which numpy, under Triton's
    interpreter, does in one pass where the pair takes four."""
    if MAGIC:
        t = tl.umulhi(x, d_m.to(tl.uint32, bitcast=True))
        return ((t + x) >> d_s.to(tl.uint32)).to(tl.int32, bitcast=True)
    else:
        return x.to(tl.int32, bitcast=True) // d


@triton.jit
def _pool_word(pos, shape, t0, h0, S0, S1, S2, S3, MAGIC: tl.constexpr):
    """Block word `pos` -> its pool word, [plane, layer, token, head, word] of the slice.
    The divisions in 32 bits (a block under 2^31 words, checked on the host), the
    address in 64."""
    hw, hw_m, hw_s, nh, nh_m, nh_s, T, T_m, T_s, layers, ly_m, ly_s = shape
    x = pos.to(tl.int32).to(tl.uint32, bitcast=True)
    r = _div(x, hw, hw_m, hw_s, MAGIC)
    w = pos.to(tl.int32) - r * hw
    tok = _div(r.to(tl.uint32, bitcast=True), nh, nh_m, nh_s, MAGIC)
    h = r - tok * nh
    lay = _div(tok.to(tl.uint32, bitcast=True), T, T_m, T_s, MAGIC)
    t = tok - lay * T
    pl = _div(lay.to(tl.uint32, bitcast=True), layers, ly_m, ly_s, MAGIC)
    at = pl.to(tl.int64) * S0 + (lay - pl * layers).to(tl.int64) * S1
    return at + (t0 + t).to(tl.int64) * S2 + (h0 + h).to(tl.int64) * S3 + w


# the pool's shape, strides and offsets vary by room and rank: not compiled in (a kernel
# a value), only n_words is (its divisibility lets the block's loads widen); a divisor
# comes with its magic pair, both signed 32-bit (the pair's multiplier reinterpreted),
# so that no value changes the kernel's signature
@triton.jit(
    do_not_specialize=[
        "hw", "hw_m", "hw_s", "nh", "nh_m", "nh_s", "T", "T_m", "T_s",
        "layers", "ly_m", "ly_s", "S0", "S1", "S2", "S3", "t0", "h0",
    ]
)  # fmt: skip
def strided_nh(
    block,
    pool,
    keys,
    out,
    n_words,
    hw,
    hw_m,
    hw_s,
    nh,
    nh_m,
    nh_s,
    T,
    T_m,
    T_s,
    layers,
    ly_m,
    ly_s,
    S0,
    S1,
    S2,
    S3,
    t0,
    h0,
    W: tl.constexpr,
    TILE: tl.constexpr,
    SCATTER: tl.constexpr,
    STORE: tl.constexpr,
    MAGIC: tl.constexpr,
):
    shape = (hw, hw_m, hw_s, nh, nh_m, nh_s, T, T_m, T_s, layers, ly_m, ly_s)
    c = tl.program_id(0)
    base = c.to(tl.int64) * W
    half: tl.constexpr = W // 2
    acc0 = tl.zeros([TILE], dtype=tl.uint64)
    acc1 = tl.zeros([TILE], dtype=tl.uint64)
    for t in range(0, half, TILE):
        i = t + tl.arange(0, TILE)
        lo = base + i
        hi = lo + half
        mlo = lo < n_words
        mhi = hi < n_words
        plo = _pool_word(lo, shape, t0, h0, S0, S1, S2, S3, MAGIC)
        phi = _pool_word(hi, shape, t0, h0, S0, S1, S2, S3, MAGIC)
        if SCATTER:
            a = tl.load(block + lo, mask=mlo, other=0)
            b = tl.load(block + hi, mask=mhi, other=0)
            tl.store(pool + plo, a, mask=mlo)
            tl.store(pool + phi, b, mask=mhi)
        else:
            a = tl.load(pool + plo, mask=mlo, other=0)
            b = tl.load(pool + phi, mask=mhi, other=0)
            if STORE:
                tl.store(block + lo, a, mask=mlo)
                tl.store(block + hi, b, mask=mhi)
        a = a.to(tl.uint32, bitcast=True)
        b = b.to(tl.uint32, bitcast=True)
        k0a = tl.load(keys + i).to(tl.uint32, bitcast=True)
        k0b = tl.load(keys + half + i).to(tl.uint32, bitcast=True)
        k1a = tl.load(keys + W + i).to(tl.uint32, bitcast=True)
        k1b = tl.load(keys + W + half + i).to(tl.uint32, bitcast=True)
        acc0 += (a + k0a).to(tl.uint64) * (b + k0b).to(tl.uint64)
        acc1 += (a + k1a).to(tl.uint64) * (b + k1b).to(tl.uint64)
    tl.store(out + 2 * c, tl.sum(acc0, axis=0).to(tl.int64, bitcast=True))
    tl.store(out + 2 * c + 1, tl.sum(acc1, axis=0).to(tl.int64, bitcast=True))
