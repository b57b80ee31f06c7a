"""Measured files (benchmark clients, server logs, metrics scrapes) read into run
directories: every format on small files written after each tool's own code
(tests/data/measured/), the figures checked by hand, bad and truncated files refused in
one line naming the file, the line and the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstage.analysis.compare import compare_runs
from kvstage.measured.formats import detect, read_measured
from kvstage.measured.measurement import MeasuredError
from kvstage.measured.prometheus import quantile
from kvstage.measured.rundir import write_measured_run
from kvstage.metrics.rooms import request_breakdown, room_latencies
from kvstage.run.rundir import load_run

DATA = Path(__file__).resolve().parent / "data" / "measured"


def imported(tmp_path: Path, name: str, fmt: str | None = None):
    run_dir = write_measured_run(read_measured(DATA / name, fmt), tmp_path / name)
    return load_run(run_dir)


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("sglang_bench_details.jsonl", "sglang-bench"),
        ("sglang_bench_summary.jsonl", "sglang-bench"),
        ("vllm_bench_detailed.json", "vllm-bench"),
        ("vllm_bench_summary.json", "vllm-bench"),
        ("genai_bench.json", "genai-bench"),
        ("aiperf_profile_export.jsonl", "aiperf-records"),
        ("aiperf_profile_export_aiperf.json", "aiperf-summary"),
        ("sglang_pd_decode.log", "sglang-log"),
        ("sglang_nonpd.log", "sglang-log"),
        ("sglang_metrics.prom", "prometheus"),
    ],
)
def test_each_format_is_detected_from_its_content(name, fmt):
    assert detect(DATA / name) == fmt


def test_vllm_detailed_gives_the_clients_figures_request_by_request(tmp_path):
    run = imported(tmp_path, "vllm_bench_detailed.json")
    assert run.mode == "measured"
    per = request_breakdown(room_latencies(run.records))
    # requests 0 and 1 have 3 tokens: TPOT = (latency - ttft) / 2; request 2 has one token
    assert per["ttft_s"] == pytest.approx([0.1, 0.25, 0.1])
    assert per["tpot_s"] == pytest.approx([0.05, 0.05])
    assert sorted(per["itl_s"]) == pytest.approx([0.04, 0.05, 0.05, 0.06])
    assert per["e2e_s"] == pytest.approx([0.2, 0.35, 0.1])
    s = run.summary
    assert (s["requests"], s["requests_done"], s["requests_failed"]) == (4, 3, 1)
    assert s["ttft_s"]["p99"] == pytest.approx(0.247)  # numpy's linear p99 of the three
    rooms = room_latencies(run.records)
    assert [rooms[r]["arrival"] for r in range(4)] == pytest.approx([0.0, 0.5, 1.0, 1.5])
    # the tool's own figures ride along, in seconds
    assert s["reported"]["ttft_s"]["p50"] == pytest.approx(0.1)
    assert s["reported"]["e2e_s"]["p99"] == pytest.approx(0.349)
    assert s["reported"]["goodput_rps"] == pytest.approx(0.6666)
    assert s["source"]["format"] == "vllm-bench"


def test_sglang_details_and_summary(tmp_path):
    run = imported(tmp_path, "sglang_bench_details.jsonl")
    per = request_breakdown(room_latencies(run.records))
    assert per["ttft_s"] == pytest.approx([0.2, 0.3])
    # last token = TTFT + the gaps: 4 gaps of 50 ms over 4 tokens after the first
    assert per["e2e_s"] == pytest.approx([0.4, 0.45])
    assert per["tpot_s"] == pytest.approx([0.05, 0.05])
    assert len(per["itl_s"]) == 7
    assert run.summary["requests_failed"] == 1
    agg = imported(tmp_path, "sglang_bench_summary.jsonl")
    assert agg.records == []
    assert agg.summary["ttft_s"] == pytest.approx(
        {"mean": 0.25, "p50": 0.25, "std": 0.05, "p99": 0.299}
    )
    assert agg.summary["itl_s"]["p95"] == pytest.approx(0.05)
    assert agg.summary["requests_per_s"] == pytest.approx(0.8)


def test_genai_bench_reads_ms_and_errors(tmp_path):
    run = imported(tmp_path, "genai_bench.json")
    per = request_breakdown(room_latencies(run.records))
    assert per["ttft_s"] == pytest.approx([0.1, 0.2, 0.3])
    # its own tpot is (e2e - ttft) / (tokens - 1): 11 tokens
    assert per["tpot_s"] == pytest.approx([0.02, 0.03, 0.04])
    assert "itl_s" not in per  # no gaps in the file
    assert run.summary["requests_failed"] == 1
    assert run.summary["reported"]["ttft_s"]["p90"] == pytest.approx(0.28)


def test_aiperf_records_skip_warmup_and_keep_gaps(tmp_path):
    run = imported(tmp_path, "aiperf_profile_export.jsonl")
    rooms = room_latencies(run.records)
    assert len(rooms) == 3  # the warmup record is not one
    per = request_breakdown(rooms)
    assert per["ttft_s"] == pytest.approx([0.1, 0.12])
    assert per["tpot_s"] == pytest.approx([0.05, 0.06])  # (latency - ttft) / (osl - 1)
    assert sorted(per["itl_s"]) == pytest.approx([0.05, 0.05, 0.06, 0.06, 0.06])
    assert rooms[1]["arrival"] == pytest.approx(0.25)
    assert run.summary["requests_failed"] == 1
    agg = imported(tmp_path, "aiperf_profile_export_aiperf.json")
    assert agg.summary["tpot_s"]["p90"] == pytest.approx(0.059)  # its inter_token_latency
    assert agg.summary["itl_s"]["p50"] == pytest.approx(0.06)  # its inter_chunk_latency
    assert agg.summary["requests_per_s"] == pytest.approx(3.2)


def test_sglang_logs_give_decode_steps_and_prefill_batches(tmp_path):
    m = read_measured(DATA / "sglang_pd_decode.log")
    assert m.reported["pd"] is True
    assert [(s.running, s.gen_tokens_per_s) for s in m.decode_steps][:3] == [
        (1, 40.0),
        (1, 40.0),
        (4, 145.45),
    ]
    assert m.decode_steps[-1].time_s == 5.0 and m.decode_steps[-1].tokens == 67200
    p = read_measured(DATA / "sglang_prefill.log")
    assert [b.new_tokens for b in p.prefill_batches] == [8192, 8192, 4096, 2048, 1024]
    assert p.prefill_batches[2].cached_tokens == 512 and p.prefill_batches[1].queue == 2
    old = read_measured(DATA / "sglang_nonpd.log")  # the older "Decode batch." lines
    assert old.reported["pd"] is False and old.decode_steps[0].running == 2
    run = load_run(write_measured_run(m, tmp_path / "log"))
    assert len(run.summary["server_log"]["decode_steps"]) == 6


def test_prometheus_histograms_as_histogram_quantile():
    buckets = [(0.1, 0.0), (0.2, 50.0), (0.4, 90.0), (0.8, 100.0), (float("inf"), 100.0)]
    assert quantile(buckets, 0.5) == pytest.approx(0.2)
    assert quantile(buckets, 0.99) == pytest.approx(0.4 + 0.4 * 9 / 10)
    m = read_measured(DATA / "sglang_metrics.prom")
    assert m.reported["ttft_s"]["p90"] == pytest.approx(0.4)
    assert m.reported["ttft_s"]["mean"] == pytest.approx(0.22)
    assert m.reported["itl_s"]["p50"] == pytest.approx(0.02 + 0.02 * 500 / 900)
    assert m.reported["requests_done"] == 100


@pytest.mark.parametrize(
    ("name", "fmt", "where", "field"),
    [
        ("sglang_bench_bad.jsonl", None, ":1:", "'itls'"),
        ("sglang_bench_truncated.jsonl", "sglang-bench", ":1:", "'(line)'"),
        ("sglang_bench_truncated.jsonl", None, ":1:", "'(line)'"),
        ("vllm_bench_bad.json", None, ": field", "'ttfts'"),
        ("genai_bench_bad.json", None, ":individual_request_metrics[1]:", "'e2e_latency'"),
        ("aiperf_truncated.jsonl", None, ":4:", "'(line)'"),
        ("sglang_bad.log", None, ":2:", "'gen throughput (token/s)'"),
        ("sglang_metrics_bad.prom", None, ":3:", "'sglang:time_to_first_token_seconds_bucket'"),
        ("sglang_bench_details.jsonl", "aiperf-records", ":1:", "'metadata'"),
    ],
)
def test_a_bad_or_partial_file_names_file_line_and_field(name, fmt, where, field):
    with pytest.raises(MeasuredError) as exc:
        read_measured(DATA / name, fmt)
    text = str(exc.value)
    assert text.startswith(str(DATA / name)) and where in text and f"field {field}" in text
    assert "\n" not in text


def test_import_cli_writes_a_run_and_exits_2_on_a_bad_file(tmp_path):
    cmd = [sys.executable, "-m", "kvstage.cli.main", "import"]
    ok = subprocess.run([*cmd, str(DATA / "vllm_bench_detailed.json"), "-o", str(tmp_path / "r")],
                        capture_output=True, text=True)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["mode"] == "measured"
    bad = subprocess.run([*cmd, str(DATA / "sglang_bad.log"), "-o", str(tmp_path / "b")],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "sglang_bad.log:2" in bad.stderr
    wrong = subprocess.run([*cmd, str(DATA / "sglang_bad.log"), "-o", str(tmp_path / "c"),
                            "--format", "csv"], capture_output=True, text=True)  # fmt: skip
    assert wrong.returncode == 2 and "allowed sglang-bench" in wrong.stderr


def test_compare_scores_client_figures_over_the_same_requests(tmp_path):
    """A measured run against itself matches exactly; against a copy whose TTFTs are
    twice as long the verdict names TTFT, and the TPOT of the same requests still matches."""
    a = imported(tmp_path, "vllm_bench_detailed.json")
    same = compare_runs(a, a)
    assert same["client"]["requests"] == 3
    assert same["verdict"].startswith("B matches A")
    assert all(r["error"] == 0 for r in same["client"]["figures"] if r["error"] is not None)
    m = read_measured(DATA / "vllm_bench_detailed.json")
    for r in m.requests:
        if r.ttft_s is not None:
            r.ttft_s *= 2
            r.e2e_s += r.ttft_s / 2
    b = load_run(write_measured_run(m, tmp_path / "slow"))
    res = compare_runs(a, b)
    ttft = {r["quantile"]: r["error"] for r in res["client"]["figures"] if r["metric"] == "ttft_s"}
    assert ttft["p50"] == pytest.approx(1.0)
    tpot = [r["error"] for r in res["client"]["figures"] if r["metric"] == "tpot_s"]
    assert tpot == pytest.approx([0.0, 0.0, 0.0])
    assert res["verdict"].startswith("B misses A: TTFT")
    # an aggregate-only run is compared on the quantiles both report
    agg = imported(tmp_path, "vllm_bench_summary.json")
    res = compare_runs(agg, a)
    assert res["client"]["basis"].startswith("each run's own")
    rows = {(r["metric"], r["quantile"]): r for r in res["client"]["figures"]}
    assert rows["ttft_s", "p99"]["a"] == pytest.approx(0.249)


def test_a_simulation_written_as_vllm_output_scores_zero_against_itself(tmp_path):
    """The loop closed on itself: a simulated run's requests written as `vllm bench serve
    --save-detailed` would write them (start times, TTFT, gaps, latency), imported, and
    compared with the simulation: the same requests, every client figure equal."""
    from kvstage.run.rundir import write_run
    from kvstage.run.summary import simulation_summary
    from kvstage.shared.scenario import load_scenario
    from kvstage.sim.driver import simulate

    scenario = load_scenario(
        Path(__file__).resolve().parents[1] / "scenarios" / "llama3-70b-p8-d2.toml",
        ['workload.prompt="fixed"', "workload.prompt_tokens=2048", "workload.requests=8",
         "workload.output_tokens=12", "workload.rate_per_s=20", "decode.max_running_requests=2"],
    )  # fmt: skip
    res = simulate(scenario)
    sim_dir = tmp_path / "sim"
    sim_dir.mkdir()
    write_run(sim_dir, scenario, res.records, simulation_summary(scenario, res), "sim")
    rooms = room_latencies(res.records)
    order = sorted(rooms)
    out = {
        "duration": 1.0, "completed": len(order), "failed": 0, "request_throughput": 1.0,
        "request_goodput": None, "output_throughput": 1.0, "total_token_throughput": 1.0,
        "input_lens": [2048] * len(order), "output_lens": [12] * len(order),
        "start_times": [100.0 + rooms[r]["arrival"] for r in order],
        "ttfts": [rooms[r]["first_token"] - rooms[r]["arrival"] for r in order],
        "itls": [rooms[r]["itls"] for r in order],
        "latencies": [rooms[r]["last_token"] - rooms[r]["arrival"] for r in order],
        "errors": [""] * len(order), "generated_texts": [""] * len(order),
    }  # fmt: skip
    (tmp_path / "vllm.json").write_text(json.dumps(out))
    measured = load_run(write_measured_run(read_measured(tmp_path / "vllm.json"), tmp_path / "m"))
    res = compare_runs(measured, load_run(sim_dir))
    assert res["client"]["requests"] == len(order)
    scored = [r for r in res["client"]["figures"] if r["metric"] in ("ttft_s", "tpot_s", "itl_s")]
    assert len(scored) == 9
    assert all(abs(r["error"]) < 1e-9 for r in scored), scored
    assert res["verdict"].startswith("B matches A")


def test_an_older_vllm_benchmark_serving_result_reads_without_send_times(tmp_path):
    """benchmarks/benchmark_serving.py before `vllm bench serve`: no start_times or
    latencies, and its goodput key spelt `request_goodput:`."""
    assert detect(DATA / "vllm_benchmark_serving_old.json") == "vllm-bench"
    run = imported(tmp_path, "vllm_benchmark_serving_old.json")
    per = request_breakdown(room_latencies(run.records))
    assert per["ttft_s"] == pytest.approx([0.1, 0.25, 0.1])
    assert per["e2e_s"] == pytest.approx([0.2, 0.35, 0.1])  # TTFT + the gaps
    assert per["tpot_s"] == pytest.approx([0.05, 0.05])


def test_check_says_a_measured_run_has_no_protocol_trace(tmp_path):
    from typer.testing import CliRunner

    from kvstage.cli.main import app

    for name in ("vllm_bench_detailed.json", "aiperf_profile_export_aiperf.json"):
        run = write_measured_run(read_measured(DATA / name), tmp_path / name)
        res = CliRunner().invoke(app, ["check", str(run)])
        assert res.exit_code == 2 and "is a measured run" in res.output, res.output
