"""The write tag: what a writer sends in CHUNK_READY so the decode can tell its block
from bytes that reached the decode's memory any other way.

transfer.verify_writes names the function (docs/design.md, "The write tag"):

- "mac" (the default): a Carter-Wegman MAC, hash then PRF. For the writer block M of
  (room, chunk), written under the grant nonce N (on the slice path, the room nonce):

      k_N   = BLAKE2b(key = K, person = "kvs-poly-key", N | room | chunk)     32 bytes
      h     = Poly1305(k_N, M)                                                16 bytes
      tag   = BLAKE2b(key = K, person = "kvs-write-tag", N | room | chunk | |M| | h)

  truncated to 63 bits (never 0: 0 means "no tag"), with K = `mac_key(pair key of
  writer -> decode)`. Poly1305 (RFC 8439, OpenSSL's vectorised code through
  `cryptography`) is the universal hash; BLAKE2b keyed (RFC 7693) the PRF.
  Forgery bound, per attempt: 8 * ceil(|M| / 16) / 2^106 + 2^-63 (+ the PRF's
  distinguishing advantage). A forger that changes M to M' != M wins either when
  Poly1305 collides under the secret one-time key (Bernstein, "The Poly1305-AES
  message-authentication code", FSE 2005, Theorem 3.3: at most 8 * ceil(L/16) / 2^106
  for messages of L bytes), or, when it does not, by guessing a 63-bit PRF output at an
  input it never saw (2^-63). For a 16 MiB block: 2^-83 + 2^-63, about 2^-63.

  A block on a CUDA device is first compressed where it lives: NH, UMAC's inner hash,
  under two keys expanded from K, one kernel over the block (hw/rank/nhash.py), so
  that only its digest D (16 bytes a 32 KiB chunk) is copied to the host; then

      k_N   = BLAKE2b(key = K, person = "kvs-nh-poly", N | room | chunk)
      h     = Poly1305(k_N, D)
      tag   = BLAKE2b(key = K, person = "kvs-nh-tag", N | room | chunk | |M| | h)

  Forgery bound, per attempt: 2^-64 (the digests of M != M' of one length collide)
  + 8 * ceil(|D| / 16) / 2^106 + 2^-63, about 2^-62. The two forms have their own
  personalisations, so a tag of one is never a tag of the other; the ranks of a run
  keep their KV on one kind of device (the launcher passes one --device to all); a
  run that mixes them is refused when the table arrives, naming both ranks
  (hw/rank/process.py `_check_tag_forms`).
- "checksum": keyed BLAKE2b over the whole block (the check before "mac"), salted with
  (room, chunk): a PRF, about 5-15x slower than "mac" on a CPU core.
- "none": no tag (an explicit opt-out).

The tag is computed over a copy no peer can write (`private_copy`): the gathered block
before it enters the registered send buffer, or the decode's copy before it scatters.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

from kvstage.hw.control.keys import CHECKSUM_MASK, block_checksum, write_key
from kvstage.hw.control.keys import _hkdf as hkdf
from kvstage.hw.rank.nhash import nh_device

KINDS = ("none", "checksum", "mac")
_MAC = b"kvstage write mac v1"
_BIND = struct.Struct("!QQQ")  # nonce, room, chunk
_LEN = struct.Struct("!Q")


def mac_key(pair_key: bytes) -> bytes:
    """K of the write MAC, from the pair key of writer -> decode (HKDF, its own label)."""
    return hkdf(pair_key, _MAC, b"")


def tag_key(kind: str, pair_key: bytes) -> bytes:
    """The key of `kind`'s tags from the pair key of writer -> decode."""
    if kind == "mac":
        return mac_key(pair_key)
    if kind == "checksum":
        return write_key(pair_key)
    raise ValueError(f"transfer.verify_writes = {kind!r} has no key (allowed: checksum, mac)")


def block_mac(key: bytes, room: int, chunk: int, nonce: int, data) -> int:
    """The "mac" tag of one writer block (a bytes-like object: bytes, a numpy array)."""
    bind = _BIND.pack(nonce, room, chunk)
    one_time = hashlib.blake2b(bind, key=key, digest_size=32, person=b"kvs-poly-key").digest()
    h = Poly1305.generate_tag(one_time, data)
    size = memoryview(data).nbytes
    digest = hashlib.blake2b(
        bind + _LEN.pack(size) + h, key=key, digest_size=8, person=b"kvs-write-tag"
    ).digest()
    return (int.from_bytes(digest, "big") & CHECKSUM_MASK) or 1


def device_mac(
    key: bytes,
    room: int,
    chunk: int,
    nonce: int,
    block: torch.Tensor,
    copy_to: torch.Tensor | None = None,
) -> int:
    """The "mac" tag of a writer block on a CUDA device: NH on the device, then Poly1305
    and BLAKE2b over its digest on the host (the module's docstring). With `copy_to`,
    the block is copied there by the same pass (what is tagged is what was copied)."""
    return digest_tag(key, room, chunk, nonce, nh_device(block, key, copy_to), block.numel())


def digest_tag(
    key: bytes, room: int, chunk: int, nonce: int, digest: torch.Tensor, nbytes: int
) -> int:
    """The "mac" tag of an `nbytes` writer block from its NH digest (`nh_device`, or a
    gather or scatter that hashed as it moved: hw/rank/kernels.py)."""
    bind = _BIND.pack(nonce, room, chunk)
    one_time = hashlib.blake2b(bind, key=key, digest_size=32, person=b"kvs-nh-poly").digest()
    h = Poly1305.generate_tag(one_time, digest.cpu().numpy().astype("<i8").tobytes())
    tag = hashlib.blake2b(
        bind + _LEN.pack(nbytes) + h, key=key, digest_size=8, person=b"kvs-nh-tag"
    ).digest()
    return (int.from_bytes(tag, "big") & CHECKSUM_MASK) or 1


def host_bytes(block: torch.Tensor) -> np.ndarray:
    """A flat uint8 block as host bytes to hash (a CUDA block is copied to the host)."""
    return block.detach().reshape(-1).cpu().numpy()


def block_tag(kind: str, key: bytes, room: int, chunk: int, nonce: int, block) -> int:
    """`kind`'s tag of one writer block (a flat uint8 tensor or a bytes-like object). A
    CUDA block's "mac" is `device_mac`, computed where it lives."""
    if kind == "mac" and isinstance(block, torch.Tensor) and block.is_cuda:
        return device_mac(key, room, chunk, nonce, block.detach().reshape(-1))
    data = host_bytes(block) if isinstance(block, torch.Tensor) else block
    if kind == "mac":
        return block_mac(key, room, chunk, nonce, data)
    if kind == "checksum":
        return block_checksum(key, room, chunk, data)
    raise ValueError(f"transfer.verify_writes = {kind!r} makes no tag (allowed: checksum, mac)")


def tag_and_copy(
    kind: str, key: bytes, room: int, chunk: int, nonce: int, src: torch.Tensor, dst: torch.Tensor
) -> int:
    """Copy `src` into `dst` (flat uint8 tensors of one size) and return `kind`'s tag of
    the bytes copied. A CUDA block's "mac" does both in one pass, each byte read once,
    so a `src` that a peer can write (the decode's ring) is safe to pass; elsewhere the
    copy is made first and tagged after."""
    if kind == "mac" and src.is_cuda:
        return device_mac(key, room, chunk, nonce, src.detach().reshape(-1), dst)
    dst.copy_(src.reshape(-1))
    return block_tag(kind, key, room, chunk, nonce, dst)
