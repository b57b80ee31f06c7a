"""Mooncake traces (JSON Lines) as `workload.trace`, `workload.trace_speedup`, and
one clear error for a bad or empty file from `validate` and `sim` alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_outcome import SCENARIO as OUTCOME_SCENARIO
from test_outcome import WIDE, assert_one_trace_error
from typer.testing import CliRunner

from kvstage.cli.main import app
from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.scenario.trace_csv import read_trace
from kvstage.shared.workload import generate_requests

# test_outcome's small scenario (its bad-CSV cases), reading trace.jsonl
SCENARIO = OUTCOME_SCENARIO.format(arrival="trace", csv="trace.jsonl")
GOOD = [
    {"timestamp": 0, "input_length": 200, "output_length": 12, "hash_ids": [0]},
    {
        "timestamp": 1500,
        "input_length": 700,
        "output_length": 3,
        "hash_ids": [0, 1],
        "extra": "ignored",
    },
    {"timestamp": 250, "input_length": 150},
]


def write(tmp_path: Path, text: str, *extra: str) -> Path:
    (tmp_path / "trace.jsonl").write_text(text)
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO + "".join(f"{line}\n" for line in extra))
    return path


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_mooncake_rows_map_to_requests(tmp_path):
    s = load_scenario(write(tmp_path, jsonl(GOOD) + "\n"))
    rows = read_trace(s.workload.trace)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.line) for r in rows] == [
        (0.0, 200, 12, 1),
        (1.5, 700, 3, 2),
        (0.25, 150, None, 3),
    ]
    reqs = generate_requests(s)
    assert [
        (r.room, r.arrival_s, r.prompt_tokens, r.prefix_tokens, r.output_tokens) for r in reqs
    ] == [(0, 0.0, 200, 0, 12), (1, 0.25, 150, 0, 0), (2, 1.5, 700, 0, 3)]
    # hash_ids: the rows' block ids, kept in row order
    assert [r.hash_ids for r in rows] == [(0,), (0, 1), ()]
    assert [r.hash_ids for r in reqs] == [(0,), (), (0, 1)]


def test_trace_speedup_divides_the_arrivals(tmp_path):
    s = load_scenario(write(tmp_path, jsonl(GOOD), "trace_speedup = 2.5"))
    assert [r.arrival_s for r in generate_requests(s)] == [0.0, 0.1, 0.6]
    with pytest.raises(ScenarioError, match="trace_speedup"):
        load_scenario(write(tmp_path, jsonl(GOOD), "trace_speedup = 0"))


def test_csv_output_tokens_column(tmp_path):
    (tmp_path / "t.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,100,7\n1,50,\n")
    rows = read_trace(tmp_path / "t.csv")
    assert [(r.prompt_tokens, r.output_tokens) for r in rows] == [(100, 7), (50, None)]


BAD = {
    "empty": ("", ["trace.jsonl: the trace file is empty", "Mooncake JSON Lines"]),
    "blank-lines-only": ("\n\n  \n", ["trace.jsonl: the trace file is empty"]),
    "not-json": ('{"timestamp": 0, "input_length": 5}\n{oops\n', ["trace.jsonl:2: not JSON"]),
    "not-an-object": ("[1, 2]\n", ["trace.jsonl:1: expected a JSON object"]),
    "missing-input": ('{"timestamp": 0}\n', ["trace.jsonl:1: missing input_length"]),
    "negative-timestamp": (
        '{"timestamp": -3, "input_length": 5}\n',
        ["trace.jsonl:1: timestamp = -3", "milliseconds"],
    ),
    "input-zero": (
        '{"timestamp": 0, "input_length": 0}\n',
        ["trace.jsonl:1: input_length = 0: must be >= 1"],
    ),
    "input-fraction": (
        '{"timestamp": 0, "input_length": 2.5}\n',
        ["input_length = 2.5: expected an integer >= 1"],
    ),
    "output-text": (
        '{"timestamp": 0, "input_length": 5, "output_length": "x"}\n',
        ['output_length = "x"'],
    ),
    "hash-ids-bad": (
        '{"timestamp": 0, "input_length": 5, "hash_ids": [1, "a"]}\n',
        ["hash_ids", "list of integers"],
    ),
    "hash-ids-not-a-list": (
        '{"timestamp": 0, "input_length": 5, "hash_ids": 7}\n',
        ["trace.jsonl:1: hash_ids = 7: expected a list of integers"],
    ),
    "hash-ids-floats": (
        '{"timestamp": 0, "input_length": 5, "hash_ids": [1.5]}\n',
        ["trace.jsonl:1: hash_ids = [1.5]: expected a list of integers"],
    ),
}


@pytest.mark.parametrize("command", ["validate", "sim"])
@pytest.mark.parametrize("case", BAD, ids=str)
def test_bad_mooncake_trace_is_one_message_and_exit_2(tmp_path, command, case):
    text, needles = BAD[case]
    path = write(tmp_path, text)
    extra = ["--out", str(tmp_path / "run"), "--no-progress"] if command == "sim" else []
    res = CliRunner().invoke(app, [command, str(path), *extra], env=WIDE)
    assert_one_trace_error(res, path, needles, tmp_path / "run")


def test_good_mooncake_trace_simulates(tmp_path):
    path = write(tmp_path, jsonl(GOOD))
    res = CliRunner().invoke(
        app, ["sim", str(path), "--out", str(tmp_path / "run"), "--no-progress"], env=WIDE
    )
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["requests_done"] == 3 and summary["requests_failed"] == 0
    # the scenario asks for 4 requests of a 3-row trace: all 3 replayed, and said
    assert (summary["trace_rows_replayed"], summary["trace_rows"]) == (3, 3)
    assert "3 of 3 trace rows" in res.output
    # row 2 (700 tokens, blocks 0, 1) finds block 0 of row 1 cached: 512 tokens
    assert summary["prefix_hit_fraction"] == pytest.approx(512 / (200 + 150 + 700))
    assert "prefix cache hits" in res.output


def test_n_of_m_trace_rows_in_the_summary(tmp_path):
    path = write(tmp_path, jsonl(GOOD))
    res = CliRunner().invoke(
        app,
        [
            "sim",
            str(path),
            "--set",
            "workload.requests=2",
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
        ],
        env=WIDE,
    )
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["trace_rows_replayed"], summary["trace_rows"]) == (2, 3)
    assert summary["requests"] == 2 and "2 of 3 trace rows" in res.output


@pytest.mark.parametrize(
    ("line", "needles"),
    [
        ('trace = "trace.parquet"', ["workload.trace", "a trace file of type '.parquet'"]),
        ('trace_csv = "trace.jsonl"', ["workload.trace_csv", "renamed workload.trace"]),
    ],
    ids=["wrong-type", "old-name"],
)
def test_wrong_trace_type_and_old_name_are_one_line_exit_2(tmp_path, line, needles):
    (tmp_path / "trace.parquet").write_text(jsonl(GOOD))
    (tmp_path / "trace.jsonl").write_text(jsonl(GOOD))
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO.replace('trace = "trace.jsonl"', line))
    res = CliRunner().invoke(app, ["validate", str(path)], env=WIDE)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.output.count("error:") == 1, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    for needle in needles:
        assert needle in res.output, res.output


def test_a_trace_read_again_is_the_same_rows_and_a_rewritten_one_is_read_anew(tmp_path):
    """read_trace keeps the rows of a file by its bytes (a plan loads one scenario per
    configuration): the same bytes give equal rows in a list of their own; other bytes
    of the same length at the same path, written at once, are read again."""
    path = tmp_path / "t.jsonl"
    path.write_text(jsonl(GOOD))
    first, again = read_trace(path), read_trace(path)
    assert again == first and again is not first
    again.clear()  # a caller's list is its own
    assert read_trace(path) == first
    path.write_text(jsonl(GOOD).replace('"input_length": 200', '"input_length": 300'))
    assert [r.prompt_tokens for r in read_trace(path)] == [300, 700, 150]
    path.write_text("not json\n")
    with pytest.raises(ScenarioError, match="not JSON"):
        read_trace(path)
