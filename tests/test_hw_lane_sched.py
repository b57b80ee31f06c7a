"""The write path's scheduling class (hw/rank/priority.py WritePriority, issue 13 item 2).

While a rank's loop runs, the transfer engine's own threads run in SCHED_RR 5
(KVSTAGE_WRITE_RT, below the loop's rr:10) so a write in flight is not queued behind the
rank's gathers, scatters and fills; the transport's write lanes too with
KVSTAGE_WRITE_RT_LANES=1, or with =slots only while a lane copies a batch and holds one of
the host's write slots (WriteSlots: cores - 1 flock files, never waited for);
KVSTAGE_WRITE_RT=0 keeps them all normal. A refused class
falls back to normal and says so; the loop's end restores every thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import require_engine
from test_hw import run, write_scenario
from test_hw_loop_sched import _on_thread, _policy, hw_case, run_with_loop_stats

from kvstage.hw.control.plane import LOOP_STATS_ENV
from kvstage.hw.rank.priority import (
    WRITE_RT_ENV,
    WRITE_RT_LANES_ENV,
    WritePriority,
    WriteSlots,
    write_slot_count,
)
from kvstage.run.rundir import read_summary

linux_only = pytest.mark.skipif(
    not hasattr(os, "sched_setscheduler"), reason="Linux scheduling classes"
)


def _idle_thread() -> tuple[threading.Thread, threading.Event, int]:
    """A thread that blocks until its event is set (an engine thread's stand-in)."""
    stop, ready, tid = threading.Event(), threading.Event(), []
    t = threading.Thread(
        target=lambda: (tid.append(threading.get_native_id()), ready.set(), stop.wait())
    )
    t.start()
    ready.wait()
    return t, stop, tid[0]


def _lane(prio: WritePriority) -> int:
    """A lane thread's class once it started (Transport.on_lane_start)."""
    return _on_thread(lambda: (prio.lane_started(), _policy(0))[1])


@linux_only
@pytest.mark.parametrize("lanes", [False, True])
def test_engine_threads_and_opted_in_lanes_raised_while_the_loop_runs_then_restored(
    monkeypatch, lanes
):
    monkeypatch.delenv(WRITE_RT_ENV, raising=False)  # the default class
    monkeypatch.setenv(WRITE_RT_LANES_ENV, "1" if lanes else "0")
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
        else:  # a lane keeps the normal class
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
            assert prio.lanes.startswith(
                f"normal ({spec} refused"
            ) and prio.engine_sched.startswith("normal (")
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
@pytest.mark.parametrize(
    "backend,setting,lanes_setting,expected",
    [
        ("mooncake", None, None, "rr:5 ("),  # Mooncake's workers raised
        ("mooncake", "0", None, "normal"),
        ("mooncake", None, "slots", "rr:5 ("),  # its lanes busy-wait: left normal even so
        ("nixl", None, None, "normal (left out)"),  # UCX's threads only go with the lanes
        ("nixl", None, "slots", "rr:5 per batch"),  # with each batch that holds a host slot
    ],
)
def test_hw_engine_threads_report_their_class_and_verify_every_byte(
    tmp_path, monkeypatch, backend, setting, lanes_setting, expected
):
    if lanes_setting is None:
        monkeypatch.delenv(WRITE_RT_LANES_ENV, raising=False)  # the default: normal lanes
    else:
        monkeypatch.setenv(WRITE_RT_LANES_ENV, lanes_setting)
    summary, figures = run_with_loop_stats(tmp_path, monkeypatch, WRITE_RT_ENV, setting, backend)
    lanes = {name: f["lane_sched"] for name, f in figures.items()}
    engine = {name: f["engine_sched"] for name, f in figures.items()}
    assert (
        summary["lane_sched"] == lanes and summary["engine_sched"] == engine
    )  # summary.json says it too
    jobs = summary["job_cpu"]  # what the heavy jobs cost in CPU (hw/transport/jobcpu.py)
    assert {"fill", "gather", "scatter"} <= set(jobs) and all(
        j["n"] > 0 and j["cpu_s"] > 0 for j in jobs.values()
    )
    assert ("write" in jobs) == (
        backend == "nixl"
    )  # NIXL's lane copies the bytes; Mooncake's engine does
    if any("refused" in c for c in (*engine.values(), *lanes.values())):
        pytest.skip(f"real-time scheduling refused on this host: {engine} {lanes}")
    if expected != "rr:5 per batch":
        assert set(lanes.values()) == {"normal (left out)"}, lanes
        assert all(e.startswith(expected) for e in engine.values()), engine
        return
    # the decode rank writes nothing: no batch, nothing raised
    assert engine.pop("decode0") == "normal (no batch raised)" and lanes.pop("decode0").endswith(
        "(0 raised, 0 normal)"
    )
    assert all(e.startswith(expected) for e in engine.values()), engine
    assert all(
        v.startswith(f"rr:5 per batch, {write_slot_count()} host slot") for v in lanes.values()
    ), lanes


# --- host-wide write slots (KVSTAGE_WRITE_RT_LANES=slots, WriteSlots) ---------------------


def test_write_slots_are_exclusive_per_acquire_never_wait_and_free_on_release(tmp_path):
    slots = WriteSlots(tmp_path / "slots", 2)
    slots.prepare()
    a, b = slots.acquire(), slots.acquire()  # two lanes of one process: a slot each
    assert a is not None and b is not None and a != b
    assert slots.acquire() is None  # both held: refused at once, not waited for
    assert WriteSlots(tmp_path / "slots", 2).acquire() is None  # another holder of the host
    slots.release(a)
    c = slots.acquire()
    assert c is not None and slots.acquire() is None
    for fd in (b, c):
        slots.release(fd)


def test_a_slot_held_by_another_process_is_refused_until_it_ends(tmp_path):
    slots = WriteSlots(tmp_path, 1)
    slots.prepare()
    holder = subprocess.Popen(  # flock the only slot, say so, hold it until stdin closes
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
            str(tmp_path / "slot-0"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert slots.acquire() is None
    finally:
        holder.stdin.close()
        holder.wait(10)
    fd = slots.acquire()  # the kernel dropped its lock with it
    assert fd is not None
    slots.release(fd)


def test_the_host_keeps_a_core_for_normal_threads():
    assert write_slot_count() == max(1, len(os.sched_getaffinity(0)) - 1)
    assert WriteSlots("/nonexistent", 0).count == 1


def _batch_on_lane(prio: WritePriority, engine_tid: int, inside=None) -> tuple[int, int]:
    """On a fresh lane thread, the lane's and the engine thread's classes during a batch
    (`inside()` runs there too: e.g. waiting for another lane)."""

    def lane():
        with prio.lane_batch():
            during = _policy(0), _policy(engine_tid)
            if inside is not None:
                inside()
        return during

    return _on_thread(lane)


def _slots_priority(monkeypatch, tmp_path, count: int, engine_tid: int) -> WritePriority:
    monkeypatch.setenv(WRITE_RT_LANES_ENV, "slots")
    prio = WritePriority("rr:5", WriteSlots(tmp_path, count))
    prio.engine = [engine_tid]
    prio.apply(engine_alone=False)  # NIXL: its UCX threads go with the lanes
    return prio


@linux_only
def test_slots_raise_the_lane_and_the_engine_for_each_batch_only(monkeypatch, tmp_path):
    engine, stop, tid = _idle_thread()
    try:
        prio = _slots_priority(monkeypatch, tmp_path, 1, tid)
        assert _policy(tid) == os.SCHED_OTHER  # nothing raised between batches
        lane, engine_during = _batch_on_lane(prio, tid)
        after = _policy(tid)
        if prio.lanes.startswith("normal (rr:5 refused"):  # no privilege here: said so
            assert lane == engine_during == os.SCHED_OTHER
            return
        assert lane == engine_during == os.SCHED_RR and after == os.SCHED_OTHER
        assert prio.lanes == "rr:5 per batch, 1 host slot (1 raised, 0 normal)"
        assert prio.engine_sched == "rr:5 per batch, with the lanes (1 threads, 1 batches)"
        fd = prio.slots.acquire()  # the batch gave its slot back
        assert fd is not None
        prio.slots.release(fd)
        prio.restore()
        assert (
            prio.lanes.startswith("rr:5 per batch")
            and _batch_on_lane(prio, tid) == (os.SCHED_OTHER,) * 2
        )
    finally:
        stop.set()
        engine.join()


def test_a_lane_that_finds_no_free_slot_copies_at_normal_scheduling(monkeypatch, tmp_path):
    engine, stop, tid = _idle_thread()
    try:
        prio = _slots_priority(monkeypatch, tmp_path, 1, tid)
        held = WriteSlots(tmp_path, 1).acquire()  # another rank's lane copies
        assert held is not None
        t = time.monotonic()
        assert _batch_on_lane(prio, tid) == (os.SCHED_OTHER, os.SCHED_OTHER)
        assert time.monotonic() - t < 1.0  # it did not wait for the slot
        assert prio.lanes == "rr:5 per batch, 1 host slot (0 raised, 1 normal)"
        assert prio.engine_sched == "normal (no batch raised)"
        os.close(held)
    finally:
        stop.set()
        engine.join()


@linux_only
def test_the_engine_stays_raised_until_the_last_lane_of_its_process_ends_its_batch(
    monkeypatch, tmp_path
):
    engine, stop, tid = _idle_thread()
    try:
        prio = _slots_priority(monkeypatch, tmp_path, 2, tid)
        first_in, first_out, seen = threading.Event(), threading.Event(), {}

        def second_lane():  # while the first lane's batch runs, this one's starts and ends
            first_in.set()
            first_out.wait(10)
            seen["engine after the first"] = _policy(tid)

        other = threading.Thread(target=lambda: _batch_on_lane(prio, tid, second_lane))
        other.start()
        first_in.wait(10)
        first = _batch_on_lane(prio, tid)
        first_out.set()
        other.join()
        if prio.lanes.startswith("normal ("):
            return  # real-time scheduling refused here
        assert first == (os.SCHED_RR, os.SCHED_RR)
        assert seen["engine after the first"] == os.SCHED_RR  # the other lane still copies
        assert _policy(tid) == os.SCHED_OTHER
        assert prio.lanes == "rr:5 per batch, 2 host slots (2 raised, 0 normal)"
    finally:
        stop.set()
        engine.join()


@pytest.mark.parametrize(
    "lanes_ok,spec,lanes",
    [
        (False, "rr:5", "normal (left out)"),  # Mooncake's lanes busy-wait
        (True, "0", "normal"),
    ],
)
def test_slots_leave_busy_waiting_lanes_and_an_off_class_normal(
    monkeypatch, tmp_path, lanes_ok, spec, lanes
):
    monkeypatch.setenv(WRITE_RT_LANES_ENV, "slots")
    prio = WritePriority(spec, WriteSlots(tmp_path, 1))
    prio.apply(lanes_ok=lanes_ok)
    assert _batch_on_lane(prio, threading.get_native_id())[0] == os.SCHED_OTHER
    assert prio.lanes == lanes and prio.batches_raised == prio.batches_normal == 0


@hw_case
def test_hw_slice_path_with_slot_raised_lanes_verifies_every_byte(tmp_path, monkeypatch):
    require_engine("nixl")
    stats = tmp_path / "loop"
    stats.mkdir()
    monkeypatch.setenv(LOOP_STATS_ENV, str(stats))
    monkeypatch.setenv(WRITE_RT_LANES_ENV, "slots")
    code, run_dir = run(tmp_path, "nixl", write_scenario(tmp_path, 2, 1, 8, path="slice"))
    summary = read_summary(run_dir)
    assert code == 0 and summary["requests_failed"] == 0, summary.get("errors")
    assert summary["bytes_wrong"] == 0 and summary["bytes_verified"] == summary["payload_bytes"] > 0
    lanes = {p.stem: json.loads(p.read_text())["lane_sched"] for p in stats.glob("prefill*.json")}
    assert len(lanes) == 2 and all(
        v.startswith(("rr:5 per batch, ", "normal (rr:5 refused")) for v in lanes.values()
    )
