"""Calibration: the pure fits on synthetic points, and a real (quick) calibration
against the loopback engines whose profile loads into a scenario and simulates."""

from __future__ import annotations

import json
import math
import os
import tomllib
from pathlib import Path

import numpy as np
import pytest
from conftest import require_engine
from test_netns import namespaces as two_namespaces  # noqa: F401 (a fixture)
from typer.testing import CliRunner

from kvstage.calibrate.fit import fit_copy, fit_latency_bandwidth, fit_per_request, median_of
from kvstage.calibrate.inrun import CPU_FIELDS
from kvstage.calibrate.profile import CalibrationPlan, calibrate, sidecar_path, write_profile
from kvstage.cli.main import app
from kvstage.run.result import judge
from kvstage.run.simrun import simulate
from kvstage.shared.scenario import PROFILE_FIELDS, load_scenario

IN_CI = os.environ.get("CI") == "true"
REPO = Path(__file__).resolve().parents[1]
SIZES = [4096 * 4**k for k in range(8)]  # 4 KiB .. 64 MiB


def noisy(clean: np.ndarray, rng: np.random.Generator, rel: float, reps: int = 7) -> list[float]:
    """Medians of `reps` measurements with multiplicative noise of `rel` (1 sigma)."""
    samples = clean[:, None] * (1 + rel * rng.standard_normal((clean.size, reps)))
    return median_of(samples.tolist())


# --------------------------------------------------------------------------- pure fits


def test_exact_points_fit_exactly() -> None:
    lat, bw = 30e-6, 8e9
    x = np.array(SIZES, dtype=float)
    fit = fit_latency_bandwidth(x, lat + x / bw)
    assert fit.latency_s == pytest.approx(lat, rel=1e-9)
    assert fit.bandwidth_Bps == pytest.approx(bw, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert max(abs(r) for r in fit.residuals) < 1e-9
    assert len(fit.residuals) == len(SIZES)
    # the result unpacks as the documented 4-tuple
    latency_s, bandwidth_Bps, r2, residuals = fit
    assert (latency_s, bandwidth_Bps) == (fit.latency_s, fit.bandwidth_Bps)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("lat,bw", [(30e-6, 8e9), (5e-6, 46e9), (400e-6, 2.5e9)])
def test_latency_bandwidth_recovered_from_noisy_points(seed: int, lat: float, bw: float) -> None:
    rng = np.random.default_rng(seed)
    x = np.array(SIZES, dtype=float)
    fit = fit_latency_bandwidth(x, noisy(lat + x / bw, rng, rel=0.03))
    assert fit.latency_s == pytest.approx(lat, rel=0.05)
    assert fit.bandwidth_Bps == pytest.approx(bw, rel=0.05)
    assert fit.r2 > 0.99


def test_unweighted_fit_is_available() -> None:
    x = np.array(SIZES, dtype=float)
    fit = fit_latency_bandwidth(x, 10e-6 + x / 4e9, relative=False)
    assert fit.latency_s == pytest.approx(10e-6, rel=1e-6)
    assert fit.bandwidth_Bps == pytest.approx(4e9, rel=1e-9)


def test_negative_intercept_is_clamped() -> None:
    x = np.array(SIZES, dtype=float)
    t = x / 5e9
    t[0] *= 0.8  # the small point is faster than pure bandwidth allows: intercept < 0
    fit = fit_latency_bandwidth(x, t)
    assert fit.latency_s == 0.0  # refitted through the origin
    assert fit.bandwidth_Bps == pytest.approx(5e9, rel=0.1)


@pytest.mark.parametrize(
    "bad",
    [
        ([1, 2], [1e-3]),  # lengths differ
        ([1], [1e-3]),  # one point
        ([1, 2], [1e-3, -1e-3]),  # negative time
        ([1, 2], [1e-3, float("nan")]),
        ([1, 2], [2e-3, 1e-3]),  # time falls with size: no bandwidth
    ],
)
def test_bad_points_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="fit_latency_bandwidth"):
        fit_latency_bandwidth(*bad)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("per", [3e-6, 25e-6])
