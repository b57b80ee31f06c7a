"""The workload generator: a pure, seeded function of the scenario."""

from __future__ import annotations

import math
import random
import statistics
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.shared.scenario import (
    Scenario,
    ScenarioError,
    load_scenario,
    scaled,
    scenario_from_dict,
)
from kvstage.shared.workload import Request, generate_requests, read_trace, trace_rows

REPO = Path(__file__).resolve().parents[1]


def scenario(
    base_dir: Path | None = None, decode: dict[str, Any] | None = None, **workload: Any
) -> Scenario:
    data = {
        "model": {"preset": "llama-3-8b"},
        "prefill": {"tp": 4},
        "decode": {"tp": 2, **(decode or {})},
        "workload": workload,
    }
    return scenario_from_dict(data, base_dir)


def check_basic(reqs: list[Request], n: int) -> None:
    assert len(reqs) == n
    assert [r.room for r in reqs] == list(range(n))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))
    assert all(r.prompt_tokens >= 1 and 0 <= r.prefix_tokens <= r.prompt_tokens for r in reqs)


# --------------------------------------------------------------------------- purity


def test_deterministic() -> None:
    s = scenario(requests=50, prompt="lognormal")
    a, b = generate_requests(s), generate_requests(s)
    assert a == b
    # A freshly loaded copy of the same scenario gives the same list too.
    path = REPO / "scenarios" / "llama3-70b-p8-d2.toml"
    assert generate_requests(load_scenario(path)) == generate_requests(load_scenario(path))


def test_seed_changes_the_list() -> None:
    a = generate_requests(scenario(requests=20, prompt="uniform", seed=0))
    b = generate_requests(scenario(requests=20, prompt="uniform", seed=1))
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]
    assert [r.prompt_tokens for r in a] != [r.prompt_tokens for r in b]


def test_global_random_untouched() -> None:
    random.seed(1234)
    expected = random.random()
    random.seed(1234)
    generate_requests(scenario(requests=30, prompt="lognormal"))
    assert random.random() == expected


def test_prompt_distribution_does_not_move_arrivals() -> None:
    a = generate_requests(scenario(requests=40, prompt="fixed"))
    b = generate_requests(scenario(requests=40, prompt="lognormal"))
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]


# --------------------------------------------------------------------------- arrivals


def test_fixed_spacing_is_exact() -> None:
    reqs = generate_requests(scenario(requests=10, arrival="fixed", rate_per_s=4.0))
    check_basic(reqs, 10)
    assert [r.arrival_s for r in reqs] == [i / 4.0 for i in range(10)]


def test_burst_grouping() -> None:
    reqs = generate_requests(scenario(requests=20, arrival="burst", burst_size=8, rate_per_s=2.0))
    check_basic(reqs, 20)
    times = [r.arrival_s for r in reqs]
    # Groups of 8 together, a group every 8 / 2 = 4 s; the last group is partial.
    assert times == [0.0] * 8 + [4.0] * 8 + [8.0] * 4


def test_poisson_rate() -> None:
    n, rate = 2000, 5.0
    reqs = generate_requests(scenario(requests=n, arrival="poisson", rate_per_s=rate))
    check_basic(reqs, n)
    assert reqs[0].arrival_s == 0.0
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False)]
    mean = statistics.fmean(gaps)
    # Standard error of the mean is (1/rate)/sqrt(n) ~ 2.2 % here; allow 10 %.
    assert mean == pytest.approx(1 / rate, rel=0.10)
    # Exponential gaps: coefficient of variation 1.
    assert statistics.stdev(gaps) / mean == pytest.approx(1.0, abs=0.15)


# --------------------------------------------------------------------------- prompts


def test_fixed_prompt() -> None:
    reqs = generate_requests(scenario(requests=5, prompt="fixed", prompt_tokens=3000))
    assert {r.prompt_tokens for r in reqs} == {3000}


