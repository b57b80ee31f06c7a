"""The write tag's device hash (hw/rank/nhash.py) and the tag built on it
(writemac.device_mac): the torch form equals the definition in numpy's unsigned
arithmetic, on every length and alignment, and the tag is bound to every byte and every
input. The Triton kernel is held to the same definition on a GPU (tests/test_gpu.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import require_triton

from kvstage.hw.rank.nhash import (
    CHUNK_BYTES,
    CHUNK_WORDS,
    KEYS,
    magic,
    nh_digest,
    nh_key_words,
    nh_reference,
    nh_torch,
)
from kvstage.hw.rank.writemac import block_mac, block_tag, device_mac, mac_key, tag_and_copy

KEY = mac_key(bytes(range(32)))


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.mark.parametrize(
    "n", [1, 3, 4, 1000, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 6, 3 * CHUNK_BYTES + 4]
)
def test_the_torch_form_is_the_definition(n):
    data = os.urandom(n)
    got = nh_digest(_tensor(data), KEY)
    assert got == nh_reference(data, KEY)
    assert len(got) == 8 * KEYS * max(1, -(-n // CHUNK_BYTES))


def test_a_block_at_any_offset_hashes_as_its_bytes():
    buf = _tensor(os.urandom(3 * CHUNK_BYTES))
    for start in (1, 2, 3, 5):
        part = buf[start : start + 2 * CHUNK_BYTES + 7]
        assert nh_digest(part, KEY) == nh_reference(bytes(part.numpy()), KEY)


def test_the_definition_is_nh():
    """One chunk by hand, in Python integers: the pairing i with i + W/2, the 32-bit
    additions, the 64-bit sum."""
    rng = np.random.default_rng(5)
    words = rng.integers(0, 2**32, CHUNK_WORDS, dtype=np.uint64)
    keys = nh_key_words(KEY)
    want = b""
    for j in range(KEYS):
        k = [int(x) for x in keys[j]]
        m = [int(x) for x in words]
        h = CHUNK_WORDS // 2
        total = sum(((m[i] + k[i]) % 2**32) * ((m[i + h] + k[i + h]) % 2**32) for i in range(h))
        want += (total % 2**64).to_bytes(8, "little")
    data = words.astype("<u4").tobytes()
    assert nh_reference(data, KEY) == want
    assert nh_digest(_tensor(data), KEY) == want


def test_every_word_and_every_key_moves_the_digest():
    data = bytearray(os.urandom(2 * CHUNK_BYTES + 100))
    base = nh_reference(bytes(data), KEY)
    for at in (0, 1, CHUNK_BYTES // 2, CHUNK_BYTES - 1, CHUNK_BYTES, len(data) - 1):
        changed = bytearray(data)
        changed[at] ^= 0x40
        assert nh_reference(bytes(changed), KEY) != base, at
    assert nh_reference(bytes(data), mac_key(bytes(32))) != base
    assert not np.array_equal(nh_key_words(KEY), nh_key_words(mac_key(bytes(32))))


def test_the_device_tag_is_bound_to_every_input_and_kept_apart_from_the_host_tag():
    data = os.urandom(CHUNK_BYTES + 10)
    block = _tensor(data)
    tag = device_mac(KEY, 4, 5, 6, block)
    assert 0 < tag < 2**63
    assert device_mac(KEY, 4, 5, 6, _tensor(data)) == tag
    others = [
        device_mac(KEY, 3, 5, 6, block),
        device_mac(KEY, 4, 4, 6, block),
        device_mac(KEY, 4, 5, 7, block),
        device_mac(mac_key(bytes(32)), 4, 5, 6, block),
        device_mac(KEY, 4, 5, 6, block[:-1]),  # one byte shorter
        device_mac(KEY, 4, 5, 6, torch.cat([block, torch.zeros(1, dtype=torch.uint8)])),
        block_mac(KEY, 4, 5, 6, data),  # the host form: its own personalisation
    ]
    assert tag not in others
    flipped = bytearray(data)
    flipped[-1] ^= 1
    assert device_mac(KEY, 4, 5, 6, _tensor(bytes(flipped))) != tag


def test_a_zero_padded_block_is_not_its_shorter_self():
    """The digest of a block and of the same block with zeros appended can be equal
    (NH pads with zeros); the tag holds the length, so the tags differ."""
    data = os.urandom(100)
    assert nh_reference(data, KEY) == nh_reference(data + bytes(4), KEY)
    assert device_mac(KEY, 1, 2, 3, _tensor(data)) != device_mac(
        KEY, 1, 2, 3, _tensor(data + bytes(4))
    )


def test_the_kernels_magic_pairs_divide_exactly():
    """The kernel divides block positions (0 .. 2^31 - 1) by a pool's row width, head
    count, token count and layer count through `magic` pairs: for small, power-of-two,
    odd and huge divisors, at both ends of the range and at random, the pair gives the
    quotient, in the uint32 arithmetic the kernel runs."""
    rng = np.random.default_rng(5)
    divisors = [*range(1, 130), 192, 256, 1000, 4096, 65535, 65536, 2**30 + 7, 2**31 - 1]
    divisors += [int(d) for d in rng.integers(1, 2**31, 200)]
    for d in divisors:
        x = np.concatenate(
            [[0, 1, d - 1, d, d + 1, 2**31 - 2, 2**31 - 1], rng.integers(0, 2**31, 500)]
        ).astype(np.uint64)
        x = x[x < 2**31]
        m, s = magic(d)
        hi = (x * np.uint64(m % 2**32)) >> np.uint64(32)  # umulhi in uint32
        assert np.array_equal((hi + x) >> np.uint64(s), x // np.uint64(d)), d
        assert -(2**31) <= m < 2**31 and 0 <= s <= 31
    with pytest.raises(ValueError, match="divides by 1"):
        magic(0)


def test_the_torch_form_wraps_as_unsigned_arithmetic():
    """Words and keys near 2^32 make products near 2^64 and sums far past it: the int64
    form's two's-complement wrap must give the unsigned result."""
    data = b"\xff" * (2 * CHUNK_BYTES)
    assert nh_digest(_tensor(data), KEY) == nh_reference(data, KEY)
    out = nh_torch(_tensor(data), KEY)
    assert out.dtype == torch.int64 and out.shape == (2, KEYS)


def test_tag_and_copy_copies_the_bytes_it_tags():
    src = _tensor(os.urandom(CHUNK_BYTES + 12))
    dst = torch.zeros_like(src)
    for kind in ("mac", "checksum"):
        dst.zero_()
        tag = tag_and_copy(kind, KEY, 1, 2, 3, src, dst)
        assert torch.equal(dst, src)
        assert tag == block_tag(kind, KEY, 1, 2, 3, src)
    with pytest.raises(ValueError, match="copy_to holds"):
        device_mac(KEY, 1, 2, 3, src, torch.zeros(5, dtype=torch.uint8))


_INTERPRETED = """
import os, sys, torch
from kvstage.hw.rank import nhash
assert nhash._kernel() is not None, "Triton did not import"
key = bytes(range(32))
for n in (4, 1000, nhash.CHUNK_BYTES, 3 * nhash.CHUNK_BYTES + 8, 200_000):
    for fill in ("random", "ones"):
        block = (torch.randint(0, 256, (n,), dtype=torch.uint8) if fill == "random"
                 else torch.full((n,), 255, dtype=torch.uint8))
        want = nhash.nh_reference(bytes(block.numpy()), key)
        words = nhash._words(block)
        for tile in (512, 1024, 2048):
            got = nhash.launch(words, key, tile=tile)
            assert got.numpy().astype("<i8").tobytes() == want, (n, fill, tile)
        dst = torch.zeros_like(words)
        got = nhash.launch(words, key, dst=dst)
        assert got.numpy().astype("<i8").tobytes() == want, (n, fill, "copy")
        assert torch.equal(dst, words), (n, fill, "the copy")
