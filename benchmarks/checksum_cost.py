"""What transfer.verify_writes costs ("mac", the default, and "checksum"), beside the
write it guards.

Each writer block is tagged twice on the chunk's critical path: the writer tags its
gathered block (a private copy) before it enters the send buffer (hw/rank/prefill.py),
the decode copies the staging region out of the ring and tags the copy before it
scatters it (hw/rank/decode.py). hw/rank/writemac.py has both functions:
- "mac": Poly1305 (OpenSSL through `cryptography`) under a one-time key, then keyed
  BLAKE2b over the 16-byte result (a Carter-Wegman MAC, docs/design.md "The write tag");
- "checksum": keyed BLAKE2b over the whole block (hashlib, one core).

For each block size, best of `--reps`, on `--device` (cpu; cuda tags a GPU block, so
its time includes the copy to the host, where the tag is computed):
- mac_s, b2_s: one tag of the block; copy_s: the decode's copy of it (torch clone);
- write_s: one write of the block measured here, from one process's NIXL agent to
  another's on this host (loopback: UCX's CMA or TCP, the host's memory bandwidth);
- model_s: the block's time on the wire of the default profile, rdma-400g (370 Gb/s,
  scenarios/profiles/rdma-400g.toml inter_bandwidth_gbps);
- x_write, x_line: the MAC's rate over the write's and over the line rate's (the bar:
  >= 20), and the overhead (2 * mac_s + copy_s) as a share of model_s (the bar: <= 5%).

Run on a quiet host; `uptime` is printed with the figures.

    .venv/bin/python benchmarks/checksum_cost.py            # 64 KiB .. 16 MiB blocks
    .venv/bin/python benchmarks/checksum_cost.py --reps 5   # quicker
    .venv/bin/python benchmarks/checksum_cost.py --device cuda --no-write
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import time

import torch

from kvstage.hw.rank.writemac import block_tag, tag_key
from kvstage.hw.transport.base import make_transport

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
    ap.add_argument("--device", default="cpu", help="where the block lives: cpu or cuda")
    ap.add_argument("--no-write", action="store_true", help="skip the NIXL write (no engine)")
    args = ap.parse_args()
    keys = {kind: tag_key(kind, bytes(32)) for kind in ("mac", "checksum")}
    writes = {} if args.no_write else _write_times(args.reps)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(
        f"{'block':>9} {'mac_s':>9} {'GB/s':>6} {'b2_s':>9} {'GB/s':>6} {'copy_s':>9} "
        f"{'write_s':>9} {'model_s':>9} {'x_write':>7} {'x_line':>7} {'/model':>8}"
    )
    for n in SIZES:
        data = torch.full((n,), 3, dtype=torch.uint8, device=args.device)

        def tag(kind: str, data=data) -> None:
            block_tag(kind, keys[kind], 1, 2, 3, data)

        mac = _best(lambda: tag("mac"), args.reps)
        b2 = _best(lambda: tag("checksum"), args.reps)
        c = _best(lambda data=data: data.clone(), args.reps)
        w, m = writes.get(n, float("nan")), n / RDMA_400G_BPS
        print(
            f"{n >> 10:>7}Ki {mac:>9.6f} {n / mac / 1e9:>6.2f} {b2:>9.6f} {n / b2 / 1e9:>6.2f} "
            f"{c:>9.6f} {w:>9.6f} {m:>9.6f} {w / mac:>7.2f} {m / mac:>7.3f} "
            f"{(2 * mac + c) / m:>8.1%}"
        )
    print(
        "x_write, x_line: the MAC's rate over the write's, over 370 Gb/s (bar: >= 20); "
        "/model: (2 * mac_s + copy_s) / model_s (bar: <= 5%)"
    )


if __name__ == "__main__":
    main()
