"""Capabilities: the nonces a decode rank hands its writers, which they must echo.

The MACs of hardware mode (hw/control/keys.py) prove which rank sent a frame. A nonce proves
more: that the sender was *given* what it names. A decode rank hands out two kinds,
each drawn for one writer (a prefill rank) and never sent to another:

- a **room nonce** for (room, writer), in BOOTSTRAP (and in the decode's ABORT of the
  room). WRITER_DONE and ABORT from the writer echo it, and CHUNK_READY does on the
  slice path, where no region is granted;
- a **grant nonce** for (room, chunk, writer, region), in STAGING_RSP. CHUNK_READY of
  that chunk echoes it.

A message from a writer that does not echo the right nonce is dropped and counted,
changing nothing: a frame that names a region, or a room, its sender was not handed
cannot complete a chunk, finish a room, fail it, or release its quarantined memory.
The decode answers a writer's unproven WRITER_DONE or ABORT about an open room with
its BOOTSTRAP, so an honest writer that failed or finished before the BOOTSTRAP
reached it proves itself one message later.

Nonces are not stored: each is a keyed BLAKE2b (RFC 7693) of what it is for, under a
key the decode rank alone holds (hardware mode: 32 random bytes per process; the
simulator: a fixed key per rank, so runs stay deterministic). So a decode checks a
nonce of a room it has long forgotten as cheaply as one of a live room, and nothing
grows with the run. Nonces are 63 bits, never 0 (0 is "none": a writer that has not
been handed one).
"""

from __future__ import annotations

import hashlib
import struct

_FIELDS = struct.Struct("!Bqqqq")
_ROOM, _GRANT = 1, 2
NONCE_BITS = 63


class Capabilities:
    """The nonces of one decode rank, derived from its key."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or not 16 <= len(key) <= 64:
            raise ValueError(f"a capability key is 16 to 64 bytes, got {key!r:.40}")
        self._key = key

    @classmethod
    def for_simulation(cls, rank: int) -> Capabilities:
        """A fixed key per decode rank: simulated runs stay the same run to run."""
        return cls(hashlib.blake2b(b"kvstage simulated decode %d" % rank, digest_size=32).digest())

    def _nonce(self, kind: int, a: int, b: int, c: int, d: int) -> int:
        digest = hashlib.blake2b(
            _FIELDS.pack(kind, a, b, c, d), key=self._key, digest_size=8
        ).digest()
        return (int.from_bytes(digest, "big") >> (64 - NONCE_BITS)) or 1

    def room(self, room: int, prefill_rank: int) -> int:
        """The nonce of `room` for writer `prefill_rank` (BOOTSTRAP, ABORT, WRITER_DONE)."""
        return self._nonce(_ROOM, room, prefill_rank, 0, 0)

    def grant(self, room: int, chunk: int, prefill_rank: int, region: int) -> int:
        """The nonce of the region `region` (the ring's allocation id; -1 for an
        OVERSIZED answer) granted for `chunk` of `room` to `prefill_rank`."""
        return self._nonce(_GRANT, room, chunk, prefill_rank, region)
