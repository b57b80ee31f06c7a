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
    scaled,
    scenario_from_dict,
)
from kvstage.sim.driver import Simulation, simulate
from kvstage.sim.host import (
    CpuShare,
    HostModel,
    Worker,
    fill_alone,
    nice_weight,
    scaled_link,
    share,
    steady_load,
)

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"

HOST = {
    "host_model": "cpu-loop",
    "host_cores": 2,
    "engine_thread_cores": 0.5,
    "event_us": 20.0,
    "fill_latency_us": 800.0,
    "fill_bandwidth_gbs": 0.25,
}


def _numbers(**kw) -> HostNumbers:
    base = dict(
        cores=2.0,
        engine_thread_cores=0.5,
        event_s=20e-6,
        fill_latency_s=800e-6,
        fill_bandwidth_bytes_s=0.25e9,
    )
    base.update(kw)
    return HostNumbers(**base)


def _scenario(prefill_tp=2, decode_tp=1, requests=4, host=True, **links):
    data = {
        "name": "host-model",
        "model": {"layers": 4, "kv_heads": 8, "head_dim": 64, "params_b": 0.5},
        "prefill": {"tp": prefill_tp, "chunked_prefill_size": 256},
        "decode": {"tp": decode_tp, "page_size": 16, "staging_pool_mb": 32},
        "links": {
            "profile": "loopback-cpu",
            "placement": "intra",
            **(HOST if host else {}),
            **links,
        },
        "workload": {
            "requests": requests,
            "arrival": "fixed",
            "rate_per_s": 4.0,
            "prompt": "uniform",
            "prompt_min": 512,
            "prompt_max": 1024,
            "seed": 3,
        },
    }
    return scenario_from_dict(data)


# --- the CPU share, the threads and the loop, closed form -------------------------------


def _worker(env, cores=1.0, weight=1.0, steady=()):
    return Worker(env, CpuShare(env, cores, steady), weight)


def test_share_is_weighted_fair_and_at_most_one_core_each():
    assert share(2, [(1, 1)] * 3) == pytest.approx([2 / 3] * 3)
    assert share(4, [(1, 1)] * 3) == pytest.approx([1, 1, 1])  # more cores than jobs
    # nice 10 (weight 1.25 ** -10 = 0.107) against nice 0 on one core
    w = nice_weight(10)
    assert w == pytest.approx(0.1074, rel=1e-3)
    assert share(1, [(1, 1), (w, 1)]) == pytest.approx([1 / (1 + w), w / (1 + w)])
    # a steady user that wants little gets it; the rest share what is left
    assert share(2, [(1, 1), (1, 1), (1, 1), (1, 0.1)]) == pytest.approx(
        [0.6333, 0.6333, 0.6333, 0.1], rel=1e-3
    )
    # two cores, one heavy job capped at one core: the light one gets the other core
    assert share(2, [(1, 1), (w, 1)]) == pytest.approx([1, 1])


def test_rates_change_when_a_job_starts_and_ends():
    """1 core: A (1 s) alone from 0; B (1 s) joins at 0.5, both at half speed: A ends
    at 1.5 with B half done, then B alone ends at 2.0."""
    env = simpy.Environment()
    cpu = CpuShare(env, 1.0)
    seen = []
    cpu.run(1.0, 1.0, lambda: seen.append(("a", env.now)))
    env.timeout(0.5).callbacks.append(
        lambda _e: cpu.run(1.0, 1.0, lambda: seen.append(("b", env.now)))
    )
    env.run()
    assert seen == [("a", pytest.approx(1.5)), ("b", pytest.approx(2.0))]
    assert cpu.cpu_s == 2.0 and cpu.running == 0


def test_steady_load_takes_its_share():
    """Other processes (background) and engine threads take their cores first."""
    h = _numbers(cores=1.0, engine_thread_cores=0.1, background_cores=0.5)
    assert steady_load(h, 2) == [(1.0, 0.1), (1.0, 0.1), (1.0, 0.5)]
    env = simpy.Environment()
    cpu = CpuShare(
        env, 1.0, steady_load(_numbers(cores=1.0, engine_thread_cores=0.0, background_cores=0.5), 1)
    )
    seen = []
    cpu.run(1.0, 1.0, lambda: seen.append(env.now))
    env.run()
    assert seen == [pytest.approx(2.0)]  # half a core left: 1 CPU second takes 2 s


def test_one_worker_serialises_its_jobs():
    env = simpy.Environment()
    loop = _worker(env)
    seen = []
    loop.submit(1.0, lambda: seen.append(("a", env.now)))
    loop.submit(2.0, lambda: seen.append(("b", env.now)))
    env.run()
    assert seen == [("a", 1.0), ("b", 3.0)]
    assert loop.busy_s == 3.0 and loop.jobs == 2


