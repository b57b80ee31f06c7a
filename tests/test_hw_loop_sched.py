"""The rank loop's scheduling class (hw/rank/priority.py LoopPriority, issue 13).

A hardware rank raises its loop thread and its ZMQ I/O threads to real-time round robin
(KVSTAGE_LOOP_RT, default rr:10) so control messages are not queued behind the rank's
copy and compute threads; KVSTAGE_LOOP_RT=0 keeps normal scheduling. Refused classes fall
back to normal scheduling and say so; threads the loop starts later never inherit it.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import zmq
from conftest import require_engine
from test_hw import run, write_scenario

from kvstage.hw.control.plane import LOOP_STATS_ENV
from kvstage.hw.rank.priority import LOOP_RT_ENV, LoopPriority, thread_ids
from kvstage.run.rundir import read_summary

linux_only = pytest.mark.skipif(
    not hasattr(os, "sched_setscheduler"), reason="Linux scheduling classes"
)


def _policy(tid: int) -> int:
    return os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK


def _on_thread(fn):
    """fn() on a fresh thread (the class it sets must not stay on pytest's thread)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@linux_only
def test_rr_raises_the_loop_and_zmq_io_threads_not_its_children_and_restores(monkeypatch):
    monkeypatch.delenv(LOOP_RT_ENV, raising=False)  # the default
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)  # starts this context's I/O thread
    try:
        io = thread_ids("ZMQbg/IO")
        for _ in range(100):  # the I/O thread names itself once it runs
            if io:
                break
            time.sleep(0.01)
            io = thread_ids("ZMQbg/IO")
        assert io, "no ZMQbg/IO thread found"

        def loop():
            prio = LoopPriority()
            got = prio.apply()
            me = _policy(0)
            child = _on_thread(lambda: _policy(0))  # a worker the loop starts later
            io_during = {_policy(t) for t in io}
            prio.restore()
            return got, me, child, io_during, _policy(0), {_policy(t) for t in io}

        got, me, child, io_during, me_after, io_after = _on_thread(loop)
        if got.startswith("normal"):  # refused here (no privilege): said so, nothing raised
            assert "refused" in got and me == os.SCHED_OTHER
            return
        assert got == "rr:10"
        assert me == os.SCHED_RR and io_during == {os.SCHED_RR}
        assert child == os.SCHED_OTHER  # SCHED_RESET_ON_FORK: workers do not inherit it
        assert me_after == os.SCHED_OTHER and io_after == {os.SCHED_OTHER}
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("spec", ["0", "off", "bogus:3", "rr:x", "rr:1000"])
def test_off_or_unusable_specs_keep_normal_scheduling(spec):
    got = _on_thread(
        lambda: (LoopPriority(spec).apply(), os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK)
    )
    assert (
        got[0] == "normal" if spec in ("0", "off") else got[0].startswith(f"normal ({spec} refused")
    )
    assert got[1] == os.SCHED_OTHER


def hw_case(fn):
    """A test that runs real ranks on this host (Linux scheduling classes, minutes)."""
    return pytest.mark.hw(pytest.mark.timeout(420)(linux_only(fn)))


def run_with_loop_stats(
    tmp_path, monkeypatch, env: str, setting: str | None, backend: str = "nixl"
) -> tuple[dict, dict[str, dict]]:
    """A P2->D1 hardware run with `env` set to `setting` (None: unset, the default) in the
    ranks: its summary (every byte verified) and each rank's loop figures."""
    require_engine(backend)
    stats = tmp_path / "loop"
    stats.mkdir()
    monkeypatch.setenv(LOOP_STATS_ENV, str(stats))  # the spawned ranks inherit both
    if setting is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, setting)
    code, run_dir = run(tmp_path, backend, write_scenario(tmp_path, 2, 1, 8))
    summary = read_summary(run_dir)
    assert code == 0, summary.get("errors")
    assert (
        summary["requests_failed"] == 0
        and summary["bytes_wrong"] == 0
        and summary["bytes_verified"] > 0
    )
    figures = {p.stem: json.loads(p.read_text()) for p in stats.glob("*.json")}
    assert sorted(figures) == ["decode0", "prefill0", "prefill1"]
    return summary, figures


@hw_case
@pytest.mark.parametrize("setting,expected", [(None, "rr:10"), ("0", "normal")])
def test_hw_ranks_report_their_loop_class_and_verify_every_byte(
    tmp_path, monkeypatch, setting, expected
):
    summary, figures = run_with_loop_stats(tmp_path, monkeypatch, LOOP_RT_ENV, setting)
    classes = {name: f["loop_sched"] for name, f in figures.items()}
    assert summary["loop_sched"] == classes  # the run records the class each loop got
    if expected == "rr:10" and any(c.startswith("normal (") for c in classes.values()):
        pytest.skip(f"real-time scheduling refused on this host: {classes}")
    assert set(classes.values()) == {expected}
