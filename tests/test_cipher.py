"""The write cipher (transfer.encrypt_writes, hw/rank/cipher.py): its definition, held
to `cryptography`'s ChaCha20 (RFC 8439), and what each key is bound to. The whole runs
(a reader of the ring through Mooncake's open port) are in tests/test_verify_writes.py."""

from __future__ import annotations

import hashlib

import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from kvstage.hw.rank.cipher import block_key, cipher_key, xor_keystream
from kvstage.hw.rank.writemac import mac_key
from kvstage.shared.scenario import ScenarioError, load_scenario


def _block(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_the_keystream_is_chacha20_under_the_blocks_own_key():
    """C = M XOR ChaCha20(k_N, counter 0, nonce 0), with k_N = BLAKE2b(K, N | room |
    chunk) under its own personalisation (the module's definition, worked here with
    hashlib and cryptography directly)."""
    pair = bytes(range(32))
    key = cipher_key(pair)
    bind = (7).to_bytes(8, "big") + (3).to_bytes(8, "big") + (1).to_bytes(8, "big")
    k = hashlib.blake2b(bind, key=key, digest_size=32, person=b"kvs-chacha-key").digest()
    assert block_key(key, room=3, chunk=1, nonce=7) == k
    m = _block(100_003)
    want = Cipher(algorithms.ChaCha20(k, bytes(16)), None).encryptor().update(m.numpy().tobytes())
    out = torch.empty_like(m)
    xor_keystream(key, 3, 1, 7, m, out)
    assert out.numpy().tobytes() == want
    back = out.clone()
    xor_keystream(key, 3, 1, 7, back, back)  # in place, and its own inverse
    assert torch.equal(back, m)


def test_each_block_and_each_pair_has_its_own_keystream():
    """No two blocks share a keystream: another nonce, room, chunk or pair key gives
    another key; the cipher's key is not the write tag's (their own HKDF labels)."""
    key = cipher_key(bytes(32))
    keys = {
        block_key(key, 1, 2, 3),
        block_key(key, 1, 2, 4),
        block_key(key, 1, 3, 3),
        block_key(key, 2, 2, 3),
        block_key(cipher_key(bytes([1]) + bytes(31)), 1, 2, 3),
    }
    assert len(keys) == 5
    assert cipher_key(bytes(32)) != mac_key(bytes(32))
    zeros = torch.zeros(4096, dtype=torch.uint8)
    a, b = torch.empty_like(zeros), torch.empty_like(zeros)
    xor_keystream(key, 1, 2, 3, zeros, a)
    xor_keystream(key, 1, 2, 4, zeros, b)
    assert not torch.equal(a, b)


def test_a_block_into_a_buffer_of_another_size_is_refused():
    with pytest.raises(ValueError, match="one size, one device"):
        xor_keystream(bytes(32), 0, 0, 0, _block(64), torch.empty(65, dtype=torch.uint8))


def test_encrypt_writes_is_on_by_default_and_names_its_choices(tmp_path):
    from test_hw import write_scenario

    path = write_scenario(tmp_path, 2, 1, 8)
    assert load_scenario(path).transfer.encrypt_writes == "chacha20"
    off = load_scenario(path, overrides=["transfer.encrypt_writes=none"])
    assert off.transfer.encrypt_writes == "none"
    with pytest.raises(ScenarioError, match="chacha20"):
        load_scenario(path, overrides=["transfer.encrypt_writes=aes"])


_INTERPRETED = """
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from kvstage.hw.rank import cipher

assert cipher._kernel() is not None
key = cipher.cipher_key(bytes(range(32)))
g = torch.Generator().manual_seed(5)
for n in (4, 68, 65536 + 4, (1 << 20) + 64 + 8):  # the last: two programs
    m = torch.randint(0, 256, (n + 8,), dtype=torch.uint8, generator=g)[4 : 4 + n]
    k = cipher.block_key(key, 9, 2, 77)
    want = Cipher(algorithms.ChaCha20(k, bytes(16)), None).encryptor().update(m.numpy().tobytes())
    host = torch.zeros(n, dtype=torch.uint8)
    cipher.xor_keystream(key, 9, 2, 77, m, host)  # host memory: cryptography
    assert host.numpy().tobytes() == want, n
    out = torch.zeros(n, dtype=torch.uint8)
    cipher._device_xor(m, out, k)  # a CUDA block's path: the kernel, interpreted
    assert torch.equal(out, host), n
    cipher._refused = "a test: the host trip"
    again = torch.zeros(n, dtype=torch.uint8)
    cipher._device_xor(m, again, k)
    assert torch.equal(again, host), n
    cipher._refused = None
print("kernel == host form")
"""


def test_the_device_form_is_the_host_form():
    """The kernel (hw/rank/chacha_kernel.py) as the cipher calls it for a CUDA block,
    under Triton's interpreter on host tensors, and the host trip a refused kernel falls
    back to: both equal the host form, cryptography's ChaCha20 under the block's key,
    offsets, odd sizes and a block of two programs included."""
    import os
    import subprocess
    import sys

    from conftest import require_triton

    require_triton()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "kernel == host form" in run.stdout
