"""What every probe of `kvstage calibrate` shares: its measuring processes' set-up, the
parent's waits on them, and one reaper.

A probe (hw/probes/engine.py, hw/probes/posting.py) starts real processes
(multiprocessing "spawn"), talks to them over Pipes and hands back raw points. Each
child sends its engine's chatter to a log (`child_setup`) and waits for the parent's
next word with a bound (`expect`); the parent, when it is done or failed, asks each
child to stop and reaps it (`reap`): every wait bounded, a child that hangs killed,
nothing left behind. A child that dies or hangs fails the measurement
(`CalibrationError`) with the tail of its log (`tail`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CalibrationError",
    "ProgressFn",
    "child_setup",
    "expect",
    "reap",
    "tail",
    "usable_cores",
]

ProgressFn = Callable[[str, int, int], None]
# how long the reaper waits for a child to exit on its own, then after killing it
REAP_JOIN_S = 10.0
REAP_KILL_JOIN_S = 5.0


class CalibrationError(RuntimeError):
    """A measurement could not be taken (engine missing, child failed or hung)."""


def usable_cores() -> int:
    """Cores this process may run on (CPU affinity where known)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def redirect_output(log_path: str) -> None:
    """Send this child's stdout/stderr (engine chatter) to a log, away from the progress bar."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def child_setup(log_path: str, place: Any = None, role: str = "") -> None:
    """A measuring process's first steps: its output to `log_path`, its host entered
    (`place`, hw/probes/hosts.py), the engines quiet, one torch thread."""
    from kvstage.hw.transport.placement import quiet_engines

    redirect_output(log_path)
    if place is not None:  # its host: a network namespace and address (hw/probes/hosts.py)
        place.enter(role)
    quiet_engines(os.environ)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    import torch

    # Like hw/rank/main.py: ranks run one intra-op thread each.
    torch.set_num_threads(int(os.environ.get("KVSTAGE_TORCH_THREADS", "1")))


def expect(conn: Any, kind: str, timeout_s: float) -> tuple:
    """In a child: the parent's next message of `kind` (TimeoutError after `timeout_s`;
    CalibrationError if the parent aborts)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not conn.poll(left):
            raise TimeoutError(f"no {kind!r} from the parent within {timeout_s:.0f} s")
        msg = conn.recv()
        if msg[0] == kind:
            return msg
        if msg[0] == "abort":
            raise CalibrationError(f"parent aborted: {msg[1]}")


def tail(path: str, lines: int = 20) -> str:
    """The last `lines` of a child's log, indented (empty if it cannot be read)."""
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in text[-lines:])


def reap(
    procs: Iterable[Any], conns: Mapping[str, Any], goodbye: Mapping[str, tuple] | None = None
) -> None:
    """The parent's end of a probe: send each child its `goodbye` (by name; one that
    cannot be sent is skipped), wait for every process to exit (REAP_JOIN_S), kill one
    that does not, and close the pipes."""
    for name, message in (goodbye or {}).items():
        try:
            conns[name].send(message)
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(REAP_JOIN_S)
        if proc.is_alive():
            proc.kill()
            proc.join(REAP_KILL_JOIN_S)
    for conn in conns.values():
        conn.close()
