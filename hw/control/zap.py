"""Who may connect to a rank's control inbox: a ZAP handler admitting only the table's keys.

CURVE (hw/control/plane.py `curve_server`) keeps out every process without the run
secret; it admits any holder of it, whatever client key it brings. A rank's control
inbox needs frames only from the ranks it talks to, and the rank table names their
keys: a control plane's outgoing sockets are CURVE clients with the plane's own X25519
key pair (the `RankInfo.key` its hello registered), and the inbox asks this handler
(ZAP, RFC 27: libzmq asks it during the handshake, before a byte of the connection is
buffered) whether a client key is one of the peers it connected to (`Gate`).

Per sender, not per connection: a key is admitted at most MAX_CONNECTIONS_PER_KEY
times over the inbox's life (an honest peer connects once, and again only if its TCP
connection breaks), so what one sender can have queued at a rank is bounded by that many
connections' RCVHWM x MAX_CONTROL_BYTES, however many connections it opens. A key
that is no peer's is refused, counted (`Gate.refused`, a rank's `refused_connections`).

The rendezvous's gate (hw/control/rendezvous.py) knows its senders from the start: each
rank connects to it with a CURVE key derived from its own credential
(hw/control/credentials.py `curve_keys`), admitted MAX_CONNECTIONS_PER_KEY times and once
more each time that rank went down (`grant`: a restarted incarnation connects again);
every other key (a tool that holds only the run secret) counts against one allowance
shared by all of them (`others`): together they are one sender.

One handler thread per ZMQ context (ZAP's endpoint is per context); each guarded
socket has its own ZAP domain and `Gate`. A CURVE server of the context with no domain
is admitted as before: the run secret alone.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter

import zmq

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # [C] RFC 27/ZAP: the endpoint libzmq asks
MAX_CONNECTIONS_PER_KEY = 2
HOLD_S = 20.0  # a handshake of a key not (yet) admitted waits this long (ZMQ gives up at 30 s)
MAX_HELD = 64  # handshakes waiting at a time, per process
POLL_MS = 20  # how often held handshakes are looked at again
_domains = itertools.count()


class Gate:
    """One inbox's admission: the peers' keys it admits, and how often each came.
    `others`: connections admitted, all together, of keys not admitted (0: none)."""

    def __init__(self, others: int = 0) -> None:
        self.keys: set[bytes] = set()
        self.connections: Counter[bytes] = Counter()
        self.granted: Counter[bytes] = Counter()  # connections over the bound, per key
        self.others = others
        self.others_admitted = 0
        self.refused = 0
        self.sealed = False  # every peer's key is in: an unknown key is refused at once
        self.lock = threading.Lock()

    def admit(self, key: bytes) -> None:
        """Admit connections with client key `key` (a peer's X25519 public key) from now on."""
        with self.lock:
            self.keys.add(bytes(key))

    def seal(self) -> None:
        """Every peer's key was admitted (the rank read its table): from now on a key
        not admitted is refused at once, not held (a rejoined peer's new key is
        admitted before that peer is told to connect: hw/control/rendezvous.py)."""
        with self.lock:
            self.sealed = True

    def grant(self, key: bytes) -> None:
        """One more connection of `key` (its rank went down: its next incarnation)."""
        with self.lock:
            self.granted[bytes(key)] += 1

    def decide(self, key: bytes, final: bool) -> tuple[bool, str] | None:
        """(admitted, why) for a connection with client key `key`; None: not known yet,
        ask again (until `final` or sealed: then refused)."""
        with self.lock:
            if key not in self.keys:
                if self.others_admitted < self.others:
                    self.others_admitted += 1
                    return True, "OK"
                if not final and not self.sealed:
                    return None
                self.refused += 1
                if self.others:
                    return False, f"keys of no rank: {self.others} connections in all, used"
                return False, "not a key of the rank table"
            limit = MAX_CONNECTIONS_PER_KEY + self.granted[key]
            if self.connections[key] >= limit:
                self.refused += 1
                return False, f"more than {limit} connections of one key"
            self.connections[key] += 1
            return True, "OK"


class ZapHandler:
    """The ZAP handler of one context: a thread answering libzmq's requests.

    Until its gate is sealed, a request for a key the inbox does not know (yet) is held,
    not refused: a peer may connect before this rank has read the table that names it,
    and a client refused at the handshake may never try again (libzmq 4.3.5: seen here,
    in 2 of 3 tries it did not reconnect). It is answered once the key is admitted, or
    refused after HOLD_S or when the gate is sealed; at most MAX_HELD are held at a time
    (more are refused at once). A held handshake buffers nothing of the connection."""

    _lock = threading.Lock()
    _of: dict[int, ZapHandler] = {}

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.gates: dict[bytes, Gate] = {}
        self.held: list[tuple[float, list[bytes]]] = []  # (refused after, request)
        self.sock = ctx.socket(zmq.ROUTER)  # answers in any order (a held request waits)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.thread = threading.Thread(target=self._serve, name="kvstage-zap", daemon=True)
        self.thread.start()

    @classmethod
    def of(cls, ctx: zmq.Context) -> ZapHandler:
        with cls._lock:
            handler = cls._of.get(id(ctx))
            if handler is None or handler.ctx is not ctx:
                handler = cls._of[id(ctx)] = cls(ctx)
            return handler

    def guard(self, sock: zmq.Socket, gate: Gate) -> None:
        """Make `sock` (a CURVE server, before it binds) admit only `gate`'s keys."""
        domain = f"kvstage-control-{next(_domains)}".encode()
        self.gates[domain] = gate
        sock.setsockopt(zmq.ZAP_DOMAIN, domain)

    def release(self, sock: zmq.Socket) -> None:
        self.gates.pop(sock.getsockopt(zmq.ZAP_DOMAIN), None)

    def holding(self, gate: Gate) -> int:
        """Handshakes held for `gate` now (keys it has not admitted, waiting)."""
        domains = {d for d, g in list(self.gates.items()) if g is gate}
        return sum(1 for _, request in list(self.held) if request[4:5] and request[4] in domains)

    def _serve(self) -> None:
        try:
            while True:
                if self.sock.poll(POLL_MS if self.held else -1):
                    request = self.sock.recv_multipart()
                    answer = self._decide(request, final=False)
                    if answer is None and len(self.held) >= MAX_HELD:
                        answer = (False, "too many handshakes waiting")
                    if answer is None:
                        self.held.append((time.monotonic() + HOLD_S, request))
                    else:
                        self._reply(request, answer)
                now = time.monotonic()
                still = []
                for until, request in self.held:
                    answer = self._decide(request, final=now >= until)
                    if answer is None:
                        still.append((until, request))
                    else:
                        self._reply(request, answer)
                self.held = still
        except zmq.ContextTerminated:
            self.sock.close(linger=0)

    def _decide(self, request: list[bytes], final: bool) -> tuple[bool, str] | None:
        """RFC 27 (after the ROUTER's routing id and the empty delimiter): version,
        request id, domain, address, identity, mechanism, credentials."""
        body = request[2:]
        if len(body) < 6:
            return False, "malformed request"
        domain, mechanism = body[2], body[5]
        if not domain:
            return True, "OK"  # no policy of ours: CURVE's own (the run secret)
        gate = self.gates.get(domain)
        if gate is None or mechanism != b"CURVE" or len(body) < 7:
            return False, "no such inbox"
        return gate.decide(body[6], final)

    def _reply(self, request: list[bytes], answer: tuple[bool, str]) -> None:
        ok, why = answer
        status = b"200" if ok else b"400"
        self.sock.send_multipart(
            [*request[:2], request[2], request[3], status, why.encode(), b"", b""]
        )
