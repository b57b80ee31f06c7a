"""Local launcher of hardware mode: P prefill + D decode rank processes and a rendezvous.

It watches every child: a rank that exits before reporting (crash, kill) fails the
whole run within `poll` time, with a message naming the rank and the tail of its
log, and every other process is terminated — nothing is left behind. Ranks it did
not start (`spawn=False`, `kvstage hw --no-spawn`) are watched through the rendezvous:
every rank says it is alive every RANK_BEAT_S, and one silent for RANK_SILENT_S is
down (hw/control/rendezvous.py); a spawned rank that goes silent is killed (it may be hung, not
dead: it must not write on).

A down rank is gone, and fails the run naming it, unless it rejoins in time: a
prefill rank restarted (`kvstage hw-rank` with the same role and rank, the run's
secret and rendezvous) may register again under a new incarnation within
`rejoin_grace_s` (`kvstage hw --rejoin-grace S`; default 0: no waiting, a dead rank
fails the run as before) and serve the rooms that arrive after its rejoin; the run
is then judged by its rooms alone, and `rejoined` says what happened. A decode rank
never rejoins (its staging ring and KV pool would come back empty). A scenario's
`faults.kill` with `restart_after_s` is carried out here: the rank, killed by its
fault, is spawned again at once and registers once `restart_after_s` has passed.

The other way round, no rank outlives its launcher: a SIGTERM (or SIGHUP) to the
launcher fails the run and terminates every rank; a SIGKILL takes them down through
the parent-death signal each spawned rank is given (Linux), and each rank also checks
once per loop turn that its launcher is still there (`check_launcher`).

Each run has its own secret (hw/control/plane.py): the launcher draws it, hands it to the
ranks it spawns in their environment (never on a command line) and writes it, 0600,
to `<run dir>/run.secret` for ranks started elsewhere (`kvstage hw-rank --secret-file`).
The secret lets a process talk to the run, not be one of its ranks: each rank also gets
its own credential (hw/control/credentials.py), which the rendezvous derives from a master
key it never writes. A rank the launcher starts inherits it on a pipe; for ranks started
elsewhere (`spawn=False`), and for prefill ranks that may be started again by hand
(`rejoin_grace_s`), it is written to `<run dir>/keys/<name>.key` (0600). Two processes
claiming one rank fail the run, naming both.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstage.hw.control.credentials import KEY_FD_ENV, credential_pipe, write_key_files
from kvstage.hw.control.plane import (
    SECRET_ENV,
    new_secret,
    rank_name,
    run_secret,
    write_secret_file,
)
from kvstage.hw.control.rendezvous import RANK_SILENT_S, RankInfo, RendezvousServer
from kvstage.hw.launch.forkserver import ForkedProcess, rank_start, start_rank
from kvstage.hw.transport.affinity import LOCAL_SLOT_ENV
from kvstage.hw.transport.placement import engine_env, launch_addresses, quiet_engines
from kvstage.shared.cluster import Sessions
from kvstage.shared.scenario import load_scenario

log = logging.getLogger("kvstage.hw.launch.launcher")

LAUNCHER_PID_ENV = "KVSTAGE_LAUNCHER_PID"  # set for the ranks a launcher spawns
SECRET_FILE = "run.secret"
_PR_SET_PDEATHSIG = 1
# A rank the launcher spawns again (faults kill restart_after_s) must register within
# this long after its restart time (its interpreter, torch and engine start meanwhile).
RESPAWN_GRACE_S = 60.0


class LaunchError(RuntimeError):
    pass


@dataclass
class LaunchResult:
    reports: dict[str, dict[str, Any]]
    wall_s: float
    errors: list[str] = field(default_factory=list)
    # ranks that died (or went silent) and rejoined: rank, incarnation, first_room, after
    rejoined: list[dict[str, Any]] = field(default_factory=list)
    # CPU time of the ranks the fork server started (not this process's children, so not
    # in its os.times()), as the fork server measured each at its exit (hw/launch/forkserver.py)
    forked_cpu_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass(frozen=True)
class RunProgress:
    """Where a run stands, for a progress display: handed to `on_progress` every turn
    of the launcher's loop (about 10 times a second)."""

    registered: int  # ranks whose hello came in
    expected: int
    started: bool  # every rank registered, the table sent
    rooms: dict[
        str, tuple[int, int]
    ]  # rank -> (rooms ended, rooms of its workload), as it last said
    reported: int  # ranks that finished and sent their report
    elapsed_s: float


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in text[-lines:])


