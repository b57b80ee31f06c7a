"""What registering a slice write's source pages for that write only costs (issue 39, item 3).

On the slice path a prefill's KV pool is the source of its writes. Registered for the
whole run, it was open to whoever reaches Mooncake's port: bytes written into it before
a write's tag were tagged as the writer's own. Now a write's pages are registered after
its tag, one region per (K/V, layer) run, and taken off when the write ends
(hw/rank/prefill.py `SourceRuns`). This measures that against the baseline of the same
run, the pool registered once: a receiver process registers a ring, a sender process
writes one chunk of a model's pool (one request per (K/V, layer, page), the slice path's
ops where a page's token rows are whole), alternating

- baseline:  write() + wait(), the pool registered once;
- per write: SourceRuns.open() + write() + wait() + SourceRuns.close();

--reps times each after one untimed warm-up of each. The pool is a prefill rank's at
TP 8 (KV heads / 8, at least 1), bf16, pages of 16 tokens, a chunk of --tokens tokens.
It prints the medians, the ratio per write / baseline, the registrations a write makes,
and the load average. Host memory on this machine's loopback (NIXL: UCX over CMA;
Mooncake: TCP); an RDMA NIC pins registered pages, which costs more, not measured here.
Mooncake over TCP is given no source (`Transport.sources_on_engine`): there the per-write
column is kvstage's own bookkeeping of the runs against the pool on the engine once.

    .venv/bin/python benchmarks/slice_sources.py [--backends nixl,mooncake] [--reps 10]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from register_per_write import _timed, connect, medians, run

MODELS = ("llama-3-8b", "llama-3-70b", "llama-3-405b")
PAGE = 16
PREFILL_TP = 8


def _pool(model: str, tokens: int):
    """A prefill rank's pool of two chunks, and its descriptor."""
    import torch

    from kvstage.hw.rank.kvpool import PoolDesc
    from kvstage.shared.scenario.presets import PRESETS

    m = PRESETS[model]
    heads = max(1, m.kv_heads // PREFILL_TP)
    pool = torch.randint(0, 256, (2 * m.layers * 2 * tokens * heads * m.head_dim * 2,))
    pool = pool.to(torch.uint8)
    desc = PoolDesc(int(pool.data_ptr()), m.layers, 2 * tokens, heads, m.head_dim, 2, PAGE)
    return pool, desc


def sender(backend: str, reps: int, tokens: int, conn: Any) -> list[dict[str, Any]]:
    from kvstage.hw.rank.prefill import SourceRuns

    t, ring = connect(backend, conn)
    rows = []
    try:
        for model in MODELS:
            pool, desc = _pool(model, tokens)
            pages = tokens // PAGE
            page_bytes = PAGE * desc.heads * desc.token_bytes_per_head
            ops = [  # chunk 1 (pages [pages, 2 pages)), packed into the ring
                (addr + p * page_bytes, ring + (k * pages + p) * page_bytes, page_bytes)
                for k, (addr, _) in enumerate(desc.page_runs(pages, pages))
                for p in range(pages)
            ]
            sources = SourceRuns(t, pool, desc)

            def write(ops=ops) -> None:
                t.wait(t.write("reg-recv", ops), 120.0)

            reg_s: list[float] = []
            dereg_s: list[float] = []

            def per_write(sources=sources, pages=pages, write=write, r=reg_s, d=dereg_s) -> None:
                r.append(_timed(lambda: d.append(sources.open(pages, pages))))
                token = d.pop()
                write()
                d.append(_timed(lambda: sources.close(token)))

            per_write()  # warm-ups, untimed
            reg_s.clear()
            dereg_s.clear()
            whole = t.register(pool)
            write()
            base, each = [], []
            for _ in range(reps):  # alternating, so drift hits both alike
                base.append(_timed(write))
                t.deregister(whole)
                each.append(_timed(per_write))
                whole = t.register(pool)
            t.deregister(whole)
            assert sources.held == 0, "a write's pages stayed registered"
            rows.append(
                {
                    "model": model,
                    "regs": len(desc.page_runs(pages, pages)),
                    "ops": len(ops),
                    "mib": sum(n for *_, n in ops) / (1 << 20),
                    **medians(base, each, reg_s, dereg_s),
                }
            )
    finally:
        conn.send("done")
        t.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="nixl,mooncake")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1024, help="a chunk's tokens (pages of 16)")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    if args.tokens < PAGE or args.tokens % PAGE:
        ap.error(f"--tokens must be a positive multiple of {PAGE}, got {args.tokens}")
    print(f"load average before: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    print(
        f"{'engine':9} {'model':>13} {'regs':>5} {'ops':>6} {'MiB':>6} {'baseline':>10} "
        f"{'per write':>10} {'ratio':>6} {'register':>9} {'deregister':>10}   (medians of {args.reps}, {args.tokens} tokens)"
    )
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        for r in run(backend, args.reps, sender, 256 << 20, args.tokens):
            print(
                f"{backend:9} {r['model']:>13} {r['regs']:>5} {r['ops']:>6} {r['mib']:>6.1f} "
                f"{r['base_s'] * 1e3:>8.3f}ms {r['each_s'] * 1e3:>8.3f}ms "
                f"{r['each_s'] / r['base_s']:>6.2f} {r['reg_s'] * 1e3:>7.3f}ms "
                f"{r['dereg_s'] * 1e3:>8.3f}ms"
            )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
