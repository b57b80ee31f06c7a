"""The ZMQ control plane of one rank, and the run secret every frame is signed with.

Protocol messages travel as the `shared.protocol` codec's multipart frames over
PUSH/PULL sockets: each rank binds one PULL socket and keeps one PUSH per peer.
A frame list that does not decode is logged and dropped; it never reaches the
state machine and never raises out of `receive`.

The rendezvous that introduces ranks, tracks their liveness and lets a restarted
prefill rank rejoin is hw/rendezvous.py.

Every frame list, control or rendezvous, is authenticated with the run's secret
(32 random bytes the launcher draws per run): an HMAC-SHA256 over the frame count
and every frame with its length goes as one extra, last frame; the key is bound to
its channel and direction, so a frame signed for one cannot pass as another. A
frame list that is too big is dropped before anything looks into it; one whose MAC
is missing or wrong is dropped before it is decoded. Both are counted
(`ControlPlane.oversize`, `.unauthenticated`, in the rank's report) and logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from kvstage.shared.protocol import Message, ProtocolError, decode, encode
from kvstage.shared.runtime import rank_name  # noqa: F401 - re-exported (launcher, ranks)

log = logging.getLogger("kvstage.hw.control")

SECRET_ENV = "KVSTAGE_RUN_SECRET"  # the run secret, hex, for ranks the launcher spawns
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
# The largest legitimate control message is a few dozen bytes (a reason string is cut
# at MAX_REASON_BYTES): anything over 64 KiB is dropped and counted, unread. ZMQ itself
# cuts off a peer that sends a single frame over 1 MiB (not counted: never delivered).
MAX_CONTROL_BYTES = 64 << 10
MAX_CONTROL_FRAMES = 8
ZMQ_MAX_CONTROL_FRAME = 1 << 20
# A report carries the rank's whole trace; a hello its transfer metadata.
MAX_RENDEZVOUS_BYTES = 512 << 20

_CONTROL = b"kvstage control v2"  # v2: frames carry sender, incarnation and sequence
# senders whose last (incarnation, sequence) a control plane remembers (replay state);
# only authenticated frames create entries, so this bounds a secret holder's flood
MAX_SENDERS = 4096
# KVSTAGE_LOOP_STATS=DIR (hw/rank.py): a control plane also stamps every frame it sends and
# receives and every wake of its poll, for benchmarks/hw_loop.py's delivery breakdown.
LOOP_STATS_ENV = "KVSTAGE_LOOP_STATS"
TO_LAUNCHER = b"kvstage rendezvous rank->launcher v1"
TO_RANK = b"kvstage rendezvous launcher->rank v1"


class RunSecretError(RuntimeError):
    """No usable run secret: a rank never runs unauthenticated."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def parse_secret(text: str, where: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise RunSecretError(
            f"{where}: not a run secret (expected {2 * SECRET_BYTES} hex digits)"
        ) from None
    if len(secret) < MIN_SECRET_BYTES:
        raise RunSecretError(
            f"{where}: a run secret of {len(secret)} bytes is too short "
            f"(at least {MIN_SECRET_BYTES}; kvstage hw draws {SECRET_BYTES})"
        )
    return secret


def run_secret(secret: bytes | None = None) -> bytes:
    """`secret` if given, else the one in $KVSTAGE_RUN_SECRET; RunSecretError if neither."""
    if secret is not None:
        if len(secret) < MIN_SECRET_BYTES:
            raise RunSecretError(
                f"a run secret of {len(secret)} bytes is too short (at least {MIN_SECRET_BYTES})"
            )
        return bytes(secret)
    text = os.environ.get(SECRET_ENV, "")
    if not text.strip():
        raise RunSecretError(
            f"no run secret: give --secret-file RUN_DIR/run.secret (written by `kvstage hw`) or set "
            f"{SECRET_ENV} (hex); control and rendezvous messages are authenticated with it"
        )
    return parse_secret(text, f"${SECRET_ENV}")