def rank_names(prefill_tp: int, decode_tp: int) -> list[str]:
    return [rank_name("prefill", p) for p in range(prefill_tp)] + [
        rank_name("decode", d) for d in range(decode_tp)
    ]


def _released(
    server: RendezvousServer, procs: dict[str, subprocess.Popen], start: float, errors: list[str]
) -> LaunchResult:
    """Every rank reported: let them exit, and gather what they said."""
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
    return LaunchResult(reports, time.monotonic() - start, errors, list(server.rejoins))


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
    bind: str | None = None,
    advertise: str | None = None,
    rejoin_grace_s: float = 0.0,
    restarts: dict[str, list[float]] | None = None,
    on_progress: Callable[[RunProgress], None] | None = None,
    probe_slots: int = 0,
    on_affinity: Callable[[dict[str, Any]], None] | None = None,
    on_table: Callable[[dict[str, RankInfo], float], None] | None = None,
    tool_connections: int = 0,
) -> LaunchResult:
    """Run every rank of a scenario on this machine (or, spawn=False, wait for external ones).

    `on_started(address, procs)`: once every rank registered; `on_progress(RunProgress)`: every loop turn.
    `rank_wrapper` is put in front of every spawned rank's command line (a profiler,
    numactl, or an instrumented rank of a test). `secret`: the run secret (default:
    32 fresh random bytes), written to `log_dir/../run.secret`. `bind`, `advertise`,
    `host`: the rendezvous' and the spawned ranks' addresses (placement.launch_addresses).
    `rejoin_grace_s`: how long a dead prefill rank may take to rejoin (started again by
    hand). `restarts`: rank -> the delays after which it is spawned again (kill faults).
    `probe_slots`: slots of the bandwidth probe before the first room (hw/transport/bandwidth.py).
    `on_affinity(rank -> its NIC, GPU, NUMA node)`: once every rank registered (hw/transport/affinity.py).
    `on_table(every rank's RankInfo by name, t0)`: once every rank registered, in this
    process only (no rank gets the whole table: each gets its peers', table_peers).
    `tool_connections`: connections the rendezvous admits of keys of no rank (tools
    holding the run secret alone; default none: hw/control/rendezvous.py).

    Call it from the thread that lives as long as the run: the ranks' parent-death
    signal fires when the thread that spawned them ends."""
    names = rank_names(prefill_tp, decode_tp)
    secret = run_secret(secret) if secret is not None else new_secret()
    bind, advertise, host = launch_addresses(host, bind, advertise)
    log_dir.mkdir(parents=True, exist_ok=True)
    secret_path = log_dir.parent / SECRET_FILE
    restarts = {name: list(delays) for name, delays in (restarts or {}).items()} if spawn else {}
    server = RendezvousServer(
        names,
        host=bind,
        port=port,
        secret=secret,
        advertise=advertise,
        silent_s=RANK_SILENT_S,
        rejoin_grace_s=rejoin_grace_s,
        grace_s={name: max(d) + RESPAWN_GRACE_S for name, d in restarts.items()},
        probe_slots=probe_slots,
        peers=table_peers(scenario_path, prefill_tp, decode_tp),
        tools=tool_connections,
    )
    # key files first: a task that waits for run.secret finds its key file with it
    by_hand = [n for n in names if not spawn or (rejoin_grace_s > 0 and n.startswith("prefill"))]
    write_key_files(log_dir.parent, server.credentials, by_hand)
    write_secret_file(secret_path, secret)
    ranks = _Ranks(log_dir, _rank_env(host, device, secret), server.credential)
    procs, logs = ranks.procs, ranks.logs
    start = time.monotonic()
    errors: list[str] = []
    stop = _StopOnSignal()
    try:
        if spawn:
            try:
                rank_start()
            except ValueError as exc:
                raise LaunchError(str(exc)) from exc
        if not spawn:
            print(
                f"rendezvous at {server.address}: start every rank with `kvstage hw-rank ... --rendezvous "
                f"{server.address} --secret-file {secret_path}` (each reads its credential, "
                f"{secret_path.parent}/keys/ROLERANK.key)",
                file=sys.stderr,
                flush=True,
            )
        else:
            for name in names:
                ranks.spawn(
                    name,
                    _rank_command(
                        name, scenario_path, server.address, host, backend, device, rank_wrapper
                    ),
                )
        errors += _until_all_reported(
            server,
            procs,
            logs,
            _with_affinity(server, on_started, on_affinity, on_table),
            start,
            timeout_s,
            restarts,
            ranks.respawn,
            on_progress,
        )
        result = _released(server, procs, start, errors)
        result.forked_cpu_s = ranks.forked_cpu_s()
        return result
    except LaunchError as exc:
        server.abort(str(exc))
        reports = {n: m for n, (_, m) in server.reports.items()}
        return LaunchResult(reports, time.monotonic() - start, [str(exc)], list(server.rejoins))
    finally:
        stop.disarm()  # a signal now would cut the clean-up short: it is ignored
        try:
            _terminate(procs)
            server.close()
        finally:
            stop.restore()


