"""Hardware mode on a GPU: kernels on device memory, and real NIXL (UCX) and Mooncake
transfers between rank processes whose KV pools, staging rings and send buffers live on
the GPU. Mooncake needs its CUDA wheel (`mooncake-transfer-engine`; the CPU build,
`-non-cuda`, cannot register device memory): without it those cases skip, saying so.

These run only where torch sees a CUDA device (a GPU machine: `benchmarks/gpu_check.sh`
runs them there). CI machines have no GPU, so here they skip, saying so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import require_engine
from rich.console import Console

from kvstage.hw.rank.kernels import gather, scatter
from kvstage.hw.rank.kvpool import KVPool, fill_pattern, verify
from kvstage.shared.layout import Geometry, owned_heads, room_pages
from kvstage.shared.workload import generate_requests

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device visible to torch"
)

LAYERS, HEAD_DIM, PAGE = 4, 64, 16


@pytest.mark.parametrize(("P", "D", "H"), [(4, 2, 8), (2, 4, 8), (4, 2, 2)])
def test_gather_scatter_verify_on_the_gpu(P, D, H):
    """Every writer's block gathered on the GPU lands in the right head slice of every
    decode rank's GPU pool, bit for bit; nothing outside the room is touched."""
    g = Geometry(P, D, H, LAYERS, HEAD_DIM, 2, PAGE)
    pages, first = 12, 3
    prefill = []
    for r in range(P):
        pool = KVPool(LAYERS, 32, PAGE, g.prefill_heads, HEAD_DIM, "bf16", device="cuda")
        fill_pattern(pool, first, pages, 7, 0, list(owned_heads(P, r, H)))
        prefill.append(pool)
    for d in range(D):
        layout = g.staging_layout(d, pages)
        region = torch.zeros(layout.region_bytes, dtype=torch.uint8, device="cuda")
        for b in layout.blocks:
            gather(
                prefill[b.prefill_rank],
                first,
                pages,
                b.heads.src_head_start,
                b.heads.num_heads,
                region[b.offset : b.offset + b.nbytes],
            )
        pool = KVPool(
            LAYERS, 32, PAGE, g.decode_heads, HEAD_DIM, "bf16", device="cuda", fill_byte=0xAB
        )
        scatter(pool, 5, pages, region, layout)
        torch.cuda.synchronize()
        checked, wrong = verify(pool, 5, pages, 7, 0, list(owned_heads(D, d, H)))
        assert wrong == 0 and checked == 2 * LAYERS * pages * PAGE * g.decode_heads * HEAD_DIM * 2
        b = pool.bytes
        assert bool((b[:, :, : 5 * PAGE] == 0xAB).all()) and bool(
            (b[:, :, (5 + pages) * PAGE :] == 0xAB).all()
        )


@pytest.mark.parametrize("nbytes", [4, 1000, 32768, 32768 * 3 + 6, 16 << 20])
def test_the_write_tag_kernel_is_the_definition(nbytes):
    """The NH kernel (Triton) on a GPU block gives the digest of the definition
    (numpy, on the host) and of the torch form on the same GPU; the block's "mac" tag
    is the device tag, and a flipped byte on the GPU changes it."""
    from kvstage.hw.rank import nhash
    from kvstage.hw.rank.writemac import block_tag, device_mac, mac_key, tag_and_copy

    key = mac_key(bytes(range(32)))
    block = torch.randint(0, 256, (nbytes + 3,), dtype=torch.uint8, device="cuda")[3:]
    want = nhash.nh_reference(bytes(block.cpu().numpy()), key)
    assert nhash.kernel_available(block), "Triton does not import beside this CUDA torch"
    assert nhash.nh_digest(block, key) == want
    assert nhash.nh_torch(block, key).cpu().numpy().astype("<i8").tobytes() == want
    tag = block_tag("mac", key, 1, 2, 3, block)
    assert tag == device_mac(key, 1, 2, 3, block.cpu())  # the same function on the host
    copy = torch.zeros(nbytes + 4, dtype=torch.uint8, device="cuda")[4:]
    assert tag_and_copy("mac", key, 1, 2, 3, block, copy) == tag  # one pass: copied, tagged
    assert torch.equal(copy, block)
    odd = torch.zeros(nbytes + 1, dtype=torch.uint8, device="cuda")[1:]  # not word-aligned
    assert tag_and_copy("mac", key, 1, 2, 3, block, odd) == tag and torch.equal(odd, block)
    block[-1] ^= 1
    assert block_tag("mac", key, 1, 2, 3, block) != tag