def test_synchronous_work_runs_before_queued_events():
    """Work the handler starts on the loop runs next; an event that queued meanwhile waits."""
    env = simpy.Environment()
    loop = _worker(env)
    seen = []

    def handler():
        seen.append(("handler", env.now))
        loop.run_next(0.5, lambda: seen.append(("post", env.now)))

    loop.submit(1.0, handler)
    loop.submit(0.25, lambda: seen.append(("message", env.now)))
    env.run()
    assert seen == [("handler", 1.0), ("post", 1.5), ("message", 1.75)]


def test_threads_of_a_rank_share_the_cores_and_a_wait_takes_none():
    """Loop and copy thread on 1 core: each gets half while both run; a loop that
    waits (a late session) leaves the copy thread the whole core."""
    env = simpy.Environment()
    cpu = CpuShare(env, 1.0)
    loop, copy = Worker(env, cpu), Worker(env, cpu)
    seen = []
    loop.submit(1.0, lambda: seen.append(("loop", env.now)))
    copy.submit(1.0, lambda: seen.append(("copy", env.now)))
    env.run()
    assert seen == [("loop", pytest.approx(2.0)), ("copy", pytest.approx(2.0))]
    env2 = simpy.Environment()
    cpu2 = CpuShare(env2, 1.0)
    loop2, copy2 = Worker(env2, cpu2), Worker(env2, cpu2)
    loop2.wait(1.0)
    copy2.submit(1.0, lambda: seen.append(("copy2", env2.now)))
    env2.run()
    assert seen[-1] == ("copy2", pytest.approx(1.0))


def test_fill_alone():
    assert fill_alone(_numbers(), 1_000_000) == pytest.approx(800e-6 + 1e6 / 0.25e9)
    assert nice_weight(0) == 1.0


# --- the driver ----------------------------------------------------------------------------


def test_driver_forward_is_fill_plus_poll_wait_plus_one_event():
    """P1 -> D1 on many cores (no sharing): a chunk's compute span is its fill on the
    forward thread, half a loop poll until the loop sees it, and one loop event; the
    next chunk starts no earlier than the first ended."""
    s = _scenario(
        prefill_tp=1,
        decode_tp=1,
        requests=1,
        host_cores=64,
        engine_thread_cores=0.0,
        loop_poll_us=1000.0,
        forward_nice=10,
    )
    sim = Simulation(s)
    r = sim.run()
    assert r.ok and r.rooms_done == 1
    h = s.links.resolved().host
    assert (h.loop_poll_s, h.forward_nice, h.background_cores) == (1e-3, 10.0, 0.0)
    g = s.geometry()
    chunk_bytes = 2 * g.layers * g.prefill_heads * g.head_dim * g.dtype_bytes * 256
    computes = sorted((x for x in r.records if x.phase == "compute"), key=lambda x: x.chunk)
    c0 = computes[0]
    assert c0.end - c0.start == pytest.approx(
        fill_alone(h, chunk_bytes) * h.fill_scale + 0.5e-3 + h.event_s
    )
    for a, b in zip(computes, computes[1:], strict=False):
        assert b.start >= a.end - 1e-12
    rt = sim.prefill[0]
    assert sim.hostm.forwards[rt].jobs == len(computes)
    assert sim.hostm.copies[rt].jobs >= 1  # gathers ran on the copy thread
    assert sim.hostm.forwards[rt].weight == pytest.approx(nice_weight(10))


def test_background_load_slows_the_forward():
    """The same run with other processes keeping a core busy takes longer."""
    quiet = simulate(_scenario(prefill_tp=2, decode_tp=1, requests=2))
    loaded = simulate(_scenario(prefill_tp=2, decode_tp=1, requests=2, background_cores=1.0))
    assert quiet.ok and loaded.ok
    span = lambda r: sum(x.end - x.start for x in r.records if x.phase == "compute")  # noqa: E731
    assert span(loaded) > span(quiet)


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
        _scenario(
            host=False,
            host_model="cpu-loop",
            host_cores=2,
            engine_thread_cores=0.5,
            event_us=20.0,
            fill_latency_us=800.0,
        )
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
    s = load_scenario(
        SCENARIOS / "llama3-8b-p4-d2.toml",
        overrides=[f"links.profile={profile}", "links.placement=intra", "workload.requests=4"],
    )
    assert s.links.resolved().host is not None
    r = simulate(scaled(s))
    assert r.ok and r.rooms_done == 4
    for fault in ("stall-scatter", "late-session", "drop-rsp-watermark"):
        fs = load_scenario(
            SCENARIOS / "faults" / f"{fault}.toml",
            overrides=[f"links.profile={profile}", "links.placement=intra"],
        )
        fr = simulate(fs)
        assert fr.ok, (fault, [v.format() for v in fr.violations[:3]])