def _with_affinity(server: RendezvousServer, on_started, on_affinity, on_table=None):
    """`on_started`, preceded by `on_affinity` with what each rank's hello says of its NIC
    and `on_table` with the whole table and t0."""
    if on_affinity is None and on_table is None:
        return on_started

    def started(address: str, procs: dict[str, subprocess.Popen]) -> None:
        if on_affinity is not None:
            on_affinity(
                {name: info.extra.get("affinity") for name, (_, info) in server.hellos.items()}
            )
        if on_table is not None:
            on_table({name: info for name, (_, info) in server.hellos.items()}, server.t0)
        if on_started is not None:
            on_started(address, procs)

    return started


def table_peers(scenario_path: Path, prefill_tp: int, decode_tp: int) -> dict[str, set[str]] | None:
    """Each rank's peers by name (Sessions.peers: the ranks it exchanges messages and
    bytes with), whose table entries it gets from the rendezvous; None (every rank) when
    the scenario's ranks are not these (its ranks then refuse to run, saying why)."""
    s = load_scenario(scenario_path)
    sessions = Sessions(s.geometry(), s.cluster.prefill_instances, s.cluster.decode_instances)
    if (sessions.ranks("prefill"), sessions.ranks("decode")) != (prefill_tp, decode_tp):
        return None
    return {
        rank_name(role, i): {rank_name(r, k) for r, k in sessions.peers(role, i)}
        for role, count in (("prefill", prefill_tp), ("decode", decode_tp))
        for i in range(count)
    }


def _rank_command(
    name: str,
    scenario_path: Path,
    rendezvous: str,
    host: str,
    backend: str | None,
    device: str | None,
    rank_wrapper: list[str] | None,
) -> list[str]:
    role = "prefill" if name.startswith("prefill") else "decode"
    cmd = [
        *(rank_wrapper or []),
        sys.executable,
        "-m",
        "kvstage.hw.rank.main",
        str(scenario_path),
        "--role",
        role,
        "--rank",
        name[len(role) :],
        "--rendezvous",
        rendezvous,
        "--host",
        host,
    ]
    cmd += ["--backend", backend] if backend else []
    cmd += ["--device", device] if device else []
    return cmd


