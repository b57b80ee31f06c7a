"""What a run's exit code and console say: failed rooms against [expect], grouped by
reason; and a bad trace CSV refused when the scenario loads, by every command."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import require_engine
from typer.testing import CliRunner

from kvstage.cli.main import app
from kvstage.run.expect import (
    GROUPS_SHOWN,
    format_failure_groups,
    group_failures,
    reason_pattern,
)
from kvstage.run.summary import run_summary
from kvstage.shared.runtime import RankResult
from kvstage.shared.scenario import dumps_toml, load_scenario

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ROOT / "scenarios" / "faults"
LOST = FAULTS / "lost-chunk-ready.toml"
ABORT = FAULTS / "abort-mid-write.toml"
# Fault scenarios whose [expect] says which rooms fail, in simulation.
FAILING = [p for p in sorted(FAULTS.glob("*.toml")) if load_scenario(p).expect.failed_rooms]
WIDE = {"COLUMNS": "1000"}  # no wrapped lines in the captured console


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=WIDE)


def kvstage_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "kvstage"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kvstage.cli"]


def without_expect(path: Path, tmp_path: Path) -> Path:
    """A copy of the scenario file without its [expect] table."""
    data = tomllib.loads(path.read_text())
    data.pop("expect", None)
    copy = tmp_path / f"{path.stem}-no-expect.toml"
    copy.write_text(dumps_toml(data))
    return copy


# --------------------------------------------------------------------------- grouping


def test_reasons_that_differ_in_numbers_group_together():
    a = "decode rank 0: room 4 timed out after 3.0s waiting for CHUNK_READY from chunk 0: prefill [1]"
    b = "decode rank 1: room 9 timed out after 3.0s waiting for CHUNK_READY from chunk 1: prefill [0, 3]"
    assert reason_pattern(a) == reason_pattern(b)
    assert reason_pattern(a) != reason_pattern("fault injection: aborted while scattering")
    groups = group_failures({9: b, 4: a, 2: "fault injection: aborted while scattering"})
    assert [(g.rooms, g.same) for g in groups] == [([4, 9], False), ([2], True)]
    lines = format_failure_groups({9: b, 4: a, 2: "fault injection: aborted while scattering"})
    assert lines[0] == "3 room(s) failed, by reason:"
    assert lines[1].startswith("  2 rooms (4, 9): decode rank #: room # timed out")
    assert lines[2] == f"      e.g. room 4: {a}"
    assert lines[3] == "  1 room (2): fault injection: aborted while scattering"


def test_ten_thousand_failed_rooms_print_a_handful_of_lines():
    failures = {r: f"reason {r % 50} kind {'abcdefghij'[r % 10]}" for r in range(10_000)}
    lines = format_failure_groups(failures)
    assert len(lines) <= 2 * GROUPS_SHOWN + 2
    assert lines[0] == "10000 room(s) failed, by reason:"
    assert lines[1] == "  1000 rooms (0, 10, 20, 30, 40, ...): reason # kind a"
    assert (
        lines[-1]
        == f"  ... {10 - GROUPS_SHOWN} more reason(s), {(10 - GROUPS_SHOWN) * 1000} room(s) (summary.json failure_groups)"
    )


def test_summary_counts_every_failed_room_per_reason():
    s = load_scenario(LOST)
    decode = {
        r: f"decode rank 0: room {r} timed out after 3.0s waiting for scatter of chunks [{r % 3}]"
        for r in range(30)
    }
    prefill = {r: "aborted by prefill rank 1: fault injection" for r in range(25, 40)}
    ranks = [
        RankResult("prefill", 1, 0, 15, prefill, 0, 0, {}, 0, False),
        RankResult("decode", 0, 0, 30, decode, 0, 0, {}, 0, False),
    ]
    summary = run_summary(s, "sim", [], ranks, requests=40, wall_s=0.0, violations=0)
    assert len(summary["failures"]) == 20  # the listing stays short ...
    assert summary[
        "failure_groups"
    ] == {  # ... the groups count all 40 rooms, a room once (decode first)
        "decode rank #: room # timed out after #s waiting for scatter of chunks [#]": 30,
        "aborted by prefill rank #: fault injection": 10,
    }


# --------------------------------------------------------------------------- sim exit codes


@pytest.mark.parametrize("path", FAILING, ids=lambda p: p.stem)
def test_sim_failed_rooms_exit_1_unless_expected(tmp_path, path):
    want = set(load_scenario(path).expect.failed_rooms)
    res = invoke("sim", str(path), "--out", str(tmp_path / "as-expected"), "--no-progress")
    assert res.exit_code == 0, res.output
    assert f"expected outcome: {len(want)} room(s) failed" in res.output
    assert "unexpected outcome" not in res.output

    res = invoke(
        "sim", str(without_expect(path, tmp_path)), "--out", str(tmp_path / "run"), "--no-progress"
    )
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    failures = {int(k): v for k, v in summary["failures"].items()}
    assert set(failures) == want
    assert (
        f"unexpected outcome: {len(want)} room(s) failed, and the scenario has no [expect]"
        in res.output
    )
    for line in format_failure_groups(failures):  # grouped by reason, with counts and rooms
        assert line in res.output.splitlines(), res.output
    assert sum(summary["failure_groups"].values()) == len(want)


def test_sim_other_rooms_than_expected_exit_1(tmp_path):
    res = invoke(
        "sim",
        str(ABORT),
        "--set",
        "expect.failed_rooms=[3]",
        "--out",
        str(tmp_path / "r"),
        "--no-progress",
    )
    assert res.exit_code == 1, res.output
    assert "unexpected outcome: expected failed rooms [3], got [2]" in res.output
    assert "1 room (2): aborted by prefill rank" in res.output
    res = invoke(
        "sim",
        str(ABORT),
        "--set",
        "expect.reason_contains=timed out",
        "--out",
        str(tmp_path / "s"),
        "--no-progress",
    )
    assert res.exit_code == 1, res.output
    assert "1 failed room(s) with a reason not containing 'timed out', e.g. room 2:" in res.output


def test_sweep_points_with_failed_rooms_are_rows_not_errors(tmp_path):
    out = tmp_path / "sw"
    res = invoke(
        "sweep",
        str(without_expect(ABORT, tmp_path)),
        "--vary",
        "decode.staging_pool_mb=1,2",
        "--workers",
        "1",
        "--out",
        str(out),
        "--no-progress",
    )
    assert res.exit_code == 0, res.output
    with (out / "sweep.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["status"], r["requests_failed"]) for r in rows] == [("ok", "1"), ("ok", "1")]


# --------------------------------------------------------------------------- bad trace CSV

SCENARIO = """
[model]
layers = 2
kv_heads = 8
head_dim = 16
params_b = 0.1
dtype = "bf16"
[prefill]
tp = 2
chunked_prefill_size = 64
[decode]
tp = 1
page_size = 16
staging_pool_mb = 4
[links]
profile = "loopback-cpu"
[workload]
requests = 4
arrival = "{arrival}"
rate_per_s = 20
prompt = "trace"
trace = "{csv}"
"""

FORMAT = "arrival_s,prompt_tokens[,prefix_tokens]"
BAD_TRACES = {
    "missing-file": (None, ["workload.trace", "gone.csv", "no such file"]),
    "empty-file": ("", ["trace.csv: the trace file is empty", FORMAT]),
    "only-comments": ("# nothing yet\n\n", ["trace.csv: the trace file is empty", FORMAT]),
    "header-only": (
        "arrival_s,prompt_tokens\n",
        ["trace.csv: trace has no data rows", "arrival_s,prompt_tokens"],
    ),
    "header-missing-column": (
        "arrival_s,tokens\n0,100\n",
        ["trace.csv:1: bad header", "missing prompt_tokens", "unknown 'tokens'", FORMAT],
    ),
    "no-header": ("0,100\n1,200\n", ["trace.csv:1: bad header", "must be the header", FORMAT]),
    "arrival-not-a-number": (
        "arrival_s,prompt_tokens\n0,100\nsoon,100\n",
        ["trace.csv:3: arrival_s = 'soon'", "expected a number of seconds >= 0"],
    ),
    "arrival-negative": (
        "arrival_s,prompt_tokens\n-0.5,100\n",
        ["trace.csv:2: arrival_s = '-0.5'", "finite number >= 0"],
    ),
    "prompt-not-an-integer": (
        "arrival_s,prompt_tokens\n0,lots\n",
        ["trace.csv:2: prompt_tokens = 'lots'", "integer >= 1"],
    ),
    "prompt-zero": (
        "arrival_s,prompt_tokens\n0,0\n",
        ["trace.csv:2: prompt_tokens = 0", "must be >= 1"],
    ),
    "prefix-negative": (
        "arrival_s,prompt_tokens,prefix_tokens\n0,100,-16\n",
        ["trace.csv:2: prefix_tokens = -16", "must be >= 0"],
    ),
    "too-many-fields": (
        "arrival_s,prompt_tokens\n0,100,5\n",
        ["trace.csv:2: 3 fields, expected 2"],
    ),
}


def write_case(tmp_path: Path, text: str | None, arrival: str = "trace") -> Path:
    name = "gone.csv" if text is None else "trace.csv"
    if text is not None:
        (tmp_path / name).write_text(text)
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO.format(arrival=arrival, csv=name))
    return path


@pytest.mark.parametrize("command", ["validate", "sim", "hw"])
@pytest.mark.parametrize("case", BAD_TRACES, ids=str)
def test_bad_trace_is_one_message_and_exit_2(tmp_path, command, case):
    text, needles = BAD_TRACES[case]
    path = write_case(tmp_path, text)
    extra = ["--out", str(tmp_path / "run")] if command != "validate" else []
    assert_one_trace_error(invoke(command, str(path), *extra), path, needles, tmp_path / "run")


def test_a_missing_trace_deep_in_the_tree_is_named_to_its_file_name(tmp_path):
    """A value too long for one error line is shortened in its middle: the file name at
    the end of a long path is what the user needs to see."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = write_case(deep, None)
    res = invoke("validate", str(path))
    assert res.exit_code == 2, res.output
    assert "gone.csv" in res.output and "..." in res.output and "no such file" in res.output


