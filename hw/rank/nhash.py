"""The write tag's universal hash where the block lives on a GPU: NH, UMAC's inner hash,
run as one kernel over the block, so that only a digest 1/2048 of its size leaves the
device (docs/design.md, "The write tag").

For a block M (bytes, zero-padded to whole chunks) of n chunks of `CHUNK_WORDS`
little-endian 32-bit words m_0 .. m_{W-1}, and two keys K_0, K_1 of W words each:

    NH_K(chunk) = sum_{i < W/2} ((m_i + K_i) mod 2^32) * ((m_{i+W/2} + K_{i+W/2}) mod 2^32)
                  mod 2^64

and the digest is NH_{K_0}(c_1) | NH_{K_1}(c_1) | ... | NH_{K_1}(c_n), 8 bytes each,
little-endian: 16 bytes per 32 KiB chunk.

Why it is a universal hash: for two distinct messages of the same length, NH under a
uniformly random key collides with probability at most 2^-32 (Black, Halevi, Krawczyk,
Krovetz, Rogaway, "UMAC: Fast and Secure Message Authentication", CRYPTO 1999, section
3: NH over w-bit words is 2^-w almost-universal on equal-length strings). UMAC pairs
neighbouring words; pairing i with i + W/2 (which keeps a kernel's loads contiguous) is
NH of the words in a fixed other order under the key in that order, so the bound
holds unchanged. The digests of M != M' collide only if the first chunk where they
differ collides under both keys; the keys are independent, so at most 2^-64. Messages
of different lengths are told apart by the tag's PRF input, which holds the length.
The keys are expanded from the write MAC's key K by keyed BLAKE2b in counter mode
(a PRF), and never leave the rank.

The kernel (Triton, where it imports and the block is on a CUDA device) and the torch
form (any device, int64 arithmetic, which wraps modulo 2^64 as two's complement) compute
the same function; `nh_reference` is the same in numpy's unsigned arithmetic, for tests.
"""

from __future__ import annotations

import functools
import hashlib
import os

import numpy as np
import torch

CHUNK_WORDS = 8192  # 32 KiB a chunk
CHUNK_BYTES = 4 * CHUNK_WORDS
KEYS = 2  # independent NH keys: 2^-64 a collision
_HALF = CHUNK_WORDS // 2
_MASK32 = 0xFFFFFFFF


