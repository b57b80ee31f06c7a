"""What closing the slice path's decode pool per room would take (issue 39, items 3 and 5).

On the slice path the writers' engines write straight into the decode's KV pool, so the
pool is registered for the whole run and, on Mooncake, open to whoever reaches its
port: bytes written there after a room's check land in its KV cache, and its KV can be
read (docs/hardware-mode.md). Closing that means registering only a room's pages, while
its writes may land, and taking them off before the check. A pool is laid out [plane,
layer, token, head, dim] (as SGLang's per-layer buffers): a room's tokens are one span
per (plane, layer), so a room is planes x layers registrations on the decode, and on
NIXL each writer must load the decode's metadata of those regions before it writes (a
remote region NIXL has no metadata of is refused), through the control plane.

For each model preset, with NIXL (UCX) on this host: the registrations a room needs, the
time to register and deregister them (one call each, a 4,096-token room's spans of one
decode rank's heads in host memory), and the bytes of the partial metadata a writer must
load (`get_partial_agent_metadata` of those regions, without connection info) beside
the control plane's bounds (a frame 4 KiB, a message 32 KiB: hw/control/plane.py).
Best of --reps. Host memory: an RDMA NIC pins what is registered, which costs more.

Then what each engine does with a region registered, or taken off, after the writer
connected (two engines in this process, loopback): whether a write lands in memory not
registered, in memory registered after the handshake (NIXL: before and after the writer
loads the partial metadata), and after the region is taken off again.

    .venv/bin/python benchmarks/slice_registration.py [--reps 5]
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch

from kvstage.hw.control.plane import MAX_CONTROL_BYTES, ZMQ_MAX_CONTROL_FRAME
from kvstage.shared.scenario.presets import PRESETS

MODELS = ("llama-3-8b", "llama-3-70b", "llama-3-405b", "deepseek-v3")
ROOM_TOKENS = 4096
DECODE_TP = 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from nixl._api import nixl_agent, nixl_agent_config

    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    agent = nixl_agent("slice-reg", nixl_agent_config(backends=["UCX"]))
    print(
        f"{'model':>13} {'regs':>5} {'span KiB':>9} {'register_s':>10} {'deregister_s':>12} "
        f"{'metadata B':>10} {'/frame':>7} {'/message':>8}"
    )
    for name in MODELS:
        m = PRESETS[name]
        planes = 1 if m.attention == "mla" else 2
        heads = max(1, m.kv_heads // DECODE_TP)
        span = ROOM_TOKENS * heads * m.head_dim * 2  # bf16
        regs = planes * m.layers
        pool = torch.empty(regs * span, dtype=torch.uint8)  # one span a (plane, layer)
        spans = [(int(pool.data_ptr()) + i * span, span, 0, "") for i in range(regs)]
        reg, dereg, md = [], [], b""
        for _ in range(args.reps):
            t = time.perf_counter()
            descs = agent.register_memory(spans, "DRAM")
            reg.append(time.perf_counter() - t)
            md = agent.get_partial_agent_metadata(descs, False, ["UCX"])
            t = time.perf_counter()
            agent.deregister_memory(descs)
            dereg.append(time.perf_counter() - t)
        print(
            f"{name:>13} {regs:>5} {span >> 10:>9} {min(reg):>10.6f} {min(dereg):>12.6f} "
            f"{len(md):>10} {len(md) / ZMQ_MAX_CONTROL_FRAME:>7.1f} "
            f"{len(md) / MAX_CONTROL_BYTES:>8.2f}"
        )
        del pool
    print(
        "regs: registrations a room needs on one decode rank (planes x layers); metadata B: "
        "what each writer must load before it writes the room; /frame, /message: over the "
        "control plane's bounds"
    )


def _mooncake_probe() -> dict[str, str]:
    import numpy as np
    from mooncake.engine import TransferEngine

    writer, decode = TransferEngine(), TransferEngine()
    for e in (writer, decode):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    session = f"127.0.0.1:{decode.get_rpc_port()}"
    src = np.full(4096, 7, dtype=np.uint8)
    writer.register_memory(src.ctypes.data, src.nbytes)
    ring = np.zeros(4096, dtype=np.uint8)
    decode.register_memory(ring.ctypes.data, ring.nbytes)
    room = np.zeros(1 << 20, dtype=np.uint8)

    def write(dst) -> str:
        dst[:4] = 0
        rc = writer.batch_transfer_sync_write(session, [src.ctypes.data], [dst.ctypes.data], [4096])
        return f"rc {rc}, {'landed' if dst[0] == 7 else 'not landed'}"

    out = {"registered at the handshake": write(ring), "never registered": write(room)}
    decode.register_memory(room.ctypes.data, room.nbytes)
    out["registered after the handshake"] = write(room)
    decode.unregister_memory(room.ctypes.data)
    out["taken off again"] = write(room)
    return out


def _nixl_probe() -> dict[str, str]:
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_listen_thread=False, backends=["UCX"])
    writer, decode = nixl_agent("probe-w", cfg), nixl_agent("probe-d", cfg)
    src = torch.full((4096,), 7, dtype=torch.uint8)
    writer.register_memory(src)
    ring = torch.zeros(4096, dtype=torch.uint8)
    decode.register_memory(ring)
    writer.add_remote_agent(decode.get_agent_metadata())
    room = torch.zeros(1 << 20, dtype=torch.uint8)

    def write(dst: torch.Tensor) -> str:
        dst[:4] = 0
        try:
            local = writer.get_xfer_descs([(src.data_ptr(), 4096, 0)], "DRAM")
            remote = writer.get_xfer_descs([(dst.data_ptr(), 4096, 0)], "DRAM")
            h = writer.initialize_xfer("WRITE", local, remote, "probe-d")
            writer.transfer(h)
            t = time.time()
            while writer.check_xfer_state(h) not in ("DONE", "ERR") and time.time() - t < 5:
                pass
            state = writer.check_xfer_state(h)
        except Exception as exc:  # NIXL refuses a region it has no metadata of
            state = type(exc).__name__
        return f"{state}, {'landed' if int(dst[0]) == 7 else 'not landed'}"

    out = {"registered at the handshake": write(ring), "never registered": write(room)}
    descs = decode.register_memory(room)
    out["registered after the handshake"] = write(room)
    writer.add_remote_agent(decode.get_partial_agent_metadata(descs, False, ["UCX"]))
    out["... and its partial metadata loaded"] = write(room)
    decode.deregister_memory(descs)
    out["taken off again"] = write(room)
    return out


def probes() -> None:
    for name, probe in (("mooncake (tcp)", _mooncake_probe), ("nixl (ucx)", _nixl_probe)):
        try:
            rows = probe()
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        for what, outcome in rows.items():
            print(f"{name:>15}  a write into memory {what}: {outcome}")


if __name__ == "__main__":
    main()
    probes()
