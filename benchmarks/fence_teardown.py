"""Can a decode cut one lost writer off in the engine, so its regions can be reused
before the fence's grace? Issue 39, item 5: measured, per engine, between two processes
on this host (hw/transport/base.py, the engines kvstage uses).

A receiver (the decode) registers a ring and loads the writer's metadata; the writer
writes 0x11 into it (it lands). Then the receiver does the engine's per-peer teardown:

- NIXL: `remove_remote_agent(writer)` (the writer's metadata invalidated at the decode);
- Mooncake 0.3.13.post1: its Python binding has no per-peer call (no segment close;
  `dir(TransferEngine)` is printed), so nothing per peer;

and the writer writes 0x22: does it land? Last the receiver deregisters the ring (the
teardown that does not pick a peer) and the writer writes 0x33.

    .venv/bin/python benchmarks/fence_teardown.py            # both engines
    .venv/bin/python benchmarks/fence_teardown.py --backend nixl
"""

from __future__ import annotations

import argparse
import multiprocessing as mp

import torch

from kvstage.hw.transport.base import make_transport

N = 1 << 20


def _receiver(backend: str, conn) -> None:
    t = make_transport(backend, "fence-recv")
    ring = torch.zeros(N, dtype=torch.uint8)
    region = t.register(ring)
    conn.send(t.metadata())
    t.add_peer("fence-send", conn.recv())
    for step in ("honest", "after per-peer teardown", "after the ring is deregistered"):
        conn.recv()  # the writer wrote
        conn.send((step, int(ring[0]), int(ring[N - 1])))
        if step == "honest":
            if backend == "nixl":
                t._agent.remove_remote_agent("fence-send")
        elif step == "after per-peer teardown":
            t.deregister(region)
        conn.send("torn down")
    conn.recv()


def probe(backend: str) -> list[str]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(backend, child), daemon=True)
    proc.start()
    lines = []
    try:
        t = make_transport(backend, "fence-send")
        src = torch.empty(N, dtype=torch.uint8)
        local = t.register(src)
        t.add_peer("fence-recv", parent.recv())
        parent.send(t.metadata())
        remote = t.peer("fence-recv").regions[0]
        for value in (0x11, 0x22, 0x33):
            src.fill_(value)
            try:
                t.wait(t.write("fence-recv", [(local.addr, remote.addr, N)]), 10.0, "probe")
                outcome = "write completed"
            except Exception as exc:  # the engine's refusal is the measurement
                outcome = f"write failed: {str(exc)[:120]}"
            parent.send("wrote")
            step, first, last = parent.recv()
            landed = first == value and last == value
            lines.append(
                f"{backend}: {step}: 0x{value:02x} {outcome}; "
                f"{'landed' if landed else f'did not land (ring holds 0x{first:02x})'}"
            )
            if value != 0x33:
                parent.recv()  # torn down
        parent.send("done")
        t.close()
    finally:
        proc.join(20)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["nixl", "mooncake"], action="append")
    args = ap.parse_args()
    for backend in args.backend or ["nixl", "mooncake"]:
        if backend == "mooncake":
            from mooncake.engine import TransferEngine

            calls = [m for m in dir(TransferEngine) if not m.startswith("_")]
            print("mooncake: TransferEngine calls:", ", ".join(calls))
        for line in probe(backend):
            print(line)


if __name__ == "__main__":
    main()
