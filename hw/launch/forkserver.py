"""A fork server for rank processes: ranks forked from a parent that imported torch once.

Most of a rank's start-up is its imports (`import torch` alone took 2.4 s a process on
the test host), paid again by every rank of every run. The launcher instead starts one
fork server per process (`python -m kvstage.hw.launch.forkserver FD`, started on first use and
kept for later runs): it imports torch, numpy, pyzmq and the ranks' own modules, starts
no engine and no thread, and forks a rank on request. NIXL/UCX and Mooncake are first
imported, and every engine initialised, in the forked rank, as in a spawned one.

A rank it forks is what a spawned one would be: its own session (process group), its
stdin /dev/null and its output appended to its log, the launcher's working directory
and exactly the environment the launcher asked for, `sys.argv` as its command line
would give it, and SIGTERM when the fork server dies (PR_SET_PDEATHSIG). It runs
`python -m MODULE ...` or `python SCRIPT ...` (a test's wrapped rank) in the forked
interpreter; any other command (a profiler, numactl in front) is spawned as before.

The fork server is the forked ranks' parent: it reaps each, and tells the launcher its
exit status (negative: the signal that ended it) and its CPU time (wait4). It forks only
while it runs no thread beyond those its imports left (/proc/self/task) and no Python
thread at all, and refuses a request otherwise; the launcher then spawns that rank. The
imports leave one: numpy's OpenBLAS starts its worker pool when it loads, and stops it
around every fork (its pthread_atfork handler), so a forked rank's BLAS works
(tests/test_forkserver.py multiplies matrices in one). When the launcher goes (its end of the socket closes,
however it died) the fork server sends SIGTERM to every rank it forked and exits.

`KVSTAGE_RANK_START`: `fork` (the default) forks ranks where it can and spawns them
where it cannot (not Linux, a wrapped command, a fork server that failed to start);
`spawn` always spawns (a new interpreter per rank, as before the fork server).

A rank's credential (hw/control/credentials.py) travels in its request, on the socket
between the launcher and its fork server (never in argv or the environment), and reaches
the forked rank as the launcher hands it to a spawned one: a pipe it alone inherits,
named by $KVSTAGE_RANK_KEY_FD.

Messages on the socket are length-prefixed JSON: a request {"argv", "env", "cwd", "log",
"key"};
the answer {"pid"} or {"refused": why}; later, when a rank ends, {"exit": pid, "code",
"cpu_s"}.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

RANK_START_ENV = "KVSTAGE_RANK_START"
RANK_START_CHOICES = ("fork", "spawn")
# What the fork server imports before it forks: everything a rank imports that starts no
# thread and no engine (hw/transport/base.py imports NIXL and Mooncake only when a rank makes
# its transport). torch first: it is most of the time.
PRELOAD = (
    "torch",
    "numpy",
    "zmq",
    "kvstage.hw.rank.main",
    "kvstage.hw.rank.process",
    "kvstage.hw.rank.prefill",
    "kvstage.hw.rank.decode",
    "kvstage.hw.transport.nixl",
    "kvstage.hw.transport.mooncake",
)
_PR_SET_PDEATHSIG = 1
_HEADER = struct.Struct("!I")


class ForkServerError(RuntimeError):
    """The fork server could not start, or is gone."""


def rank_start(env: dict[str, str] | None = None) -> str:
    """How ranks start: $KVSTAGE_RANK_START, `fork` by default. A ValueError names the
    bad value and the choices."""
    value = (env if env is not None else os.environ).get(RANK_START_ENV, "fork") or "fork"
    if value not in RANK_START_CHOICES:
        raise ValueError(
            f"{RANK_START_ENV}={value!r} is not a way to start ranks: use one of "
            f"{', '.join(RANK_START_CHOICES)}"
        )
    return value


def forkable(cmd: list[str]) -> bool:
    """Whether the fork server can run `cmd`: this interpreter with `-m MODULE` or a
    script, on Linux (pidfd_open, PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return False
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    if cmd[1] == "-m":
        return len(cmd) >= 3
    return not cmd[1].startswith("-")


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _recv(sock: socket.socket) -> dict[str, Any] | None:
    """One message, or None when the other end closed."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(head)[0])
    return None if body is None else json.loads(body)


# ---------------------------------------------------------------- the launcher's side


class ForkedProcess:
    """A rank the fork server forked, as the launcher sees it: the part of
    subprocess.Popen the launcher uses (pid, returncode, poll, wait, kill)."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.cpu_s: float | None = None  # user + system, from the fork server's wait4

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.pump(0.0)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the rank if it has not ended (its exit comes in as any other)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server.pump(0.5 if left is None else min(left, 0.5))
        return self.returncode


class ForkServer:
    """The launcher's end of one fork server process. Thread-safe: runs of one process
    share it."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, pythonpath: str | None) -> None:
        self.proc = proc
        self.sock = sock
        self.pythonpath = pythonpath  # its sys.path came from this: a rank must want the same
        self.lock = threading.Lock()
        self.live: dict[int, ForkedProcess] = {}
        self.closed = False

    @classmethod
    def start(cls, preload: tuple[str, ...] = PRELOAD, timeout_s: float = 120.0) -> ForkServer:
        """Start a fork server and wait until it has imported `preload` (ForkServerError
        if it cannot, naming why)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-m", "kvstage.hw.launch.forkserver", str(theirs.fileno()), *preload]
        try:
            proc = subprocess.Popen(
                cmd,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            raise ForkServerError(f"the fork server did not start: {exc}") from exc
        finally:
            theirs.close()
        ours.settimeout(timeout_s)
        try:
            hello = _recv(ours)
        except OSError:
            hello = None
        if not hello or "ready" not in hello:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait(timeout=30)
            ours.close()
            why = (hello or {}).get("failed") or f"no answer within {timeout_s:g}s"
            raise ForkServerError(f"the fork server did not start: {why}")
        ours.settimeout(None)
        return cls(proc, ours, os.environ.get("PYTHONPATH"))

    def fork(
        self, argv: list[str], env: dict[str, str], log: Path, credential: bytes = b""
    ) -> ForkedProcess:
        """Fork a rank running `argv` (see `forkable`), output appended to `log`, handed
        `credential` (if any). ForkServerError if the fork server refuses or is gone."""
        with self.lock:
            if self.closed:
                raise ForkServerError("the fork server is closed")
            request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log)}
            if credential:
                request["key"] = credential.hex()
            try:
                _send(self.sock, request)
                while True:
                    msg = _recv(self.sock)
                    if msg is None:
                        raise ForkServerError("the fork server is gone")
                    if "exit" in msg:
                        self._ended(msg)
                    elif "refused" in msg:
                        raise ForkServerError(f"the fork server refused: {msg['refused']}")
                    else:
                        child = self.live[msg["pid"]] = ForkedProcess(self, msg["pid"], argv)
                        return child
            except OSError as exc:
                self._gone()
                raise ForkServerError(f"the fork server is gone: {exc}") from exc
            except ForkServerError:
                if self.proc.poll() is not None:
                    self._gone()
                raise

    def pump(self, timeout: float) -> None:
        """Take the exit messages that came in, waiting up to `timeout` for the first."""
        with self.lock:
            if self.closed:
                return
            sel = selectors.DefaultSelector()
            try:
                sel.register(self.sock, selectors.EVENT_READ)
                wait = timeout
                while sel.select(wait):
                    msg = _recv(self.sock)
                    if msg is None:
                        self._gone()
                        return
                    self._ended(msg)
                    wait = 0.0
            except OSError:
                self._gone()
            finally:
                sel.close()

    def _ended(self, msg: dict[str, Any]) -> None:
        child = self.live.pop(msg["exit"], None)
        if child is not None:
            child.cpu_s = msg["cpu_s"]
            child.returncode = msg["code"]

    def _gone(self) -> None:
        """The fork server died: its ranks were sent SIGTERM (their parent-death signal)."""
        self.closed = True
        for child in self.live.values():
            child.returncode = -int(signal.SIGTERM)
        self.live.clear()
        with contextlib.suppress(OSError):
            self.sock.close()

    @property
    def alive(self) -> bool:
        return not self.closed and self.proc.poll() is None

    def close(self) -> None:
        """Close the socket: the fork server ends every rank it still runs, and exits."""
        with self.lock:
            if not self.closed:
                self.closed = True
                with contextlib.suppress(OSError):
                    self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_server: ForkServer | None = None
