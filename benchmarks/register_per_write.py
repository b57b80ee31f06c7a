"""What registering a send block with the engine for each write costs (issue 39, item 3).

A prefill rank registers each send-buffer block for its own write only and takes it off
the engine when the write is done (hw/rank/prefill.py `_write`, `_release_slot`), so a
peer reaches a block only while it is being written. This measures that against the
baseline of the same run, a buffer registered once: a receiver process registers a ring,
a sender process writes blocks of each size into it, alternating

- baseline:  write() + wait(), the block inside a buffer registered once;
- per write: register(block) + write() + wait() + deregister(block);

--reps times each after one untimed warm-up of each, on one transport. It prints the
median of each, the ratio per write / baseline, and the median register and deregister
calls alone, and the load average. Host memory on this machine's loopback (NIXL: UCX,
here over CMA; Mooncake: TCP): an RDMA NIC pins registered pages, which costs more, and
is not measured here.

    .venv/bin/python benchmarks/register_per_write.py [--backends nixl,mooncake] [--reps 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
import traceback
from typing import Any

SIZES = (256 << 10, 4 << 20, 64 << 20)  # bytes per block
STEP_TIMEOUT_S = 120.0


def _recv(conn: Any, what: str) -> Any:
    if not conn.poll(STEP_TIMEOUT_S):
        raise TimeoutError(f"no {what!r} within {STEP_TIMEOUT_S} s")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise RuntimeError(f"the receiver failed:\n{msg[1]}")
    return msg


def receiver(backend: str, nbytes: int, conn: Any) -> None:
    try:
        import torch

        from kvstage.hw.transport.base import make_transport

        t = make_transport(backend, "reg-recv")
        ring = torch.zeros(nbytes, dtype=torch.uint8)
        t.register(ring)
        conn.send(t.metadata())
        _recv(conn, "done")
        t.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def connect(backend: str, conn: Any):
    """The sender's transport with the receiver as its peer, and the ring's address;
    the receiver is told "done" if that fails."""
    from kvstage.hw.transport.base import make_transport

    t = make_transport(backend, "reg-send")
    try:
        t.add_peer("reg-recv", _recv(conn, "metadata"))
    except BaseException:
        conn.send("done")
        t.close()
        raise
    return t, t.peer("reg-recv").regions[0].addr


def sender(backend: str, reps: int, conn: Any) -> list[dict[str, Any]]:
    import torch

    t, ring = connect(backend, conn)
    rows = []
    try:
        for size in SIZES:
            whole = torch.randint(0, 256, (2 * size,), dtype=torch.uint8)
            once = whole[:size]  # the baseline's block: registered for the whole run
            whole_region = t.register(once)
            block = whole[size:]  # the per-write block: registered for each write only
            reg_s: list[float] = []
            dereg_s: list[float] = []

            def write(src, size=size) -> None:
                t.wait(t.write("reg-recv", [(int(src.data_ptr()), ring, size)]), 60.0)

            def per_write(block=block, reg_s=reg_s, dereg_s=dereg_s, write=write) -> None:
                r0 = time.perf_counter()
                region = t.register(block)
                reg_s.append(time.perf_counter() - r0)
                write(block)
                d0 = time.perf_counter()
                t.deregister(region)
                dereg_s.append(time.perf_counter() - d0)

            write(once)  # warm-ups, untimed
            per_write()
            reg_s.clear()
            dereg_s.clear()
            base, each = [], []
            for _ in range(reps):  # alternating, so drift hits both alike
                base.append(_timed(lambda once=once, write=write: write(once)))
                each.append(_timed(per_write))
            t.deregister(whole_region)
            rows.append({"size": size, **medians(base, each, reg_s, dereg_s)})
    finally:
        conn.send("done")
        t.close()
    return rows


def medians(base, each, reg_s, dereg_s) -> dict[str, float]:
    """A row's timings: the medians of the baseline, the per-write whole, and the
    register and deregister calls alone."""
    return {
        "base_s": statistics.median(base),
        "each_s": statistics.median(each),
        "reg_s": statistics.median(reg_s),
        "dereg_s": statistics.median(dereg_s),
    }


def run(backend: str, reps: int, send=sender, ring_bytes: int = max(SIZES), *args):
    """`send(backend, reps, *args, conn)` in this process against a receiver process
    that registered a ring of `ring_bytes`."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(backend, ring_bytes, child), daemon=True)
    proc.start()
    try:
        return send(backend, reps, *args, parent)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="nixl,mooncake")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    print(f"load average before: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    print(
        f"{'engine':9} {'block':>8} {'baseline':>10} {'per write':>10} {'ratio':>6} "
        f"{'register':>9} {'deregister':>10}   (medians of {args.reps})"
    )
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        for r in run(backend, args.reps):
            print(
                f"{backend:9} {r['size'] >> 10:>6}Ki {r['base_s'] * 1e3:>8.3f}ms "
                f"{r['each_s'] * 1e3:>8.3f}ms {r['each_s'] / r['base_s']:>6.2f} "
                f"{r['reg_s'] * 1e6:>7.1f}us {r['dereg_s'] * 1e6:>8.1f}us"
            )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