def read_secret_file(path: str | Path) -> bytes:
    """The run secret in `path`, which only its owner may read: a secret that others on
    the host can read authenticates nobody (RunSecretError, naming the mode and the fix)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise RunSecretError(
            f"cannot read the run secret file {path}: {exc.strerror or exc}"
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if mode & 0o077:
            raise RunSecretError(
                f"the run secret file {path} can be read by others (mode {mode & 0o777:04o}); "
                f"allowed: readable by its owner only (chmod 600 {path})"
            )
        text = os.read(fd, 4096).decode(errors="replace")
    except OSError as exc:
        raise RunSecretError(
            f"cannot read the run secret file {path}: {exc.strerror or exc}"
        ) from None
    finally:
        os.close(fd)
    return parse_secret(text, str(path))


def write_secret_file(path: Path, secret: bytes) -> None:
    """Write `secret` (hex) to a new file `path`, readable by its owner only (0600).

    A file already there (a run directory used again) is removed first, and never
    followed: `unlink` removes a planted symlink itself, and the new file is created
    with O_EXCL | O_NOFOLLOW, so a link planted again in between makes this fail
    instead of writing the secret where the link points."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (secret.hex() + "\n").encode())
    finally:
        os.close(fd)


class FrameMac:
    """HMAC-SHA256 of a frame list under one key and channel label."""

    def __init__(self, secret: bytes, label: bytes) -> None:
        self._base = hmac.new(secret, label, hashlib.sha256)

    def of(self, frames: Sequence[bytes]) -> bytes:
        h = self._base.copy()
        h.update(len(frames).to_bytes(4, "big"))
        for f in frames:
            h.update(len(f).to_bytes(8, "big"))
            h.update(f)
        return h.digest()

    def sign(self, frames: Sequence[bytes]) -> list[bytes]:
        return [*frames, self.of(frames)]

    def verify(self, frames: Sequence[bytes]) -> list[bytes] | None:
        """The frames without their MAC, or None when it is missing or wrong."""
        if len(frames) < 2:
            return None
        body = list(frames[:-1])
        return body if hmac.compare_digest(self.of(body), frames[-1]) else None


class Throttled:
    """Logs the first few of a kind of drop, then every 1000th (a flood stays readable)."""

    def __init__(self, logger: logging.Logger, first: int = 5) -> None:
        self.log = logger
        self.first = first
        self.seen: dict[str, int] = {}

    def warn(self, kind: str, fmt: str, *args: Any) -> None:
        n = self.seen[kind] = self.seen.get(kind, 0) + 1
        if n <= self.first or n % 1000 == 0:
            self.log.warning(f"{fmt} ({kind} #{n})", *args)


_by_hand = iter(range(1, 1 << 62))


def signed(
    frames: Sequence[bytes],
    secret: bytes,
    *,
    sender: bytes = b"by-hand",
    incarnation: int | None = None,
    seq: int | None = None,
) -> list[bytes]:
    """`frames` as `ControlPlane.send` sends them, header and MAC included (for tools and
    tests that build frames by hand). By default each call is a fresh frame: the next
    sequence number of an incarnation that starts now."""
    inc = time.time_ns() if incarnation is None else incarnation
    header = _header(inc, next(_by_hand) if seq is None else seq)
    return FrameMac(run_secret(secret), _CONTROL).sign([sender, header, *frames])


def _header(incarnation: int, seq: int) -> bytes:
    return incarnation.to_bytes(8, "big") + seq.to_bytes(8, "big")


def frames_size(frames: Sequence[bytes]) -> int:
    return sum(len(f) for f in frames)


