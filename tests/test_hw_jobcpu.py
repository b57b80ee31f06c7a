"""A rank's job CPU totals (hw/transport/jobcpu.py): per kind, the count, the CPU of the thread that
ran each job, its wall time and bytes; summed over ranks for summary.json job_cpu."""

from __future__ import annotations

import threading
import time

import pytest

from kvstage.hw.transport.jobcpu import JobCpu, merge


def _spin(seconds: float) -> int:
    """Burn `seconds` of this thread's CPU (not of wall time: on a loaded host a
    wall-clock spin may get only a fraction of a core)."""
    end, x = time.thread_time() + seconds, 0
    while time.thread_time() < end:
        x += 1
    return x


def test_a_job_counts_its_cpu_and_its_wall_time_apart():
    cpu = JobCpu()
    busy = cpu.wrap("gather", _spin, 1000)
    idle = cpu.wrap("fill", time.sleep, 10)
    t = threading.Thread(target=lambda: (busy(0.05), idle(0.05)))  # on another thread
    t.start()
    t.join()
    got = cpu.to_wire()
    assert got["gather"]["n"] == 1 and got["gather"]["bytes"] == 1000
    assert got["gather"]["cpu_s"] > 0.02 and got["gather"]["wall_s"] >= 0.05
    assert got["fill"]["cpu_s"] < 0.02 < 0.05 <= got["fill"]["wall_s"]  # asleep: no CPU


def test_a_failing_job_still_counts_and_raises():
    cpu = JobCpu()

    def boom() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError):
        cpu.wrap("write", boom, 5)()
    assert cpu.to_wire()["write"]["n"] == 1


def test_merge_sums_the_ranks_per_kind():
    a = {"fill": {"n": 2, "cpu_s": 1.0, "wall_s": 2.0, "bytes": 10}}
    b = {
        "fill": {"n": 1, "cpu_s": 0.5, "wall_s": 1.0, "bytes": 5},
        "scatter": {"n": 1, "cpu_s": 0.1, "wall_s": 0.2, "bytes": 3},
    }
    got = merge([a, b, {}])
    assert got["fill"] == {"n": 3, "cpu_s": 1.5, "wall_s": 3.0, "bytes": 15}
    assert got["scatter"]["n"] == 1