def test_per_request_recovered_from_noisy_batches(seed: int, per: float) -> None:
    rng = np.random.default_rng(100 + seed)
    lat, bw, s = 40e-6, 6e9, 4096
    counts = np.array([1, 4, 16, 64, 256, 1024], dtype=float)
    t = noisy(lat + counts * (s / bw + per), rng, rel=0.03)
    fit = fit_per_request(counts, t, op_bytes=s, bandwidth_Bps=bw)
    assert fit.per_request_s == pytest.approx(per, rel=0.05)
    assert fit.intercept_s == pytest.approx(lat, rel=0.05)
    assert fit.r2 > 0.99
    assert len(fit.residuals) == counts.size


def test_per_request_never_negative() -> None:
    counts = [1, 10, 100]
    # slope below what the bytes alone take: no overhead left
    fit = fit_per_request(
        counts, [1e-5 + n * 1e-7 for n in counts], op_bytes=4096, bandwidth_Bps=1e9
    )
    assert fit.per_request_s == 0.0
    with pytest.raises(ValueError):
        fit_per_request(counts, [1e-5] * 3, op_bytes=4096, bandwidth_Bps=0.0)


@pytest.mark.parametrize("seed", range(4))
def test_copy_fit_separates_launches_and_bandwidth(seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    launch, bw = 12e-6, 5e9
    nbytes = np.array([2**k for k in range(16, 26)], dtype=float)
    both = np.concatenate([nbytes, nbytes])
    launches = np.array([1] * nbytes.size + [4] * nbytes.size, dtype=float)
    t = noisy(launches * launch + both / bw, rng, rel=0.03)
    fit = fit_copy(both, t, launches)
    assert fit.launch_s == pytest.approx(launch, rel=0.05)
    assert fit.bandwidth_Bps == pytest.approx(bw, rel=0.05)


# --------------------------------------------------------------------------- CLI


def test_cli_registers_calibrate_and_refuses_bad_input() -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["calibrate", "--help"])
    assert res.exit_code == 0
    assert "--backend" in res.output and "--quick" in res.output
    res = runner.invoke(app, ["calibrate", "--backend", "ucx"])
    assert res.exit_code == 2


# --------------------------------------------------------------------------- real engines


@pytest.mark.hw
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
@pytest.mark.slow
def test_quick_calibration_writes_a_profile_that_loads_and_simulates(
    backend: str, tmp_path: Path
) -> None:
    require_engine(backend)
    stages: set[str] = set()
    cal = calibrate(
        backend, "cpu", quick=True, progress=lambda stage, done, total: stages.add(stage)
    )
    assert {
        "writes",
        "batches",
        "control",
        "kernels",
        "fill",
        "posting fresh",
        "posting pairs",
    } <= stages
    assert cal.write.bandwidth_Bps > 0 and cal.write.latency_s >= 0
    assert cal.per_request.per_request_s >= 0
    assert 0 < cal.control_rtt_s < 1.0
    profile, side = write_profile(cal, tmp_path / f"{backend}-loopback.toml")

    # the profile holds every profile field and nothing else; fit and raw go to the sidecar
    data = tomllib.loads(profile.read_text())
    # every field but the steps' CPU factors, which it notes and leaves unset (cpu_factors)
    assert set(data) == {"source", *PROFILE_FIELDS} - set(CPU_FIELDS)
    assert "fill_cpu_scale = " in profile.read_text()  # measured (summary.json job_cpu), noted
    assert side == sidecar_path(profile) and side.is_file()
    extra = json.loads(side.read_text())
    assert extra["backend"] == backend
    assert {
        "write",
        "per_request",
        "control",
        "gather",
        "scatter",
        "copy",
        "fill",
        "posting",
    } <= set(extra["fit"])
    # the posting probe: its fit with R^2 and the serialisation verdicts, in the profile too
    posting = extra["fit"]["posting"]
    assert posting["fresh"]["r2"] <= 1.0 and posting["per_request_s"] > 0
    assert posting["two_ranks"]["verdict"] in ("overlap", "partial", "serialise")
    assert data["post_threads"] == 1 and data["descriptor_reuse"] is False
    assert data["inter_per_request_us"] == pytest.approx(posting["per_request_s"] * 1e6, rel=1e-3)
    assert "two ranks at once" in profile.read_text()
    assert len(extra["raw"]["write"]["sizes"]) == len(CalibrationPlan.quick_plan().sizes)
    # the host model's fields: the rank loop's constants, the message CPU, the host's load
    from kvstage.hw.rank.prefill import FORWARD_NICE

    assert data["host_model"] == "cpu-loop"
    # the loop wakes when a thread's job ends (hw/rank/process.py): no poll period to model
    assert data["loop_poll_us"] == 0 and data["forward_nice"] == FORWARD_NICE
    assert extra["raw"]["control"]["cpu_per_ping_s"] > 0
    assert data["event_us"] > extra["raw"]["handle"]["mean_s"] * 1e6  # handle() + one message
    assert data["background_cores"] >= 0 and extra["raw"]["conditions"]["cores"] >= 1

    # a catalogue scenario loads with it and simulates a handful of requests
    s = load_scenario(
        REPO / "scenarios" / "llama3-8b-p4-d2.toml",
        overrides=[f"links.profile={profile}", "workload.requests=4"],
    )
    r = s.links.resolved()
    assert r.profile_path == str(profile.resolve())
    assert r.host is not None and r.host.loop_poll_s == 0
    assert r.link.bandwidth_bytes_s == pytest.approx(data["inter_bandwidth_gbps"] * 1e9 / 8)
    assert r.control_latency_s == pytest.approx(data["control_latency_us"] / 1e6)
    result = simulate(s)
    assert judge(result).code == 0
    assert result.summary["requests_done"] == 4 and result.summary["requests_failed"] == 0
    # both processes on this host: every number is same-host, and the profile says its
    # inter-node figure is one
    assert set(extra["measured_where"].values()) == {"same-host"}
    assert "inter_* are a SAME-HOST figure" in profile.read_text()


