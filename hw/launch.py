"""Local launcher of hardware mode: P prefill + D decode rank processes and a rendezvous.

It watches every child: a rank that exits before reporting (crash, kill) fails the
whole run within `poll` time, with a message naming the rank and the tail of its
log, and every other process is terminated — nothing is left behind.

Each run has its own secret (hw/control.py): the launcher draws it, hands it to the
ranks it spawns in their environment (never on a command line) and writes it, 0600,
to `<run dir>/run.secret` for ranks started elsewhere (`kvstage hw-rank --secret-file`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstage.hw.control import (
    SECRET_ENV,
    RendezvousServer,
    new_secret,
    rank_name,
    run_secret,
    write_secret_file,
)

log = logging.getLogger("kvstage.hw.launch")

SECRET_FILE = "run.secret"


class LaunchError(RuntimeError):
    pass


@dataclass
class LaunchResult:
    reports: dict[str, dict[str, Any]]
    wall_s: float
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in text[-lines:])


def rank_names(prefill_tp: int, decode_tp: int) -> list[str]:
    return [rank_name("prefill", p) for p in range(prefill_tp)] + [rank_name("decode", d) for d in range(decode_tp)]


def launch(
    scenario_path: Path,
    prefill_tp: int,
    decode_tp: int,
    log_dir: Path,
    *,
    backend: str | None = None,
    device: str | None = None,
    timeout_s: float = 600.0,
    spawn: bool = True,
    port: int = 0,
    on_started=None,
    rank_wrapper: list[str] | None = None,
    secret: bytes | None = None,
    host: str | None = None,
) -> LaunchResult:
    """Run every rank of a scenario on this machine (or, spawn=False, wait for external ones).

    `on_started(address, procs)` is called once every rank has registered.
    `rank_wrapper` is put in front of every spawned rank's command line (a profiler,
    numactl, or an instrumented rank of a test). `secret`: the run secret (default:
    32 fresh random bytes), written to `log_dir/../run.secret`. `host`: the address
    the rendezvous and the spawned ranks bind (default $KVSTAGE_HOST, else 127.0.0.1).
"""
    names = rank_names(prefill_tp, decode_tp)
    secret = run_secret(secret) if secret is not None else new_secret()
    host = host or os.environ.get("KVSTAGE_HOST", "127.0.0.1")
    log_dir.mkdir(parents=True, exist_ok=True)
    secret_path = log_dir.parent / SECRET_FILE
    write_secret_file(secret_path, secret)
    server = RendezvousServer(names, host=host, port=port, secret=secret)
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    start = time.monotonic()
    errors: list[str] = []
    env = _rank_env(host, secret)
    try:
        if not spawn:
            print(f"rendezvous at {server.address}: start every rank with `kvstage hw-rank ... --rendezvous "
                  f"{server.address} --secret-file {secret_path}`", file=sys.stderr, flush=True)
        else:
            for name in names:
                role = "prefill" if name.startswith("prefill") else "decode"
                cmd = [*(rank_wrapper or []), sys.executable, "-m", "kvstage.hw.rank_main", str(scenario_path), "--role", role,
                       "--rank", name[len(role):], "--rendezvous", server.address, "--host", host]
                cmd += ["--backend", backend] if backend else []
                cmd += ["--device", device] if device else []
                logs[name] = log_dir / f"{name}.log"
                with logs[name].open("w") as fh:
                    procs[name] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                                   start_new_session=True)
        _until_all_reported(server, procs, logs, on_started, start, timeout_s)
        server.release()
        for name, proc in procs.items():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                errors.append(f"rank {name} did not exit after the run; killed")
        reports = {name: msg for name, (_, msg) in server.reports.items()}
        for _name, rep in sorted(reports.items()):
            if rep.get("error"):
                errors.append(rep["error"])
        return LaunchResult(reports, time.monotonic() - start, errors)
    except LaunchError as exc:
        server.abort(str(exc))
        return LaunchResult({n: m for n, (_, m) in server.reports.items()}, time.monotonic() - start, [str(exc)])
    finally:
        _terminate(procs)
        server.close()


def _until_all_reported(server: RendezvousServer, procs: dict[str, subprocess.Popen], logs: dict[str, Path],
                        on_started, start: float, timeout_s: float) -> None:
    """Serve the rendezvous until every rank reported; LaunchError when a rank dies
    first or `timeout_s` passes after `start` (monotonic)."""
    notified = False
    while not server.all_reported:
        server.poll(0.1)
        if on_started is not None and server.started and not notified:
            notified = True  # every rank registered: the run is under way
            on_started(server.address, procs)
        for name, proc in procs.items():
            code = proc.poll()
            if code is not None and name not in server.reports:
                why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                raise LaunchError(f"rank {name} died before finishing ({why}); its log {logs[name]}:\n{_tail(logs[name])}")
        if time.monotonic() - start > timeout_s:
            missing = sorted(server.expected - set(server.reports))
            stage = "register" if not server.started else "finish"
            raise LaunchError(f"ranks {missing} did not {stage} within {timeout_s:.0f}s")


def _rank_env(host: str, secret: bytes) -> dict[str, str]:
    """The spawned ranks' environment: the run secret, and quiet engines that keep to
    `host`."""
    env = dict(os.environ)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    env.setdefault("MC_TCP_BIND_ADDRESS", host)
    env[SECRET_ENV] = secret.hex()
    return env


def _terminate(procs: dict[str, subprocess.Popen]) -> None:
    """Make sure no child (or anything it started) outlives the launcher."""
    alive = [p for p in procs.values() if p.poll() is None]
    for p in alive:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    for p in alive:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=5)