print("kernel == definition")
"""


def test_the_gpu_kernel_is_the_definition_under_tritons_interpreter():
    """The Triton kernel itself (every tile shape, with and without its copy, a partial
    last chunk, words at 2^32 - 1), run by Triton's interpreter on the CPU, gives the
    digest of the definition: the same kernel source a GPU compiles. tests/test_gpu.py
    holds the compiled kernel to it on a GPU."""
    _interpret(_INTERPRETED, "kernel == definition")


def test_a_writer_and_a_decode_that_tag_by_different_forms_are_refused_at_the_table():
    """A GPU rank's "mac" is hashed on the device, a host rank's on the host: a run that
    mixes them is refused when the table arrives, naming both ranks, instead of failing
    every room on a rejected write."""
    from types import SimpleNamespace

    from kvstage.hw.control.membership import RankInfo
    from kvstage.hw.rank.process import RankError, RankProcess

    def rank(role: str, cuda: bool, verify: str = "mac"):
        me = SimpleNamespace(
            role=role,
            name=f"{role}0",
            pool=SimpleNamespace(bytes=SimpleNamespace(is_cuda=cuda)),
            s=SimpleNamespace(transfer=SimpleNamespace(verify_writes=verify)),
        )
        me._tag_form = lambda: RankProcess._tag_form(me)
        return me

    def info(role: str, form: str) -> RankInfo:
        fields = {f: None for f in RankInfo.__dataclass_fields__}
        fields.update(role=role, rank=0, extra={"tag_form": form})
        return RankInfo(**fields)

    table = {"prefill0": info("prefill", "device"), "decode0": info("decode", "host")}
    with pytest.raises(RankError, match=r"decode0 keeps its KV in host memory and prefill0"):
        RankProcess._check_tag_forms(rank("decode", cuda=False), table)
    with pytest.raises(RankError, match=r"prefill0 keeps its KV in device memory and decode0"):
        RankProcess._check_tag_forms(rank("prefill", cuda=True), table)
    RankProcess._check_tag_forms(rank("decode", cuda=True), table)  # same form as its writer
    RankProcess._check_tag_forms(rank("decode", cuda=False, verify="checksum"), table)
    assert RankProcess._tag_form(rank("decode", cuda=True)) == "device"


_INTERPRETED_MOVES = """
import torch
from kvstage.hw.rank import nhash
from kvstage.hw.rank.kernels import block_bytes, gather, gather_hashed, scatter_hashed
from kvstage.hw.rank.kvpool import KVPool
key = bytes(range(32))
for planes, heads, head_dim, first, pages, h0, nh in (
    (2, 4, 8, 1, 3, 1, 2),    # K and V, a head slice, pages after the first
    (2, 2, 64, 0, 2, 0, 2),   # every head
    (1, 1, 72, 2, 2, 0, 1),   # an MLA latent
):
    pool = KVPool(3, 6, 16, heads, head_dim, "bf16", kv_planes=planes)
    pool.bytes.copy_(torch.randint(0, 256, pool.bytes.shape, dtype=torch.uint8))
    n = block_bytes(pool, pages, nh)
    want_block = torch.empty(n, dtype=torch.uint8)
    gather(pool, first, pages, h0, nh, want_block)
    want = nhash.nh_reference(bytes(want_block.numpy()), key)
    out = torch.zeros(n, dtype=torch.uint8)
    got = gather_hashed(pool, first, pages, h0, nh, key, out)
    assert got.numpy().astype("<i8").tobytes() == want, ("gather", planes, heads)
    assert torch.equal(out, want_block), ("gathered bytes", planes, heads)
    got = gather_hashed(pool, first, pages, h0, nh, key)  # the hash only
    assert got.numpy().astype("<i8").tobytes() == want, ("hash only", planes, heads)
    before = pool.bytes.clone()
    block = torch.randint(0, 256, (n,), dtype=torch.uint8)
    got = scatter_hashed(pool, first, pages, block, h0, nh, key)
    assert got.numpy().astype("<i8").tobytes() == nhash.nh_reference(bytes(block.numpy()), key)
    back = torch.empty(n, dtype=torch.uint8)
    gather(pool, first, pages, h0, nh, back)
    assert torch.equal(back, block), ("scattered bytes", planes, heads)
    ps = pool.page_size
    touched = torch.zeros(pool.bytes.shape, dtype=torch.bool)
    touched[:, :, first * ps : (first + pages) * ps, h0 : h0 + nh] = True
    assert torch.equal(pool.bytes[~touched], before[~touched]), ("outside", planes, heads)
