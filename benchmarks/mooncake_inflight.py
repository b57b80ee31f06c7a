"""Does deregistering a region on Mooncake's TCP transport stop a write already under
way into it? Measured on loopback (docs/results/2026-12-04-mooncake-inflight.md).

Mooncake's TCP server (mooncake-transfer-engine/src/transport/tcp_transport/
tcp_transport_session_impl.h, `ServerSession`) reads a request's 24-byte header,
checks (address, size) against the registered buffers once (`validate_addr_`, in
`readHeader`), then reads the body from the socket straight into that address, 64 KiB
a read (`readBody`, `MC_TCP_SLICE_SIZE`), with no further check and no timeout.
`unregister_memory` only takes the buffer out of the local segment descriptor
(`TransferMetadata::removeLocalMemoryBuffer`), which the next header's check reads.

The target: Mooncake's own engine (P2PHANDSHAKE, tcp, as hw/transport/mooncake.py
initialises it) with a numpy buffer of zeros registered. The writer: a plain socket,
no Mooncake code, that learns the data port from the handshake (the segment descriptor
a Metadata request is answered with, `tcp_data_port`) and speaks the request framing:

    header = struct.pack("<QQB7x", size, addr, opcode)   # SessionHeader, padded to 24
    opcode = 1 (WRITE) | 0x80 (v2: the server answers an 8-byte little-endian status,
             0x4D435456_00000000 ok after the last byte is in memory, ..._00000001 when
             the header's address is not within a registered buffer; without 0x80 the
             legacy framing: no status, a refused header only closes the connection)

Each trial: register the buffer; send a header for a write of --size bytes into it and
the first half of the body (0xA1; --before bytes if given); wait until those bytes are
in the buffer; the target calls `unregister_memory` (rc); a new request to the buffer is then tried twice, a raw
v2 header on a new connection (the status it gets) and a 4 KiB write through
Mooncake's own API from a second engine (rc, and whether it landed); the writer waits
--delays seconds, sends the rest of the body (0xA2), and the buffer is polled: how many
bytes of each part landed, and the status the server sent at the end.

    .venv/bin/python benchmarks/mooncake_inflight.py [--size 1048576] [--delays 0,1,5] [--reps 3]
    .venv/bin/python benchmarks/mooncake_inflight.py --before 1 --delays 0,30 --reps 1
    .venv/bin/python benchmarks/mooncake_inflight.py --legacy --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import time

import numpy as np

HEADER = struct.Struct("<QQB7x")  # SessionHeader {uint64 size; uint64 addr; uint8 opcode}
WRITE, V2 = 1, 0x80  # TransferRequest::WRITE; kOpcodeV2Flag
STATUS_MAGIC = 0x4D435456 << 32  # "MCTV": kStatusMagic
STATUS = {STATUS_MAGIC: "ok", STATUS_MAGIC | 1: "addr rejected"}
METADATA = 1  # HandShakeRequestType::Metadata
BEFORE, AFTER, PROBE = 0xA1, 0xA2, 0x77
PROBE_BYTES = 4096


def handshake(rpc_port: int) -> dict:
    """The target's segment descriptor, as its P2P handshake gives it to any peer:
    an 8-byte length (1 + the JSON's), the request type, the JSON (common.h
    writeString/readString); a Metadata request is answered with the local segment."""
    body = bytes([METADATA]) + b"{}"
    with socket.create_connection(("127.0.0.1", rpc_port), timeout=5) as s:
        s.sendall(struct.pack("<Q", len(body)) + body)
        (length,) = struct.unpack("<Q", _recv_exact(s, 8))
        reply = _recv_exact(s, length)
    assert reply[0] == METADATA, reply[:16]
    return json.loads(reply[1:])


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = s.recv(n - len(out))
        if not part:
            break
        out += part
    return out


def _status(s: socket.socket, timeout: float) -> str:
    """The v2 status frame the server sends on this connection, or what happened."""
    s.settimeout(timeout)
    try:
        frame = _recv_exact(s, 8)
    except TimeoutError:
        return "none (timeout)"
    except OSError as exc:
        return f"none ({type(exc).__name__})"
    if len(frame) < 8:
        return "connection closed"
    (value,) = struct.unpack("<Q", frame)
    return STATUS.get(value, f"0x{value:016x}")


def _wait(cond, timeout: float = 5.0) -> float | None:
    """Seconds until cond() holds (polled), None if it did not within timeout."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if cond():
            return time.perf_counter() - t0
        time.sleep(0.0005)
    return None


class Prober:
    """A second Mooncake engine: Mooncake's own API writing 4 KiB of PROBE. A new one
    each trial: one engine's write right after a refused one can fail on its own side
    (seen: rc -1 with no request at the target, 2 ms after a refusal)."""

    def __init__(self) -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.src = np.full(PROBE_BYTES, PROBE, dtype=np.uint8)
        assert self.engine.register_memory(self.src.ctypes.data, self.src.nbytes) == 0

    def close(self) -> None:
        self.engine.unregister_memory(self.src.ctypes.data)
        del self.engine