def test_event_scale_holds_the_loop_without_a_core():
    """event_scale 3: an event holds its loop 3x its CPU; the 2 extra seconds leave the
    core to others (a copy job of 2 CPU seconds started at once ends at 2.0, not later)."""
    env = simpy.Environment()
    h = _numbers(cores=1.0, engine_thread_cores=0.0, event_s=1.0, event_scale=3.0)
    host = HostModel(env, h, ["r"], [])
    seen = []
    host.deliver("r", lambda rt, ev: seen.append((ev, env.now)), "a")
    host.deliver("r", lambda rt, ev: seen.append((ev, env.now)), "b")
    host.copy("r", 2.0, lambda rt, ev: seen.append((ev, env.now)), "copied")
    env.run()
    # a: 2 s of wait, then 1 s of CPU; the copy had the core alone meanwhile, so its
    # 2 CPU seconds were done at 2.0; its completion is an event queued behind b
    assert seen[0] == ("a", pytest.approx(3.0))
    assert seen[1] == ("b", pytest.approx(6.0))
    assert seen[2][0] == "copied" and seen[2][1] == pytest.approx(9.0)  # its event queued behind b


def test_scaled_link_stretches_every_part_of_a_write():
    from kvstage.shared.scenario import LinkNumbers

    link = LinkNumbers(1e9, 10e-6, 1e-6, 2e-6, 1e6, 1)
    s = scaled_link(link, 2.0)
    assert (
        s.bandwidth_bytes_s,
        s.latency_s,
        s.per_request_s,
        s.per_batch_s,
        s.message_rate,
    ) == pytest.approx((0.5e9, 20e-6, 2e-6, 4e-6, 0.5e6))
    assert s.post_threads == 1 and scaled_link(link, 1.0) is link


def test_a_real_time_loop_takes_a_core_ahead_of_the_other_threads():
    """loop_rt (hw/rank/process.py runs the loop in SCHED_RR): on 1 core beside a copy job, an
    event's 1 CPU second ends at 1.0 instead of 2.0 (fair halves); the copy gets the core
    back after it. Without loop_rt the two share it."""

    def run(loop_rt: bool) -> list:
        env = simpy.Environment()
        h = _numbers(cores=1.0, engine_thread_cores=0.0, event_s=1.0, loop_rt=loop_rt)
        host = HostModel(env, h, ["r"], [])
        seen = []
        host.copy("r", 2.0, lambda rt, ev: seen.append((ev, env.now)), "copied")
        host.deliver("r", lambda rt, ev: seen.append((ev, env.now)), "a")
        env.run()
        return seen

    assert run(True)[0] == ("a", pytest.approx(1.0))
    assert run(True)[1] == ("copied", pytest.approx(4.0))  # 3.0 on CPU, then its event on the loop
    assert run(False)[0] == ("a", pytest.approx(2.0))


def test_calibration_sets_loop_rt_from_the_in_run_loops():
    from kvstage.calibrate.inrun import loop_is_realtime

    assert loop_is_realtime({"loop_sched": {"prefill0": "rr:10", "decode0": "fifo:5"}})
    assert not loop_is_realtime(
        {"loop_sched": {"prefill0": "rr:10", "decode0": "normal (rr:10 refused: EPERM)"}}
    )
    assert not loop_is_realtime({}) and not loop_is_realtime(None)
    s = _scenario(loop_rt=True)
    assert s.links.resolved().host.loop_rt is True
    assert _scenario().links.resolved().host.loop_rt is False


def test_a_write_on_cpu_shares_the_cores_and_a_socket_write_keeps_two_threads_busy():
    """write_on_cpu: a 1 s write (alone) beside a 1 s copy on 1 core ends at 2.0 (fair
    halves), not at 1.0 as a link flow would; with write_cpu_threads 2 the write's two
    threads and the copy take a third each, so the write ends at 3.0 (no RT loop here)."""

    def run(threads: int) -> dict:
        env = simpy.Environment()
        h = _numbers(
            cores=1.0,
            engine_thread_cores=0.0,
            event_s=0.0,
            write_on_cpu=True,
            write_cpu_threads=threads,
        )
        host = HostModel(env, h, ["r"], [])
        seen = {}
        host.write("r", 0, 1.0, lambda: seen.setdefault("write", env.now))
        host.copy("r", 1.0, lambda rt, ev: seen.setdefault(ev, env.now), "copied")
        env.run()
        return seen

    assert run(1)["write"] == pytest.approx(2.0)
    assert run(2)["write"] == pytest.approx(3.0)


