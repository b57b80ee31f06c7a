"""The bandwidth verdict (hw/transport/bandwidth.py): each pair's achieved GB/s (its bytes over the
time its writes were busy) against the raw ceiling its prefill measured before the
first room, and `kvstage hw --target F` ending with a PASS/FAIL line and the matching
exit code. The two-namespace run (test_netns.py) shows the same across a veth."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from conftest import require_engine
from test_hw import write_scenario
from test_outcome import kvstage_cmd

from kvstage.hw.probes.baseline import TOOLS, parse_ib_write_bw, parse_teb
from kvstage.hw.transport.bandwidth import (
    PROBE_BYTES,
    PROBE_MIN_BYTES,
    PairFigure,
    achieved_by_pair,
    bandwidth_summary,
    busy_seconds,
    limit_lines,
    probe_bytes,
    verdict,
)
from kvstage.shared.trace import TraceRecord


def _write(
    rank: int, peer: int, start: float, end: float, nbytes: int, phase: str = "write"
) -> TraceRecord:
    return TraceRecord(
        room=0,
        chunk=0,
        role="prefill",
        rank=rank,
        phase=phase,
        start=start,
        end=end,
        peer=peer,
        bytes=nbytes,
    )


def test_busy_time_is_the_union_of_the_write_intervals():
    assert busy_seconds([]) == 0.0
    assert (
        busy_seconds([(0.0, 1.0), (0.5, 1.5), (3.0, 4.0)]) == 2.5
    )  # overlap counted once, gap not at all
    assert busy_seconds([(2.0, 3.0), (0.0, 1.0)]) == 2.0
    records = [
        _write(0, 1, 0.0, 1.0, 2_000_000_000),
        _write(0, 1, 0.5, 2.0, 1_000_000_000),
        _write(0, 1, 10.0, 11.0, 1_000_000_000, "slice_write"),
        _write(1, 1, 0.0, 4.0, 1_000_000_000),
    ]
    got = achieved_by_pair(records)
    assert got[(0, 1)] == {"bytes": 4_000_000_000, "busy_s": 3.0, "gbs": 4 / 3}
    assert got[(1, 1)]["gbs"] == 0.25


def test_the_probe_writes_a_large_block_or_nothing():
    assert probe_bytes(1 << 40) == PROBE_BYTES
    assert probe_bytes(16 << 20) == 16 << 20
    assert probe_bytes(PROBE_MIN_BYTES - 1) == 0  # a tiny write measures latency, not bandwidth


def test_the_verdict_names_the_lowest_pair():
    figures = [PairFigure(0, 0, 4.0, 5.0, 1), PairFigure(1, 0, 2.0, 5.0, 1)]
    assert verdict(figures, 0.3) == (
        True,
        "bandwidth: PASS: every pair reached at least 30% of its ceiling; "
        "lowest prefill1->decode0 2.00 of 5.00 GB/s (40%)",
    )
    passed, line = verdict(figures, 0.5)
    assert not passed and line.startswith(
        "bandwidth: FAIL: 1 of 2 pair(s) below 50% of their ceiling"
    )
    passed, line = verdict([PairFigure(0, 0, 4.0, None, 1)], 0.5)
    assert not passed and "no ceiling measured for 1 pair(s) (prefill0->decode0)" in line
    assert verdict([], 0.5)[0] is False


@pytest.mark.slow
def test_kvstage_hw_reports_pairs_against_their_ceiling_and_exits_by_the_verdict(tmp_path):
    require_engine("nixl")
    scenario = write_scenario(tmp_path, 2, 1, 8, requests=3)
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            *kvstage_cmd(),
            "hw",
            str(scenario),
            "--backend",
            "nixl",
            "--out",
            str(out),
            "--target",
            "1.0",
            "--timeout",
            "120",
            "--baseline",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = " ".join((proc.stdout + proc.stderr).split())
    _check_baselines(proc.stdout, out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bytes_wrong"] == 0 and summary["requests_done"] == 3, text[-2000:]
    pairs = summary["bandwidth"]["pairs"]
    assert [(p["prefill"], p["decode"]) for p in pairs] == [
        ("prefill0", "decode0"),
        ("prefill1", "decode0"),
    ]
    for p in pairs:  # every pair measured its ceiling in this run and wrote its rooms' bytes
        assert p["ceiling_gbs"] > 0 and p["achieved_gbs"] > 0 and p["bytes"] > 0, p
        assert f"{p['prefill']} -> {p['decode']}" in text
    # the probe's writes are not the run's: the run's request count is its rooms' alone
    assert summary["transfer_requests_posted"] == summary["transfer_requests"]["total"]
    passed = all(p["ratio"] >= 1.0 for p in pairs)
    assert ("bandwidth: PASS" in text) is passed and ("bandwidth: FAIL" in text) is not passed
    assert proc.returncode == (0 if passed else 1), text[-2000:]
    assert (out / "environment.json").exists()
    env_text = (out / "environment.json").read_text()
    assert json.loads(env_text)["versions"]["nixl"]
    assert (out / "run.secret").read_text().strip() not in env_text  # never the secret


def _reports(link_gbs, tx_bytes):
    """Two hosts: prefill0 on A writes to decode0 on B; A's NIC counters say `tx_bytes`."""
    aff = {"nic": "mlx5_0", "link_gbs": link_gbs}
    return {
        "prefill0": {
            "host": "A",
            "affinity": aff,
            "ceiling": {"decode0": {"gbs": 40.0}},
            "nic": {"mlx5_0/1": {"tx_bytes": tx_bytes, "rx_bytes": 10}},
        },
        "decode0": {"host": "B", "affinity": aff, "nic": {}},
    }