@functools.lru_cache(maxsize=256)
def nh_key_words(key: bytes) -> np.ndarray:
    """The NH keys (KEYS x CHUNK_WORDS uint32) expanded from the write MAC's key."""
    need = KEYS * CHUNK_BYTES
    out = b"".join(
        hashlib.blake2b(
            i.to_bytes(8, "big"), key=key, digest_size=64, person=b"kvs-nh-key"
        ).digest()
        for i in range(need // 64)
    )
    return np.frombuffer(out, dtype="<u4").reshape(KEYS, CHUNK_WORDS).copy()


_DEVICE_KEYS: dict[tuple[bytes, str], torch.Tensor] = {}


def _device_key(key: bytes, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The NH keys on `device` (int32 bit patterns for the kernel, int64 for torch)."""
    slot = (key, f"{device}:{dtype}")
    got = _DEVICE_KEYS.get(slot)
    if got is None:
        words = nh_key_words(key)
        host = (
            torch.from_numpy(words.view(np.int32).copy())
            if dtype == torch.int32
            else torch.from_numpy(words.astype(np.int64))
        )
        got = host.to(device)
        if len(_DEVICE_KEYS) >= 256:
            _DEVICE_KEYS.pop(next(iter(_DEVICE_KEYS)))
        _DEVICE_KEYS[slot] = got
    return got


def nh_reference(data: bytes, key: bytes) -> bytes:
    """The digest, in numpy's unsigned (wrapping) arithmetic: the definition."""
    n = max(1, -(-len(data) // CHUNK_BYTES))
    padded = np.zeros(n * CHUNK_BYTES, dtype=np.uint8)
    padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    words = padded.view("<u4").reshape(n, CHUNK_WORDS)
    keys = nh_key_words(key)
    out = np.empty((n, KEYS), dtype="<u8")
    with np.errstate(over="ignore"):
        for j in range(KEYS):
            a = (words + keys[j]).astype(np.uint64)  # uint32 + uint32 wraps mod 2^32
            out[:, j] = (a[:, :_HALF] * a[:, _HALF:]).sum(axis=1, dtype=np.uint64)
    return out.tobytes()


def _words(block: torch.Tensor) -> torch.Tensor:
    """A flat uint8 block as int32 words (a copy, zero-padded, only where its length or
    its alignment does not allow a view)."""
    flat = block.reshape(-1)
    if flat.numel() % 4 or flat.storage_offset() % 4:
        padded = torch.zeros(-(-flat.numel() // 4) * 4, dtype=torch.uint8, device=flat.device)
        padded[: flat.numel()] = flat
        flat = padded
    return flat.view(torch.int32)


_TORCH_CHUNKS = 512  # chunks a step of the torch form (16 MiB: bounds its int64 copies)


def nh_torch(block: torch.Tensor, key: bytes) -> torch.Tensor:
    """The digest as (chunks, KEYS) int64, in torch on the block's device."""
    words = _words(block)
    n = max(1, -(-words.numel() // CHUNK_WORDS))
    keys = _device_key(key, words.device, torch.int64)
    out = torch.empty((n, KEYS), dtype=torch.int64, device=words.device)
    for first in range(0, n, _TORCH_CHUNKS):
        m = min(_TORCH_CHUNKS, n - first)
        part = words[first * CHUNK_WORDS : (first + m) * CHUNK_WORDS]
        w = torch.zeros(m * CHUNK_WORDS, dtype=torch.int64, device=words.device)
        w[: part.numel()] = part.to(torch.int64) & _MASK32
        w = w.view(m, CHUNK_WORDS)
        for j in range(KEYS):
            a = (w + keys[j]) & _MASK32
            out[first : first + m, j] = (a[:, :_HALF] * a[:, _HALF:]).sum(dim=1)
    return out


# tests only: "1" runs the kernel's magic-pair divisions under Triton's interpreter too
MAGIC_ON_HOST_ENV = "KVSTAGE_TAG_KERNEL_MAGIC_ON_HOST"


@functools.lru_cache(maxsize=256)
def magic(d: int) -> tuple[int, int]:
    """The pair (m, s) with x // d == (umulhi(x, m) + x) >> s for every 0 <= x < 2^31
    (Granlund and Montgomery, PLDI 1994; PyTorch's IntDivider): s the least with
    2^s >= d, m = 2^32 (2^s - d) // d + 1 < 2^32, given as a signed 32-bit value (the
    kernel reinterprets it)."""
    if not 1 <= d < 2**31:
        raise ValueError(f"a divisor of {d}: the kernel divides by 1 .. 2^31 - 1")
    s = (d - 1).bit_length()
    m = (2**32 * (2**s - d)) // d + 1
    return (m - 2**32 if m >= 2**31 else m), s


@functools.lru_cache(maxsize=1)
def _kernel():
    """The NH kernel (hw/rank/nhash_kernel.py), imported on first use: None where Triton
    does not import (the CPU build of torch ships without it)."""
    try:
        from kvstage.hw.rank.nhash_kernel import strided_nh
    except ImportError:
        return None
    return strided_nh


def launch_strided(
    pool_words: torch.Tensor,
    block_words: torch.Tensor | None,
    key: bytes,
    tokens: slice,
    heads: slice,
    scatter: bool,
    tile: int | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """NH of the writer block that is `pool_words[:, :, tokens, heads]` (int32, a pool as
    [planes, layers, tokens, heads, words]) in block order, moving it as it hashes:
    scatter, `block_words` -> pool; else gather, pool -> `block_words` (None: hash
    only). The digest as (chunks, KEYS) int64, as `launch` gives for the gathered
    block."""
    planes, layers, _, _, hw = pool_words.shape
    T, nh = tokens.stop - tokens.start, heads.stop - heads.start
    n_words = planes * layers * T * nh * hw
    if block_words is not None and block_words.numel() != n_words:
        raise ValueError(f"the block holds {block_words.numel()} words, the slice {n_words}")
    if block_words is None and scatter:
        raise ValueError("a scatter needs the block it scatters")
    if n_words + CHUNK_WORDS >= 2**31:
        raise ValueError(f"a block of {4 * n_words} bytes: the kernel takes under 8 GiB")
    n = max(1, -(-n_words // CHUNK_WORDS))
    out = torch.empty((n, KEYS), dtype=torch.int64, device=pool_words.device)
    keys = _device_key(key, pool_words.device, torch.int32)
    S0, S1, S2, S3, _ = pool_words.stride()
    block = pool_words if block_words is None else block_words  # None: never stored to
    args = (block, pool_words, keys, out, n_words)
    for d in (hw, nh, T, layers):
        args += (d, *magic(d))
    args += (S0, S1, S2, S3, tokens.start, heads.start)
    shape = {"W": CHUNK_WORDS, "TILE": tile or TILE, "SCATTER": scatter}
    shape["STORE"] = block_words is not None
    # on a GPU the divisions by magic pairs; under the interpreter plain ones, faster in
    # numpy, unless MAGIC_ON_HOST_ENV is "1" (tests of the pairs' path)
    shape["MAGIC"] = pool_words.is_cuda or os.environ.get(MAGIC_ON_HOST_ENV) == "1"
    run_kernel(_kernel(), (n,), pool_words, args, warps or WARPS, **shape)
    return out


def run_kernel(kernel, grid: tuple[int, ...], on: torch.Tensor, args: tuple, warps: int, **meta):
    """Run a Triton kernel where `on` lives: a CPU tensor under the interpreter (tests),
    as it is; on a GPU with `warps` warps, from that device even where another is
    current (a rank's kernels and the cipher's)."""
    if not on.is_cuda:  # the interpreter (tests)
        kernel[grid](*args, **meta)
    elif on.device.index == torch.cuda.current_device():
        kernel[grid](*args, **meta, num_warps=warps)
    else:
        with torch.cuda.device(on.device):
            kernel[grid](*args, **meta, num_warps=warps)


# why the kernel is not used in this process (None: it is, where Triton imports): set when
# it failed to compile or run on this GPU (hw/rank/kernels.py `warm_hashed_moves`); the
# torch form computes the same digest, so a rank that falls back still agrees with peers
_refused: str | None = None


def refuse_kernel(why: str) -> None:
    global _refused
    _refused = why


def kernel_ready() -> bool:
    """Whether the Triton kernel can be used in this process."""
    return _refused is None and _kernel() is not None


def kernel_available(block: torch.Tensor) -> bool:
    return block.is_cuda and kernel_ready()


def launch(
    words: torch.Tensor,
    key: bytes,
    dst: torch.Tensor | None = None,
    tile: int | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """The kernel over contiguous int32 `words` (copied into int32 `dst` if given): the
    digest as (chunks, KEYS) int64 on their device."""
    row = words.reshape(1, 1, 1, 1, -1)  # a pool of one row: block word i is word i
    one = slice(0, 1)
    return launch_strided(row, dst, key, one, one, scatter=False, tile=tile, warps=warps)


# the kernel's shape: TILE word pairs a step, WARPS warps a chunk (benchmarks/checksum_cost.py
# --device cuda --parts measures the choices on the GPU at hand)
TILE, WARPS = 1024, 8


def _aligned_words(block: torch.Tensor) -> bool:
    return block.numel() % 4 == 0 and block.storage_offset() % 4 == 0


def nh_device(
    block: torch.Tensor,
    key: bytes,
    copy_to: torch.Tensor | None = None,
    tile: int | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """The digest as (chunks, KEYS) int64 on the block's device: the kernel on a CUDA
    block where Triton imports, else the torch form. With `copy_to` (a flat uint8 tensor
    of the block's size on its device) the block is also copied there, by the same
    kernel where it can: what is hashed is what was copied."""
    if copy_to is not None and copy_to.numel() != block.numel():
        raise ValueError(f"copy_to holds {copy_to.numel()} bytes, the block {block.numel()}")
    fused = copy_to is not None and _aligned_words(block) and _aligned_words(copy_to)
    if not kernel_available(block) or (copy_to is not None and not fused):
        if copy_to is not None:
            copy_to.copy_(block.reshape(-1))
            block = copy_to
        return nh_torch(block, key)
    words = _words(block)
    return launch(words, key, copy_to.view(torch.int32) if fused else None, tile, warps)


def nh_digest(block: torch.Tensor, key: bytes, copy_to: torch.Tensor | None = None) -> bytes:
    """The digest's bytes on the host (the one copy off the device: 16 bytes a chunk)."""
    return nh_device(block, key, copy_to).cpu().numpy().astype("<i8").tobytes()