print("moves == definition")
"""


@pytest.mark.parametrize("magic", [True, False], ids=["magic-pairs", "plain-division"])
def test_the_fused_gather_and_scatter_hash_what_they_move_under_tritons_interpreter(magic):
    """The kernel that gathers (or scatters) a writer block and hashes it in one pass
    gives the digest of the definition over the block as `gather` makes it, moves the
    same bytes as `gather`, and writes nothing outside the room's pages and heads: K and
    V or an MLA latent, a head slice or every head, pages after the first. Both forms
    of its address divisions: the magic pairs a GPU runs, the plain ones whole
    interpreted runs take (faster in numpy)."""
    _interpret(_INTERPRETED_MOVES, "moves == definition", magic=magic)


_INTERPRETED_DECODE = """
from types import SimpleNamespace
import torch
from kvstage.hw.rank.cipher import cipher_key, xor_keystream
from kvstage.hw.rank.decode import DecodeRank
from kvstage.hw.rank.kernels import gather
from kvstage.hw.rank.kvpool import KVPool, fill_pattern, verify
from kvstage.hw.rank.writemac import device_mac, mac_key
from kvstage.shared.layout import Geometry, owned_heads

P, D, H, LAYERS, HEAD_DIM, PAGE, pages = 4, 2, 8, 2, 16, 16, 3
g = Geometry(P, D, H, LAYERS, HEAD_DIM, 2, PAGE)
d = 1
layout = g.staging_layout(d, pages)
keys = {p: mac_key(bytes([p]) * 32) for p in range(P)}
region = torch.zeros(layout.region_bytes, dtype=torch.uint8)
checksums = []
for b in layout.blocks:
    src = KVPool(LAYERS, 8, PAGE, g.prefill_heads, HEAD_DIM, "bf16")
    fill_pattern(src, 2, pages, 7, 0, list(owned_heads(P, b.prefill_rank, H)))
    block = region[b.offset : b.offset + b.nbytes]
    gather(src, 2, pages, b.heads.src_head_start, b.heads.num_heads, block)
    tag = device_mac(keys[b.prefill_rank], 7, 0, 99, block)  # the writer's GPU form
    checksums.append((b.writer, b.prefill_rank, tag, 99))