def test_uniform_prompt() -> None:
    reqs = generate_requests(
        scenario(requests=2000, prompt="uniform", prompt_min=1000, prompt_max=3000)
    )
    lengths = [r.prompt_tokens for r in reqs]
    assert min(lengths) >= 1000 and max(lengths) <= 3000
    assert statistics.fmean(lengths) == pytest.approx(2000, rel=0.03)
    assert min(lengths) < 1050 and max(lengths) > 2950


def test_lognormal_prompt() -> None:
    reqs = generate_requests(
        scenario(
            requests=2000,
            prompt="lognormal",
            prompt_tokens=4096,
            prompt_sigma=0.5,
            prompt_min=1,
            prompt_max=10**6,
        )
    )
    lengths = [r.prompt_tokens for r in reqs]
    # The sample median's standard error is ~1.25 * sigma / sqrt(n) ~ 1.4 % in log space.
    assert statistics.median(lengths) == pytest.approx(4096, rel=0.06)
    logs = [math.log(x) for x in lengths]
    assert statistics.stdev(logs) == pytest.approx(0.5, rel=0.1)


def test_lognormal_clamped() -> None:
    reqs = generate_requests(
        scenario(
            requests=500,
            prompt="lognormal",
            prompt_tokens=4096,
            prompt_sigma=1.5,
            prompt_min=2048,
            prompt_max=8192,
        )
    )
    lengths = [r.prompt_tokens for r in reqs]
    assert min(lengths) == 2048 and max(lengths) == 8192


def test_max_prompt_tokens_caps_everything() -> None:
    reqs = generate_requests(
        scenario(
            requests=200, prompt="uniform", prompt_min=1000, prompt_max=9000, max_prompt_tokens=2000
        )
    )
    assert max(r.prompt_tokens for r in reqs) == 2000


# --------------------------------------------------------------------------- prefix