def test_the_nic_or_the_engine_is_named_as_the_limit() -> None:
    # 4 GB in two busy seconds (a 1 s gap between the writes does not count): 2 GB/s achieved
    records = [_write(0, 0, 0.0, 1.0, 2 * 10**9), _write(0, 0, 2.0, 3.0, 2 * 10**9)]
    # a 2.5 GB/s link carrying 4 GB in 2 busy seconds: 80% of the link, the NIC is the limit
    bw = bandwidth_summary(records, _reports(2.5, 4 * 10**9))
    lim = bw["limits"]["A"]
    assert (lim["device"], lim["busy_s"], lim["nic_gbs"], lim["limit"]) == (
        "mlx5_0/1",
        2.0,
        2.0,
        "nic",
    )
    assert lim["lowest_of_ceiling"] == 0.05  # 2 of the 40 GB/s ceiling
    line = limit_lines(bw["limits"])[0]
    assert (
        line.startswith("limit on A: the NIC: mlx5_0/1 carried 2.00 GB/s")
        and "80% of its 2.50 GB/s link" in line
    )
    # the same bytes on a 50 GB/s link: 4% of it, so the engine was the limit
    bw = bandwidth_summary(records, _reports(50.0, 4 * 10**9))
    assert bw["limits"]["A"]["limit"] == "engine"
    assert "the engine, not the NIC" in limit_lines(bw["limits"])[0]
    # a veth: no link rate, said so; the engine (and the CPUs copying for it) is the limit
    bw = bandwidth_summary(records, _reports(None, 4 * 10**9))
    assert bw["limits"]["A"]["limit"] == "engine" and bw["limits"]["A"]["link_gbs"] is None
    assert "no link rate" in limit_lines(bw["limits"])[0]
    assert bw["unit"].startswith("GB/s")


def _check_baselines(stdout: str, run_dir) -> None:
    """`--baseline`: one line per tool; an absent one says so, a present one that can run
    on this host (Mooncake's transfer_engine_bench, installed with its wheel) gives GB/s
    beside the run's lowest pair; every entry is in baseline.json. The limit line and
    the affinity table come before."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("baseline ")]
    assert [ln.split()[1].rstrip(":") for ln in lines] == list(TOOLS), stdout[-2000:]
    entries = {e["tool"]: e for e in json.loads((run_dir / "baseline.json").read_text())}
    for tool, line in zip(TOOLS, lines, strict=True):
        if shutil.which(tool) is None:
            assert line == f"baseline {tool}: not on PATH: no baseline from it"
            assert entries[tool]["gbs"] is None
    if shutil.which("transfer_engine_bench") is not None:
        teb = entries["transfer_engine_bench"]
        assert teb["gbs"] and teb["gbs"] > 0, teb
        assert "GB/s" in lines[2] and "kvstage: lowest pair" in lines[2], lines[2]
    assert "limit on 127.0.0.1: the engine, not the NIC" in stdout, stdout[-2000:]
    assert stdout.index("rank       host") < stdout.index("pair ") < stdout.index("baseline ")


def test_baseline_outputs_parse() -> None:
    # perftest's result row with --report_gbits: #bytes #iterations peak average MsgRate
    row = " 8388608    5000           391.20             390.80               0.005823\n"
    assert parse_ib_write_bw(" #bytes #iterations BW peak[Gb/sec]\n" + row) == 390.80 / 8
    assert parse_ib_write_bw("Couldn't connect\n") is None
    line = "I1202 transfer_engine_bench.cpp:569] Test completed: duration 2.02, batch count 87, throughput 0.72 GB/s"
    assert parse_teb(line) == 0.72 and parse_teb("") is None
