"""The harness the calibration probes share (hw/probes/harness.py): its reaper asks each
child to stop, waits for it, kills one that does not go, and closes every pipe."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

from kvstage.hw.probes import harness


def _polite(conn) -> None:
    conn.send(("ready",))
    conn.recv()  # the goodbye: it goes


def _stubborn(conn) -> None:
    conn.send(("ready",))
    conn.send(("got", conn.recv()))
    while True:  # hangs: only a kill ends it
        time.sleep(1)


def _started(target) -> tuple:
    """A spawned child running `target`, once it said it is ready; the parent's pipe end."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,), daemon=True)
    proc.start()
    child.close()
    assert parent.poll(120), "the child did not start within 120 s"
    assert parent.recv() == ("ready",)
    return proc, parent


def test_the_reaper_says_goodbye_and_waits_for_a_child_that_goes():
    proc, conn = _started(_polite)
    harness.reap([proc], {"polite": conn}, {"polite": ("bye",)})
    assert proc.exitcode == 0 and conn.closed


def test_the_reaper_kills_a_child_that_hangs(monkeypatch):
    monkeypatch.setattr(harness, "REAP_JOIN_S", 0.5)
    proc, conn = _started(_stubborn)
    harness.reap([proc], {"stubborn": conn}, {"stubborn": ("run", "stop")})
    assert proc.exitcode == -signal.SIGKILL and conn.closed


def test_a_goodbye_that_cannot_be_sent_stops_nothing_else():
    proc, conn = _started(_polite)
    gone, _ = mp.get_context("spawn").Pipe()
    gone.close()  # sending to it raises OSError: skipped
    harness.reap([proc], {"gone": gone, "polite": conn}, {"gone": ("bye",), "polite": ("bye",)})
    assert proc.exitcode == 0 and conn.closed
