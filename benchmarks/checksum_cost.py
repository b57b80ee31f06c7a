"""What transfer.verify_writes costs ("mac", the default, and "checksum"), beside the
write it guards.

Each writer block is tagged twice on the chunk's critical path: the writer tags its
gathered block (a private copy) before it enters the send buffer (hw/rank/prefill.py),
the decode copies the staging region out of the ring and tags the copy before it
scatters it (hw/rank/decode.py). hw/rank/writemac.py has both functions:
- "mac": Poly1305 (OpenSSL through `cryptography`) under a one-time key, then keyed
  BLAKE2b over the 16-byte result (a Carter-Wegman MAC, docs/design.md "The write tag");
- "checksum": keyed BLAKE2b over the whole block (hashlib, one core).

For each block size, best of `--reps`, on `--device` (cpu, or cuda: a GPU block's
"mac" runs NH on the device, hw/rank/nhash.py, and only its digest goes to the host;
cuda adds 64 and 256 MiB blocks):
- mac_s, b2_s: one tag of the block; copy_s: a plain copy of it (torch clone);
- tagcopy_s: a copy of the block with its "mac" (`tag_and_copy`: one pass on a GPU),
  what the writer does into its send buffer and the decode out of its ring;
- host_s: the "mac" of the block's bytes on the host, the copy there included (on a
  GPU block: what the tag cost before the device hash; x_host = host_s / mac_s);
- write_s: one write of the block measured here, from one process's NIXL agent to
  another's on this host (loopback: UCX's CMA or TCP, the host's memory bandwidth);
- model_s: the block's time on the wire of the default profile, rdma-400g (370 Gb/s,
  scenarios/profiles/rdma-400g.toml inter_bandwidth_gbps);
- x_write, x_line: the MAC's rate over the write's and over the line rate's (the bar:
  >= 20), and the overhead (2 * tagcopy_s: the two copies the tag brings, each with its
  tag; without it the writer gathers into the send buffer and the decode scatters out
  of the ring) as a share of model_s (the bar: <= 5%).
- `--parts` (cuda): the NH kernel alone by kernel shape, the launch's host time, the
  digest's trip to the host, and the fused copy's rate.

On GPU pools the ranks no longer make those two copies: the hash rides inside the
writer's gather and the decode's scatter (hw/rank/kernels.py `gather_hashed`,
`scatter_hashed`). What that costs on a block's path, against the same wire time, is
printed by benchmarks/gpu_kernels.py (its "write tag on a block's path" lines).

Run on a quiet host; `uptime` is printed with the figures.

    .venv/bin/python benchmarks/checksum_cost.py            # 64 KiB .. 16 MiB blocks
    .venv/bin/python benchmarks/checksum_cost.py --reps 5   # quicker
    .venv/bin/python benchmarks/checksum_cost.py --device cuda --no-write --parts
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import time
import tomllib
from pathlib import Path

import torch

from kvstage.hw.rank.nhash import nh_device
from kvstage.hw.rank.writemac import block_mac, block_tag, host_bytes, tag_and_copy, tag_key
from kvstage.hw.transport.base import make_transport

SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20]
# the default profile's line rate (370 Gb/s), bytes a second, read from the profile itself
_PROFILE = Path(__file__).resolve().parent.parent / "scenarios/profiles/rdma-400g.toml"
RDMA_400G_BPS = tomllib.loads(_PROFILE.read_text())["inter_bandwidth_gbps"] * 1e9 / 8


def best_wall(fn, reps: int) -> float:
    """Fewest wall-clock seconds of `fn` over `reps` runs."""
    took = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t)
    return min(took)


def _receiver(conn, nbytes: int) -> None:
    t = make_transport("nixl", "ck-recv")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    t.register(buf)
    conn.send(t.metadata())
    conn.recv()  # done
    t.close()


def _write_times(reps: int) -> dict[int, float]:
    """Best NIXL write time of each block size, process to process on this host."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, max(SIZES)), daemon=True)
    proc.start()
    try:
        t = make_transport("nixl", "ck-send")
        src = torch.full((max(SIZES),), 7, dtype=torch.uint8)
        local = t.register(src)
        t.add_peer("ck-recv", parent.recv())
        remote = t.peer("ck-recv").regions[0]
        out = {}
        for n in SIZES:

            def write(n=n):
                t.wait(t.write("ck-recv", [(local.addr, remote.addr, n)]), 30.0, "bench write")

            write()  # warm-up: connection set-up
            out[n] = best_wall(write, reps)
        t.close()
        return out
    finally:
        parent.send("done")
        proc.join(10)