def test_prefix_capped_at_page_floor_of_prompt() -> None:
    s = scenario(
        decode={"prefix_tokens": 4096},
        requests=300,
        prompt="uniform",
        prompt_min=1000,
        prompt_max=6000,
    )
    for r in generate_requests(s):
        assert r.prefix_tokens == min(4096, r.prompt_tokens // 16 * 16)
        assert r.prefix_tokens % 16 == 0


# --------------------------------------------------------------------------- traces


TRACE = """\
# a comment line
arrival_s,prompt_tokens,prefix_tokens
0.5,1000,
0.0,2000,512

0.25,300,100
1.0,4000,8000
"""


def write_trace(tmp_path: Path, text: str = TRACE) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_trace_arrivals_and_prompts(tmp_path: Path) -> None:
    write_trace(tmp_path)
    s = scenario(
        tmp_path,
        decode={"prefix_tokens": 64},
        requests=100,
        arrival="trace",
        prompt="trace",
        trace="trace.csv",
    )
    reqs = generate_requests(s)
    check_basic(reqs, 4)
    assert [(r.arrival_s, r.prompt_tokens, r.prefix_tokens) for r in reqs] == [
        (0.0, 2000, 512),
        (0.25, 300, 100),  # not page aligned: kept, the protocol must fail the room
        (0.5, 1000, 64),  # no prefix in the row: decode.prefix_tokens
        (1.0, 4000, 4000),  # capped at the prompt
    ]
    # At most `requests` rows, the first ones of the file.
    reqs = generate_requests(
        scenario(tmp_path, requests=2, arrival="trace", prompt="trace", trace="trace.csv")
    )
    assert [r.arrival_s for r in reqs] == [0.0, 0.5]


def test_trace_arrivals_with_sampled_prompts(tmp_path: Path) -> None:
    write_trace(tmp_path)
    reqs = generate_requests(
        scenario(tmp_path, arrival="trace", trace="trace.csv", prompt="fixed", prompt_tokens=777)
    )
    assert [r.prompt_tokens for r in reqs] == [777] * 4


def test_csv_prompts_with_generated_arrivals_cycle(tmp_path: Path) -> None:
    write_trace(tmp_path)
    reqs = generate_requests(
        scenario(
            tmp_path,
            requests=6,
            arrival="fixed",
            rate_per_s=1.0,
            prompt="trace",
            trace="trace.csv",
        )
    )
    assert [r.prompt_tokens for r in reqs] == [1000, 2000, 300, 4000, 1000, 2000]
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("arrival_s,prompt_tokens\n0,100\nzero,100\n", "trace.csv:3: arrival_s = 'zero'"),
        ("arrival_s,prompt_tokens\n0,100\n1,0\n", "trace.csv:3: prompt_tokens = 0"),
        ("arrival_s,prompt_tokens\n-1,100\n", "trace.csv:2: arrival_s = '-1'"),
        ("arrival_s,prompt_tokens\nnan,100\n", "trace.csv:2: arrival_s = 'nan'"),
        ("arrival_s,prompt_tokens\ninf,100\n", "trace.csv:2: arrival_s = 'inf'"),
        ("arrival_s,prompt_tokens\n0,100,5\n", "trace.csv:2: 3 fields, expected 2"),
        ("arrival_s,prompt_tokens\n0,1.5\n", "trace.csv:2: prompt_tokens = '1.5'"),
        (
            "arrival_s,prompt_tokens\n0,\n",
            "trace.csv:2: prompt_tokens = '': expected an integer >= 1",
        ),
        ("arrival_s,prompt_tokens,prefix_tokens\n0,100,-16\n", "prefix_tokens = -16"),
        (
            "arrival_s,prompt_tokens,prefix_tokens\n0,100,x\n",
            "prefix_tokens = 'x': expected an integer >= 0",
        ),
        ("arrival,prompt_tokens\n0,100\n", "trace.csv:1: bad header"),
        ("arrival_s,arrival_s,prompt_tokens\n", "arrival_s given twice"),
        ("prompt_tokens\n100\n", "missing arrival_s"),
        ("0,100\n", "must be the header"),
        ("arrival_s,prompt_tokens\n", "trace has no data rows"),
        ("arrival_s,prompt_tokens\n# only comments\n\n", "trace has no data rows"),
        ("", "the trace file is empty"),
        ("\n# nothing\n  \n", "the trace file is empty"),
        ('arrival_s,prompt_tokens\n"0,100\n', "trace.csv"),
    ],
)
def test_bad_trace(tmp_path: Path, text: str, expected: str) -> None:
    path = write_trace(tmp_path, text)
    # Loading the scenario reads the trace: a bad one never gets to a run.
    with pytest.raises(ScenarioError) as info:
        scenario(tmp_path, arrival="trace", trace="trace.csv")
    assert expected in str(info.value)
    assert str(info.value).startswith("workload.trace: ")
    assert info.value.field == "workload.trace"
    # ... also when only the prompts come from it
    with pytest.raises(ScenarioError, match="workload.trace"):
        scenario(tmp_path, arrival="fixed", prompt="trace", trace="trace.csv")
    # The reader alone says the same.
    with pytest.raises(ScenarioError) as direct:
        read_trace(path)
    assert expected in str(direct.value)


def test_bad_trace_named_in_a_scenario_file(tmp_path: Path) -> None:
    write_trace(tmp_path, "arrival_s,prompt_tokens\n0,100\n0.5,many\n")
    path = tmp_path / "s.toml"
    path.write_text(
        '[model]\npreset = "llama-3-8b"\n[prefill]\ntp = 4\n[decode]\ntp = 2\n'
        '[workload]\narrival = "trace"\ntrace = "trace.csv"\n'
    )
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    message = str(info.value)
    assert message.startswith(f"{path}: workload.trace: {tmp_path / 'trace.csv'}:3: ")
    assert "prompt_tokens = 'many': expected an integer >= 1" in message


def test_a_named_trace_is_read_even_with_its_arrivals_and_prompts_overridden(
    tmp_path: Path,
) -> None:
    # it still supplies what the scenario does not override (output lengths, prefixes)
    write_trace(tmp_path, "not a trace at all\n")
    with pytest.raises(ScenarioError, match="workload.trace"):
        scenario(tmp_path, arrival="fixed", prompt="fixed", trace="trace.csv")