def test_where_each_number_was_measured() -> None:
    from kvstage.calibrate.measure import measured_where
    from kvstage.hw.probes.hosts import ProbeHost

    apart = {"sender": ProbeHost("10.0.0.1"), "receiver": ProbeHost("10.0.0.2", "nsB")}
    w = measured_where(apart, {"over": "tcp"})
    assert (w["write"], w["batch"], w["control"]) == ("inter-host", "inter-host", "inter-host")
    assert w["kernels"] == w["posting"] == w["inrun"] == "same-host"
    assert w["hosts"] == "10.0.0.1 -> 10.0.0.2 (netns nsB)"
    # two namespaces whose writes UCX still copied with CMA crossed no network: same-host
    assert measured_where(apart, {"over": "same-host"})["write"] == "same-host"
    assert measured_where(None, {"over": "same-host"})["write"] == "same-host"


@pytest.mark.hw
@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.xdist_group("netns")  # with tests/test_netns.py: one two-namespace run at a time
def test_calibration_across_two_namespaces_records_inter_host(
    tmp_path: Path,
    two_namespaces,  # noqa: F811 (the fixture imported from test_netns)
) -> None:
    """`kvstage calibrate --host A --peer-host B --peer-netns NS_B`, run in namespace A: the
    writes cross the veth (its counters), the profile's inter-node numbers come from
    them and it says so, and the numbers measured on one host say that too."""
    import subprocess
    import sys

    from test_netns import ADDR_A, ADDR_B, _veth_tx

    require_engine("nixl")
    ns_a, ns_b, veth_a = two_namespaces
    out = tmp_path / "cal" / "p.toml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "MC_TCP_"))}
    env["UCX_TLS"] = "tcp"  # one machine to UCX: without it, it would copy with CMA
    before = _veth_tx(ns_a, veth_a)
    done = subprocess.run(
        ["ip", "netns", "exec", ns_a, str(Path(sys.executable).parent / "kvstage"), "calibrate"]
        + ["--backend", "nixl", "--quick", "--host", ADDR_A, "--peer-host", ADDR_B]
        + ["--peer-netns", ns_b, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    crossed = _veth_tx(ns_a, veth_a) - before
    extra = json.loads(sidecar_path(out).read_text())
    where = extra["measured_where"]
    assert (where["write"], where["batch"], where["control"]) == ("inter-host",) * 3, where
    assert where["kernels"] == where["inrun"] == "same-host"
    assert where["hosts"] == f"{ADDR_A} -> {ADDR_B} (netns {ns_b})"
    used = extra["raw"]["transport_used"]
    assert used["over"] == "tcp" and used["writes"]["inter-node"] == [f"tcp/{veth_a}"], used
    raw = extra["raw"]["write"]
    sent = sum(size * len(reps) for size, reps in zip(raw["sizes"], raw["seconds"], strict=True))
    assert crossed >= sent, f"{crossed} bytes left {veth_a}, {sent} written"
    text = out.read_text()
    assert "inter_* were measured between two hosts" in text and "inter-host writes" in text
    data = tomllib.loads(text)
    assert data["inter_bandwidth_gbps"] == pytest.approx(
        extra["fit"]["write"]["bandwidth_Bps"] * 8 / 1e9, rel=1e-3
    )
    assert "writes measured inter-host" in done.stdout


def test_weak_fits_are_named():
    """calibrate warns about every fit that explains too little (R² < 0.9)."""
    from types import SimpleNamespace

    from kvstage.cli.commands.calibrate import MIN_R2, weak_fits

    good, bad = SimpleNamespace(r2=0.99), SimpleNamespace(r2=0.32)
    cal = SimpleNamespace(
        write=bad,
        per_request=good,
        gather=good,
        gather_sub=good,
        scatter=SimpleNamespace(r2=0.5),
        copy=good,
        fill=good,
    )
    lines = weak_fits(cal)
    assert (
        len(lines) == 2
        and "write bandwidth" in lines[0]
        and "0.32" in lines[0]
        and "scatter" in lines[1]
    )
    assert all(str(MIN_R2) in line for line in lines)
    cal.write = cal.scatter = good
    assert weak_fits(cal) == []


def test_host_fields_from_raw_points():
    """event_us = handle() + half the CPU of a ping; background from the recorded
    conditions; the rank-loop constants as recorded (older raw points: read from hw/)."""
    from types import SimpleNamespace

    from kvstage.calibrate.profile import Calibration

    raw = {
        "control": {"rtt_s": [1e-4], "cpu_per_ping_s": 60e-6},
        "handle": {"mean_s": 10e-6},
        "conditions": {"cores": 2, "other_cpu_share": 0.25},
        "rank_loop": {"busy_poll_s": 0.002, "forward_nice": 5},
    }
    cal = SimpleNamespace(raw=raw, device="cpu")
    cal.message_cpu_s = Calibration.message_cpu_s.fget(cal)
    assert cal.message_cpu_s == pytest.approx(30e-6)
    assert Calibration.event_s.fget(cal) == pytest.approx(40e-6)
    assert Calibration.background_cores.fget(cal) == pytest.approx(0.5)
    assert Calibration.rank_loop.fget(cal) == {"busy_poll_s": 0.002, "forward_nice": 5}
    old = SimpleNamespace(raw={"control": {"rtt_s": [1e-4]}}, device="cuda:0")
    assert Calibration.message_cpu_s.fget(old) == 0.0
    assert Calibration.background_cores.fget(old) == 0.0
    assert Calibration.rank_loop.fget(old)["forward_nice"] == 0  # a GPU forward is not reniced


def test_inrun_factors_fixed_point_on_a_model():
    """fit_factors: each factor moves by target / simulated until they agree."""
    from kvstage.calibrate.inrun import FACTORS, fit_factors

    truth = {
        "fill_scale": 4.0,
        "copy_scale": 2.0,
        "control_scale": 10.0,
        "write_scale": 3.0,
        "event_scale": 6.0,
    }
    # a step is part scaled work, part fixed (as the poll wait and one loop event are)
    base = {
        "fill": (1e-3, 0.5e-3),
        "copy": (0.2e-3, 0.5e-3),
        "control": (0.1e-3, 0.1e-3),
        "write": (0.3e-3, 0.0),
        "event": (0.2e-3, 0.1e-3),
    }

    def model(f):
        return {k: a * f[FACTORS[k][0]] + b for k, (a, b) in base.items()}

    target = model(truth)
    factors, history = fit_factors(target, model, rounds=40)
    assert len(history) == 40 and history[0]["factors"] == dict.fromkeys(truth, 1.0)
    assert history[-1]["worst"] < history[0]["worst"]
    for name, want in truth.items():
        assert factors[name] == pytest.approx(want, rel=1e-3)
    # no figure for a kind (nan) leaves its factor alone
    factors, _ = fit_factors({**target, "copy": float("nan")}, model, rounds=3)
    assert factors["copy_scale"] == 1.0


def test_inrun_fit_recovers_factors_from_a_simulated_run():
    """fit_profile on the calibration scenario: step times simulated with known factors
    are fitted back to factors that reproduce them (the real simulator, no hardware)."""
    from kvstage.calibrate.inrun import CAL_SCENARIO, fit_profile, kind_means
    from kvstage.shared.scenario import scenario_from_dict
    from kvstage.sim.driver import Simulation

    host = {
        "host_model": "cpu-loop",
        "host_cores": 2,
        "engine_thread_cores": 0.02,
        "event_us": 80.0,
        "fill_latency_us": 330.0,
        "fill_bandwidth_gbs": 1.7,
        "loop_poll_us": 1000.0,
        "forward_nice": 10.0,
    }
    truth = {
        "fill_scale": 4.0,
        "copy_scale": 5.0,
        "control_scale": 10.0,
        "write_scale": 3.0,
        "event_scale": 8.0,
    }
    data = {**CAL_SCENARIO, "links": {**CAL_SCENARIO["links"], **host, **truth}}
    target = kind_means(Simulation(scenario_from_dict(data), check=False).run().records)
    fit = fit_profile(host, {"ok": True, "steps": target})
    sim = fit["history"][-1]["simulated"]
    for kind, want in target.items():
        assert sim[kind] == pytest.approx(want, rel=0.1), kind
    assert fit["factors"]["fill_scale"] == pytest.approx(4.0, rel=0.15)
    assert fit_profile(host, {"ok": False, "steps": target}) == {}  # a failed run fits nothing


def test_copy_op_from_two_runs_of_different_copy_sizes():
    """copy_op_from_runs: t = s * (op + alone) in both runs gives op back; runs that
    cannot tell (the bigger copies no slower, a missing figure) give 0, and a broken
    pair is held to COPY_OP_MAX_S."""
    from kvstage.calibrate.inrun import COPY_OP_MAX_S, copy_op_from_runs

    s, op, big, small = 4.0, 80e-6, 189e-6, 57e-6
    assert copy_op_from_runs((s * (op + big), big), (s * (op + small), small)) == pytest.approx(op)
    assert copy_op_from_runs((s * big, big), (s * small, small)) == pytest.approx(0.0, abs=1e-12)
    assert copy_op_from_runs((1e-3, big), (1.2e-3, small)) == 0.0  # the big ones were faster
    assert copy_op_from_runs((float("nan"), big), (1e-3, small)) == 0.0
    assert copy_op_from_runs((1.0001e-3, big), (1e-3, small)) == COPY_OP_MAX_S


@pytest.mark.slow
def test_inrun_fit_finds_the_copy_op_of_a_simulated_pair_of_runs():
    """fit_profile with the CAL_SMALL run: copies simulated with a known fixed part are
    fitted back to that part (corrected against the simulated small run: the closed form
    alone gives 277 here, the runs sharing their cores differently)."""
    from kvstage.calibrate.inrun import (
        CAL_SCENARIO,
        CAL_SMALL,
        copy_bytes_mean,
        fit_profile,
        kind_means,
    )
    from kvstage.shared.scenario import scenario_from_dict
    from kvstage.sim.driver import Simulation

    host = {
        "host_model": "cpu-loop",
        "host_cores": 2,
        "engine_thread_cores": 0.02,
        "event_us": 80.0,
        "fill_latency_us": 330.0,
        "fill_bandwidth_gbs": 1.7,
        "forward_nice": 10.0,
        "mem_bandwidth_gbs": 20.0,
        "kernel_launch_us": 10.0,
    }
    truth = {"copy_op_us": 200.0, "fill_scale": 2.0, "copy_scale": 3.0, "event_scale": 2.0}

    def run(data):
        records = (
            Simulation(
                scenario_from_dict({**data, "links": {**data["links"], **host, **truth}}),
                check=False,
            )
            .run()
            .records
        )
        return {"ok": True, "steps": kind_means(records), "copy_bytes": copy_bytes_mean(records)}

    inrun = {**run(CAL_SCENARIO), "small": run(CAL_SMALL)}
    assert inrun["copy_bytes"] == pytest.approx(4 * inrun["small"]["copy_bytes"])
    fit = fit_profile(host, inrun)
    assert fit["copy_op_us"] == pytest.approx(200.0, rel=0.1)
    assert (
        fit_profile(host, {**inrun, "small": {"ok": False}})["copy_op_us"] == 0.0
    )  # no small run: none


def test_joint_steps_pool_both_runs_but_the_copy():
    """joint_steps: the factors are fitted to the geometric mean of the two in-run runs'
    step means, except the copy (the first run's: the second fits copy_op); one run
    alone is its own target."""
    from kvstage.calibrate.inrun import joint_steps

    big = {"fill": 4e-3, "copy": 1.5e-3, "event": 1e-3, "control": 0.4e-3, "write": 2e-3}
    small = {"fill": 1e-3, "copy": 0.8e-3, "event": 0.25e-3, "control": 0.1e-3, "write": 0.5e-3}
    joint = joint_steps(big, small)
    assert joint["copy"] == big["copy"]
    for k in ("fill", "event", "control", "write"):
        assert joint[k] == pytest.approx(big[k] / 2)
    assert joint_steps(big, None) == big
    assert math.isnan(
        joint_steps(big, {**small, "write": 0.0})["write"]
    )  # no figure: that factor stays


def test_cpu_factors_from_the_ranks_job_cpu():
    """cpu_factors: each step's CPU in the in-run runs over its time alone; the copy's
    fixed part from the two runs' CPU (t = s * (op + alone) exactly here)."""
    from kvstage.calibrate.inrun import cpu_factors

    fields = {
        "fill_latency_us": 200.0,
        "fill_bandwidth_gbs": 10.0,
        "kernel_launch_us": 10.0,
        "mem_bandwidth_gbs": 20.0,
        "intra_latency_us": 100.0,
        "intra_per_batch_us": 0.0,
        "intra_bandwidth_gbps": 80.0,
        "write_on_cpu": True,
    }
    s, op = 2.0, 50e-6

    def run(nbytes: int) -> dict:
        copy_alone = 10e-6 + 2 * nbytes / 20e9
        return {
            "job_cpu": {
                "fill": {"n": 4, "cpu_s": 4 * 3.0 * (200e-6 + nbytes / 10e9), "bytes": 4 * nbytes},
                "gather": {"n": 2, "cpu_s": 2 * s * (op + copy_alone), "bytes": 2 * nbytes},
                "scatter": {"n": 2, "cpu_s": 2 * s * (op + copy_alone), "bytes": 2 * nbytes},
                "write": {"n": 4, "cpu_s": 4 * 1.5 * (100e-6 + nbytes / 10e9), "bytes": 4 * nbytes},
            }
        }

    got = cpu_factors(fields, [run(2 << 20), run(512 << 10)])
    assert got["fill_cpu_scale"] == pytest.approx(3.0, rel=1e-3)
    assert got["copy_op_us"] == pytest.approx(50.0, rel=1e-3)
    assert got["copy_cpu_scale"] == pytest.approx(2.0, rel=1e-3)
    assert got["write_cpu_scale"] == pytest.approx(1.5, rel=1e-3)
    assert "write_cpu_scale" not in cpu_factors({**fields, "write_on_cpu": False}, [run(2 << 20)])
    assert cpu_factors(fields, [{}]) == {}  # runs without job_cpu: nothing measured


@pytest.mark.parametrize("what", [[], ["--descriptors"]], ids=["profile", "descriptors"])
@pytest.mark.slow
def test_calibrate_on_cuda_without_a_gpu_is_one_line_exit_2(tmp_path, what) -> None:
    """No CUDA device: the command says so in one line before any process starts (exit 2,
    no traceback, no profile written), the descriptor probe too."""
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "p.toml"
    done = subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "calibrate", "--device", "cuda", "--quick"]
        + what
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda:"), done.stderr
    assert "no CUDA device" in lines[0] and "allowed here: cpu" in lines[0]
    assert "Traceback" not in done.stderr + done.stdout and not out.exists()


def test_descriptor_probe_times_every_part_with_the_real_nixl() -> None:
    """The probe (hw/probes/descriptors.py) on host memory: one timing per part, count
    and repetition, all positive; more descriptors cost more to build; the fit names
    each part with its R^2."""
    require_engine("nixl")
    from kvstage.calibrate.descriptors import fit_descriptors
    from kvstage.hw.probes.descriptors import DescriptorPlan, measure_descriptors

    plan = DescriptorPlan(counts=(256, 4096, 16384), reps=2, gil_n=1024, gil_s=0.2)
    raw = measure_descriptors(plan)
    assert (raw["memory"], raw["device"], raw["counts"]) == ("DRAM", "cpu", [256, 4096, 16384])
    for part, rows in raw["sweep"].items():
        assert len(rows) == 3 and all(len(r) == 2 and min(r) > 0 for r in rows), part
    build = [min(r) for r in raw["sweep"]["build_s"]]
    assert build[-1] > build[0]  # 64x the descriptors: numpy's work grows
    assert all(v > 0 for v in raw["gil"].values())
    fit = fit_descriptors(raw)
    assert {"build_numpy", "prepare", "post"} <= set(fit.table()["parts"])
