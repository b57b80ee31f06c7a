"""Who may speak for whom: each rank's key pair, and the keys its frames are signed with.

The run secret alone proves only that a frame comes from *some* holder of it. So
every control plane also draws an X25519 key pair when it starts; its public half
travels in the rank's hello (hw/control/rendezvous.py `RankInfo.key`), next to its name and
incarnation. The key of frames from A to B is

    HKDF-SHA256(ikm = X25519(A, B), salt = run secret,
                info = "kvstage control v3" | A's identity | B's identity)

with an identity being (name, incarnation, public key). Only A and B can compute the
shared X25519 secret, so a frame's MAC proves which rank sent it and to which rank:
another rank, or anyone else who holds the run secret, can neither make nor reuse it
(a frame sent to one rank is worthless at another), and a restarted rank (a new
incarnation and key pair) cannot be spoken for with its predecessor's frames. The
salt keeps a process without the run secret from talking at all.

Before any of that, a connection itself is authenticated: every socket that listens
(a rank's control inbox, the rendezvous) is a ZMQ CURVE server (RFC 26) whose key
pair is derived from the run secret (`curve_server_keys`), and every connecting socket
a CURVE client of it. A process without the run secret cannot finish the handshake, so
ZMQ buffers not one byte of what it sends (bounded before authenticated).

A writer's blocks are checked with a key of the pair too (transfer.verify_writes =
"checksum"): `write_key` derives it from the pair key of writer -> decode, and
`block_checksum` is keyed BLAKE2b over the block, salted with (room, chunk). Only the
writer and its decode hold the key: bytes that reached the decode's staging ring any
other way (an engine's open port, a write into the wrong region, a fenced writer's
late write) fail the check, so the decode never scatters them. BLAKE2b, not CRC32C or
xxhash: those are not MACs (a CRC is linear, so a writer of known data can fix up any
change it makes whatever the key).

The rendezvous cannot use pair keys (a rank knows its address, not a key): a rank's
messages to it are signed with `rank_key`, HKDF of the rank's own credential
(hw/control/credentials.py), salted with the run secret, over the rank's name and
incarnation, and carry a sequence number (hw/control/rendezvous.py refuses replays).
The run secret alone signs only for names outside the run (a tool's own).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PUBLIC_KEY_BYTES = 32  # an X25519 public key (RFC 7748)
MAX_NAME_BYTES = 64  # a rank's name on the wire ("prefill12", "decode3"; tools' own names)
_PAIR = b"kvstage control v3"
_RANK = b"kvstage rendezvous v2"
_CURVE = b"kvstage curve server v1"
_WRITE = b"kvstage write checksum v1"
CHECKSUM_MASK = (1 << 63) - 1  # a CHUNK_READY's checksum field holds 63 bits (shared/protocol.py)


def _hkdf(secret: bytes, info: bytes, ikm: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=secret, info=info).derive(ikm)


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(2, "big") + data


@dataclass(frozen=True)
class Identity:
    """A control plane as its peers know it: name, incarnation, X25519 public key."""

    name: str
    incarnation: int
    public: bytes

    def __post_init__(self) -> None:
        if len(self.public) != PUBLIC_KEY_BYTES:
            raise ValueError(
                f"public key of {len(self.public)} bytes (an X25519 key has {PUBLIC_KEY_BYTES})"
            )
        if not 0 < len(self.name.encode()) <= MAX_NAME_BYTES:
            raise ValueError(f"name {self.name[:80]!r}: 1 to {MAX_NAME_BYTES} bytes allowed")

    def label(self) -> bytes:
        return (
            _field(self.name.encode()) + self.incarnation.to_bytes(8, "big") + _field(self.public)
        )


class KeyPair:
    """One control plane's X25519 key pair (drawn fresh: never stored, never sent)."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw()

    def curve(self) -> tuple[bytes, bytes]:
        """(public, secret) raw keys of this pair as a CURVE client's (its sockets
        connect with the key its peers know from the rank table: hw/control/zap.py)."""
        return self.public, self._private.private_bytes_raw()

    def pair_key(self, secret: bytes, sender: Identity, receiver: Identity) -> bytes:
        """The key of frames from `sender` to `receiver`, one of which holds this pair."""
        if sender.public == self.public:
            peer = receiver
        elif receiver.public == self.public:
            peer = sender
        else:
            raise ValueError("neither end of the pair holds this key pair")
        shared = self._private.exchange(X25519PublicKey.from_public_bytes(peer.public))
        return _hkdf(secret, _PAIR + sender.label() + receiver.label(), shared)


def rank_key(
    secret: bytes, direction: bytes, name: str, incarnation: int, credential: bytes = b""
) -> bytes:
    """The key of rendezvous messages of rank `name`'s `incarnation` in `direction`:
    under the run secret and, for a rank of the run, its own `credential`
    (hw/control/credentials.py; a tool that holds only the run secret signs for its own
    name with none)."""
    info = _RANK + _field(direction) + _field(name.encode()) + incarnation.to_bytes(8, "big")
    return _hkdf(secret, info, credential)


def curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) raw 32-byte Curve25519 keys of every listening socket of the run:
    a function of the run secret, so only its holders can connect."""
    private = X25519PrivateKey.from_private_bytes(_hkdf(secret, _CURVE, b""))
    return private.public_key().public_bytes_raw(), private.private_bytes_raw()


def write_key(pair_key: bytes) -> bytes:
    """The key of a writer's block checksums, from the pair key of writer -> decode."""
    return _hkdf(pair_key, _WRITE, b"")


def block_checksum(key: bytes, room: int, chunk: int, data) -> int:
    """Keyed BLAKE2b (RFC 7693) of one writer block (any buffer: bytes, a numpy array),
    bound to its room and chunk: 63 bits, never 0 (0 means "no checksum")."""
    salt = struct.pack("!QQ", room, chunk)
    digest = hashlib.blake2b(data, digest_size=8, key=key, salt=salt).digest()
    return (int.from_bytes(digest, "big") & CHECKSUM_MASK) or 1
