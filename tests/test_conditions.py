"""Run conditions: the host's cores, load and the CPU share other processes took."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from kvstage.run import conditions
from kvstage.run.conditions import Sample, describe, is_loaded, loaded_warnings, measure
from kvstage.run.simrun import run_simulation
from kvstage.shared.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]


def test_measure_by_hand():
    cores = os.cpu_count()
    before = Sample(wall=100.0, busy_s=1000.0, own_s=5.0, loadavg=(0.5, 0.4, 0.3))
    # over 10 s the host was busy 0.6 x cores x 10 s; this run took 1 s of it
    after = Sample(wall=110.0, busy_s=1000.0 + 6.0 * cores, own_s=6.0, loadavg=(1.5, 0.6, 0.35))
    c = measure(before, after)
    assert c["cores"] == cores and c["wall_s"] == 10.0 and c["cpu_own_s"] == 1.0
    assert c["cpu_other_s"] == round(6.0 * cores - 1.0, 4)
    assert c["other_cpu_share"] == round((6.0 * cores - 1.0) / (10.0 * cores), 4)
    assert c["loaded"] is True and is_loaded(c)
    assert c["loadavg_before"] == [0.5, 0.4, 0.3] and c["loadavg_after"] == [1.5, 0.6, 0.35]
    quiet = measure(before, Sample(110.0, 1000.0 + 1.2, 6.0, (0.5, 0.4, 0.3)))
    assert quiet["cpu_other_s"] == 0.2 and quiet["loaded"] is False
    assert "quiet" in describe(quiet) and "LOADED" in describe(c)
    # no /proc/stat: nothing claimed
    unknown = measure(Sample(0.0, None, 0.0, None), Sample(1.0, None, 0.5, None))
    assert (
        unknown["other_cpu_share"] is None
        and unknown["loaded"] is None
        and is_loaded(unknown) is None
    )


def test_child_processes_count_as_the_runs_own():
    """A hardware run's ranks are children the launcher waits for: their CPU time is the
    run's own (os.times children), not other processes'."""
    before = conditions.sample()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass",
        ],
        check=True,
    )
    c = measure(before)
    assert c["cpu_own_s"] >= 0.45
    if c["cpu_busy_s"] is not None:
        assert c["cpu_busy_s"] >= 0.4  # the child's time shows host-wide as well


def test_no_spawn_ranks_on_this_host_are_not_others():
    """With --no-spawn the ranks are not the launcher's children: the CPU those on this
    host report for themselves is the run's own, so a quiet host is not called LOADED."""
    cores = os.cpu_count()
    before = Sample(wall=0.0, busy_s=0.0, own_s=0.0, loadavg=None)
    # the ranks kept 0.9 of the cores busy for 10 s; nothing else ran
    after = Sample(wall=10.0, busy_s=9.0 * cores, own_s=0.0, loadavg=None)
    reports = {
        "prefill0": {"hostname": "here", "cpu_s": 4.5 * cores},
        "decode0": {"hostname": "here", "cpu_s": 4.5 * cores},
        "decode1": {"hostname": "elsewhere", "cpu_s": 100.0},  # another node's kernel
    }
    mine = conditions.rank_cpu_here(reports, hostname="here")
    assert mine == 9.0 * cores
    c = measure(before, after, spawned=False, ranks_cpu_s=mine)
    assert c["cpu_other_s"] == 0.0 and c["loaded"] is False and c["cpu_ranks_here_s"] == mine
    # the same run without the ranks' own figures: every rank looks like another process
    blind = measure(before, after, spawned=False)
    assert blind["loaded"] is True
    # a spawned run's ranks are already counted through os.times(): not added twice
    assert measure(before, after, spawned=True, ranks_cpu_s=mine)["loaded"] is True


def test_forked_ranks_cpu_is_the_runs_own():
    """Ranks forked by the fork server are its children, not the launcher's: the CPU time
    it measured for them is added to the run's own, so they are not other processes."""
    cores = os.cpu_count()
    before = Sample(wall=0.0, busy_s=0.0, own_s=0.0, loadavg=None)
    after = Sample(wall=10.0, busy_s=9.0 * cores, own_s=0.0, loadavg=None)
    c = measure(before, after, forked_cpu_s=9.0 * cores)
    assert c["cpu_own_s"] == 9.0 * cores and c["cpu_forked_s"] == 9.0 * cores
    assert c["cpu_other_s"] == 0.0 and c["loaded"] is False
    assert "cpu_forked_s" not in measure(before, after) and measure(before, after)["loaded"]


def test_summary_json_holds_the_conditions(tmp_path):
    s = load_scenario(
        ROOT / "scenarios" / "llama3-8b-p4-d2.toml", overrides=["workload.requests=4"]
    )
    assert (
        run_simulation(s, out=tmp_path / "run", progress=False, console=Console(file=io.StringIO()))
        == 0
    )
    c = json.loads((tmp_path / "run" / "summary.json").read_text())["conditions"]
    assert c["cores"] == os.cpu_count()
    assert len(c["loadavg_before"]) == len(c["loadavg_after"]) == 3
    assert c["wall_s"] > 0 and c["cpu_own_s"] >= 0
    if Path("/proc/stat").exists():
        assert c["cpu_busy_s"] >= 0 and c["cpu_other_s"] >= 0 and c["other_cpu_share"] >= 0
        assert c["loaded"] == (c["other_cpu_share"] > conditions.LOADED_SHARE)


def test_only_measured_runs_are_warned_of():
    loaded = {"cores": 4, "other_cpu_share": 0.3}
    assert loaded_warnings(
        [
            ("A", "hw", loaded),
            ("B", "hw", {"other_cpu_share": 0.1}),
            ("C", "sim", loaded),
            ("D", "hw", None),
        ]
    ) == [
        "A was taken on a loaded host: other processes took 30% of the 4 cores (more than 25%); its timings "
        "measure the host as much as the transfer path"
    ]


def test_a_hw_run_whose_loops_had_no_real_time_class_is_warned_of():
    from kvstage.run.conditions import loops_realtime

    assert (
        loops_realtime({"prefill0": {"loop_sched": "rr:10"}, "decode0": {"loop_sched": "rr:10"}})
        is True
    )
    assert (
        loops_realtime(
            {
                "prefill0": {"loop_sched": "rr:10"},
                "decode0": {"loop_sched": "normal (rr:10 refused: [Errno 1] EPERM)"},
            }
        )
        is False
    )
    assert loops_realtime({}) is None
    quiet = {"cores": 2, "other_cpu_share": 0.0}
    assert (
        loaded_warnings(
            [
                ("A", "hw", {**quiet, "loops_realtime": True}),
                ("C", "sim", {"loops_realtime": False}),
            ]
        )
        == []
    )
    (w,) = loaded_warnings([("B", "hw", {**quiet, "loops_realtime": False})])
    assert w.startswith("B ran its rank loops without a real-time class") and "KVSTAGE_LOOP_RT" in w
