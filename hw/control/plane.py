"""The ZMQ control plane of one rank, and the run secret every frame is signed with.

Protocol messages travel as the `shared.protocol` codec's multipart frames over
PUSH/PULL sockets: each rank binds one PULL socket and keeps one PUSH per peer.
A frame list that does not decode is logged and dropped; it never reaches the
state machine and never raises out of `receive`.

The rendezvous that introduces ranks, tracks their liveness and lets a restarted
prefill rank rejoin is hw/control/rendezvous.py.

Every frame list, control or rendezvous, is authenticated: an HMAC-SHA256 over the
frame count and every frame with its length goes as one extra, last frame. A control
frame's key belongs to one (sender, receiver) pair (hw/control/keys.py: X25519 between the
two ranks' key pairs, HKDF with the run secret, 32 random bytes the launcher draws
per run, over both identities, incarnations included), so its MAC proves which rank
sent it and to whom; a rendezvous message's key is bound to its rank, incarnation and
direction. Below the MACs, every connection is a ZMQ CURVE one whose server key is
derived from the run secret (`curve_server`, `curve_client`): a process without the
secret never gets a connection, so nothing it sends is buffered; a rank's inbox admits
only the CURVE keys of its peers in the rank table, a few connections each (ZAP:
hw/control/zap.py), so a holder of the secret that is no rank gets none either. A frame list that is
too big is dropped before anything looks into it (ZMQ `MAXMSGSIZE` on each frame's
header first, before its bytes are buffered, then the frame count and size); one from no known peer, or whose
MAC is missing or wrong, is dropped before it is decoded; an authenticated message
that speaks for another rank than its sender, or is addressed to another rank, is
dropped after. Each is counted (`ControlPlane.oversize`, `.unauthenticated`,
`.misattributed`, in the rank's report) and logged.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from kvstage.hw.control.keys import MAX_NAME_BYTES, Identity, KeyPair, curve_server_keys
from kvstage.hw.control.zap import Gate, ZapHandler
from kvstage.shared.protocol import Message, ProtocolError, decode, encode
from kvstage.shared.runtime import rank_name  # noqa: F401 - re-exported (launcher, ranks)

log = logging.getLogger("kvstage.hw.control.plane")

SECRET_ENV = "KVSTAGE_RUN_SECRET"  # the run secret, hex, for ranks the launcher spawns
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
# The largest legitimate control frame is a reason string (cut at MAX_REASON_BYTES,
# 1 KiB [C] shared/protocol.py) and a message has at most 6 frames (name, header, tag,
# integers, reason, MAC): ZMQ itself cuts off a peer that sends a frame over 4 KiB
# (MAXMSGSIZE, checked on the frame's header before its bytes are buffered; not
# counted: never delivered), and a message of more than 8 frames or 32 KiB is dropped
# and counted, unread.
ZMQ_MAX_CONTROL_FRAME = 4 << 10
MAX_CONTROL_FRAMES = 8
MAX_CONTROL_BYTES = MAX_CONTROL_FRAMES * ZMQ_MAX_CONTROL_FRAME
# ZMQ's receive queue of a control inbox, in messages (ZMQ's default [C] libzmq
# zmq_setsockopt(3), made explicit): with the bounds above at most
# 1,000 x 32 KiB = 32 MiB queued from peers that hold the run secret.
CONTROL_RCVHWM = 1000
# What a sender may make the rendezvous hold (docs/hardware-mode.md, "Bounded per
# sender"). A message to it (a hello with its transfer metadata, a beat, a part of a
# report) is at most 1 MiB, frames together: ZMQ cuts a connection off on the header of a
# frame over it (MAXMSGSIZE), the rendezvous refuses a frame list over it unread. A
# rank's hello measured 0.8-1.4 KB (P2->D1 on the CPU, NIXL 1.4 KB with 760 bytes of
# metadata, Mooncake 0.8 KB; 2026-12-03, by spying on Membership._hello in a launch):
# the bound leaves room for engine metadata of hundreds of regions.
MAX_RENDEZVOUS_BYTES = 1 << 20
# ZMQ's receive queue of the rendezvous, in messages per connection: at most
# 4 x 1 MiB queued on one connection before the rendezvous reads it (a sender's
# connections: hw/control/zap.py).
RENDEZVOUS_RCVHWM = 4
# What the rendezvous sends a rank (the table of every rank's metadata): the rank
# trusts the address it was given, so only this bound.
MAX_TABLE_BYTES = 512 << 20

# KVSTAGE_LOOP_STATS=DIR (hw/rank/process.py): a control plane also stamps every frame it sends and
# receives and every wake of its poll, for benchmarks/hw_loop.py's delivery breakdown.
LOOP_STATS_ENV = "KVSTAGE_LOOP_STATS"
TO_LAUNCHER = b"kvstage rendezvous rank->launcher v1"
TO_RANK = b"kvstage rendezvous launcher->rank v1"


class RunSecretError(RuntimeError):
    """No usable run secret: a rank never runs unauthenticated."""


def curve_server(sock: zmq.Socket, secret: bytes) -> None:
    """Make `sock`, before it binds, a CURVE server with the run's key pair
    (hw/control/keys.py `curve_server_keys`): only a holder of the run secret gets a
    connection, so nothing a stranger sends is ever buffered."""
    public, private = curve_server_keys(secret)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, private)


def curve_client(sock: zmq.Socket, secret: bytes, keys: tuple[bytes, bytes] | None = None) -> None:
    """Make `sock`, before it connects, a CURVE client of the run's listening sockets
    with key pair `keys` (raw public, secret: a control plane's own, which a rank's
    inbox admits only from the ranks of its table, hw/control/zap.py); none: drawn
    fresh (the rendezvous accepts any holder of the run secret)."""
    public, private = keys if keys is not None else zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, curve_server_keys(secret)[0])
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, private)


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def parse_secret(text: str, where: str, what: str = "run secret") -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise RunSecretError(
            f"{where}: not a {what} (expected {2 * SECRET_BYTES} hex digits)"
        ) from None
    if len(secret) < MIN_SECRET_BYTES:
        raise RunSecretError(
            f"{where}: a {what} of {len(secret)} bytes is too short "
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


def read_secret_file(path: str | Path, what: str = "run secret") -> bytes:
    """The run secret (or another key: `what`) in `path`, which only its owner may read:
    a secret that others on the host can read authenticates nobody (RunSecretError,
    naming the mode and the fix)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise RunSecretError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if mode & 0o077:
            raise RunSecretError(
                f"the {what} file {path} can be read by others (mode {mode & 0o777:04o}); "
                f"allowed: readable by its owner only (chmod 600 {path})"
            )
        text = os.read(fd, 4096).decode(errors="replace")
    except OSError as exc:
        raise RunSecretError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return parse_secret(text, str(path), what)


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