def test_a_trace_supplies_everything_it_has_unless_overridden(tmp_path: Path) -> None:
    write_trace(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0,1000,7\n0.5,2000,9\n")
    only = scenario(tmp_path, trace="trace.csv")  # nothing but the trace named
    w = only.workload
    assert (w.arrival, w.prompt, w.requests, w.output_tokens) == ("trace", "trace", None, None)
    reqs = generate_requests(only)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 1000, 7),
        (0.5, 2000, 9),
    ]
    # each explicit setting overrides its part, and only that
    reqs = generate_requests(
        scenario(tmp_path, trace="trace.csv", prompt="fixed", prompt_tokens=64, output_tokens=3)
    )
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 64, 3),
        (0.5, 64, 3),
    ]
    reqs = generate_requests(
        scenario(tmp_path, trace="trace.csv", arrival="fixed", rate_per_s=1.0, requests=3)
    )
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 1000, 7),
        (1.0, 2000, 9),
        (2.0, 1000, 7),
    ]
    # the resolved scenario says where each part comes from, and loads back the same
    again = scenario_from_dict(tomllib.loads(only.to_toml()), tmp_path)
    assert generate_requests(again) == generate_requests(only)


def test_the_old_prompt_name_csv_is_refused_with_its_new_name(tmp_path: Path) -> None:
    write_trace(tmp_path)
    with pytest.raises(ScenarioError) as info:
        scenario(tmp_path, arrival="trace", prompt="csv", trace="trace.csv")
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "workload.prompt" in message and 'renamed "trace"' in message


def test_trace_with_byte_order_mark_and_unsorted_rows(tmp_path: Path) -> None:
    write_trace(tmp_path, "\ufeffprompt_tokens,arrival_s\n300,2.0\n100,0.5\n200,0.5\n")
    reqs = generate_requests(
        scenario(tmp_path, requests=10, arrival="trace", prompt="trace", trace="trace.csv")
    )
    # rows need not be sorted; ties keep file order
    assert [(r.arrival_s, r.prompt_tokens) for r in reqs] == [(0.5, 100), (0.5, 200), (2.0, 300)]


def test_missing_trace(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="no such trace file"):
        read_trace(tmp_path / "gone.csv")
    # The loader already refuses a scenario naming a missing trace.
    with pytest.raises(ScenarioError, match="workload.trace"):
        scenario(tmp_path, arrival="trace", trace="gone.csv")
    # The trace is read once, at load: its rows stay with the scenario, so the requests
    # are drawn again, the same, after the file is gone.
    path = write_trace(tmp_path)
    s = scenario(tmp_path, arrival="trace", trace="trace.csv")
    before = generate_requests(s)
    path.unlink()
    assert generate_requests(s) == before and trace_rows(s) == (4, 4)


def test_the_trace_is_read_once_at_load(tmp_path: Path, monkeypatch) -> None:
    """Loading reads the trace; drawing the requests (five times in one simulation:
    the driver, the summary, the bottleneck...) reads it no more."""
    import kvstage.shared.scenario.loading as loading
    import kvstage.shared.workload as workload

    reads: list[str] = []
    real = loading.read_trace

    def counting(path):
        reads.append(str(path))
        return real(path)

    monkeypatch.setattr(loading, "read_trace", counting)
    monkeypatch.setattr(workload, "read_trace", counting)
    write_trace(tmp_path)
    s = scenario(tmp_path, arrival="trace", trace="trace.csv")
    assert len(reads) == 1
    for _ in range(5):
        generate_requests(s)
    trace_rows(s)
    assert len(reads) == 1


# --------------------------------------------------------------------------- scaled