_server_lock = threading.Lock()
_server_failed: str | None = None


def shared_server() -> ForkServer:
    """This process's fork server, started on first use (and again if it died).
    ForkServerError if it cannot start; it is not tried again in this process."""
    global _server, _server_failed
    with _server_lock:
        if _server_failed is not None:
            raise ForkServerError(_server_failed)
        if _server is None or not _server.alive:
            try:
                _server = ForkServer.start()
            except ForkServerError as exc:
                _server_failed = str(exc)
                raise
            atexit.register(_server.close)
        return _server


def start_rank(
    cmd: list[str], env: dict[str, str], log: Path, warn=None, credential: bytes = b""
) -> subprocess.Popen | ForkedProcess | None:
    """A forked rank running `cmd` with `env` and `credential`, its output appended to `log`, when ranks
    start by fork (`rank_start(env)`) and `cmd` is forkable; None when it must be
    spawned (`warn(why)` is told why the fork server could not)."""
    if rank_start(env) != "fork" or not forkable(cmd):
        return None
    try:
        server = shared_server()
        if env.get("PYTHONPATH") != server.pythonpath:
            return None  # its imports would come from elsewhere
        return server.fork(cmd, env, log, credential)
    except ForkServerError as exc:
        if warn is not None:
            warn(f"{exc}; the rank is spawned instead")
        return None