def test_the_simulator_runs_writes_on_cpu_and_stays_deterministic():
    s = _scenario(write_on_cpu=True, write_cpu_threads=2, loop_rt=True)
    a, b = Simulation(s).run(), Simulation(s).run()
    assert a.rooms_done == 4 and not a.violations
    assert [r.end for r in a.records] == [r.end for r in b.records]
    flow = Simulation(_scenario()).run()  # the same writes as link flows finish sooner on 2 cores
    assert max(r.end for r in a.records) > max(r.end for r in flow.records)


def test_a_real_time_write_goes_ahead_of_the_copies_and_behind_the_loop():
    """write_rt (Mooncake's engine threads in SCHED_RR 5): on 1 core a 1 s write beside a
    1 s copy ends at 1.0, the copy at 2.0; an event on a real-time loop (rr:10) still goes
    first."""
    env = simpy.Environment()
    h = _numbers(
        cores=1.0,
        engine_thread_cores=0.0,
        event_s=0.5,
        write_on_cpu=True,
        write_rt=True,
        loop_rt=True,
    )
    host = HostModel(env, h, ["r"], [])
    seen = {}
    host.copy("r", 1.0, lambda rt, ev: seen.setdefault(ev, env.now), "copied")
    host.write("r", 0, 1.0, lambda: seen.setdefault("write", env.now))
    host.deliver("r", lambda rt, ev: seen.setdefault(ev, env.now), "event")
    env.run()
    # (the classes are weights 1e6 apart, so "ahead" holds to a millionth)
    assert seen["event"] == pytest.approx(0.5, rel=1e-3)
    assert seen["write"] == pytest.approx(1.5, rel=1e-3)
    assert seen["copied"] == pytest.approx(3.0, rel=1e-3)  # 2.5 on CPU, then its event on the loop
    from kvstage.calibrate.inrun import loop_is_realtime

    assert loop_is_realtime({"engine_sched": {"prefill0": "rr:5 (3 of 4 threads)"}}, "engine_sched")
    assert not loop_is_realtime({"engine_sched": {"prefill0": "normal (left out)"}}, "engine_sched")


@pytest.mark.parametrize("op_s,want", [(0.0, 2.0 + 1.0), (0.5, 3.0 + 1.0)])
def test_a_copy_costs_its_fixed_part_and_its_bytes_both_scaled(op_s, want):
    """copy_op_us: every gather or scatter also costs the rank a fixed CPU part, scaled
    with the kernel by copy_scale: a 1 s copy with a 0.5 s part at scale 2 is 3 s of CPU
    (alone on one core: done at 3.0; its event then takes the loop's 1 s)."""
    env = simpy.Environment()
    h = _numbers(cores=1.0, engine_thread_cores=0.0, event_s=1.0, copy_scale=2.0, copy_op_s=op_s)
    host = HostModel(env, h, ["r"], [])
    seen = []
    host.copy("r", 1.0, lambda rt, ev: seen.append(env.now), "copied")
    env.run()
    assert seen == [pytest.approx(want)]


def test_copy_op_us_is_read_from_the_profile_and_slows_the_copies():
    base = simulate(_scenario())
    slower = simulate(_scenario(copy_op_us=300.0))
    assert _scenario(copy_op_us=300.0).links.resolved().host.copy_op_s == pytest.approx(300e-6)
    spans = [
        sum(r.end - r.start for r in res.records if r.phase in ("gather", "scatter"))
        for res in (base, slower)
    ]
    assert spans[1] > spans[0]
    with pytest.raises(ScenarioError, match="copy_op_us"):
        _scenario(copy_op_us=-1.0)


def test_split_work_keeps_all_cpu_unless_the_cpu_was_measured():
    from kvstage.sim.host import split_work

    assert split_work(2.0, 3.0, 0.0) == (6.0, 0.0)  # not measured: all CPU
    assert split_work(2.0, 3.0, 1.5) == (3.0, 3.0)  # measured: the rest waits
    assert split_work(2.0, 1.0, 1.5) == (3.0, 0.0)  # never less than its CPU


def test_a_fill_whose_cpu_was_measured_waits_the_rest_without_a_core():
    """fill_cpu_scale 1 of fill_scale 3: a 1 s fill waits 2 s without a core, then takes
    1 s of CPU; a 2 s copy submitted with it has the one core alone meanwhile."""
    env = simpy.Environment()
    h = _numbers(
        cores=1.0,
        engine_thread_cores=0.0,
        event_s=0.0,
        fill_latency_s=1.0,
        fill_bandwidth_bytes_s=1e30,
        fill_scale=3.0,
        fill_cpu_scale=1.0,
    )
    host = HostModel(env, h, ["r"], ["r"])
    seen = {}
    host.fill("r", 1, lambda rt, ev: seen.setdefault(ev, env.now), "filled")
    host.copy("r", 2.0, lambda rt, ev: seen.setdefault(ev, env.now), "copied")
    env.run()
    assert seen == {"copied": pytest.approx(2.0), "filled": pytest.approx(3.0)}