def trial(
    target, prober: Prober, buf: np.ndarray, size: int, half: int, delay: float, v2: bool = True
) -> dict:
    """One write of `size` bytes into buf[:size], deregistered after `half` bytes; the
    in-flight write's header v2 (acknowledged) or, `v2=False`, the legacy framing."""
    addr, rpc_port = buf.ctypes.data, target.get_rpc_port()
    session = f"127.0.0.1:{rpc_port}"
    buf[:] = 0
    row: dict = {"delay_s": delay, "register_rc": target.register_memory(addr, buf.nbytes)}
    desc = handshake(rpc_port)
    port = int(desc["tcp_data_port"])
    row["listed_before"] = any(int(b["addr"]) == addr for b in desc["buffers"])
    # the second engine's write while registered: the probe works, then clear it
    src = prober.src
    row["api_before_rc"] = prober.engine.batch_transfer_sync_write(
        session, [src.ctypes.data], [addr + size], [PROBE_BYTES]
    )
    row["api_before_landed"] = bool((buf[size:] == PROBE).all())
    buf[size:] = 0

    w = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        w.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        w.sendall(HEADER.pack(size, addr, WRITE | (V2 if v2 else 0)))
        w.sendall(bytes([BEFORE]) * half)
        row["first_half_in_s"] = _wait(lambda: bool(buf[half - 1] == BEFORE))
        t = time.perf_counter()
        row["unregister_rc"] = target.unregister_memory(addr)
        t_unreg = time.perf_counter()
        row["unregister_s"] = t_unreg - t
        row["listed_after"] = any(int(b["addr"]) == addr for b in handshake(rpc_port)["buffers"])
        # a new request to the same buffer, raw: a v2 header on a new connection
        with socket.create_connection(("127.0.0.1", port), timeout=5) as p:
            p.sendall(HEADER.pack(PROBE_BYTES, addr + size, WRITE | V2))
            row["raw_new_status"] = _status(p, 5.0)
        # ... and through Mooncake's own API from another engine
        row["api_after_rc"] = prober.engine.batch_transfer_sync_write(
            session, [src.ctypes.data], [addr + size], [PROBE_BYTES]
        )
        row["api_after_landed"] = bool((buf[size:] == PROBE).any())
        time.sleep(max(0.0, delay - (time.perf_counter() - t_unreg)))
        row["rest_sent_after_unreg_s"] = time.perf_counter() - t_unreg
        w.sendall(bytes([AFTER]) * (size - half))
        _wait(lambda: bool(buf[size - 1] == AFTER))
        row["last_byte_after_unreg_s"] = time.perf_counter() - t_unreg
        row["writer_status"] = _status(w, 5.0) if v2 else "- (v1)"
    finally:
        w.close()
    row["landed_before"] = int((buf[:half] == BEFORE).sum())
    row["landed_after"] = int((buf[half:size] == AFTER).sum())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=1 << 20, help="bytes of the write")
    ap.add_argument("--before", type=int, help="bytes sent before (default: half)")
    ap.add_argument("--delays", default="0,1,5", help="seconds after unregister_memory")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--legacy", action="store_true", help="the in-flight write in v1 framing")
    args = ap.parse_args()
    from importlib.metadata import version

    from mooncake.engine import TransferEngine

    delays = [float(d) for d in args.delays.split(",")]
    half = args.size // 2 if args.before is None else args.before
    assert 0 < half < args.size
    print(
        f"mooncake-transfer-engine-non-cuda {version('mooncake-transfer-engine-non-cuda')}, "
        f"loadavg {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}, "
        f"write {args.size:,} B ({'v1' if args.legacy else 'v2'} header): {half:,} before "
        "unregister_memory, the rest after"
    )
    target = TransferEngine()
    assert target.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.zeros(args.size + PROBE_BYTES, dtype=np.uint8)
    desc = handshake(target.get_rpc_port())
    print(
        f"target: rpc port {target.get_rpc_port()}, data port {desc['tcp_data_port']} "
        f"(handshake), tcp_proto_version {desc.get('tcp_proto_version')}"
    )
    cols = (
        f"{'delay s':>7} {'unreg rc':>8} {'listed':>6} {'raw new header':>14} "
        f"{'api new rc':>10} {'landed before':>13} {'landed after':>12} "
        f"{'rest sent s':>11} {'last byte s':>11} {'writer status':>13}"
    )
    print(cols)
    rows = []
    try:
        for _ in range(args.reps):
            for delay in delays:
                prober = Prober()
                try:
                    r = trial(target, prober, buf, args.size, half, delay, not args.legacy)
                finally:
                    prober.close()
                rows.append(r)
                assert r["register_rc"] == 0 and r["listed_before"], r
                assert r["api_before_rc"] == 0 and r["api_before_landed"], r
                assert r["first_half_in_s"] is not None, r  # in memory before the call
                print(
                    f"{delay:>7g} {r['unregister_rc']:>8} {'yes' if r['listed_after'] else 'no':>6} "
                    f"{r['raw_new_status']:>14} "
                    f"{r['api_after_rc']:>6}{' L' if r['api_after_landed'] else '  '}  "
                    f"{r['landed_before']:>13,} {r['landed_after']:>12,} "
                    f"{r['rest_sent_after_unreg_s']:>11.3f} {r['last_byte_after_unreg_s']:>11.3f} "
                    f"{r['writer_status']:>13}"
                )
    finally:
        del target
    print(
        "listed: the buffer in the descriptor the handshake gives after unregister_memory; "
        "raw new header: the status a new v2 write header to the buffer got; api new rc: "
        "a new 4 KiB write through Mooncake's API from a second engine (L: it landed); "
        "landed before / after: bytes of the body sent before unregister_memory (0xA1) "
        "and of the rest, sent after (0xA2), found in the buffer; rest sent s / last byte s: after "
        "unregister_memory; writer status: the v2 status the in-flight write got at its end"
    )
    u = [r["unregister_s"] for r in rows]
    print(
        f"unregister_memory {min(u) * 1e6:.0f}-{max(u) * 1e6:.0f} us; "
        f"loadavg {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}"
    )


if __name__ == "__main__":
    main()
