"""An autoscaled day on the disaggregated simulation (kvstage/explore/autoscale_disagg.py):
Dynamo's replica rule per side, rooms routed only to serving instances, lives and
GPU-hours, and `kvstage autoscale --disaggregated`."""

from __future__ import annotations

import json

import pytest
from test_plan import SCENARIO as TINY_SCENARIO
from test_plan import SLO as TINY_SLO
from typer.testing import CliRunner

from kvstage.cli.main import app
from kvstage.explore.autoscale import warp_arrivals
from kvstage.explore.autoscale_disagg import (
    DisaggPlanner,
    SidePlanner,
    peak_capacities,
    run_disagg_day,
)
from kvstage.shared.scenario import load_scenario
from kvstage.shared.workload import generate_requests

PROFILE = (0.25, 1.75)


def test_each_side_targets_its_tokens_over_one_instances_within_bounds():
    p = SidePlanner(capacity_tps=1000.0, floor=1, ceiling=4)
    assert p.target(0.0) == 1  # the floor
    assert p.target(1000.0) == 1 and p.target(1001.0) == 2  # ceil(tokens/s / capacity)
    assert p.target(10_000.0) == 4  # the ceiling


def test_slots_are_reused_once_their_instance_is_gone():
    p = SidePlanner(capacity_tps=1.0, floor=1, ceiling=2)
    assert p.add(0.0, 0.0) and p.add(10.0, 40.0) and not p.add(20.0, 50.0)  # two slots
    assert p.serving(30.0) == [0] and p.closed(30.0) == {1}  # slot 1 is starting up
    p.drain(1, 60.0)
    assert p.running() == [0] and p.closed(60.0) == {1}
    p.gone(1, 70.0)
    assert p.add(80.0, 90.0) and p.current[1] == 2  # a new life in the freed slot
    assert p.lives[1] == [1, 10.0, 40.0, 60.0, 70.0]


@pytest.fixture(scope="module")
def day(tmp_path_factory):
    # the tiny model: one TP1 prefill instance computes 3,000 prompt tokens/s, ~2.9 of
    # its 1,024-token prompts a second; a mean of 2.5 req/s warped to 0.625 then 4.375:
    # one prefill instance for the first half, two for the second
    path = tmp_path_factory.mktemp("dday") / "tiny.toml"
    path.write_text(TINY_SCENARIO + TINY_SLO)
    sets = ["workload.requests=600", "workload.rate_per_s=2.5", "workload.arrival=poisson",
            "cluster.prefill_instances=2", "cluster.decode_instances=1"]  # fmt: skip
    s = load_scenario(path, sets)
    reqs = warp_arrivals(generate_requests(s), PROFILE)
    cp, cd = peak_capacities(reqs, PROFILE, 2, 1)
    planner = DisaggPlanner(SidePlanner(cp, 1, 3), SidePlanner(cd, 1, 2), startup_s=15,
                            interval_s=10, cooldown_s=30)  # fmt: skip
    return s, reqs, run_disagg_day(s, reqs, planner)


def test_prefill_scales_up_with_its_load(day):
    s, _, d = day
    tl = d["timeline"]
    half = len(tl) // 2
    assert max(x["prefill_instances"] for x in tl[: half - 2]) == 1
    assert max(x["prefill_instances"] for x in tl[half + 2 :]) >= 2
    assert all(x["prefill_target"] >= 1 and x["decode_target"] >= 1 for x in tl)
    assert d["violations"] == 0 and d["slo_attainment"] > 0.5


def test_rooms_go_only_to_instances_serving_at_their_arrival(day):
    _, reqs, d = day
    lives, routes = d["lives"], d["routes"]
    assert len(routes) == len(reqs)
    for r in reqs:
        for side, slot in zip(("prefill", "decode"), routes[r.room], strict=True):
            # a life of that slot was serving: ready, not drained yet
            assert any(
                x[0] == slot and x[2] <= r.arrival_s and (x[3] is None or r.arrival_s < x[3])
                for x in lives[side]
            ), (r.room, side, slot, r.arrival_s)


def test_gpu_hours_count_each_life_from_its_request(day):
    s, _, d = day
    by_hand = sum((x[4] - x[1]) * s.prefill.tp for x in d["lives"]["prefill"])
    by_hand += sum((x[4] - x[1]) * s.decode.tp for x in d["lives"]["decode"])
    assert d["gpu_hours"] == pytest.approx(by_hand / 3600)
    fixed = (2 * s.prefill.tp + 1 * s.decode.tp) * d["span_s"] / 3600
    assert d["fixed_gpu_hours"] == pytest.approx(fixed)
    added = [x for x in d["lives"]["prefill"] if x[1] > 0]
    assert added and all(x[2] - x[1] == pytest.approx(15) for x in added)  # start-up


def test_the_command_scales_both_sides(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SCENARIO + TINY_SLO)
    out = tmp_path / "as"
    args = ["autoscale", str(path), "--disaggregated", "--set", "workload.requests=200",
            "--set", "cluster.prefill_instances=2", "--profile", "0.5,1.5",
            "--interval-s", "10", "--startup-s", "10", "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert "disaggregated: prefill TP1" in res.output and "2 + 1 fixed" in res.output
    assert {p.name for p in out.iterdir()} == {"autoscale.csv", "autoscale.json", "autoscale.png"}
    doc = json.loads((out / "autoscale.json").read_text())
    assert doc["fixed_instances"] == {"prefill": 2, "decode": 1}
    head = (out / "autoscale.csv").read_text().splitlines()[0].split(",")
    assert {"prefill_instances", "decode_instances", "slo_attainment"} <= set(head)
    res = CliRunner().invoke(app, [*args, "--tp", "2"], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "--tp: not with --disaggregated" in res.output