class _Ranks:
    """The rank processes this launcher started, and their logs (`<name>.log`; a rank
    started again: `<name>-restartN.log`). Forked from the fork server where it can
    (hw/launch/forkserver.py, $KVSTAGE_RANK_START), spawned otherwise."""

    def __init__(
        self, log_dir: Path, env: dict[str, str], credential: Callable[[str], bytes]
    ) -> None:
        self.log_dir = log_dir
        self.env = env
        self.credential = credential  # rank name -> its credential, handed to it alone
        self.procs: dict[str, subprocess.Popen | ForkedProcess] = {}
        self.forked: list[ForkedProcess] = []
        self.logs: dict[str, Path] = {}
        self.commands: dict[str, list[str]] = {}
        self.restarted: dict[str, int] = {}
        self.slots: dict[str, int] = {}

    def spawn(self, name: str, cmd: list[str], log: str | None = None) -> None:
        self.commands.setdefault(name, cmd)
        slot = self.slots.setdefault(name, len(self.slots))  # its local rank, for its NIC
        self.logs[name] = self.log_dir / (log or f"{name}.log")
        with self.logs[name].open("w") as fh:
            env = {**self.env, LOCAL_SLOT_ENV: str(slot)}
            key = self.credential(name)
            forked = start_rank(cmd, env, self.logs[name], warn=_say_once, credential=key)
            if forked is not None:
                self.procs[name] = forked
                self.forked.append(forked)
                return
            fd = credential_pipe(key)  # inherited by this rank alone, and closed here
            try:
                self.procs[name] = subprocess.Popen(
                    cmd,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env={**env, KEY_FD_ENV: str(fd)},
                    pass_fds=(fd,),
                    start_new_session=True,
                    preexec_fn=_die_with_launcher(),
                )
            finally:
                os.close(fd)

    def forked_cpu_s(self) -> float:
        return sum(p.cpu_s or 0.0 for p in self.forked)

    def respawn(self, name: str, register_at: float) -> None:
        """Start a killed rank again; it registers at `register_at` (epoch s)."""
        n = self.restarted[name] = self.restarted.get(name, 0) + 1
        self.spawn(
            name,
            [*self.commands[name], "--register-at", f"{register_at:.6f}"],
            f"{name}-restart{n}.log",
        )


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        print(f"launcher: {message}", file=sys.stderr, flush=True)


