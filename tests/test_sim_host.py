"""The opt-in host model (links.host_model = "cpu-loop", sim/host.py): closed-form checks
of the rank loop and CPU sharing, the driver's use of them, determinism, validation,
and that a scenario naming a calibrated-style profile runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import simpy

from kvstage.shared.scenario import (
    HOST_FIELDS,
    HostNumbers,
    ScenarioError,
    load_scenario,
    scenario_from_dict,
)
from kvstage.sim.driver import Simulation, simulate
from kvstage.sim.host import RankLoop, cpu_scale, fill_time

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"

HOST = {"host_model": "cpu-loop", "host_cores": 2, "engine_thread_cores": 0.5, "event_us": 20.0,
        "fill_latency_us": 800.0, "fill_bandwidth_gbs": 0.25}


def _numbers(**kw) -> HostNumbers:
    base = dict(cores=2.0, engine_thread_cores=0.5, event_s=20e-6, fill_latency_s=800e-6,
                fill_bandwidth_bytes_s=0.25e9)
    base.update(kw)
    return HostNumbers(**base)


def _scenario(prefill_tp=2, decode_tp=1, requests=4, host=True, **links):
    data = {
        "name": "host-model",
        "model": {"layers": 4, "kv_heads": 8, "head_dim": 64, "params_b": 0.5},
        "prefill": {"tp": prefill_tp, "chunked_prefill_size": 256},
        "decode": {"tp": decode_tp, "page_size": 16, "staging_pool_mb": 32},
        "links": {"profile": "loopback-cpu", "placement": "intra", **(HOST if host else {}), **links},
        "workload": {"requests": requests, "arrival": "fixed", "rate_per_s": 4.0, "prompt": "uniform",
                     "prompt_min": 512, "prompt_max": 1024, "seed": 3},
    }
    return scenario_from_dict(data)


# --- the loop and the CPU share, closed form ---------------------------------------------


def test_one_rank_loop_serialises_two_events():
    env = simpy.Environment()
    loop = RankLoop(env)
    seen = []
    loop.submit(1.0, lambda: seen.append(("a", env.now)))
    loop.submit(2.0, lambda: seen.append(("b", env.now)))
    env.run()
    assert seen == [("a", 1.0), ("b", 3.0)]
    assert loop.busy_s == 3.0 and loop.jobs == 2


def test_synchronous_work_runs_before_queued_events():
    """A gather the handler starts runs next; an event that queued meanwhile waits."""
    env = simpy.Environment()
    loop = RankLoop(env)
    seen = []

    def handler():
        seen.append(("handler", env.now))
        loop.run_next(0.5, lambda: seen.append(("gather", env.now)))

    loop.submit(1.0, handler)
    loop.submit(0.25, lambda: seen.append(("message", env.now)))
    env.run()
    assert seen == [("handler", 1.0), ("gather", 1.5), ("message", 1.75)]


def test_fills_interleave_with_messages():
    """Fill k+1 is queued when fill k ends: a message that arrived during fill k is
    handled between them, not after the whole queue of fills."""
    env = simpy.Environment()
    loop = RankLoop(env)
    seen = []

    def fill(k):
        seen.append((f"fill{k}", env.now))
        if k < 1:
            loop.submit(1.0, fill, k + 1)

    loop.submit(1.0, fill, 0)
    env.timeout(0.5).callbacks.append(lambda _e: loop.submit(0.1, lambda: seen.append(("msg", env.now))))
    env.run()
    assert seen == [("fill0", 1.0), ("msg", 1.1), ("fill1", 2.1)]


def test_cpu_sharing_scales_loop_work_by_demand_over_cores():
    # 3 ranks, each one loop + 0.5 core of engine threads, on 2 cores: 4.5 / 2
    assert cpu_scale(_numbers(), 3) == pytest.approx(2.25)
    assert cpu_scale(_numbers(engine_thread_cores=0.0), 6) == pytest.approx(3.0)
    assert cpu_scale(_numbers(cores=16.0), 3) == 1.0  # enough cores: no slowdown
    assert fill_time(_numbers(), 1_000_000) == pytest.approx(800e-6 + 1e6 / 0.25e9)


# --- the driver ----------------------------------------------------------------------------


def test_driver_fill_and_gather_take_loop_time():
    """P1 -> D1: the first chunk's compute span is exactly its scaled fill plus one
    event; the next chunk starts no earlier than the first ended (one loop)."""
    s = _scenario(prefill_tp=1, decode_tp=1, requests=1)
    sim = Simulation(s)
    r = sim.run()
    assert r.ok and r.rooms_done == 1
    h = s.links.resolved().host
    scale = cpu_scale(h, 2)
    assert sim.cpu_scale == scale == pytest.approx(2 * 1.5 / 2)
    g = s.geometry()
    chunk_bytes = 2 * g.layers * g.prefill_heads * g.head_dim * g.dtype_bytes * 256
    computes = sorted((x for x in r.records if x.phase == "compute"), key=lambda x: x.chunk)
    c0 = computes[0]
    assert c0.end - c0.start == pytest.approx(fill_time(h, chunk_bytes) * scale + h.event_s * scale)
    for a, b in zip(computes, computes[1:], strict=False):
        assert b.start >= a.end - 1e-12
    # every prefill/decode loop was used, and its busy time covers the fills
    loop = sim.loops[sim.prefill[0]]
    assert loop.busy_s >= sum(x.end - x.start for x in computes) - 1e-9


def test_host_model_is_deterministic_and_keeps_invariants():
    a = simulate(_scenario(prefill_tp=4, decode_tp=2, requests=6))
    b = simulate(_scenario(prefill_tp=4, decode_tp=2, requests=6))
    assert a.ok and a.rooms_done == 6
    assert a.records == b.records


def test_host_model_is_slower_than_gpu_model_on_a_small_host():
    fast = simulate(_scenario(host=False, requests=3))
    slow = simulate(_scenario(requests=3))
    assert slow.ok and fast.ok
    assert slow.sim_time_s > fast.sim_time_s


def test_default_is_the_gpu_model():
    s = _scenario(host=False)
    assert s.links.resolved().host is None
    assert not hasattr(Simulation(s), "loops")
    assert _scenario(host=False, host_model="gpu").links.resolved().host is None


def test_cpu_loop_needs_every_host_field():
    with pytest.raises(ScenarioError, match="fill_bandwidth_gbs"):
        _scenario(host=False, host_model="cpu-loop", host_cores=2, engine_thread_cores=0.5, event_us=20.0,
                  fill_latency_us=800.0)
    with pytest.raises(ScenarioError, match="host_model"):
        _scenario(host=False, host_model="cpu")
    with pytest.raises(ScenarioError, match="host_cores"):
        _scenario(host_cores=0)


def test_calibrated_profile_turns_the_host_model_on(tmp_path):
    """A profile as `kvstage calibrate` writes it (every field, host ones included):
    naming it in links.profile simulates with the host model; faults still work."""
    base = (SCENARIOS / "profiles" / "loopback-cpu.toml").read_text()
    lines = [ln for ln in base.splitlines() if ln.split("=")[0].strip() not in HOST_FIELDS]
    for k, v in HOST.items():
        lines.append(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v!r}")
    profile = tmp_path / "calibrated.toml"
    profile.write_text("\n".join(lines) + "\n")
    s = load_scenario(SCENARIOS / "llama3-8b-p4-d2.toml",
                      overrides=[f"links.profile={profile}", "links.placement=intra", "workload.requests=4"])
    assert s.links.resolved().host is not None
    r = simulate(s.scaled())
    assert r.ok and r.rooms_done == 4
    for fault in ("stall-scatter", "late-session", "drop-rsp-watermark"):
        fs = load_scenario(SCENARIOS / "faults" / f"{fault}.toml",
                           overrides=[f"links.profile={profile}", "links.placement=intra"])
        fr = simulate(fs)
        assert fr.ok, (fault, [v.format() for v in fr.violations[:3]])