# ------------------------------------------------------------- the fork server's side


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


class _Zygote:
    """The fork server process: imports, then forks and reaps ranks until the launcher
    closes its socket."""

    def __init__(self, sock: socket.socket, threads: int) -> None:
        self.sock = sock
        self.threads = threads  # what the imports left running (not Python threads)
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ, None)
        self.children: dict[int, int] = {}  # pid -> its pidfd
        libc = ctypes.CDLL(None, use_errno=True)
        self.prctl = libc.prctl
        self.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4

    def serve(self) -> None:
        while True:
            for key, _ in self.sel.select():
                if key.data is None:
                    msg = _recv(self.sock)
                    if msg is None:
                        self._end_all()
                        return
                    self._fork(msg)
                else:
                    self._reap(key.data)

    def _fork(self, req: dict[str, Any]) -> None:
        threads, python = _threads(), threading.active_count()
        if threads > self.threads or python != 1:
            why = f"the fork server runs {threads} threads ({python} Python); it forks at {self.threads} (1)"
            _send(self.sock, {"refused": why})
            return
        sys.stdout.flush()
        sys.stderr.flush()
        me = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:
            _send(self.sock, {"refused": f"fork failed: {exc}"})
            return
        if pid == 0:
            self._child(req, me)  # never returns
        fd = os.pidfd_open(pid)
        self.children[pid] = fd
        self.sel.register(fd, selectors.EVENT_READ, pid)
        _send(self.sock, {"pid": pid})

    def _reap(self, pid: int) -> None:
        fd = self.children.pop(pid)
        self.sel.unregister(fd)
        os.close(fd)
        _, status, usage = os.wait4(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        cpu = round(usage.ru_utime + usage.ru_stime, 4)
        with contextlib.suppress(OSError):
            _send(self.sock, {"exit": pid, "code": code, "cpu_s": cpu})

    def _end_all(self) -> None:
        """The launcher is gone: so is every rank it asked for."""
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)

    def _child(self, req: dict[str, Any], zygote: int) -> None:
        code = 1
        try:
            os.setsid()
            self.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != zygote:  # the fork server died before the line above
                os._exit(1)
            self.sel.close()
            for fd in self.children.values():
                os.close(fd)
            self.sock.close()
            _redirect(req["log"])
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            if req.get("key"):  # as a spawned rank gets it: a pipe of its own
                from kvstage.hw.control.credentials import KEY_FD_ENV, credential_pipe

                os.environ[KEY_FD_ENV] = str(credential_pipe(bytes.fromhex(req.pop("key"))))
            code = _run(req["argv"])
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            _finish(code)


def _redirect(log: str) -> None:
    """stdin from /dev/null; stdout and stderr appended to `log`."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)


def _run(argv: list[str]) -> int:
    """Run `python -m MODULE ARGS` or `python SCRIPT ARGS` (argv[0]: the interpreter) here."""
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.path[0] = os.getcwd()  # as `python -m` puts it
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            sys.path[0] = str(Path(argv[1]).resolve().parent)
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc.code)
    return 0


def _exit_code(code: Any) -> int:
    """What the interpreter makes of `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """End a forked rank as the interpreter ends: wait for its non-daemon threads, run its
    exit handlers, flush; then leave without the fork server's own clean-up."""
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvstage.hw.launch.forkserver FD MODULE...`: serve on socket FD once MODULEs are
    imported."""
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    try:
        for name in args[1:]:
            importlib.import_module(name)
    except BaseException:
        _send(sock, {"failed": traceback.format_exc()[-2000:]})
        return 1
    if threading.active_count() != 1:
        _send(sock, {"failed": f"the imports started Python threads: {threading.enumerate()}"})
        return 1
    _send(sock, {"ready": os.getpid()})
    _Zygote(sock, _threads()).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