def _parts(key: bytes, sizes: list[int], reps: int) -> None:
    """Where a GPU tag's time goes, per block size: the NH kernel alone (CUDA events over
    `reps` back-to-back launches) for each kernel shape, the launch's host time, and the
    digest's trip to the host."""
    shapes = [(512, 4), (1024, 4), (1024, 8), (2048, 8)]
    print("NH kernel alone, GB/s of the block read (tile x warps):")
    print(f"{'block':>9} " + " ".join(f"{f'{t}x{w}':>9}" for t, w in shapes), end="")
    print(f" {'launch_s':>9} {'fetch_s':>9} {'fused GB/s':>10}")
    for n in sizes:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(data)
        rates = []
        for tile, warps in shapes:
            nh_device(data, key, tile=tile, warps=warps)  # compile
            torch.cuda.synchronize()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(reps):
                nh_device(data, key, tile=tile, warps=warps)
            t1.record()
            torch.cuda.synchronize()
            rates.append(n * reps / (t0.elapsed_time(t1) * 1e-3) / 1e9)
        torch.cuda.synchronize()
        launch = best_wall(lambda data=data: nh_device(data, key), reps)
        torch.cuda.synchronize()
        out = nh_device(data, key)
        torch.cuda.synchronize()
        fetch = best_wall(lambda out=out: out.cpu(), reps)
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(reps):
            nh_device(data, key, copy_to=dst)
        t1.record()
        torch.cuda.synchronize()
        fused = n * reps / (t0.elapsed_time(t1) * 1e-3) / 1e9
        print(
            f"{n >> 10:>7}Ki "
            + " ".join(f"{r:>9.1f}" for r in rates)
            + f" {launch:>9.6f} {fetch:>9.6f} {fused:>10.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cpu", help="where the block lives: cpu or cuda")
    ap.add_argument("--no-write", action="store_true", help="skip the NIXL write (no engine)")
    ap.add_argument("--parts", action="store_true", help="cuda: where a tag's time goes")
    args = ap.parse_args()
    keys = {kind: tag_key(kind, bytes(32)) for kind in ("mac", "checksum")}
    writes = {} if args.no_write else _write_times(args.reps)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    cuda = torch.device(args.device).type == "cuda"
    sizes = SIZES + ([64 << 20, 256 << 20] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(
        f"{'block':>9} {'mac_s':>9} {'GB/s':>7} {'tagcopy_s':>9} {'copy_s':>9} {'host_s':>9} "
        f"{'x_host':>6} {'b2_s':>9} {'GB/s':>6} {'write_s':>9} {'model_s':>9} {'x_write':>7} "
        f"{'x_line':>7} {'/model':>7}"
    )
    for n in sizes:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, device=args.device)
        dst = torch.empty_like(data)
        block_tag("mac", keys["mac"], 1, 2, 3, data)  # warm-up: the kernel's compilation
        tag_and_copy("mac", keys["mac"], 1, 2, 3, data, dst)

        def tag(kind: str, data=data) -> None:
            block_tag(kind, keys[kind], 1, 2, 3, data)

        def copy(data=data) -> None:
            data.clone()
            sync()

        mac = best_wall(lambda: tag("mac"), args.reps)
        tc = best_wall(
            lambda d=data, o=dst: tag_and_copy("mac", keys["mac"], 1, 2, 3, d, o), args.reps
        )
        host = best_wall(
            lambda data=data: block_mac(keys["mac"], 1, 2, 3, host_bytes(data)), args.reps
        )
        b2 = best_wall(lambda: tag("checksum"), args.reps)
        c = best_wall(copy, args.reps)
        w, m = writes.get(n, float("nan")), n / RDMA_400G_BPS
        print(
            f"{n >> 10:>7}Ki {mac:>9.6f} {n / mac / 1e9:>7.2f} {tc:>9.6f} {c:>9.6f} {host:>9.6f} "
            f"{host / mac:>6.1f} {b2:>9.6f} {n / b2 / 1e9:>6.2f} {w:>9.6f} {m:>9.6f} "
            f"{w / mac:>7.2f} {m / mac:>7.3f} {2 * tc / m:>7.1%}"
        )
    print(
        "x_write, x_line: the MAC's rate over the write's, over 370 Gb/s (bar: >= 20); "
        "/model: what the tag adds to a block's path, 2 * tagcopy_s (the writer's copy into "
        "the send buffer and the decode's out of the ring, each with its tag), over "
        "model_s (bar: <= 5%)"
    )
    if args.parts and cuda:
        _parts(keys["mac"], sizes, args.reps)


if __name__ == "__main__":
    main()