def _until_all_reported(
    server: RendezvousServer,
    procs: dict[str, subprocess.Popen],
    logs: dict[str, Path],
    on_started,
    start: float,
    timeout_s: float,
    restarts: dict[str, list[float]] | None = None,
    respawn: Callable[[str, float], None] | None = None,
    on_progress: Callable[[RunProgress], None] | None = None,
) -> list[str]:
    """Serve the rendezvous until every rank reported or is gone. A rank that dies
    before the run started is a LaunchError (the run cannot start); one that dies (or
    goes silent) during the run is down and the others go on: their failure detectors
    fail its rooms and they finish. It is gone, and noted (returned: why, in the order
    they went), unless it rejoins within its grace; a rank with a restart left
    (`restarts`) is spawned again at once (`respawn`). LaunchError too when
    `timeout_s` passes after `start`."""
    notified = False
    handled: set[int] = set()  # pids whose end was dealt with
    fenced: set[int] = set()
    spares: set[int] = set()  # respawned ranks waiting for their restart time (down, not silent)
    restarts = restarts or {}
    while not server.all_reported:
        server.poll(0.1)
        if on_progress is not None:
            on_progress(
                RunProgress(
                    len(server.hellos),
                    len(server.expected),
                    server.started,
                    dict(server.rooms),
                    len(server.reports),
                    time.monotonic() - start,
                )
            )
        if on_started is not None and server.started and not notified:
            notified = True  # every rank registered: the run is under way
            on_started(server.address, procs)
        for name, proc in list(procs.items()):
            code = proc.poll()
            if code is None or proc.pid in handled or name in server.reports:
                continue
            handled.add(proc.pid)
            why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            message = f"rank {name} died before finishing ({why}); its log {logs[name]}:\n{_tail(logs[name])}"
            if not server.started:
                raise LaunchError(message)
            if restarts.get(name) and respawn is not None and name not in server.gone:
                delay = restarts[name].pop(0)
                server.mark_down(name, message)
                respawn(name, time.time() + delay)  # it registers once its restart time came
                spares.add(procs[name].pid)
                print(
                    f"launcher: {name} died ({why}); started again, it rejoins in {delay:g}s",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                server.mark_down(name, message)
        spares = {
            pid
            for pid in spares
            if any(p.pid == pid and n in server.down for n, p in procs.items())
        }
        for (
            name
        ) in server.down:  # a spawned rank gone silent may be hung, not dead: it must not write on
            proc = procs.get(name)
            if (
                proc is not None
                and proc.poll() is None
                and proc.pid not in fenced
                and proc.pid not in spares
            ):
                fenced.add(proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for event in server.take_events():
            print(f"launcher: {event}", file=sys.stderr, flush=True)
        if server.duplicates:  # two processes hold one rank's credential: trust nothing
            raise LaunchError(f"rank credential used twice: {server.duplicates[0]}")
        if time.monotonic() - start > timeout_s:
            missing = sorted(server.expected - set(server.reports) - set(server.gone))
            stage = "register" if not server.started else "finish"
            raise LaunchError(f"ranks {missing} did not {stage} within {timeout_s:.0f}s")
    return list(server.gone.values())


def _rank_env(host: str, device: str | None, secret: bytes) -> dict[str, str]:
    """The spawned ranks' environment: the run secret and this launcher's pid, and
    quiet engines that keep to `host`."""
    env = dict(os.environ)
    quiet_engines(env)
    # UCX (under NIXL) listens on every network device's address unless told
    # otherwise: keep it, and Mooncake's TCP data path, on the ranks' address
    # (UCX_NET_DEVICES each rank sets itself, for its own NIC: hw/transport/affinity.py)
    env.update({k: v for k, v in engine_env(host, device, env).items() if k != "UCX_NET_DEVICES"})
    env[SECRET_ENV] = secret.hex()
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    return env


class _StopOnSignal:
    """While armed, SIGTERM and SIGHUP raise LaunchError in the launching thread, so
    the run fails and `launch` terminates every rank; disarmed (during that clean-up)
    they are ignored. Only from the main thread, where Python runs signal handlers;
    elsewhere nothing changes."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.armed = threading.current_thread() is threading.main_thread()
        self.previous = (
            {s: signal.signal(s, self._handler) for s in self.SIGNALS} if self.armed else {}
        )

    def _handler(self, signum: int, _frame: Any) -> None:
        if self.armed:
            self.armed = False
            raise LaunchError(
                f"the launcher received {signal.Signals(signum).name}: run stopped, ranks terminated"
            )

    def disarm(self) -> None:
        self.armed = False

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _die_with_launcher() -> Callable[[], None] | None:
    """A `preexec_fn` that gives a spawned rank SIGTERM when the launcher dies
    (PR_SET_PDEATHSIG), and exits at once if it already has. None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    launcher = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != launcher:  # it died before the line above
            os._exit(1)

    return preexec


class LauncherGone(BaseException):
    """Raised in a rank whose launcher is gone. A BaseException, like SystemExit: no
    `except Exception` on the way up turns it into a report nobody would receive."""


class LauncherWatch:
    """A rank's check that the launcher that spawned it (pid in $KVSTAGE_LAUNCHER_PID)
    is still there: while it is the rank's parent, one getppid() a call; otherwise
    (a wrapper between them) a look at /proc at most every `interval_s`, which also
    tells an exited launcher nobody reaped yet (a zombie) or a reused pid."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.direct = os.getppid() == pid
        self.started = _proc_start(pid)
        self._next = 0.0

    def alive(self) -> bool:
        if self.direct:
            return os.getppid() == self.pid
        now = time.monotonic()
        if now < self._next:
            return True
        self._next = now + self.interval_s
        if self.started is not None:
            return _proc_start(self.pid) == self.started
        try:  # no /proc: only whether the pid exists
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def __call__(self) -> None:
        if not self.alive():
            log.error("the launcher (pid %d) is gone: this rank stops", self.pid)
            raise LauncherGone(f"the launcher (pid {self.pid}) is gone")


def _proc_start(pid: int) -> int | None:
    """A live process's start time (clock ticks since boot, /proc/PID/stat), 0 when it
    has exited (no such process, a zombie); None where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0 if Path("/proc/self/stat").exists() else None
    except OSError:
        return None
    return 0 if fields[0] in ("Z", "X") else int(fields[19])


_watch: LauncherWatch | None = None


def watch_launcher() -> None:
    """Start watching the launcher named in $KVSTAGE_LAUNCHER_PID (a rank calls this
    first thing); ranks started by hand have none and watch nothing."""
    global _watch
    pid = os.environ.get(LAUNCHER_PID_ENV, "")
    _watch = LauncherWatch(int(pid)) if pid.isdigit() else None


def check_launcher() -> None:
    """Raise LauncherGone if this rank's launcher is gone (cheap: call it every loop turn)."""
    if _watch is not None:
        _watch()


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
