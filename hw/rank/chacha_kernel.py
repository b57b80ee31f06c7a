"""ChaCha20 (RFC 8439) where a KV block lives on a GPU: the keystream XORed into the
block by one Triton kernel, so that a block a prefill rank writes into a decode rank's
staging ring is ciphertext there, and nothing else of it leaves the device. Its own
module, imported only where a block is enciphered on a device, so that a rank on host
memory (which uses `cryptography`'s ChaCha20) never imports Triton.

The cipher is that of RFC 8439 section 2.4: ChaCha block j of the data (64 bytes, the
last one possibly partial) is XORed with the block function (section 2.3) of the state

    "expa" "nd 3" "2-by" "te k"     the constants 0x61707865 0x3320646e 0x79622d32 0x6b206574
    k0 k1 k2 k3 k4 k5 k6 k7         the 32-byte key, little-endian words
    counter + j  n0 n1 n2           the 32-bit block counter, the 12-byte nonce's words

run through 20 rounds (10 double rounds: a quarter round on each column, then on each
diagonal; rotations by 16, 12, 8, 7) and added to itself, word by word, mod 2^32.
Output word w of block j is XORed into data word 16 j + w (little-endian words, as the
cipher's bytes are), so the keystream is byte for byte `cryptography`'s
`algorithms.ChaCha20(key, counter.to_bytes(4, "little") + nonce)`. The counter never
wraps: a block that would need it to is refused on the host.

One program enciphers BLOCKS consecutive ChaCha blocks, one a lane: the 16 state words
are 16 uint32 tensors of BLOCKS lanes, in registers. A lane reads each of its block's
words before it writes it, and no other lane touches them, so the data may be
enciphered in place. The data is any whole number of 32-bit words: the lanes and words
past its end are masked. Under TRITON_INTERPRET=1 the kernel runs on CPU tensors, in
numpy: how the tests hold it to `cryptography` without a GPU.
"""

from __future__ import annotations

import os
import struct

import torch
import triton
import triton.language as tl

from kvstage.hw.rank.nhash import run_kernel


@triton.jit
def _rotl(x, n: tl.constexpr):
    """x rotated left by n bits (uint32 x: both shifts logical)."""
    return (x << n) | (x >> (32 - n))


@triton.jit
def _quarter(a, b, c, d):
    """RFC 8439 section 2.1's quarter round."""
    a += b
    d = _rotl(d ^ a, 16)
    c += d
    b = _rotl(b ^ c, 12)
    a += b
    d = _rotl(d ^ a, 8)
    c += d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


@triton.jit
def _xor_word(src, dst, at, n_words, x, s):
    """Output word x + s (the round's word plus the input state's) XORed into the data
    words at `at`, read before they are written."""
    mask = at < n_words
    data = tl.load(src + at, mask=mask, other=0).to(tl.uint32, bitcast=True)
    tl.store(dst + at, (data ^ (x + s)).to(tl.int32, bitcast=True), mask=mask)


