"""Raw transport throughput between two processes, per backend.

For each backend a receiver process registers a zeroed buffer and a sender process
writes into it through hw.transport:
- large:   one write of --size-mib (default 64 MiB), one op;
- batched: --ops x --op-kib ops (default 1024 x 64 KiB, the same bytes) in ONE batch,
           source page i to a shuffled destination page, as a paged KV cache would be.
Each case runs --reps times after one untimed warm-up; a rep is write() (validation,
descriptor building, post) plus wait(). The receiver checks every byte at the end.
Both buffers are host memory, or GPU memory with --device cuda (both processes on one
GPU: the VRAM ceiling benchmarks/gpu_check.sh prints); --json writes the figures.

    .venv/bin/python benchmarks/transport_raw.py [--backends nixl,mooncake] [--reps 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from typing import Any

STEP_TIMEOUT_S = 120.0
SEED = 7


def _recv(conn: Any, what: str) -> tuple:
    if not conn.poll(STEP_TIMEOUT_S):
        raise TimeoutError(f"no {what!r} within {STEP_TIMEOUT_S} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"peer process failed:\n{msg[1]}")
    return msg


def _source(nbytes: int) -> Any:
    import torch

    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(SEED)
    )


def _permutation(n: int) -> Any:
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(SEED + 1))


def receiver(backend: str, nbytes: int, nops: int, device: str, conn: Any) -> None:
    try:
        import torch

        from kvstage.hw.transport.base import make_transport

        transport = make_transport(backend, "bench-recv", device)
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        transport.register(dst)
        conn.send(("metadata", transport.metadata()))
        _recv(conn, "check")
        # Last thing written: the batched case, source page i -> destination page perm[i].
        page = nbytes // nops
        src = _source(nbytes).view(nops, page)
        ok = torch.equal(dst.cpu().view(nops, page)[_permutation(nops)], src)
        conn.send(("checked", ok))
        transport.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def sender(
    backend: str, nbytes: int, nops: int, reps: int, timeout_s: float, device: str, conn: Any
) -> None:
    try:
        import numpy as np

        from kvstage.hw.transport.base import make_transport

        transport = make_transport(backend, "bench-send", device)
        src = _source(nbytes).to(device)
        local = transport.register(src)
        _, metadata = _recv(conn, "metadata")
        transport.add_peer("bench-recv", metadata)
        remote = transport.peer("bench-recv").regions[0]
        page = nbytes // nops
        perm = _permutation(nops).numpy().astype(np.int64)
        cases = {
            "large": np.array([[local.addr, remote.addr, nbytes]], dtype=np.int64),
            "batched": np.stack(
                [
                    local.addr + np.arange(nops, dtype=np.int64) * page,
                    remote.addr + perm * page,
                    np.full(nops, page, dtype=np.int64),
                ],
                axis=1,
            ),
        }
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(reps + 1):  # rep 0 warms up connections and page tables
            for name, ops in cases.items():
                t0 = time.perf_counter()
                handle = transport.write("bench-recv", ops)
                transport.wait(handle, timeout_s, f"{name} rep {rep}")
                if rep:
                    seconds[name].append(time.perf_counter() - t0)
        conn.send(("times", seconds, transport.requests_posted))
        transport.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run_backend(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    nbytes = args.size_mib << 20
    nops = nbytes // (args.op_kib << 10)
    ctx = mp.get_context("spawn")
    r_conn, r_child = ctx.Pipe()
    s_conn, s_child = ctx.Pipe()
    procs = [
        ctx.Process(
            target=receiver, args=(backend, nbytes, nops, args.device, r_child), daemon=True
        ),
        ctx.Process(
            target=sender,
            args=(backend, nbytes, nops, args.reps, args.timeout, args.device, s_child),
            daemon=True,
        ),
    ]
    for proc in procs:
        proc.start()
    r_child.close()
    s_child.close()
    try:
        _, metadata = _recv(r_conn, "metadata")
        s_conn.send(("metadata", metadata))
        _, seconds, posted = _recv(s_conn, "times")
        r_conn.send(("check",))
        _, ok = _recv(r_conn, "checked")
    finally:
        for proc in procs:
            proc.join(STEP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    return {"seconds": seconds, "nbytes": nbytes, "nops": nops, "posted": posted, "ok": ok}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="nixl,mooncake")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--op-kib", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=60.0, help="bound of one wait()")
    parser.add_argument(
        "--device", default="cpu", help="cpu, cuda or cuda:N: where both buffers live"
    )
    parser.add_argument(
        "--json", default=None, help="also write {backend: {case: median GB/s, ...}} here"
    )
    args = parser.parse_args()
    if args.reps < 1 or (args.size_mib << 10) % args.op_kib:
        parser.error("--reps must be >= 1 and --op-kib must divide --size-mib")

    from kvstage.hw.transport.base import probe_engine

    print(
        f"{'backend':9} {'case':8} {'ops':>5} {'median GB/s':>12} {'best GB/s':>10} "
        f"{'median ms':>10}  bytes ok"
    )
    failed = False
    figures: dict[str, dict[str, Any]] = {}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        reason = probe_engine(backend)
        if reason:
            print(f"{backend:9} skipped: {reason}")
            failed = True
            continue
        res = run_backend(backend, args)
        gbps = {}
        for name, secs in res["seconds"].items():
            nops = 1 if name == "large" else res["nops"]
            med = statistics.median(secs)
            gbps[name] = res["nbytes"] / med / 1e9
            print(
                f"{backend:9} {name:8} {nops:5d} {gbps[name]:12.2f} "
                f"{res['nbytes'] / min(secs) / 1e9:10.2f} {med * 1e3:10.2f}  {res['ok']}"
            )
        print(
            f"{backend:9} batched/large throughput ratio {gbps['batched'] / gbps['large']:.2f} "
            f"({res['posted']} transfer requests posted in total)"
        )
        failed = failed or not res["ok"]
        figures[backend] = {**gbps, "bytes": res["nbytes"], "ok": res["ok"], "device": args.device}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