def assert_one_trace_error(res, path, needles, run_dir) -> None:
    """A bad trace file: exit 2, one error line naming the file and the field, no
    traceback, no run directory."""
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.output.count("error:") == 1, res.output
    assert f"{path}: workload.trace" in res.output
    for needle in needles:
        assert needle in res.output, res.output
    assert not run_dir.exists()


def test_bad_trace_for_prompts_only_and_in_a_sweep(tmp_path):
    path = write_case(tmp_path, "arrival_s,prompt_tokens\n0,-3\n", arrival="fixed")
    res = invoke("validate", str(path))
    assert res.exit_code == 2 and "trace.csv:2: prompt_tokens = -3: must be >= 1" in res.output, (
        res.output
    )
    res = invoke(
        "sweep", str(path), "--vary", "decode.staging_pool_mb=4,8", "--out", str(tmp_path / "sw")
    )
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "trace.csv:2: prompt_tokens = -3" in res.output
    assert not (tmp_path / "sw").exists()


def test_bad_trace_sim_subprocess_no_traceback(tmp_path):
    path = write_case(tmp_path, "")
    proc = subprocess.run(
        [*kvstage_cmd(), "sim", str(path), "--out", str(tmp_path / "run"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **WIDE},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and out.count("error:") == 1
    assert "trace.csv: the trace file is empty" in out


def test_good_trace_validates_and_simulates(tmp_path):
    path = write_case(
        tmp_path, "\ufeff# t, tokens\narrival_s,prompt_tokens\n0.05,200\n0,150\n0.1,300\n"
    )
    res = invoke("validate", str(path))
    assert res.exit_code == 0, res.output
    res = invoke("sim", str(path), "--out", str(tmp_path / "run"), "--no-progress")
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["requests_done"] == 3 and summary["failure_groups"] == {}


# --------------------------------------------------------------------------- hardware


@pytest.mark.hw
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_hw_failed_room_without_expect_exits_1_with_the_reason(tmp_path):
    require_engine("nixl")
    path = without_expect(ABORT, tmp_path)
    proc = subprocess.run(
        [
            *kvstage_cmd(),
            "hw",
            str(path),
            "--backend",
            "nixl",
            "--out",
            str(tmp_path / "run"),
            "--timeout",
            "240",
        ],
        capture_output=True,
        text=True,
        timeout=290,
        cwd=ROOT,
        env={**os.environ, **WIDE},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Traceback" not in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert not summary["errors"] and summary["bytes_wrong"] == 0, summary["errors"]
    failures = {int(k): v for k, v in summary["failures"].items()}
    assert set(failures) == {2}
    assert "unexpected outcome: 1 room(s) failed, and the scenario has no [expect]" in out
    assert "1 room(s) failed, by reason:" in out
    assert f"  1 room (2): {failures[2]}" in out.splitlines(), out
    assert "aborted" in failures[2]
    assert summary["failure_groups"] == {reason_pattern(failures[2]): 1}
