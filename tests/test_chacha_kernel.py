"""The Triton ChaCha20 kernel (hw/rank/chacha_kernel.py), run by Triton's interpreter on
the CPU, held to `cryptography`'s ChaCha20 (RFC 8439), the cipher a rank on host memory
uses: the same keystream byte for byte, on the RFC's own test vector and on random keys,
nonces and counters, for every length the kernel masks differently, in place and into
another tensor; and what it refuses."""

from __future__ import annotations

import pytest
import torch
from conftest import require_triton
from test_nhash import _interpret

_INTERPRETED = """
import os
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from kvstage.hw.rank.chacha_kernel import BLOCKS, chacha20_xor

def cipher(data, key, counter, nonce):
    iv = counter.to_bytes(4, "little") + nonce  # cryptography's 16-byte nonce
    return Cipher(algorithms.ChaCha20(key, iv), mode=None).encryptor().update(data)

def tensor(data):
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)

# RFC 8439 section 2.4.2: the plaintext (114 bytes, padded here to whole words) and the
# ciphertext as the RFC prints it
key = bytes(range(32))
nonce = bytes.fromhex("000000000000004a00000000")
plain = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip "
         b"for the future, sunscreen would be it.")
rfc = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
    "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
    "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
    "5af90bbf74a35be6b40b8eedf2785e42874d"
)
src = tensor(plain + bytes(2))
dst = torch.zeros_like(src)
chacha20_xor(src, dst, key, 1, nonce)
assert bytes(dst.numpy())[:114] == rfc == cipher(plain, key, 1, nonce), "RFC 8439 2.4.2"
assert bytes(src.numpy())[:114] == plain, "src written"
chacha20_xor(dst, dst, key, 1, nonce)  # in place: the keystream again gives the plaintext
assert torch.equal(dst, src), "RFC 8439 2.4.2 back"

tile = 64 * BLOCKS  # the bytes one program enciphers
sizes = [4, 60, 64, 68, tile, tile + 4, 3 * tile + 12]
counters = [0, 1, 2**31 + 12345, None]  # None: the last that fits (its last block 2^32 - 1)
for i, n in enumerate(sizes):
    for m, counter in enumerate(counters):
        if counter is None:
            counter = 2**32 - -(-n // 64)
        key, nonce, data = os.urandom(32), os.urandom(12), os.urandom(n)
        want = cipher(data, key, counter, nonce)
        if (i + m) % 2:  # in place
            block = tensor(data)
            chacha20_xor(block, block, key, counter, nonce)
        else:  # into another tensor, from a view at an offset, to one at another
            buf = tensor(os.urandom(64) + data + os.urandom(64))
            out = tensor(os.urandom(n + 8))
            before = bytes(out.numpy())
            block = out[4 : 4 + n]
            chacha20_xor(buf[64 : 64 + n], block, key, counter, nonce)
            assert bytes(buf[64 : 64 + n].numpy()) == data, ("src written", n, counter)
            got = bytes(out.numpy())
            assert got[:4] + got[4 + n :] == before[:4] + before[4 + n :], ("outside", n)
        assert bytes(block.numpy()) == want, (n, counter)

# other tile shapes: programs that end inside a ChaCha block, and past the data
data, key, nonce = os.urandom(3 * 64 * 16 + 20), os.urandom(32), os.urandom(12)
for blocks in (16, 64, 1024):
    block = tensor(data)
    chacha20_xor(block, block, key, 7, nonce, blocks=blocks)
    assert bytes(block.numpy()) == cipher(data, key, 7, nonce), blocks

# about 1 MiB (16384 ChaCha blocks), in place, in 5 programs of 4096 (at the kernel's
# own 256 it is 65 programs, 13 s of the interpreter's time: the tiles of 256 are
# covered above, from one block to three tiles and a part)
n = (1 << 20) + 4
key, nonce, data = os.urandom(32), os.urandom(12), os.urandom(n)
block = tensor(data)
chacha20_xor(block, block, key, 5, nonce, blocks=4096)
assert bytes(block.numpy()) == cipher(data, key, 5, nonce), "1 MiB"
print("kernel == cryptography")
"""