def test_scaled_workload_fits() -> None:
    s = scaled(
        load_scenario(
            REPO / "scenarios" / "llama3-70b-p8-d2.toml", ["hardware.scale_down.enabled=true"]
        )
    )
    reqs = generate_requests(s)
    check_basic(reqs, 8)
    assert max(r.prompt_tokens for r in reqs) <= 2048


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    n=st.integers(1, 60),
    arrival=st.sampled_from(["poisson", "fixed", "burst"]),
    prompt=st.sampled_from(["fixed", "uniform", "lognormal"]),
    rate=st.floats(0.01, 1000),
    burst=st.integers(1, 10),
    bounds=st.tuples(st.integers(1, 5000), st.integers(1, 5000)).map(sorted),
    sigma=st.floats(0, 3),
    prefix_pages=st.integers(0, 400),
    page_log2=st.integers(0, 7),
    cap=st.one_of(st.none(), st.integers(1, 5000)),
)
def test_generated_lists_are_well_formed(
    seed: int,
    n: int,
    arrival: str,
    prompt: str,
    rate: float,
    burst: int,
    bounds: list[int],
    sigma: float,
    prefix_pages: int,
    page_log2: int,
    cap: int | None,
) -> None:
    page = 2**page_log2
    lo, hi = bounds
    s = scenario(
        decode={"page_size": page, "prefix_tokens": prefix_pages * page, "staging_pool_mb": 1e6},
        requests=n,
        arrival=arrival,
        prompt=prompt,
        rate_per_s=rate,
        burst_size=burst,
        prompt_min=lo,
        prompt_max=hi,
        prompt_tokens=lo,
        prompt_sigma=sigma,
        seed=seed,
        max_prompt_tokens=cap,
    )
    reqs = generate_requests(s)
    check_basic(reqs, n)
    assert reqs == generate_requests(s)
    for r in reqs:
        assert r.prefix_tokens % page == 0
        assert r.prefix_tokens <= r.prompt_tokens // page * page
        if cap is not None:
            assert r.prompt_tokens <= cap
        if prompt != "fixed" and cap is None:
            assert lo <= r.prompt_tokens <= hi


# --------------------------------------------------------------------------- whole traces


def long_trace(tmp_path: Path, rows: int = 40) -> Path:
    return write_trace(
        tmp_path,
        "arrival_s,prompt_tokens\n" + "".join(f"{i / 10},{100 + i}\n" for i in range(rows)),
    )


def test_every_trace_row_replayed_without_requests(tmp_path: Path) -> None:
    long_trace(tmp_path)
    s = scenario(tmp_path, arrival="trace", prompt="trace", trace="trace.csv")
    assert s.workload.requests is None
    reqs = generate_requests(s)
    check_basic(reqs, 40)  # not the 16 a generated workload defaults to
    assert [r.prompt_tokens for r in reqs] == [100 + i for i in range(40)]
    assert trace_rows(s) == (40, 40)
    # generated arrivals still default to 16, written out (a resolved scenario says so)
    g = scenario(tmp_path, arrival="poisson")
    assert g.workload.requests == 16 and len(generate_requests(g)) == 16
    assert trace_rows(g) is None


def test_requests_replays_the_first_rows_n_of_m(tmp_path: Path) -> None:
    long_trace(tmp_path)
    s = scenario(tmp_path, requests=7, arrival="trace", prompt="trace", trace="trace.csv")
    assert [r.prompt_tokens for r in generate_requests(s)] == [100 + i for i in range(7)]
    assert trace_rows(s) == (7, 40)
    big = scenario(tmp_path, requests=100, arrival="trace", prompt="trace", trace="trace.csv")
    assert trace_rows(big) == (40, 40)


def test_the_old_name_trace_csv_is_refused_in_one_line(tmp_path: Path) -> None:
    write_trace(tmp_path)
    with pytest.raises(ScenarioError) as info:
        scenario(tmp_path, arrival="trace", trace_csv="trace.csv")
    message = str(info.value)
    assert "\n" not in message and "workload.trace_csv" in message
    assert "renamed workload.trace" in message


@pytest.mark.parametrize("name", ["trace.parquet", "trace.json", "trace"])
def test_a_trace_of_another_type_is_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("arrival_s,prompt_tokens\n0,100\n")
    with pytest.raises(ScenarioError) as info:
        scenario(tmp_path, arrival="trace", trace=name)
    message = str(info.value)
    assert message.startswith("workload.trace: ") and "\n" not in message
    assert "a trace file of type" in message and ".csv" in message and ".jsonl" in message