def run_delay_s() -> float:
    """Seconds the calling thread has waited, runnable, for a CPU (Linux schedstat; nan
    elsewhere): what separates a turn slowed by the CPU from one slowed by its own work."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return math.nan


class Waker:
    """An eventfd that a worker thread (or an engine's completion thread) sets when its
    work finished: the rank loop's poll wakes on it together with the control socket,
    so it can block until something happens instead of waking every millisecond to look
    (each needless wake-up costs the interpreter lock that the workers' glue needs)."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def set(self) -> None:
        """Wake the loop (thread-safe; any number of sets before it looks wake it once)."""
        try:
            os.eventfd_write(self.fd, 1)
        except OSError:
            pass  # closed at shutdown: nobody waits any more

    def clear(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass  # not set

    def close(self) -> None:
        fd, self.fd = self.fd, -1  # a late set() fails instead of writing to a reused number
        os.close(fd)


class ControlPlane:
    """This rank's inbox (PULL, bound on an ephemeral port) and outboxes (PUSH).

    `secret`: the run secret (default: $KVSTAGE_RUN_SECRET; RunSecretError without one).

    Replay protection: every frame carries its sender's name, the sender's incarnation
    (the wall clock in ns when its control plane started) and a sequence number, under
    the MAC. A receiver keeps the last (incarnation, sequence) of each sender and drops,
    as replayed, a frame that is not newer: a captured frame sent again, or a late frame
    of a sender's earlier incarnation after the restarted process has spoken (PUSH/PULL
    over TCP keeps one sender's frames in order, so honest frames are always newer).
    Once a rank learns that a peer restarted (the rendezvous says so), it raises that
    peer's floor to the new incarnation (`expect_incarnation`): every late frame of the
    old one is dropped from then on, before the new one has said anything."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        ctx: zmq.Context | None = None,
        *,
        secret: bytes | None = None,
        name: str | None = None,
    ) -> None:
        self._mac = FrameMac(run_secret(secret), _CONTROL)
        self._incarnation = time.time_ns()
        self._seq = 0
        self._last: dict[bytes, tuple[int, int]] = {}  # sender -> its newest (incarnation, seq)
        self.ctx = ctx or zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_CONTROL_FRAME)
        port = self.inbox.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._name = (name or self.address).encode()
        self.replayed = 0
        self._out: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.waker = Waker()
        self.poller.register(self.waker.fd, zmq.POLLIN)
        self.malformed = 0
        self.unauthenticated = 0
        self.oversize = 0
        self.sent = 0
        self.received = 0
        self._warn = Throttled(log)
        # with $KVSTAGE_LOOP_STATS: ("s", peer, seq, kind, called, returned) per frame sent,
        # ("w", poll start, woke, run delay at both) per wait, ("r", sender, seq, kind, received)
        # per frame accepted (time.time() and run_delay_s(), s)
        self.stamps: list[tuple] | None = [] if os.environ.get(LOOP_STATS_ENV) else None

    @property
    def incarnation(self) -> int:
        """This control plane's incarnation: the wall clock in ns when it started."""
        return self._incarnation

    def renew_incarnation(self, at_least: int) -> None:
        """Take an incarnation of at least `at_least` (a restarted rank whose clock is
        behind its predecessor's); only before the first frame went out."""
        if self._seq:
            raise RuntimeError("the incarnation is fixed once a frame went out")
        self._incarnation = max(self._incarnation, at_least)

    def connect(self, peer: str, address: str) -> None:
        """Send to `peer` at `address` from now on (a peer that restarted: the frames
        still queued for its old address are dropped)."""
        old = self._out.pop(peer, None)
        if old is not None:
            old.close(linger=0)
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(address)
        self._out[peer] = sock

    def expect_incarnation(self, peer: str, incarnation: int) -> None:
        """`peer` restarted as `incarnation`: from now on a frame of any earlier
        incarnation of it is dropped as replayed (a late or replayed frame of the old
        process), even before the new one has sent anything."""
        sender = peer.encode()
        floor = (incarnation, 0)
        last = self._last.get(sender)
        if last is None or last < floor:
            if last is None and len(self._last) >= MAX_SENDERS:
                self._last.pop(next(iter(self._last)))
            self._last[sender] = floor

    def send(self, peer: str, msg: Message) -> None:
        sock = self._out.get(peer)
        if sock is None:
            raise KeyError(f"no control connection to {peer} (known: {sorted(self._out)})")
        self._seq += 1
        called = time.time() if self.stamps is not None else 0.0
        sock.send_multipart(
            self._mac.sign([self._name, _header(self._incarnation, self._seq), *encode(msg)]),
            copy=False,
        )
        if self.stamps is not None:
            self.stamps.append(("s", peer, self._seq, type(msg).__name__, called, time.time()))
        self.sent += 1

    def wait(self, timeout_s: float) -> bool:
        """Block until a message is waiting or the waker was set, at most `timeout_s`:
        True when a message may be waiting (the waker is cleared here)."""
        # round up: a sub-millisecond wait truncated to 0 would spin and starve the
        # other ranks sharing this machine's cores
        if self.stamps is None:
            events = dict(self.poller.poll(max(0, math.ceil(timeout_s * 1000))))
        else:
            delay, start = run_delay_s(), time.time()
            events = dict(self.poller.poll(max(0, math.ceil(timeout_s * 1000))))
            self.stamps.append(("w", start, time.time(), delay, run_delay_s()))
        if self.waker.fd in events:
            self.waker.clear()
        return self.inbox in events

    def receive(self, timeout_s: float) -> list[Message]:
        """Every message waiting (after at most `timeout_s` of waiting for the first, or
        until the waker is set)."""
        return self.drain() if self.wait(timeout_s) else []

    def drain(self) -> list[Message]:
        """Every message waiting now, without blocking."""
        out: list[Message] = []
        while True:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) > MAX_CONTROL_FRAMES or frames_size(frames) > MAX_CONTROL_BYTES:
                self.oversize += 1
                self._warn.warn(
                    "oversize",
                    "dropped a control message of %d frames, %d bytes (at most %d, %d)",
                    len(frames),
                    frames_size(frames),
                    MAX_CONTROL_FRAMES,
                    MAX_CONTROL_BYTES,
                )
                continue
            body = self._mac.verify(frames)
            if body is None:
                self.unauthenticated += 1
                self._warn.warn(
                    "unauthenticated", "dropped a control message whose MAC is missing or wrong"
                )
                continue
            if not self._fresh(body):
                continue
            try:
                out.append(decode(body[2:]))
                self.received += 1
                if self.stamps is not None:
                    self.stamps.append(
                        (
                            "r",
                            bytes(body[0]).decode(errors="replace"),
                            int.from_bytes(body[1][8:], "big"),
                            type(out[-1]).__name__,
                            time.time(),
                        )
                    )
            except ProtocolError as exc:
                self.malformed += 1
                log.warning("dropped a malformed control message: %s", exc)

    def _fresh(self, body: list) -> bool:
        """An authenticated frame newer than its sender's last one (False: dropped)."""
        if len(body) < 3 or len(body[1]) != 16:
            self.malformed += 1
            self._warn.warn("malformed", "dropped a control message without its sender header")
            return False
        sender = bytes(body[0])
        stamp = (int.from_bytes(body[1][:8], "big"), int.from_bytes(body[1][8:], "big"))
        last = self._last.get(sender)
        if last is not None and stamp <= last:
            self.replayed += 1
            self._warn.warn(
                "replayed",
                "dropped a control message not newer than its sender's last "
                "(replayed, or from an earlier incarnation of a restarted rank)",
            )
            return False
        if last is None and len(self._last) >= MAX_SENDERS:
            self._last.pop(next(iter(self._last)))
        self._last[sender] = stamp
        return True

    def counters(self) -> dict[str, int]:
        """Messages dropped, by why (the rank's report carries them)."""
        return {
            "malformed": self.malformed,
            "unauthenticated": self.unauthenticated,
            "oversize": self.oversize,
            "replayed": self.replayed,
        }

    def close(self) -> None:
        for sock in self._out.values():
            sock.close(linger=500)
        self.inbox.close(linger=0)
        self.waker.close()