def decode():
    me = SimpleNamespace(pool=KVPool(LAYERS, 8, PAGE, g.decode_heads, HEAD_DIM, "bf16"),
                         bytes_checksummed=0, bytes_hashed_in_moves=0)
    me.scatter_layout = lambda n: g.staging_layout(d, n)
    me._block_rejected = lambda *args: DecodeRank._block_rejected(me, *args)
    return me

a = SimpleNamespace(room=7, chunk=0, num_pages=pages, dst_page_base=1, page_start=0,
                    checksums=checksums)
me = decode()
assert DecodeRank._scattered_rejected(me, a, region, keys, None) == ""
checked, wrong = verify(me.pool, 1, pages, 7, 0, list(owned_heads(D, d, H)))
assert wrong == 0 and checked > 0, (checked, wrong)
assert me.bytes_checksummed == me.bytes_hashed_in_moves == layout.region_bytes
# the same region as the ring holds it by default: each block encrypted by its writer
seals = {p: cipher_key(bytes([p]) * 32) for p in range(P)}
sealed = region.clone()
for b in layout.blocks:
    span = sealed[b.offset : b.offset + b.nbytes]
    xor_keystream(seals[b.prefill_rank], 7, 0, 99, span, span)
assert not torch.equal(sealed, region)
me = decode()
assert DecodeRank._scattered_rejected(me, a, sealed, keys, seals) == ""
checked, wrong = verify(me.pool, 1, pages, 7, 0, list(owned_heads(D, d, H)))
assert wrong == 0 and checked > 0, (checked, wrong)
last = layout.blocks[-1]
for ring, opened in ((region, None), (sealed, seals)):
    ring[last.offset + 5] ^= 1  # a peer's byte in the last block
    why = DecodeRank._scattered_rejected(decode(), a, ring, keys, opened)
    assert f"block of writer {last.writer} (prefill rank {last.prefill_rank}" in why, why
