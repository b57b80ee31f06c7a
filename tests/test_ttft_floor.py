"""benchmarks/ttft_floor.py: its published figures are the evidence table's, and its
line through two points is the line through them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mods():
    try:
        yield _module("ttft_floor"), _module("published_serving")
    finally:
        sys.modules.pop("ttft_floor", None)
        sys.modules.pop("published_serving", None)


def test_the_nim_figures_are_the_tables(mods):
    floor, table = mods
    # published_serving's NIM set: (model, gpu, tp, precision, TTFT at 2,000, at 7,000)
    preset = {"llama3-8b": "llama-3-8b", "llama3-70b": "llama-3-70b"}
    theirs = {(preset[m], g, tp, p): (a, b) for m, g, tp, p, a, b in table._NIM_SET}
    assert len(floor.NIM) == len(theirs) == 12
    for model, gpu, tp, dtype, (_, at2k, at7k) in floor.NIM:
        a, b = theirs[model, gpu, tp, dtype]
        assert (at2k, at7k) == (pytest.approx(a, abs=0.01), pytest.approx(b, abs=0.01))
    assert [t for _, t in floor.TRT] == [r.published for r in table.ROWS if "TRT-LLM" in r.case
                                         and "TTFT" in r.case]  # fmt: skip


def test_the_fit_goes_through_its_points(mods):
    floor, _ = mods
    a, b = floor.fit([(200, 10.0), (2000, 46.0)])
    assert (a, b) == (pytest.approx(6.0), pytest.approx(20.0))  # 20 us a token


def test_it_prints_every_configuration(mods, capsys):
    floor, _ = mods
    floor.main()
    out = capsys.readouterr().out
    assert out.count("TP") >= 13 and "published a = 79.4 ms" in out


def test_tp_cost_is_what_dividing_the_work_leaves_out(mods):
    floor, _ = mods
    # TP1 at 20 us a token halves to 10 at TP2: a TP2 slope of 14 leaves 4 us of TP's own
    assert floor.tp_cost(20.0, 14.0, 1, 2) == pytest.approx(4.0)
    assert floor.tp_cost(60.0, 30.0, 4, 8) == pytest.approx(0.0)
    # every pair names two configurations of the table
    names = {(m, g, tp, d) for m, g, tp, d, _ in floor.NIM}
    for model, gpu, dtype, lo, hi in floor.TP_PAIRS:
        d_lo, d_hi = dtype if isinstance(dtype, tuple) else (dtype, dtype)
        assert {(model, gpu, lo, d_lo), (model, gpu, hi, d_hi)} <= names


def test_the_implied_attention_rate_inverts_a_quadratic(mods):
    floor, table = mods
    s = table._dli("llama3-8b", "h100-sxm", 1, "fp16")
    k = floor.attention_flops(s, 1, 0.5, decode=False)  # FLOPs of n^2 causal attention
    rate = 500e12  # TTFT = k n^2 / rate: the slopes between 200, 2,000 and 7,000 tokens
    t = {n: k * n * n / rate * 1e3 for n in floor.PROMPTS}
    b = (t[2000] - t[200]) / 1800 * 1e3
    b2 = (t[7000] - t[2000]) / 5000 * 1e3
    assert floor.implied_attention_tflops(s, b, b2) == pytest.approx(500.0)
    assert floor.implied_attention_tflops(s, b, b) == float("inf")  # no rise: not attention
