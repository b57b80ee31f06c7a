"""Who is still there: a failure detector over heartbeats, pure (the driver passes `now`).

A hardware rank tells its peers it is alive a few times a second (HEARTBEAT, and any
other message counts too); a peer silent for `timeout_s` is lost, reported once, and
the rank's runtime gets PeerLost for it: the peer's rooms fail with that reason while
the rank keeps serving the others. The simulator detects a dead rank after the same
PEER_TIMEOUT_S. A lost prefill rank that restarts and rejoins the run (the rendezvous
tells its peers) is watched again (`rejoined`): PeerRejoined, its new incarnation
serves the rooms that had not arrived yet.
"""

from __future__ import annotations

from collections.abc import Iterable

Peer = tuple[str, int]  # (role, rank)

# A rank tells its peers it is alive this often; a peer silent for PEER_TIMEOUT_S is
# lost. The timeout is long against the beat so that a rank descheduled for a moment
# on a loaded host is not declared dead. The simulator detects a killed rank after the
# same timeout, so both modes fail the same rooms for the same reason.
HEARTBEAT_S = 0.2
PEER_TIMEOUT_S = 3.0


class PeerWatch:
    def __init__(self, peers: Iterable[Peer], timeout_s: float, now: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._last: dict[Peer, float] = {p: now for p in peers}
        self.lost: dict[Peer, float] = {}  # peer -> when it was declared lost

    def __contains__(self, peer: Peer) -> bool:
        """Whether `peer` is one of the watched peers."""
        return peer in self._last

    def heard(self, peer: Peer, now: float) -> None:
        """`peer` said something (a heartbeat or any message). A lost peer stays lost
        (until it rejoins: a late frame of its old process does not revive it)."""
        if peer in self._last and peer not in self.lost and now > self._last[peer]:
            self._last[peer] = now

    def newly_lost(self, now: float) -> list[Peer]:
        """Peers silent for longer than the timeout, each reported once."""
        gone = [p for p, t in self._last.items() if p not in self.lost and now - t > self.timeout_s]
        for p in gone:
            self.lost[p] = now
        return gone

    def rejoined(self, peer: Peer, now: float) -> None:
        """`peer` came back as a new incarnation (a restarted rank): watched again, as
        if just heard from."""
        if peer in self._last:
            self.lost.pop(peer, None)
            self._last[peer] = max(self._last[peer], now)

    def silent_for(self, peer: Peer, now: float) -> float:
        return now - self._last[peer]
