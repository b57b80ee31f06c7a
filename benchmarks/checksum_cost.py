"""What transfer.verify_writes = "checksum" costs, against the transfer of the same blocks.

With "checksum" each writer block is hashed twice on the chunk's critical path: the
writer hashes its gathered block before it posts the write (hw/prefill_rank.py), the
decode copies the staging region out of the ring and hashes the copy before it
scatters it (hw/decode_rank.py). The hash is keyed BLAKE2b, 8-byte digest
(hw/keys.py `block_checksum`; hashlib, one core, GIL released).

For each block size it prints, best of `--reps`:
- hash_s: one keyed BLAKE2b of the block; copy_s: the decode's copy of it (torch clone);
- write_s: one write of the block measured here, from one process's NIXL agent to
  another's on this host (loopback: UCX's CMA or TCP, the host's memory bandwidth);
- model_s: the block's time on the wire of the default profile, rdma-400g (370 Gb/s,
  scenarios/profiles/rdma-400g.toml [D]/[A]);
- the overhead (2 * hash_s + copy_s) as a fraction of write_s and of model_s.

The issue's bar: the hardware-mode default if the overhead is at most 5% of the
transfer. Run on a quiet host; `uptime` is printed with the figures.

    .venv/bin/python benchmarks/checksum_cost.py            # 64 KiB .. 16 MiB blocks
    .venv/bin/python benchmarks/checksum_cost.py --reps 5   # quicker
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import time

import torch

from kvstage.hw.keys import block_checksum, write_key
from kvstage.hw.transport import make_transport

SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20]
RDMA_400G_BPS = 370e9 / 8  # [A] scenarios/profiles/rdma-400g.toml inter_bandwidth_gbps


def _best(fn, reps: int) -> float:
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
            out[n] = _best(write, reps)
        t.close()
        return out
    finally:
        parent.send("done")
        proc.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    key = write_key(bytes(32))
    writes = _write_times(args.reps)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(
        f"{'block':>9} {'hash_s':>10} {'GB/s':>6} {'copy_s':>10} {'write_s':>10} "
        f"{'model_s':>10} {'/write':>8} {'/model':>8}"
    )
    for n in SIZES:
        data = torch.full((n,), 3, dtype=torch.uint8)
        view = data.numpy()
        h = _best(lambda view=view: block_checksum(key, 1, 2, view), args.reps)
        c = _best(lambda data=data: data.clone(), args.reps)
        w, m = writes[n], n / RDMA_400G_BPS
        extra = 2 * h + c
        print(
            f"{n >> 10:>7}Ki {h:>10.6f} {n / h / 1e9:>6.2f} {c:>10.6f} {w:>10.6f} "
            f"{m:>10.6f} {extra / w:>8.1%} {extra / m:>8.1%}"
        )
    print("overhead = 2 * hash_s + copy_s (writer's hash, decode's copy and hash)")


if __name__ == "__main__":
    main()
