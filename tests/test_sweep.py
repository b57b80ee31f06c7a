"""`kvstage sweep`: cross product, deterministic rows, target answer, Ray == local, CLI.

The scenario is the small fan-in case (Llama-3-8B, TP4 -> TP2) made stall-prone: a
200 Gb/s link, a prefill far faster than the link, fixed 16k-token prompts, 8 requests,
so the staging pool decides how long writers wait for the watermark. One Ray instance
serves the whole file (module fixture); without Ray its tests skip, except in CI.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstage.cli.main import app
from kvstage.explore.executor import ray_init
from kvstage.explore.sweep import (
    METRICS,
    STATUS_INVALID,
    STATUS_OK,
    SweepError,
    _split_values,
    parse_vary,
    run_sweep,
)
from kvstage.explore.sweep_target import Target, parse_target, target_answers

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "llama3-8b-p4-d2.toml"
SETS = [
    "workload.requests=8",
    "links.profile=roce-200g",
    "prefill.tokens_per_s=1000000",
    "workload.prompt=fixed",
    "workload.prompt_tokens=16384",
]
POOLS = (512, 2048)
RATES = (4, 16)
VARY = [
    f"decode.staging_pool_mb={','.join(map(str, POOLS))}",
    f"workload.rate_per_s={','.join(map(str, RATES))}",
]
TARGET = "watermark_stall_s.total<1.0"


def _expected_answers(rows: list[dict], limit: float) -> dict[int, int | None]:
    """The target answer straight from the rows: per rate, the smallest pool whose point
    ran with no failed request and a total watermark stall under `limit`."""
    out = {}
    for rate in RATES:
        ok = [
            r["decode.staging_pool_mb"]
            for r in rows
            if r["workload.rate_per_s"] == rate
            and r["status"] == STATUS_OK
            and not r["requests_failed"]
            and r["watermark_stall_s.total"] is not None
            and r["watermark_stall_s.total"] < limit
        ]
        out[rate] = min(ok) if ok else None
    return out


@pytest.fixture(scope="module")
def local_sweep():
    return run_sweep(SCENARIO, [parse_vary(v) for v in VARY], SETS, workers=2)


@pytest.fixture(scope="module")
def ray_session():
    try:
        import ray
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("Ray is not installed, and CI must run the Ray tests: pip install ray")
        pytest.skip("Ray is not installed")
    started = ray_init("local", 2)
    yield ray
    if started:
        ray.shutdown()


def test_two_by_two_sweep_rows_and_target(local_sweep):
    rows = local_sweep.rows
    assert len(rows) == 4
    # Cross-product order, first --vary outermost, whatever order the points finished in.
    assert [(r["decode.staging_pool_mb"], r["workload.rate_per_s"]) for r in rows] == [
        (p, q) for p in POOLS for q in RATES
    ]
    assert local_sweep.columns[:3] == ["decode.staging_pool_mb", "workload.rate_per_s", "status"]
    assert set(METRICS) <= set(local_sweep.columns)
    for r in rows:
        assert r["status"] == STATUS_OK, r["reason"]
        assert r["requests_done"] == 8 and r["requests_failed"] == 0
        assert r["invariant_violations"] == 0
        assert r["transfer_latency_s.p99"] > 0 and r["sim_time_s"] > 0
    # Stall-prone: the small pool makes writers wait for the watermark longer.
    for rate in RATES:
        small, big = (
            next(
                r
                for r in rows
                if r["decode.staging_pool_mb"] == p and r["workload.rate_per_s"] == rate
            )
            for p in POOLS
        )
        assert small["watermark_stall_s.total"] > big["watermark_stall_s.total"]

    answers = target_answers(local_sweep, parse_target(TARGET))
    assert [a["settings"] for a in answers] == [{"workload.rate_per_s": q} for q in RATES]
    expected = _expected_answers(rows, 1.0)
    assert {a["settings"]["workload.rate_per_s"]: a["smallest"] for a in answers} == expected
    for a in answers:
        assert a["meets"] == (a["smallest"] is not None)
        if a["meets"]:
            assert a["metric_value"] < 1.0


@pytest.mark.slow
def test_ray_gives_the_same_rows(local_sweep, ray_session):
    ray_result = run_sweep(
        SCENARIO, [parse_vary(v) for v in VARY], SETS, workers=2, ray_address="local"
    )
    assert ray_session.is_initialized()  # the module's instance was used, not shut down
    assert ray_result.columns == local_sweep.columns
    strip = [{k: v for k, v in r.items() if k != "wall_s"} for r in ray_result.rows]
    assert strip == [{k: v for k, v in r.items() if k != "wall_s"} for r in local_sweep.rows]
    assert target_answers(ray_result, parse_target(TARGET)) == target_answers(
        local_sweep, parse_target(TARGET)
    )


def test_cli_sweep_writes_table_target_and_plots(tmp_path):
    out = tmp_path / "sw"
    args = [
        "sweep",
        str(SCENARIO),
        "--vary",
        "decode.staging_pool_mb=256,512,2048",
        "--vary",
        VARY[1],
        "--target",
        TARGET,
        "--workers",
        "1",
        "--out",
        str(out),
        "--no-progress",
    ]
    for s in SETS:
        args += ["--set", s]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "smallest decode." in res.output
    for name in (
        "sweep.csv",
        "sweep.parquet",
        "sweep.json",
        "target.json",
        "heatmap-transfer_latency_s_p99.png",
        "lines-transfer_latency_s_p99.png",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name

    with (out / "sweep.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6
    # 256 MiB is below one 512 MiB chunk: an invalid row with the reason, not a crash.
    for r in rows[:2]:
        assert r["status"] == STATUS_INVALID and "smaller than one full chunk" in r["reason"]
    assert all(r["status"] == STATUS_OK for r in rows[2:])

    import pyarrow.parquet as pq

    table = pq.read_table(out / "sweep.parquet")
    assert table.num_rows == 6 and table.column_names[0] == "decode.staging_pool_mb"

    typed = [
        {
            "decode.staging_pool_mb": int(r["decode.staging_pool_mb"]),
            "workload.rate_per_s": int(r["workload.rate_per_s"]),
            "status": r["status"],
            "requests_failed": int(r["requests_failed"]) if r["requests_failed"] else None,
            "watermark_stall_s.total": float(r["watermark_stall_s.total"])
            if r["watermark_stall_s.total"]
            else None,
        }
        for r in rows
    ]
    report = json.loads((out / "target.json").read_text())
    assert (
        report["key"] == "decode.staging_pool_mb" and report["metric"] == "watermark_stall_s.total"
    )
    got = {a["settings"]["workload.rate_per_s"]: a["smallest"] for a in report["answers"]}
    assert got == _expected_answers(typed, 1.0)


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--vary", "decode.pool_mb=512,1024"], ["unknown key 'pool_mb'", "staging_pool_mb"]),
        (
            ["--vary", "decode.staging_pool_mb=512", "--target", "transfer_latency_s.p99=0.5"],
            ["--target", "METRIC<VALUE"],
        ),
        (
            ["--vary", "decode.staging_pool_mb=512", "--target", "latency<0.5"],
            ["unknown metric 'latency'", "transfer_latency_s.p99"],
        ),
        (["--vary", "decode.page_size=16,24"], ["--vary decode.page_size", "power of two"]),
        (["--vary", "decode.staging_pool_mb=512", "--metric", "p99"], ["unknown metric 'p99'"]),
    ],
)
def test_cli_bad_input_exits_2_with_a_message(tmp_path, extra, needles):
    res = CliRunner().invoke(app, ["sweep", str(SCENARIO), *extra, "--out", str(tmp_path / "x")])
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and "Traceback" not in res.output
    flat = " ".join(res.output.split())
    for needle in needles:
        assert needle in flat, res.output
    assert not (tmp_path / "x").exists()


def test_parsing_rules():
    assert _split_values("1, [2, 3],'a,b'") == ["1", "[2, 3]", "'a,b'"]
    v = parse_vary("decode.staging_pool_mb=512,1024.5")
    assert v.values == (512, 1024.5)
    assert parse_vary("transfer.path=staging,slice").values == ("staging", "slice")
    for text, op in (
        ("ttft_s.p99<=2", "<="),
        ("throughput_gbps>100", ">"),
        ("requests_done >= 8", ">="),
    ):
        assert parse_target(text).op == op
    with pytest.raises(SweepError, match="given twice"):
        parse_vary("decode.staging_pool_mb=512,512")
    t = Target("ttft_s.p99", "<", 1.0)
    assert t.met_by({"status": "ok", "ttft_s.p99": 0.5, "requests_failed": 0})
    assert not t.met_by(
        {"status": "ok", "ttft_s.p99": 0.5, "requests_failed": 1}
    )  # failures disqualify
    assert not t.met_by({"status": "ok", "ttft_s.p99": None, "requests_failed": 0})  # no samples
    assert not t.met_by({"status": "invalid", "ttft_s.p99": None, "requests_failed": None})
    assert Target("requests_failed", "<=", 1).met_by({"status": "ok", "requests_failed": 1})


def test_cli_sweep_progress_lines_off_a_terminal(tmp_path):
    """CliRunner's output is not a terminal: progress comes as lines, not a bar."""
    args = [
        "sweep",
        str(SCENARIO),
        "--vary",
        VARY[0],
        "--workers",
        "1",
        "--out",
        str(tmp_path / "s"),
    ]
    for s in SETS:
        args += ["--set", s]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    lines = [x for x in res.output.splitlines() if x.startswith("sweeping: ")]
    assert (
        lines and lines[-1].startswith("sweeping: 2/2 simulations") and lines[-1].endswith("done")
    )
