"""[serving] kernels: a measured per-op table overrides the default kernel efficiencies,
the forward follows it, and a bad file is one FILE:LINE error."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.serving.compute import attention_flops, decode_step, prefill_forward
from kvstage.shared.serving.gpus import GPUS

HEADER = "op,gpu,dtype,M,N,K,time_us,source\n"
SCENARIO = """
[model]
preset = "llama-3.1-8b"
[prefill]
tp = 1
gpu = "a100-80g"
[decode]
tp = 1
gpu = "a100-80g"
"""


def scenario(tmp_path: Path, rows: str, *sets: str, serving: str = 'kernels = "k.csv"'):
    (tmp_path / "k.csv").write_text(HEADER + rows)
    p = tmp_path / "s.toml"
    p.write_text(SCENARIO + f"[serving]\n{serving}\n")
    return load_scenario(p, list(sets))


def rate(m: int, n: int, k: int, us: float) -> float:
    return 2.0 * m * n * k / (us * 1e-6)


def test_gemm_rows_set_the_forwards_matmul_rate(tmp_path):
    # two shapes at M = 4,096 (their rates averaged) and one at 1,024
    s = scenario(
        tmp_path,
        "gemm,a100-80g,bf16,4096,4096,4096,800,probe\n"
        "gemm,a100-80g,bf16,4096,8192,4096,1000,probe\n"
        "gemm,a100-80g,bf16,1024,4096,4096,400,probe\n",
    )
    peak = GPUS["a100-80g"].peak_flops("bf16")
    big = (rate(4096, 4096, 4096, 800) + rate(4096, 8192, 4096, 1000)) / 2
    small = rate(1024, 4096, 4096, 400)
    f = prefill_forward(s, 4096)
    assert f.linear_s == pytest.approx(f.linear_flops / big)
    assert f.mfu == pytest.approx(big / peak)
    # between the measured M: log2-interpolated share (2,048 is halfway)
    f2 = prefill_forward(s, 2048)
    assert f2.mfu == pytest.approx((big + small) / 2 / peak)
    # flat beyond them
    assert prefill_forward(s, 16384).mfu == pytest.approx(big / peak)
    assert prefill_forward(s, 256).mfu == pytest.approx(small / peak)
    # the default differs, so the table is what moved it
    default = prefill_forward(load_scenario(tmp_path / "s.toml", ["serving.kernels=''"]), 4096)
    assert not math.isclose(default.linear_s, f.linear_s, rel_tol=0.05)


def test_a_compute_bound_decode_step_takes_the_largest_m(tmp_path):
    s = scenario(tmp_path, "gemm,a100-80g,bf16,8192,4096,4096,500,probe\n")
    step = decode_step(s, 1024, 1024 * 64)
    assert step.mfu == pytest.approx(rate(8192, 4096, 4096, 500) / 312e12)


def test_attention_rows_set_the_attention_rate_by_keys(tmp_path):
    s = scenario(
        tmp_path,
        "attention,a100-80g,bf16,4096,1024,8192,200,fa2 probe\n"
        "attention,a100-80g,bf16,4096,4096,8192,600,fa2 probe\n",
    )
    f = prefill_forward(s, 8192)  # the mean query attends to 4,096.5 keys
    assert f.attention_s == pytest.approx(f.attention_flops / rate(4096, 4096, 8192, 600))
    short = prefill_forward(s, 2048)  # 1,024.5 keys
    assert short.attention_s == pytest.approx(
        short.attention_flops / rate(4096, 1024, 8192, 200), rel=1e-3
    )
    flops = attention_flops(s, 2048, 2048 * 1024.5, decode=False)
    assert short.attention_flops == pytest.approx(flops)


def test_rows_of_other_gpus_leave_this_one_on_the_defaults(tmp_path):
    s = scenario(tmp_path, "gemm,h100-sxm,bf16,4096,4096,4096,100,probe\n")
    base = load_scenario(tmp_path / "s.toml", ["serving.kernels=''"])
    assert prefill_forward(s, 4096).total_s == prefill_forward(base, 4096).total_s


@pytest.mark.parametrize(
    ("rows", "where", "says"),
    [
        ("matmul,a100-80g,bf16,1,1,1,1,x\n", ":2:", "op = 'matmul'; allowed: gemm, attention"),
        ("gemm,a99,bf16,1,1,1,1,x\n", ":2:", "gpu = 'a99' is no known GPU; allowed: a10"),
        ("gemm,a100-80g,int8,1,1,1,1,x\n", ":2:", "dtype = 'int8' for gemm; allowed: fp32"),
        ("attention,a100-80g,int4,1,1,1,1,x\n", ":2:", "allowed: bf16, fp8"),
        ("attention,a100-80g,fp8,1,1,1,1,x\n", ":2:", "no FP8 tensor cores"),
        ("gemm,a100-80g,bf16,1,1,1,1,x\ngemm,a100-80g,bf16,0,1,1,1,x\n", ":3:", "M = '0'"),
        ("gemm,a100-80g,bf16,1,1,1,-2,x\n", ":2:", "time_us = '-2': must be a number > 0"),
        ("gemm,a100-80g,bf16,1.5,1,1,1,x\n", ":2:", "M = '1.5': must be a whole number"),
        ("gemm,a100-80g,bf16,1,1,1,1,\n", ":2:", "source is empty"),
        ("", ":", "no rows"),
    ],
)
def test_a_bad_row_is_one_file_line_error(tmp_path, rows, where, says):
    with pytest.raises(ScenarioError) as err:
        scenario(tmp_path, rows)
    msg = str(err.value)
    assert "serving.kernels: " in msg and f"k.csv{where}" in msg and says in msg, msg
    assert "\n" not in msg


def test_a_missing_column_or_file_is_named(tmp_path):
    (tmp_path / "k.csv").write_text("op,gpu,dtype,M,N,time_us\n")
    p = tmp_path / "s.toml"
    p.write_text(SCENARIO + '[serving]\nkernels = "k.csv"\n')
    with pytest.raises(ScenarioError, match=r"k\.csv:1: the header lacks K, source"):
        load_scenario(p)
    p.write_text(SCENARIO + '[serving]\nkernels = "nope.csv"\n')
    with pytest.raises(ScenarioError, match=r"nope\.csv: no such kernel table"):
        load_scenario(p)


def test_a_serving_profile_and_a_kernel_table_go_together(tmp_path):
    (tmp_path / "prof.toml").write_text("[prefill]\nmfu = 0.3\n")
    s = scenario(
        tmp_path,
        "gemm,a100-80g,bf16,4096,4096,4096,800,probe\n",
        serving='profile = "prof.toml"\nkernels = "k.csv"',
    )
    assert s.prefill.mfu == 0.3  # prefill.mfu (one figure for all) wins over a table
    assert s.serving.kernels == str((tmp_path / "k.csv").resolve())
    assert prefill_forward(s, 4096).mfu == 0.3


def test_a_run_records_the_table_it_used(tmp_path):
    from kvstage.run.summary import simulation_summary
    from kvstage.sim.driver import simulate

    s = scenario(
        tmp_path,
        "gemm,a100-80g,bf16,4096,4096,4096,800,probe\n",
        "workload.requests=2",
        'transfer.path="slice"',
    )
    fig = simulation_summary(s, simulate(s))["serving_model"]
    assert fig["kernel_table"] == str((tmp_path / "k.csv").resolve())
    assert fig["prefill_mfu_at_chunk"] == pytest.approx(rate(4096, 4096, 4096, 800) / 312e12)


def test_a_table_is_read_once_per_file_and_again_when_it_changes(tmp_path):
    """A plan loads one scenario per configuration, all naming the same table: the same
    bytes give the table read before; other bytes, or other own GPUs its names may
    mean, are read again."""
    row = "gemm,a100-80g,bf16,4096,4096,4096,{us},probe\n"
    first = scenario(tmp_path, row.format(us=100))
    again = load_scenario(tmp_path / "s.toml", ["decode.tp=2"])
    assert again.serving.table is first.serving.table  # not parsed again
    (tmp_path / "k.csv").write_text(HEADER + row.format(us=200))  # the file changed
    changed = load_scenario(tmp_path / "s.toml")
    assert changed.serving.table is not first.serving.table
    assert changed.serving.table != first.serving.table
    assert prefill_forward(changed, 4096).linear_s > prefill_forward(first, 4096).linear_s
    own = "[gpus.mine]\nmemory_gib = 80\nhbm_gbs = 2000\nbf16_tflops = 300\n"
    own += 'scaleup_gbs = 300\nscaleup = "NVLink"\nsource = "test"\n'
    p = tmp_path / "s.toml"
    p.write_text(SCENARIO + own + '[serving]\nkernels = "k.csv"\n')
    mine = load_scenario(p)
    assert mine.serving.table is not changed.serving.table  # its own GPUs: read for it
    assert mine.serving.table == changed.serving.table  # no row names "mine": the same rows
