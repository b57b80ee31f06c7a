"""What one admitted peer's message of many frames makes a rank hold (issue 39, item 4).

A rank's control inbox admits only its peers' CURVE keys (hw/control/zap.py), holds a
peer to 4 KiB a frame (ZMQ `MAXMSGSIZE`, cut off on the frame's header) and drops a
message of more than 8 frames unread (hw/control/plane.py `drain`). But ZMQ delivers a
multipart message whole: its frames are queued until the last one arrives, and neither
`MAXMSGSIZE` (per frame) nor `RCVHWM` (whole messages) counts them, so a peer whose key
the inbox admits (a compromised rank) can make it hold any number of frames.

This measures that: a receiver process holds a `ControlPlane` inbox that admits the
sender's key and drains it (as a rank's loop does); the sender sends ONE message of N
frames of --frame-bytes bytes (default empty), for each N; the receiver reports its resident memory before the message,
at its peak while the frames queue, and once the message was dropped, and how many
messages its drain dropped as oversize. It prints the load average.

    .venv/bin/python benchmarks/control_frames.py [--frames 100000,1000000] [--frame-bytes 0]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
import traceback
from typing import Any

STEP_TIMEOUT_S = 120.0


def _rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def receiver(secret: bytes, conn: Any) -> None:
    try:
        from kvstage.hw.control.plane import ControlPlane

        cp = ControlPlane(secret=secret, name="inbox")
        conn.send(cp.address)
        cp.gate.admit(conn.recv())  # the sender's public key: a peer of its table
        conn.send("admitted")
        while True:
            if conn.poll(0):
                if conn.recv() == "stop":
                    break
                conn.send((cp.oversize, _rss_bytes()))  # asked: what it dropped, its RSS
            cp.receive(0.01)
        cp.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _ask(conn: Any) -> tuple[int, int]:
    conn.send("ask")
    if not conn.poll(STEP_TIMEOUT_S):
        raise TimeoutError("the receiver did not answer")
    got = conn.recv()
    if got[0] == "error":
        raise RuntimeError(got[1])
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", default="100000,1000000")
    ap.add_argument("--frame-bytes", type=int, default=0, help="bytes in each frame")
    args = ap.parse_args()
    try:
        counts = [int(x) for x in args.frames.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--frames must be whole numbers separated by commas, got {args.frames!r}")
    if not counts or min(counts) < 1:
        ap.error(f"--frames must be positive, got {args.frames!r}")
    if not 0 <= args.frame_bytes <= 1024:
        ap.error(f"--frame-bytes must be in 0..1024, got {args.frame_bytes}")

    import zmq
    from zmq.utils import z85

    from kvstage.hw.control.plane import curve_client, new_secret

    secret = new_secret()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(secret, child), daemon=True)
    proc.start()
    print(f"load average before: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    print(
        f"{'frames':>9} {'before MiB':>11} {'peak MiB':>9} {'after MiB':>10} {'B/frame':>8} dropped"
    )
    try:
        address = parent.recv()
        public, private = (z85.decode(k) for k in zmq.curve_keypair())
        parent.send(public)
        assert parent.recv() == "admitted"
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        curve_client(sock, secret, (public, private))
        sock.connect(address)
        for n in counts:
            dropped0, before = _ask(parent)
            sock.send_multipart([b"x" * args.frame_bytes] * n)
            peak = before
            while True:  # until the drain dropped it (RSS sampled meanwhile)
                dropped, rss = _ask(parent)
                peak = max(peak, rss)
                if dropped > dropped0:
                    break
                time.sleep(0.01)
            time.sleep(0.5)
            _, after = _ask(parent)
            print(
                f"{n:>9} {before / 2**20:>11.1f} {peak / 2**20:>9.1f} {after / 2**20:>10.1f} "
                f"{(peak - before) / n:>8.1f} {dropped - dropped0}"
            )
        sock.close()
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