# the key, the counter and the nonce change from block to block, the length from room to
# room: values, not compiled in (a word each as a signed 32-bit value, which the kernel
# reinterprets, so that no value changes the kernel's signature), so that one compiled
# kernel serves every block; a lane's loads are 64 bytes apart, so n_words's divisibility
# would widen none of them
@triton.jit(
    do_not_specialize=[
        "n_words", "k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "counter", "n0", "n1", "n2",
    ]
)  # fmt: skip
def chacha20_xor_kernel(
    src,
    dst,
    n_words,
    k0,
    k1,
    k2,
    k3,
    k4,
    k5,
    k6,
    k7,
    counter,
    n0,
    n1,
    n2,
    BLOCKS: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * BLOCKS
    j = first + tl.arange(0, BLOCKS)  # the lane's ChaCha block
    at = j * 16  # its first data word
    s0 = tl.full([BLOCKS], 0x61707865, tl.uint32)
    s1 = tl.full([BLOCKS], 0x3320646E, tl.uint32)
    s2 = tl.full([BLOCKS], 0x79622D32, tl.uint32)
    s3 = tl.full([BLOCKS], 0x6B206574, tl.uint32)
    zero = tl.zeros([BLOCKS], dtype=tl.uint32)  # the scalars as lanes (loop-carried)
    s4 = zero + k0.to(tl.uint32, bitcast=True)
    s5 = zero + k1.to(tl.uint32, bitcast=True)
    s6 = zero + k2.to(tl.uint32, bitcast=True)
    s7 = zero + k3.to(tl.uint32, bitcast=True)
    s8 = zero + k4.to(tl.uint32, bitcast=True)
    s9 = zero + k5.to(tl.uint32, bitcast=True)
    s10 = zero + k6.to(tl.uint32, bitcast=True)
    s11 = zero + k7.to(tl.uint32, bitcast=True)
    s12 = counter.to(tl.uint32, bitcast=True) + j.to(tl.uint32)  # no wrap (host-checked)
    s13 = zero + n0.to(tl.uint32, bitcast=True)
    s14 = zero + n1.to(tl.uint32, bitcast=True)
    s15 = zero + n2.to(tl.uint32, bitcast=True)
    x0, x1, x2, x3, x4, x5, x6, x7 = s0, s1, s2, s3, s4, s5, s6, s7
    x8, x9, x10, x11, x12, x13, x14, x15 = s8, s9, s10, s11, s12, s13, s14, s15
    for _ in range(10):  # a double round: the columns, then the diagonals
        x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
    _xor_word(src, dst, at, n_words, x0, s0)
    _xor_word(src, dst, at + 1, n_words, x1, s1)
    _xor_word(src, dst, at + 2, n_words, x2, s2)
    _xor_word(src, dst, at + 3, n_words, x3, s3)
    _xor_word(src, dst, at + 4, n_words, x4, s4)
    _xor_word(src, dst, at + 5, n_words, x5, s5)
    _xor_word(src, dst, at + 6, n_words, x6, s6)
    _xor_word(src, dst, at + 7, n_words, x7, s7)
    _xor_word(src, dst, at + 8, n_words, x8, s8)
    _xor_word(src, dst, at + 9, n_words, x9, s9)
    _xor_word(src, dst, at + 10, n_words, x10, s10)
    _xor_word(src, dst, at + 11, n_words, x11, s11)
    _xor_word(src, dst, at + 12, n_words, x12, s12)
    _xor_word(src, dst, at + 13, n_words, x13, s13)
    _xor_word(src, dst, at + 14, n_words, x14, s14)
    _xor_word(src, dst, at + 15, n_words, x15, s15)


# the kernel's shape: BLOCKS ChaCha blocks (16 KiB of data at 256) a program, WARPS warps a
# program (2 lanes a thread: 54 registers, no spills, as Triton 3.6's ptxas compiles it
# for sm_90; 512 lanes take 102); not yet measured on a GPU against other choices
BLOCKS, WARPS = 256, 4


def _check_flat(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        what = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else t
        raise ValueError(f"{name} is {what}: the kernel takes a flat uint8 tensor")
    if t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} has stride {t.stride(0)}: the kernel takes contiguous bytes")
    if t.numel() % 4:
        raise ValueError(f"{name} holds {t.numel()} bytes: the kernel takes whole 4-byte words")
    if t.storage_offset() % 4 or t.data_ptr() % 4:
        raise ValueError(
            f"{name} starts at byte {t.storage_offset()} of its storage (address "
            f"{t.data_ptr():#x}): the kernel takes blocks aligned to 4 bytes"
        )


def chacha20_xor(
    src: torch.Tensor,
    dst: torch.Tensor,
    key: bytes,
    counter: int = 0,
    nonce: bytes = bytes(12),
    *,
    blocks: int | None = None,
    warps: int | None = None,
) -> None:
    """dst = src XOR ChaCha20's keystream (RFC 8439) under `key` (32 bytes) and `nonce`
    (12 bytes) from block `counter`: the kernel, on the tensors' CUDA device (on the CPU
    under TRITON_INTERPRET=1), on its current stream, which the caller waits on. `src`
    and `dst`: flat uint8 tensors of one size, a whole number of 4-byte words, each
    aligned to 4 bytes, on one device; `dst` may be `src` (in place), but no other
    overlap. `blocks`, `warps`: the kernel's shape (default BLOCKS, WARPS)."""
    _check_flat("src", src)
    _check_flat("dst", dst)
    if src.numel() != dst.numel():
        raise ValueError(f"src holds {src.numel()} bytes, dst {dst.numel()}: they must match")
    if src.device != dst.device:
        raise ValueError(f"src is on {src.device}, dst on {dst.device}: they must be on one")
    if not src.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the block is on {src.device}: the kernel runs on a CUDA device "
            "(or on the CPU under TRITON_INTERPRET=1)"
        )
    n = src.numel()
    if src.data_ptr() != dst.data_ptr() and (
        src.data_ptr() < dst.data_ptr() + n and dst.data_ptr() < src.data_ptr() + n
    ):
        raise ValueError("src and dst overlap: dst must be src itself or apart from it")
    if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
        raise ValueError(f"a key of {_length(key)}: ChaCha20 takes 32 bytes")
    if not isinstance(nonce, (bytes, bytearray)) or len(nonce) != 12:
        raise ValueError(f"a nonce of {_length(nonce)}: ChaCha20 (RFC 8439) takes 12 bytes")
    n_blocks = -(-n // 64)
    if not isinstance(counter, int) or not 0 <= counter < 2**32:
        raise ValueError(f"a counter of {counter!r}: ChaCha20's is 0 .. 2^32 - 1")
    if counter + n_blocks > 2**32:
        raise ValueError(
            f"{n} bytes from block {counter} need blocks past 2^32 - 1: the 32-bit "
            "counter would wrap (at most (2^32 - counter) * 64 bytes)"
        )
    if n == 0:
        return
    tile = blocks or BLOCKS
    if tile & (tile - 1):
        raise ValueError(f"a tile of {tile} blocks: the kernel takes a power of two")
    args = (src.view(torch.int32), dst.view(torch.int32), n // 4)
    args += struct.unpack("<8i", key)
    args += (counter - 2**32 if counter >= 2**31 else counter,)
    args += struct.unpack("<3i", nonce)
    grid = (-(-n_blocks // tile),)
    run_kernel(chacha20_xor_kernel, grid, src, args, warps or WARPS, BLOCKS=tile)


def _length(value: object) -> str:
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    return f"type {type(value).__name__}"