@pytest.mark.parametrize("nbytes", [4, 1000, 16 << 20])
def test_the_write_cipher_kernel_is_chacha20(nbytes):
    """The write cipher's Triton kernel (hw/rank/chacha_kernel.py), compiled, on a GPU
    block: cryptography's ChaCha20 under the block's key, in place and into another
    buffer; the rank's start-up check accepts it."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    from kvstage.hw.rank import cipher

    cipher.warm_device_cipher("cuda")
    assert cipher._refused is None and cipher._kernel() is not None, cipher._refused
    key = cipher.cipher_key(bytes(range(32)))
    block = torch.randint(0, 256, (nbytes + 4,), dtype=torch.uint8, device="cuda")[4:]
    k = cipher.block_key(key, 1, 2, 3)
    plain = bytes(block.cpu().numpy())
    want = Cipher(algorithms.ChaCha20(k, bytes(16)), None).encryptor().update(plain)
    out = torch.zeros_like(block)
    cipher.xor_keystream(key, 1, 2, 3, block, out)
    assert bytes(out.cpu().numpy()) == want
    cipher.xor_keystream(key, 1, 2, 3, out, out)
    assert bytes(out.cpu().numpy()) == plain


def test_the_moves_that_carry_the_write_tag_hash_what_they_move():
    """Compiled on the GPU: `gather_hashed` and `scatter_hashed` move the bytes `gather`
    moves and give the digest of the definition over the block (as under Triton's
    interpreter in tests/test_nhash.py)."""
    from kvstage.hw.rank import nhash
    from kvstage.hw.rank.kernels import (
        block_bytes,
        fused_tag_possible,
        gather_hashed,
        scatter_hashed,
    )

    key = bytes(range(32))
    pool = KVPool(LAYERS, 12, PAGE, 8, HEAD_DIM, "bf16", device="cuda")
    pool.bytes.copy_(torch.randint(0, 256, pool.bytes.shape, dtype=torch.uint8, device="cuda"))
    n = block_bytes(pool, 5, 3)
    want = torch.empty(n, dtype=torch.uint8, device="cuda")
    gather(pool, 2, 5, 4, 3, want)
    out = torch.zeros_like(want)
    assert fused_tag_possible(pool, out)
    digest = gather_hashed(pool, 2, 5, 4, 3, key, out)
    ref = nhash.nh_reference(bytes(want.cpu().numpy()), key)
    assert digest.cpu().numpy().astype("<i8").tobytes() == ref
    assert torch.equal(out, want)
    block = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    digest = scatter_hashed(pool, 6, 5, block, 1, 3, key)
    assert digest.cpu().numpy().astype("<i8").tobytes() == nhash.nh_reference(
        bytes(block.cpu().numpy()), key
    )
    back = torch.empty_like(block)
    gather(pool, 6, 5, 1, 3, back)
    assert torch.equal(back, block)


def mooncake_cuda_problem() -> str | None:
    """Why Mooncake cannot move GPU memory here, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("mooncake-transfer-engine")
    except PackageNotFoundError:
        return "Mooncake's CUDA wheel (mooncake-transfer-engine) is not installed"
    return None


def _scenario(tmp_path: Path, device: str, path: str, backend: str = "nixl") -> Path:
    f = tmp_path / "gpu.toml"
    f.write_text(f"""
name = "gpu-p2-d1"
[model]
layers = 8
kv_heads = 8
head_dim = 128
params_b = 1.0
dtype = "bf16"
[prefill]
tp = 2
chunked_prefill_size = 256
[decode]
tp = 1
page_size = 16
staging_pool_mb = 16
prefix_tokens = 16
[transfer]
path = "{path}"
room_timeout_s = 60
[workload]
requests = 4
arrival = "fixed"
rate_per_s = 20
prompt = "uniform"
prompt_min = 300
prompt_max = 700
seed = 5
[hardware]
backend = "{backend}"
device = "{device}"
""")
    return f


@pytest.mark.hw
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["staging", "slice"])
@pytest.mark.parametrize(
    ("backend", "device"), [("nixl", "cuda"), ("nixl", "cuda:0"), ("mooncake", "cuda:0")]
)
def test_every_byte_lands_between_gpu_pools(tmp_path, backend, device, path):
    from kvstage.run.hwrun import run_hardware
    from kvstage.run.rundir import read_summary
    from kvstage.shared.scenario import load_scenario

    require_engine(backend)
    if backend == "mooncake" and (why := mooncake_cuda_problem()):
        pytest.skip(why)
    s = load_scenario(_scenario(tmp_path, device, path, backend))
    code, run_dir = run_hardware(s, out=tmp_path / "run", timeout_s=240, console=Console(width=120))
    summary = read_summary(run_dir)
    assert code == 0, summary.get("errors")
    assert summary["requests_done"] == 4 and summary["bytes_wrong"] == 0
    g = s.geometry()
    expected = sum(
        room_pages(r.prompt_tokens, r.prefix_tokens, g.page_size)
        * g.page_size
        * 2
        * g.layers
        * g.decode_heads
        * g.head_dim
        * g.dtype_bytes
        for r in generate_requests(s)
    )
    assert summary["bytes_verified"] == expected
    # the write tag, on by default, hashed by the GPU moves themselves: every byte the
    # decode checked was hashed as the scatter (or the page read) moved it
    assert summary["verify_writes"] == "mac" and summary["writes_rejected"] == 0
    assert summary["bytes_hashed_in_moves"] == summary["bytes_checksummed"] >= expected
