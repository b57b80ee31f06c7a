"""Load over time (kvstage/explore/autoscale.py): the rate warp, the planner's targets,
an autoscaled replay on the colocated engine, its GPU-hours and the command."""

from __future__ import annotations

import json

import pytest
from test_plan import SCENARIO as TINY_SCENARIO
from test_plan import SLO as TINY_SLO
from typer.testing import CliRunner

from kvstage.cli.main import app
from kvstage.explore.autoscale import Planner, gpu_hours, parse_profile, run_day, warp_arrivals
from kvstage.explore.executor import ExploreError
from kvstage.shared.scenario import load_scenario
from kvstage.shared.workload import Request, generate_requests
from kvstage.sim.colocated import colocated_scenario


def _requests(n: int, span: float) -> list[Request]:
    return [Request(i, i * span / (n - 1), 100, 0, 4) for i in range(n)]


def test_the_warp_keeps_requests_order_and_span_and_follows_the_profile():
    reqs = _requests(4001, 1000.0)
    warped = warp_arrivals(reqs, (1.0, 3.0))
    assert len(warped) == len(reqs) and [r.room for r in warped] == [r.room for r in reqs]
    times = [r.arrival_s for r in warped]
    assert times == sorted(times)
    assert times[0] == 0 and times[-1] == pytest.approx(1000.0)
    # rate x 0.5 in the first half, x 1.5 in the second: a quarter of the requests first
    first = sum(1 for t in times if t < 500)
    assert first == pytest.approx(1000, abs=2)
    assert [r.prompt_tokens for r in warped] == [r.prompt_tokens for r in reqs]


def test_profiles_parse_or_say_what_is_allowed():
    assert len(parse_profile("day")) == 24 and parse_profile("1,2.5") == (1.0, 2.5)
    for bad in ("0", "-1,2", "fast", ""):
        with pytest.raises(ExploreError, match="--profile"):
            parse_profile(bad)


def test_the_planner_targets_rate_and_queue_within_its_bounds():
    p = Planner(capacity_rps=2.0, floor=2, ceiling=6, queue_per_instance=4)
    assert p.target(0.0, 0) == 2  # the floor
    assert p.target(5.0, 0) == 3  # ceil(5 / 2)
    assert p.target(5.0, 9) == 6  # + ceil(9 / 4), at the ceiling
    assert p.target(50.0, 0) == 6


@pytest.fixture(scope="module")
def day(tmp_path_factory):
    # the tiny model: one instance prefills 3,000 tokens/s, ~2.9 of its 1,024-token
    # prompts a second; a mean of 3 req/s warped to 0.75, 3 and 5.25 over three thirds
    path = tmp_path_factory.mktemp("day") / "tiny.toml"
    path.write_text(TINY_SCENARIO + TINY_SLO)
    sets = ["decode.tp=2", "workload.requests=3000", "workload.rate_per_s=3",
            "workload.arrival=poisson"]  # fmt: skip
    s = colocated_scenario(load_scenario(path, sets), 2, 1)
    reqs = warp_arrivals(generate_requests(s), (0.25, 1.0, 1.75))
    planner = Planner(capacity_rps=2.0, floor=1, ceiling=8, startup_s=30, interval_s=20,
                      cooldown_s=60)  # fmt: skip
    return s, run_day(s, reqs, planner, fixed_instances=4)


def test_an_autoscaled_day_follows_its_load(day):
    s, d = day
    tl = d["timeline"]
    third = len(tl) // 3
    early = max(x["instances"] for x in tl[: third - 2])
    late = max(x["instances"] for x in tl[2 * third + 2 :])
    assert early <= 2 < late  # 0.75 req/s needs one instance, 5.25 needs three
    assert min(x["instances"] for x in tl) >= 1  # the floor
    assert all(x["serving"] <= x["instances"] + 1 for x in tl)  # a draining one may serve
    added = d["lives"][1:]
    assert added and all(ready - start == pytest.approx(30) for start, ready, _ in added)
    assert all(end >= start for start, _, end in added)  # one asked for late may never serve
    assert d["slo_attainment"] > 0.5


def test_gpu_hours_count_each_instance_from_its_request(day):
    s, d = day
    assert d["gpu_hours"] == pytest.approx(gpu_hours(d["lives"], s.decode.tp))
    by_hand = sum(end - start for start, _, end in d["lives"]) * 2 / 3600
    assert d["gpu_hours"] == pytest.approx(by_hand)
    assert d["fixed_gpu_hours"] == pytest.approx(4 * 2 * d["span_s"] / 3600)
    assert d["gpu_hours"] < d["fixed_gpu_hours"]  # a third of the day at one instance


def test_the_command_writes_the_timeline_figure_and_summary(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SCENARIO + TINY_SLO)
    out = tmp_path / "as"
    args = ["autoscale", str(path), "--tp", "2", "--set", "workload.requests=300",
            "--profile", "0.5,1.5", "--fixed-instances", "2", "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "GPU-hours against" in res.output
    assert {p.name for p in out.iterdir()} == {"autoscale.csv", "autoscale.json", "autoscale.png"}
    doc = json.loads((out / "autoscale.json").read_text())
    assert doc["requests"] == 300 and doc["fixed_instances"] == 2
    res = CliRunner().invoke(app, [*args[:-2], "--profile", "x", "--out", str(out)])
    assert res.exit_code == 2 and "--profile" in res.output


def test_a_drained_instance_takes_nothing_new_and_goes_when_its_last_finishes(tmp_path):
    from kvstage.sim.colocated import simulate_colocated

    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SCENARIO + TINY_SLO)
    s = colocated_scenario(
        load_scenario(path, ["decode.tp=2", "workload.requests=400", "workload.rate_per_s=8"]), 2, 2
    )
    drained_at = []

    def control(engine, now):
        busy = all(x.outstanding for x in engine.instances)  # drain one that is working
        if now >= 10 and busy and not drained_at:
            assert engine.drain_instance(now)
            drained_at.append((now, next(x.index for x in engine.instances if x.draining)))

    r = simulate_colocated(s, control=control, interval=5.0)
    ((when, gone),) = drained_at
    mine = [i for i in r.rooms.values() if i["instance"] == gone]
    assert mine and all(i["arrival"] <= when for i in mine)
    last = max(i["generate_end"] for i in mine)  # busy at the drain: it goes with its last
    assert last > when and r.lives[gone][2] == pytest.approx(last)
    later = [i for i in r.rooms.values() if i["arrival"] > when]
    assert later and all(i["instance"] != gone for i in later)