def test_the_kernel_is_cryptographys_chacha20_under_tritons_interpreter():
    """The kernel (the source a GPU compiles, executed by Triton's interpreter in numpy)
    XORs in exactly `cryptography`'s ChaCha20 keystream: RFC 8439's vector (section
    2.4.2) both ways; one word, under a ChaCha block, one, one and a word, one tile of
    blocks, a tile and a word, three tiles and a part, and about 1 MiB; counters 0, 1, past 2^31 (the kernel's
    signed arguments reinterpreted) and the last that fits; in place, and from an offset
    view into another one, touching nothing around it; tiles of other sizes."""
    _interpret(_INTERPRETED, "kernel == cryptography")


@pytest.fixture
def xor(monkeypatch):
    """chacha20_xor, as on a device: CPU tensors let through (the refusals below come
    before any launch)."""
    require_triton()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvstage.hw.rank.chacha_kernel import chacha20_xor

    return chacha20_xor


def _bytes(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


KEY, NONCE = bytes(range(32)), bytes(12)


@pytest.mark.parametrize(
    "src, dst, match",
    [
        (lambda: _bytes(66), lambda: _bytes(66), r"src holds 66 bytes: .* whole 4-byte words"),
        (lambda: _bytes(64), lambda: _bytes(68)[2:66], r"dst starts at byte 2 .* aligned to 4"),
        (lambda: _bytes(68)[1:65], lambda: _bytes(64), r"src starts at byte 1 .* aligned to 4"),
        (lambda: _bytes(64), lambda: _bytes(68), r"src holds 64 bytes, dst 68: they must match"),
        (lambda: _bytes(64).view(torch.int32), lambda: _bytes(64), r"flat uint8 tensor"),
        (lambda: _bytes(64).view(4, 16), lambda: _bytes(64), r"flat uint8 tensor"),
        (lambda: _bytes(128)[::2], lambda: _bytes(64), r"src has stride 2: .* contiguous"),
    ],
)
def test_blocks_the_kernel_cannot_take_are_refused(xor, src, dst, match):
    with pytest.raises(ValueError, match=match):
        xor(src(), dst(), KEY, 0, NONCE)


def test_overlapping_blocks_are_refused_but_in_place_is_not(xor):
    buf = _bytes(128)
    with pytest.raises(ValueError, match="overlap: dst must be src itself or apart"):
        xor(buf[0:64], buf[4:68], KEY, 0, NONCE)
    xor(buf[0:0], buf[0:0], KEY, 0, NONCE)  # nothing to encipher: no launch


@pytest.mark.parametrize(
    "key, nonce, match",
    [
        (bytes(31), NONCE, r"a key of 31 bytes: ChaCha20 takes 32 bytes"),
        (bytes(33), NONCE, r"a key of 33 bytes"),
        ("k" * 32, NONCE, r"a key of type str"),
        (KEY, bytes(8), r"a nonce of 8 bytes: .* takes 12 bytes"),
        (KEY, bytes(16), r"a nonce of 16 bytes"),
    ],
)
def test_keys_and_nonces_of_other_lengths_are_refused(xor, key, nonce, match):
    with pytest.raises(ValueError, match=match):
        xor(_bytes(64), _bytes(64), key, 0, nonce)


def test_a_counter_that_would_wrap_is_refused(xor):
    for counter in (-1, 2**32):
        with pytest.raises(ValueError, match=r"a counter of .*: ChaCha20's is 0 \.\. 2\^32 - 1"):
            xor(_bytes(64), _bytes(64), KEY, counter, NONCE)
    # 68 bytes are two ChaCha blocks: from 2^32 - 1 the second would be block 2^32
    with pytest.raises(ValueError, match=r"68 bytes from block 4294967295 .* would wrap"):
        xor(_bytes(68), _bytes(68), KEY, 2**32 - 1, NONCE)


def test_a_tile_of_other_than_a_power_of_two_blocks_is_refused(xor):
    with pytest.raises(ValueError, match="a tile of 100 blocks: .* power of two"):
        xor(_bytes(64), _bytes(64), KEY, 0, NONCE, blocks=100)


def test_a_cpu_block_is_refused_outside_the_interpreter(monkeypatch):
    require_triton()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from kvstage.hw.rank.chacha_kernel import chacha20_xor

    with pytest.raises(ValueError, match=r"the block is on cpu: .* CUDA device"):
        chacha20_xor(_bytes(64), _bytes(64), KEY, 0, NONCE)