def frame_header(incarnation: int, seq: int) -> bytes:
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


@dataclass
class _Sender:
    """A peer this control plane accepts frames from: its identity, the key of its frames
    to this plane, and its newest sequence number (replay state)."""

    identity: Identity
    mac: FrameMac
    last_seq: int = 0


def claimed_sender(receiver_role: str, msg: Message) -> tuple[str, str]:
    """(the rank `msg` speaks for, the rank it is addressed to) when a `receiver_role`
    rank receives it: a message to a prefill rank speaks for its decode rank, and the
    other way round (every message names both)."""
    prefill, decode_ = rank_name("prefill", msg.prefill_rank), rank_name("decode", msg.decode_rank)
    return (decode_, prefill) if receiver_role == "prefill" else (prefill, decode_)


class ControlPlane:
    """This rank's inbox (PULL, bound on an ephemeral port) and outboxes (PUSH).

    `secret`: the run secret (default: $KVSTAGE_RUN_SECRET; RunSecretError without one).
    `name`: this plane's name as its peers know it (a rank's: prefill0, decode1).
    `role`: a rank's role; then a message that speaks for another rank than the one
    that sent it, or is addressed to another rank than this one, is dropped
    (`misattributed`): a rank speaks only for itself.

    Peers: `connect(peer, address, identity)` with the peer's `Identity` (its name,
    incarnation and public key, from the rendezvous' table). Frames to it are signed
    with the key of this pair (hw/control/keys.py), and only frames from a connected peer,
    signed with the key of that peer to this plane, are accepted.

    Replay protection: every frame carries its sender's name, the sender's incarnation
    (the wall clock in ns when its control plane started) and a sequence number, under
    the MAC. A receiver keeps the last sequence of each peer and drops, as replayed, a
    frame that is not newer, or one of an earlier incarnation than the peer's it knows
    (a captured frame sent again, a late frame of a restarted rank's old process; PUSH/
    PULL over TCP keeps one sender's frames in order, so honest frames are always
    newer). A rank that learns that a peer restarted connects to its new identity: the
    old process's frames fail from then on, before the new one has said anything."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        ctx: zmq.Context | None = None,
        *,
        secret: bytes | None = None,
        name: str | None = None,
        role: str | None = None,
    ) -> None:
        self._secret = run_secret(secret)
        self._keys = KeyPair()
        self._incarnation = time.time_ns()
        self._seq = 0
        self._senders: dict[bytes, _Sender] = {}  # peer name -> what its frames are checked with
        self._macs: dict[str, FrameMac] = {}  # peer -> the key of this plane's frames to it
        self._pair_keys: dict[
            str, bytes
        ] = {}  # peer -> raw key of frames to it (hw/control/keys.py)
        self._pair_keys_in: dict[str, bytes] = {}  # peer -> raw key of its frames to this plane
        self.role = role
        self.ctx = ctx or zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_CONTROL_FRAME)
        self.inbox.setsockopt(zmq.RCVHWM, CONTROL_RCVHWM)
        # only the keys of the peers this plane connects to get a connection (ZAP)
        self.gate = Gate()
        ZapHandler.of(self.ctx).guard(self.inbox, self.gate)
        curve_server(self.inbox, self._secret)
        port = self.inbox.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.name = name or self.address
        self._name = self.name.encode()
        if len(self._name) > MAX_NAME_BYTES:
            raise ValueError(
                f"control plane name {self.name[:80]!r}: at most {MAX_NAME_BYTES} bytes"
            )
        self.replayed = 0
        self._out: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.waker = Waker()
        self.poller.register(self.waker.fd, zmq.POLLIN)
        self.malformed = 0
        self.unauthenticated = 0
        self.misattributed = 0
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

    @property
    def identity(self) -> Identity:
        """This plane as its peers must know it (`connect`)."""
        return Identity(self.name, self._incarnation, self._keys.public)

    def renew_incarnation(self, at_least: int) -> None:
        """Take an incarnation of at least `at_least` (a restarted rank whose clock is
        behind its predecessor's); only before any peer is connected."""
        if self._seq or self._macs:
            raise RuntimeError("the incarnation is fixed once a peer is connected")
        self._incarnation = max(self._incarnation, at_least)

    def _pair_mac(self, sender: Identity, receiver: Identity) -> FrameMac:
        return FrameMac(self._keys.pair_key(self._secret, sender, receiver), b"")

    def connect(self, peer: str, address: str, identity: Identity) -> None:
        """Talk to `peer` (`identity`) at `address` from now on, and accept its frames. A
        peer that restarted: the frames still queued for its old address are dropped, and
        its old incarnation's frames are refused from now on."""
        old = self._out.pop(peer, None)
        if old is not None:
            old.close(linger=0)
        me = self.identity
        sender = identity.name.encode()
        known = self._senders.get(sender)
        if known is None or known.identity != identity:
            self._senders[sender] = _Sender(identity, self._pair_mac(identity, me))
        self._macs[peer] = self._pair_mac(me, identity)
        self._pair_keys[peer] = self._keys.pair_key(self._secret, me, identity)
        self._pair_keys_in[peer] = self._keys.pair_key(self._secret, identity, me)
        self.gate.admit(identity.public)  # its connections to this inbox, from now on
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_CONTROL_FRAME)  # nothing comes back on a PUSH
        curve_client(sock, self._secret, self._keys.curve())
        sock.connect(address)
        self._out[peer] = sock

    def pair_key(self, peer: str, *, to_peer: bool) -> bytes:
        """The pair key (hw/control/keys.py) of frames from this plane to `peer` (`to_peer`) or
        from `peer` to it: other keys of the pair (`write_key`) are derived from it."""
        return (self._pair_keys if to_peer else self._pair_keys_in)[peer]

    def seal(
        self,
        peer: str,
        frames: Sequence[bytes],
        *,
        incarnation: int | None = None,
        seq: int | None = None,
    ) -> list[bytes]:
        """`frames` as this plane sends them to `peer`: name, header, MAC (the next sequence
        number unless `seq` is given; tools and tests that build frames by hand)."""
        mac = self._macs.get(peer)
        if mac is None:
            raise KeyError(f"no control connection to {peer} (known: {sorted(self._out)})")
        if seq is None:
            self._seq += 1
            seq = self._seq
        inc = self._incarnation if incarnation is None else incarnation
        return mac.sign([self._name, frame_header(inc, seq), *frames])

    def send(self, peer: str, msg: Message) -> None:
        sock = self._out.get(peer)
        if sock is None:
            raise KeyError(f"no control connection to {peer} (known: {sorted(self._out)})")
        called = time.time() if self.stamps is not None else 0.0
        sock.send_multipart(self.seal(peer, encode(msg)), copy=False)
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
            found = self._authentic(frames)
            if found is None:
                continue
            sender, body = found
            try:
                msg = decode(body[2:])
            except ProtocolError as exc:
                self.malformed += 1
                log.warning("dropped a malformed control message: %s", exc)
                continue
            if self.role is not None and claimed_sender(self.role, msg) != (sender, self.name):
                self.misattributed += 1
                self._warn.warn(
                    "misattributed",
                    "dropped a %s signed by %s that speaks for %s to %s (a rank speaks only "
                    "for itself, to its peer)",
                    type(msg).__name__,
                    sender,
                    *claimed_sender(self.role, msg),
                )
                continue
            out.append(msg)
            self.received += 1
            if self.stamps is not None:
                self.stamps.append(
                    (
                        "r",
                        sender,
                        int.from_bytes(body[1][8:], "big"),
                        type(msg).__name__,
                        time.time(),
                    )
                )

    def _authentic(self, frames: list) -> tuple[str, list] | None:
        """(sender, frames without the MAC) of a frame list from a connected peer, signed
        with its key to this plane and newer than its last; None: dropped and counted."""
        if len(frames) < 4 or len(frames[1]) != 16:
            self.unauthenticated += 1
            self._warn.warn(
                "unauthenticated", "dropped a control message without its sender header"
            )
            return None
        name = bytes(frames[0])
        peer = self._senders.get(name)
        incarnation = int.from_bytes(frames[1][:8], "big")
        seq = int.from_bytes(frames[1][8:], "big")
        if peer is not None and incarnation < peer.identity.incarnation:
            self.replayed += 1
            self._warn.warn(
                "replayed",
                "dropped a control message of an earlier incarnation of %s (a late frame of "
                "its old process, or one replayed)",
                peer.identity.name,
            )
            return None
        body = (
            peer.mac.verify(frames)
            if peer is not None and incarnation == peer.identity.incarnation
            else None
        )
        if body is None:
            self.unauthenticated += 1
            self._warn.warn(
                "unauthenticated",
                "dropped a control message that no peer of this rank signed for it "
                "(MAC missing or wrong, or an unknown sender)",
            )
            return None
        if seq <= peer.last_seq:
            self.replayed += 1
            self._warn.warn(
                "replayed", "dropped a control message not newer than its sender's last"
            )
            return None
        peer.last_seq = seq
        return peer.identity.name, body

    def counters(self) -> dict[str, int]:
        """Messages dropped, by why (the rank's report carries them)."""
        return {
            "malformed": self.malformed,
            "unauthenticated": self.unauthenticated,
            "misattributed": self.misattributed,
            "oversize": self.oversize,
            "replayed": self.replayed,
            # handshakes of no peer's key (ZAP): refused, or held now (hw/control/zap.py)
            "refused_connections": self.gate.refused + ZapHandler.of(self.ctx).holding(self.gate),
        }

    def close(self) -> None:
        for sock in self._out.values():
            sock.close(linger=500)
        ZapHandler.of(self.ctx).release(self.inbox)
        self.inbox.close(linger=0)
        self.waker.close()
