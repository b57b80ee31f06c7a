"""Staging blocks encrypted: what a process that reads the decode's ring, or a send
block during its write, finds there (transfer.encrypt_writes; docs/hardware-mode.md,
"Encrypted in the ring").

Registered memory is open to reads by whoever reaches the engine (Mooncake serves it
on every address with no secret), and the staging ring must stay registered for the
writes. So with "chacha20" (the default) a writer's block travels and sits in the
ring as ChaCha20 ciphertext (RFC 8439), under a key only its writer and its decode can
make. For the writer block of (room, chunk) written under the grant nonce N:

    K   = HKDF-SHA256(pair key of writer -> decode, "kvstage write cipher v1")
    k_N = BLAKE2b(key = K, person = "kvs-chacha-key", N | room | chunk)     32 bytes
    C   = M XOR ChaCha20(k_N, counter 0, nonce 0)

k_N is a key for this block alone (N is drawn by the decode for each grant), so no
keystream is used twice and the zero nonce is safe. The writer encrypts the block after
its write tag is made over the plaintext (hw/rank/writemac.py) and before the block is
registered for its write; the decode decrypts each writer block out of the ring into
memory of its own process, checks the tag there, and scatters that copy. A reader of
the ring or of a send block learns the blocks' sizes and nothing of their bytes; a
writer of the ring can flip ciphertext bits, which flips the same plaintext bits, and
the write tag (Poly1305 under a one-time key, then a PRF) rejects any change.

The slice path and OVERSIZED chunks move bytes from one KV pool to the other through
the engine, with no staging copy to encrypt: they are not encrypted (the docs say why).

On a CUDA device the block is encrypted where it lives, by a Triton kernel
(hw/rank/chacha_kernel.py) that computes the same keystream; on host memory by
`cryptography`'s ChaCha20 (OpenSSL's vectorised code).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from kvstage.hw.control.keys import _hkdf as hkdf

log = logging.getLogger("kvstage.hw.rank.process")

_LABEL = b"kvstage write cipher v1"
_BIND = struct.Struct("!QQQ")  # nonce, room, chunk
_ZERO_NONCE = bytes(16)  # cryptography's ChaCha20 nonce: counter 0 (4 bytes LE) + nonce 0


def cipher_key(pair_key: bytes) -> bytes:
    """K of the write cipher, from the pair key of writer -> decode (HKDF, its own label)."""
    return hkdf(pair_key, _LABEL, b"")


def block_key(key: bytes, room: int, chunk: int, nonce: int) -> bytes:
    """k_N: the ChaCha20 key of one writer block (the module's docstring)."""
    bind = _BIND.pack(nonce, room, chunk)
    return hashlib.blake2b(bind, key=key, digest_size=32, person=b"kvs-chacha-key").digest()


def xor_keystream(
    key: bytes, room: int, chunk: int, nonce: int, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """dst = src XOR the block's keystream (encrypts and decrypts alike). `src` and `dst`
    are flat uint8 tensors of one size on one device; `dst` may be `src` (in place).
    Each byte of `src` is read once, so a `src` that a peer can write (the ring) is safe
    to pass: what lands in `dst` is what was read."""
    if src.numel() != dst.numel() or src.device != dst.device:
        raise ValueError(
            f"a block of {src.numel()} bytes on {src.device} into {dst.numel()} bytes on "
            f"{dst.device}: one size, one device"
        )
    k = block_key(key, room, chunk, nonce)
    if src.is_cuda:
        _device_xor(src.view(-1), dst.view(-1), k)
        return
    _host_xor(k, src.view(-1), dst.view(-1))


def _host_xor(k: bytes, src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst = src XOR ChaCha20(k) on host tensors, by `cryptography` (in place if one)."""
    enc = Cipher(algorithms.ChaCha20(k, _ZERO_NONCE), None).encryptor()
    enc.update_into(src.numpy(), dst.numpy())


@functools.lru_cache(maxsize=1)
def _kernel():
    """The Triton kernel, imported on first use: None where Triton does not import."""
    try:
        from kvstage.hw.rank.chacha_kernel import chacha20_xor
    except ImportError:
        return None
    return chacha20_xor


# why the kernel is not used in this process (None: it is): set when it failed or
# disagreed with the host form on this GPU (`warm_device_cipher`)
_refused: str | None = None


def _device_xor(src: torch.Tensor, dst: torch.Tensor, k: bytes) -> None:
    """dst = src XOR ChaCha20(k) on the tensors' CUDA device (on host tensors under
    TRITON_INTERPRET=1: tests). Whole interpreted runs of the GPU path's code
    (KVSTAGE_TAG_KERNEL_ON_HOST) keep the host form: under the interpreter a program
    costs about 0.3 s, a few hundred blocks a run."""
    kernel = _kernel()
    aligned = all(t.numel() % 4 == 0 and t.data_ptr() % 4 == 0 for t in (src, dst))
    if kernel is not None and _refused is None and aligned:
        # under Triton's interpreter (tests) a program costs much the same whatever its
        # width: one program a block up to 1 MiB (16,384 ChaCha blocks; measured 0.25 s
        # a MiB, against 18 s at the GPU's 256)
        wide = min(1 << 14, 1 << max(4, (-(-src.numel() // 64) - 1).bit_length()))
        kernel(src, dst, k, blocks=None if src.is_cuda else wide)
        return
    # no kernel here: a trip through host memory of this process (slow, the same bytes)
    host = src.cpu() if src.is_cuda else src.clone()  # .cpu() of a CUDA tensor is a copy
    _host_xor(k, host, host)
    dst.copy_(host)


def warm_device_cipher(device: torch.device | str) -> None:
    """Compile the kernel before the run and hold it to the host form on this GPU; one
    that fails or disagrees is refused for this process (the host trip takes over,
    logged). A no-op off CUDA."""
    global _refused
    if not torch.device(device).type == "cuda" or _kernel() is None:
        return
    key = bytes(range(32))
    data = torch.randint(0, 256, (4096 + 68,), dtype=torch.uint8)
    want = data.clone()
    _host_xor(key, want, want)
    try:
        got = data.to(device)
        _kernel()(got, got, key)
        if not torch.equal(got.cpu(), want):
            raise RuntimeError("its keystream differs from cryptography's on this GPU")
    except Exception as exc:  # a GPU or Triton it does not run on
        _refused = f"{type(exc).__name__}: {exc}"
        log.warning(
            "the write cipher's Triton kernel does not run here (%s): blocks are encrypted "
            "through host memory",
            _refused,
        )
