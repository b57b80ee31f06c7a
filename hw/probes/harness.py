"""What every probe of `kvstage calibrate` shares: its measuring processes' start and
set-up, the parent's waits on them, and one reaper.

A probe (hw/probes/engine.py, hw/probes/posting.py) starts real processes
(`start_child`), talks to them over Pipes and hands back raw points. Each child sends
its engine's chatter to a log (`child_setup`) and waits for the parent's next word with
a bound (`expect`); the parent, when it is done or failed, asks each child to stop and
reaps it (`reap`): every wait bounded, a child that hangs killed, nothing left behind.
A child that dies or hangs fails the measurement (`CalibrationError`) with the tail of
its log (`tail`).

The children start as the ranks of a run do (hw/launch/forkserver.py): forked from a
process that imported torch and numpy once (multiprocessing's "forkserver", started on
the first probe and kept for the next), not each a new interpreter that imports them
again (2.4 s for torch alone). A forked child runs with the environment and working
directory the parent has when it starts the child, as a spawned one would; no engine is
loaded before the fork. `$KVSTAGE_RANK_START=spawn`, or a system without the fork
server, spawns them ("spawn").
"""

from __future__ import annotations

import multiprocessing as mp
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
    "probe_context",
    "reap",
    "start_child",
    "tail",
    "usable_cores",
]

ProgressFn = Callable[[str, int, int], None]
# how long the reaper waits for a child to exit on its own, then after killing it
REAP_JOIN_S = 10.0
REAP_KILL_JOIN_S = 5.0


class CalibrationError(RuntimeError):
    """A measurement could not be taken (engine missing, child failed or hung)."""


# What the fork server imports before it forks a measuring process: what every child
# imports first that starts no engine (the probes import NIXL and Mooncake in the child).
PROBE_PRELOAD = (
    "torch",
    "numpy",
    "kvstage.hw.probes.harness",
    "kvstage.hw.probes.engine",
    "kvstage.hw.probes.posting",
    "kvstage.hw.transport.placement",
    "kvstage.hw.transport.used",
)


def probe_context() -> Any:
    """The multiprocessing context the probes start their children with: "forkserver"
    with PROBE_PRELOAD (see the module doc), or "spawn" where ranks are spawned
    ($KVSTAGE_RANK_START, hw/launch/forkserver.py) or the system has no fork server."""
    from kvstage.hw.launch.forkserver import rank_start

    if rank_start() != "fork" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PROBE_PRELOAD))  # used when the fork server starts
    return ctx


def start_child(ctx: Any, target: Callable[..., None], args: tuple, name: str) -> Any:
    """Start a measuring process (daemon) running `target(*args)` in this process's
    current environment and working directory, however `ctx` starts it."""
    proc = ctx.Process(
        target=_in_parents_place,
        args=(dict(os.environ), os.getcwd(), target, args),
        daemon=True,
        name=name,
    )
    proc.start()
    return proc


def _in_parents_place(
    env: dict[str, str], cwd: str, target: Callable[..., None], args: tuple
) -> None:
    """In the child: the parent's environment and directory of when it started the child
    (a forked child would otherwise have the fork server's), then the probe."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    os.chdir(cwd)
    target(*args)


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
