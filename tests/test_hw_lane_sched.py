"""The write path's scheduling class (hw/priority.py WritePriority, issue 13 item 2).

While a rank's loop runs, the transfer engine's own threads run in SCHED_RR 5
(KVSTAGE_WRITE_RT, below the loop's rr:10) so a write in flight is not queued behind the
rank's gathers, scatters and fills; the transport's write lanes too with
KVSTAGE_WRITE_RT_LANES=1; KVSTAGE_WRITE_RT=0 keeps them all normal. A refused class
falls back to normal and says so; the loop's end restores every thread.
"""

from __future__ import annotations

import os
import threading

import pytest
from test_hw_loop_sched import _on_thread, _policy, hw_case, run_with_loop_stats

from kvstage.hw.priority import WRITE_RT_ENV, WRITE_RT_LANES_ENV, WritePriority

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling classes")


def _idle_thread() -> tuple[threading.Thread, threading.Event, int]:
    """A thread that blocks until its event is set (an engine thread's stand-in)."""
    stop, ready, tid = threading.Event(), threading.Event(), []
    t = threading.Thread(target=lambda: (tid.append(threading.get_native_id()), ready.set(), stop.wait()))
    t.start()
    ready.wait()
    return t, stop, tid[0]


def _lane(prio: WritePriority) -> int:
    """A lane thread's class once it started (Transport.on_lane_start)."""
    return _on_thread(lambda: (prio.lane_started(), _policy(0))[1])


@linux_only
@pytest.mark.parametrize("lanes", [False, True])
def test_engine_threads_and_opted_in_lanes_raised_while_the_loop_runs_then_restored(monkeypatch, lanes):
    monkeypatch.delenv(WRITE_RT_ENV, raising=False)  # the default class
    if lanes:
        monkeypatch.setenv(WRITE_RT_LANES_ENV, "1")
    else:
        monkeypatch.delenv(WRITE_RT_LANES_ENV, raising=False)
    engine, stop, tid = _idle_thread()
    try:
        prio = WritePriority()
        prio.engine = [tid]
        before = _lane(prio)  # a lane started before the loop: left alone
        prio.apply()
        lane = _lane(prio)
        engine_during = _policy(tid)
        prio.restore()
        if prio.engine_sched.startswith("normal"):  # refused here (no privilege): said so
            assert "refused" in prio.engine_sched and engine_during == os.SCHED_OTHER
            return
        assert before == os.SCHED_OTHER
        assert prio.engine_sched == "rr:5 (1 of 1 threads)" and engine_during == os.SCHED_RR
        if lanes:
            assert prio.lanes == "rr:5" and lane == os.SCHED_RR
        else:  # by default a lane keeps the normal class (the interpreter lock: hw/priority.py)
            assert prio.lanes == "normal (left out)" and lane == os.SCHED_OTHER
        assert _policy(tid) == os.SCHED_OTHER  # restored with the loop's end
    finally:
        stop.set()
        engine.join()


@pytest.mark.parametrize("spec", ["0", "bogus:3", "rr:1000"])
def test_off_or_refused_write_classes_keep_normal_scheduling(monkeypatch, spec):
    monkeypatch.setenv(WRITE_RT_LANES_ENV, "1")
    engine, stop, tid = _idle_thread()
    try:
        prio = WritePriority(spec)
        prio.engine = [tid]
        prio.apply()
        lane = _lane(prio)
        assert lane == os.SCHED_OTHER and _policy(tid) == os.SCHED_OTHER
        if spec == "0":
            assert prio.lanes == prio.engine_sched == "normal"
        else:
            assert prio.lanes.startswith(f"normal ({spec} refused") and prio.engine_sched.startswith("normal (")
    finally:
        stop.set()
        engine.join()


def test_spinning_engine_threads_and_lanes_stay_normal(monkeypatch):
    monkeypatch.setenv(WRITE_RT_LANES_ENV, "1")
    engine, stop, tid = _idle_thread()
    try:
        prio = WritePriority("rr:5")
        prio.engine = [tid]
        # NIXL with KVSTAGE_NIXL_PROGRESS_DELAY_US=0; Mooncake's lanes
        prio.apply(engine_ok=False, lanes_ok=False)
        assert prio.engine_sched == "normal (left out)" and _policy(tid) == os.SCHED_OTHER
        assert _lane(prio) == os.SCHED_OTHER and prio.lanes == "normal (left out)"
        prio.restore()
    finally:
        stop.set()
        engine.join()


@linux_only
@pytest.mark.parametrize("lanes", [False, True])
def test_engine_threads_that_share_a_lock_with_the_lanes_go_only_with_them(monkeypatch, lanes):
    monkeypatch.setenv(WRITE_RT_LANES_ENV, "1" if lanes else "0")
    engine, stop, tid = _idle_thread()
    try:
        prio = WritePriority("rr:5")
        prio.engine = [tid]
        prio.apply(engine_alone=False)  # NIXL: UCX's progress thread and the lanes
        during = _policy(tid)
        prio.restore()
        if prio.engine_sched.startswith("normal (rr:5 refused"):
            return  # no privilege here
        assert during == (os.SCHED_RR if lanes else os.SCHED_OTHER)
        assert prio.engine_sched == ("rr:5 (1 of 1 threads)" if lanes else "normal (left out)")
    finally:
        stop.set()
        engine.join()


@hw_case
@pytest.mark.parametrize("backend,setting,expected", [
    ("mooncake", None, "rr:5 ("),  # Mooncake's workers raised
    ("mooncake", "0", "normal"),
    ("nixl", None, "normal (left out)"),  # UCX's threads only go with the lanes
])
def test_hw_engine_threads_report_their_class_and_verify_every_byte(tmp_path, monkeypatch, backend, setting, expected):
    monkeypatch.delenv(WRITE_RT_LANES_ENV, raising=False)
    _, figures = run_with_loop_stats(tmp_path, monkeypatch, WRITE_RT_ENV, setting, backend)
    lanes = {name: f["lane_sched"] for name, f in figures.items()}
    engine = {name: f["engine_sched"] for name, f in figures.items()}
    assert set(lanes.values()) == {"normal (left out)"}, lanes  # by default, and where off
    if expected == "rr:5 (" and any(e.startswith("normal (") for e in engine.values()):
        pytest.skip(f"real-time scheduling refused on this host: {engine}")
    assert all(e.startswith(expected) for e in engine.values()), engine
