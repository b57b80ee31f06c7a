"""The heartbeat failure detector (shared/liveness.py)."""

from __future__ import annotations

import pytest

from kvstage.shared.liveness import PeerWatch


def test_a_silent_peer_is_lost_once_and_stays_lost():
    w = PeerWatch([("decode", 0), ("decode", 1)], timeout_s=2.0, now=0.0)
    w.heard(("decode", 0), 1.5)
    assert w.newly_lost(2.0) == []  # exactly the timeout: not yet
    assert w.newly_lost(2.01) == [("decode", 1)]
    assert w.newly_lost(3.0) == []  # reported once
    assert w.newly_lost(3.6) == [("decode", 0)]
    w.heard(("decode", 0), 4.0)  # too late: lost stays lost
    assert set(w.lost) == {("decode", 0), ("decode", 1)}


def test_strangers_and_old_news_do_not_count():
    w = PeerWatch([("prefill", 0)], timeout_s=1.0, now=10.0)
    w.heard(("prefill", 7), 10.5)  # not a peer
    w.heard(("prefill", 0), 9.0)  # older than what we know
    assert w.newly_lost(11.01) == [("prefill", 0)]
    with pytest.raises(ValueError):
        PeerWatch([], 0.0, 0.0)