print("decode checks as it scatters")
"""


def test_the_decode_checks_each_block_as_it_scatters_it_under_tritons_interpreter():
    """The decode's GPU path (DecodeRank._scattered_rejected), run by Triton's
    interpreter on host pools: a P4 -> D2 region whose blocks carry their writers' device
    tags lands whole in the room's pages and passes, in plaintext and encrypted by each
    writer (transfer.encrypt_writes: decrypted into a private copy, then scattered); one
    flipped byte fails exactly its writer's block, named."""
    _interpret(_INTERPRETED_DECODE, "decode checks as it scatters")


def _interpret(script: str, done: str, magic: bool = True) -> None:
    """Run `script` with Triton's interpreter (TRITON_INTERPRET=1: the kernels' own
    source, executed in numpy on the CPU) in a process of its own; it prints `done`.
    `magic`: the kernel divides by magic pairs, as on a GPU (nhash.MAGIC_ON_HOST_ENV)."""
    import subprocess
    import sys

    from kvstage.hw.rank.nhash import MAGIC_ON_HOST_ENV

    require_triton()
    env = {**os.environ, "TRITON_INTERPRET": "1", MAGIC_ON_HOST_ENV: "1" if magic else "0"}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert done in run.stdout


_INTERPRETED_WARM = """
import torch
from kvstage.hw.rank import kernels
from kvstage.hw.rank.kvpool import KVPool
calls = []
for name in ("gather_hashed", "scatter_hashed"):
    real = getattr(kernels, name)
    setattr(kernels, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
kernels.fused_tag_possible = lambda pool, *flat: True  # as on a GPU
pool = KVPool(2, 4, 16, 2, 64, "bf16", kv_planes=2)
before = pool.bytes.clone()
kernels.warm_hashed_moves(pool)
assert calls == ["gather_hashed", "gather_hashed", "scatter_hashed"], calls
assert torch.equal(pool.bytes, before), "the warm-up wrote into the rank's own pool"
assert kernels.nhash.kernel_ready()
def broken(*a, **k):
    raise RuntimeError("no such instruction on this GPU")
kernels.gather_hashed = broken  # a kernel that does not run here: the torch form instead
kernels.warm_hashed_moves(pool)
assert not kernels.nhash.kernel_ready()
assert "no such instruction" in kernels.nhash._refused
print("warmed on a scratch pool")
"""


def test_the_tag_kernels_compile_before_the_run_on_a_scratch_pool():
    """A GPU rank compiles the three moves at start (Triton's first launch compiles), on
    a scratch pool of its rows, and checks the kernel's digest against the torch form's:
    its own pool is not touched, and a kernel that fails there is refused for the
    process (the torch form, the same digest, takes over). On a host pool nothing is
    made."""
    from kvstage.hw.rank.kernels import warm_hashed_moves
    from kvstage.hw.rank.kvpool import KVPool

    pool = KVPool(2, 4, 16, 2, 64, "bf16")
    warm_hashed_moves(pool)  # a host pool: returns at once
    _interpret(_INTERPRETED_WARM, "warmed on a scratch pool")
