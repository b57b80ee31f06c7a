"""The serving engine's host (sim/engine_host.py): closed-form answers for each resource."""

from __future__ import annotations

import math

import pytest
import simpy

from kvstage.shared.scenario import ScenarioError, scenario_from_dict
from kvstage.shared.scenario.engines import ENGINE_PRESETS
from kvstage.shared.serving.compute import prefill_forward_s
from kvstage.sim.driver import Simulation
from kvstage.sim.engine_host import EngineForward, Gil, Threads
from kvstage.sim.forward import GroupForward


def _ends(env: simpy.Environment, threads: list[Threads], bursts: list[tuple[int, float, float]]):
    """Submit (thread index, gil_s, free_s) bursts at t = 0; their end times, in order."""
    ends: dict[int, float] = {}
    for i, (t, gil_s, free_s) in enumerate(bursts):
        threads[t].submit(gil_s, free_s, lambda i=i: ends.__setitem__(i, env.now))
    env.run()
    return [ends[i] for i in range(len(bursts))]


def test_one_burst_alone_takes_its_gil_and_free_parts() -> None:
    env = simpy.Environment()
    (end,) = _ends(env, [Threads(env, Gil(env))], [(0, 0.003, 0.002)])
    assert end == pytest.approx(0.005)


def test_bursts_queue_on_one_scheduler_thread() -> None:
    """N bursts of d on one thread: the k-th waits k - 1 of them, ends at k d."""
    env = simpy.Environment()
    d, n = 0.0013, 7
    ends = _ends(env, [Threads(env, Gil(env))], [(0, d, 0.0)] * n)
    assert ends == pytest.approx([k * d for k in range(1, n + 1)])


def test_gil_shared_by_two_threads_halves_each() -> None:
    """Two threads both running Python: each at half rate while both run."""
    env = simpy.Environment()
    gil = Gil(env)
    a, b = Threads(env, gil), Threads(env, gil)
    # 1 s and 2 s of Python: both at 1/2 until 2 s (a done), then b alone: 1 s more
    assert _ends(env, [a, b], [(0, 1.0, 0.0), (1, 2.0, 0.0)]) == pytest.approx([2.0, 3.0])


def test_work_without_the_gil_runs_beside_python_at_full_speed() -> None:
    env = simpy.Environment()
    gil = Gil(env)
    a, b = Threads(env, gil), Threads(env, gil)
    assert _ends(env, [a, b], [(0, 1.0, 0.0), (1, 0.0, 1.0)]) == pytest.approx([1.0, 1.0])


def test_separate_processes_do_not_share_a_gil() -> None:
    env = simpy.Environment()
    a, b = Threads(env, Gil(env)), Threads(env, Gil(env))
    assert _ends(env, [a, b], [(0, 1.0, 0.0), (1, 1.0, 0.0)]) == pytest.approx([1.0, 1.0])


def test_a_pool_of_three_runs_three_bursts_at_once() -> None:
    env = simpy.Environment()
    pool = Threads(env, Gil(env), 3)
    ends = _ends(env, [pool], [(0, 0.0, 1.0)] * 4)  # no GIL: truly parallel
    assert ends == pytest.approx([1.0, 1.0, 1.0, 2.0])


def _scenario(prompts: int, path: str = "slice", preset: str | None = "sglang-nixl", **eng):
    data = {
        "model": {"preset": "llama-3.1-8b"},
        "prefill": {"tp": 2},
        "decode": {"tp": 4},
        "transfer": {"path": path, "room_timeout_s": 600.0},
        "workload": {
            "requests": prompts,
            "arrival": "burst",
            "burst_size": prompts,
            "rate_per_s": 1e-3,
            "prompt": "fixed",
            "prompt_tokens": 128,
        },
    }
    if preset is not None:
        data["engine"] = {"preset": preset, **eng}
    return scenario_from_dict(data)


def _slice_writes(result, rank: int = 0) -> list:
    rows = [r for r in result.records if r.phase == "slice_write" and r.rank == rank]
    return sorted(rows, key=lambda r: r.end)


def test_sglang_nixl_calls_queue_on_the_scheduler_in_closed_form() -> None:
    """After the batch's forward, each transfer call of rank 0 waits for the calls
    before it on the scheduler thread: the k-th ends at forward end + k D + its
    fabric time alone, D = n (build + prepare + post) + post per call."""
    prompts = 3
    s = _scenario(prompts)
    result = Simulation(s).run()
    assert result.ok and result.rooms_done == prompts
    p = ENGINE_PRESETS["sglang-nixl"]
    writes = _slice_writes(result)
    assert len(writes) == 2 * prompts  # two decode targets per prefill rank
    n = writes[0].requests
    g = s.geometry()
    assert n == g.slice_requests(0, 0, g.chunks(128 // g.page_size)[0].num_pages)
    d = p.build_s(n) + p.prepare_s(n) + p.post_s(n)
    link = s.links.resolved().link
    nic_w = link.bandwidth_bytes_s / link.message_rate
    fabric = link.latency_s + max(writes[0].bytes, n * nic_w) / link.bandwidth_bytes_s
    assert fabric < d  # the flows never overlap: each call alone on the NIC
    t0 = writes[0].start  # the batch's forward end: every call is issued then
    assert all(w.start == t0 for w in writes)
    for k, w in enumerate(writes, start=1):
        assert w.end == pytest.approx(t0 + k * d + fabric, rel=1e-9)


def test_one_batch_holds_the_burst_and_the_forward_is_one() -> None:
    s = _scenario(8)
    sim = Simulation(s)
    result = sim.run()
    assert isinstance(sim.group_forwards[0], EngineForward)
    assert sim.group_forwards[0].budget == s.prefill.chunked_prefill_size == 8192
    assert sim.group_forwards[0].batches == 1  # 8 x 128 tokens fit one 8192-token batch
    computes = {(r.start, r.end) for r in result.records if r.phase == "compute"}
    assert len(computes) == 1
    ((start, end),) = computes
    assert end - start == pytest.approx(prefill_forward_s(s, 8 * 128))


def test_worker_posting_frees_the_scheduler_for_the_next_launch() -> None:
    """Many prompts, more than a batch: with the post on the scheduler thread the next
    batch waits for the send work, with a worker it does not (mean TTFT falls)."""

    def mean_done(preset: str) -> float:
        r = Simulation(_scenario(192, preset=preset)).run()
        done = [x.end for x in r.records if x.phase == "room_done" and x.role == "decode"]
        return sum(done) / len(done)

    assert mean_done("sglang-nixl-prepped") < mean_done("sglang-nixl")


def test_the_request_path_is_a_delay_of_request_us_not_a_queue(monkeypatch) -> None:
    """Every room of a burst opens request_us after its arrival (none waits for
    another), and each TTFT is the one without the request path plus request_us."""
    from dataclasses import replace

    from kvstage.metrics.rooms import room_latencies

    p = ENGINE_PRESETS["sglang-nixl"]
    delay = p.request_us * 1e-6
    assert delay > 0

    def rooms() -> dict[int, dict[str, float]]:
        result = Simulation(_scenario(8, path="staging")).run()
        assert result.ok and result.rooms_done == 8
        return room_latencies(result.records)

    with_path = rooms()
    for info in with_path.values():
        assert info["arrival"] == 0.0  # the burst arrives at t = 0, on record
        assert info["admitted"] - info["arrival"] == pytest.approx(delay, rel=1e-12)
    monkeypatch.setitem(ENGINE_PRESETS, "sglang-nixl", replace(p, request_us=0.0))
    without = rooms()
    for room, info in with_path.items():
        ttft, base = (
            info["done"] - info["arrival"],
            without[room]["done"] - without[room]["arrival"],
        )
        assert ttft == pytest.approx(base + delay, rel=1e-9)


def test_sglang_nixl_gives_the_shape_of_sglang_pr_22536() -> None:
    """The issue's target, by mechanism (docs/staging-vs-slice.md): TP2 -> TP4 under
    sglang-nixl, the slice / staging TTFT ratio <= 1.3 for one prompt, rising with the
    burst, >= 1.4 at 256; one serialized per-room cost, so c(N) = 2 Delta / (N + 1)
    steady within 2.5x; at equal TP (TP4 -> TP4) within 0.85-1.35."""

    def ttft(prompts: int, path: str, decode_tp: int = 4, prefill_tp: int = 2) -> float:
        data = _scenario(prompts, path).model_dump(exclude_none=True)
        data["prefill"]["tp"], data["decode"]["tp"] = prefill_tp, decode_tp
        data.pop("links")
        result = Simulation(scenario_from_dict(data)).run()
        assert result.ok and result.rooms_done == prompts
        done = [r.end for r in result.records if r.phase == "room_done" and r.role == "decode"]
        return max(done) if prompts == 1 else sum(done) / len(done)

    counts = (1, 8, 64, 256)
    slice_, staging = [ttft(n, "slice") for n in counts], [ttft(n, "staging") for n in counts]
    ratios = [a / b for a, b in zip(slice_, staging, strict=True)]
    assert ratios[0] <= 1.3 and ratios[-1] >= 1.4
    assert ratios == sorted(ratios)
    c = [2 * (a - b) / (n + 1) for a, b, n in zip(slice_, staging, counts, strict=True)]
    assert max(c) / min(c) <= 2.5
    for n in (1, 64):
        equal = ttft(n, "slice", prefill_tp=4) / ttft(n, "staging", prefill_tp=4)
        assert 0.85 <= equal <= 1.35


def test_without_engine_the_driver_is_unchanged() -> None:
    sim = Simulation(_scenario(2, preset=None))
    assert sim.engine is None
    assert all(type(f) is GroupForward for f in sim.group_forwards)


def test_unknown_engine_preset_names_the_field_and_the_choices() -> None:
    with pytest.raises(ScenarioError) as e:
        _scenario(1, preset="sglang-bogus")
    text = str(e.value)
    assert "engine.preset" in text and "sglang-nixl" in text


def test_event_count_per_request_stays_flat() -> None:
    """One event per (request, resource) burst: events grow with prompts, not with
    descriptors (a 1024-token prompt has 8x the descriptors of a 128-token one)."""

    def events(tokens: int) -> int:
        s = _scenario(4)
        data = s.model_dump(exclude_none=True)
        data["workload"]["prompt_tokens"] = tokens
        data.pop("links")
        sim = Simulation(scenario_from_dict(data))
        sim.run()
        return next(sim.env._eid)  # SimPy's count of events scheduled

    few, many = events(128), events(1024)
    assert math.isclose(few, many, rel_tol=0.25)


def test_descriptor_fit_recovers_per_descriptor_costs_and_gil_ratios() -> None:
    from kvstage.calibrate.descriptors import fit_descriptors

    counts = [256, 1024, 4096, 16384]
    line = lambda a, b: [[a + b * n] * 3 for n in counts]  # noqa: E731
    raw = {
        "engine": "nixl",
        "counts": counts,
        "sweep": {"build_s": line(2e-5, 20e-9), "prepare_s": line(3e-5, 55e-9)},
        "gil": {
            "worker_batches_per_s_alone": 300.0,
            "worker_batches_per_s_beside_python": 100.0,
            "python_iters_per_s_alone": 2e5,
            "python_iters_per_s_beside_worker": 1e5,
        },
    }
    fit = fit_descriptors(raw)
    assert fit.per_descriptor_ns("build_numpy") == pytest.approx(20.0)
    assert fit.parts["prepare"].intercept_s == pytest.approx(3e-5)
    assert fit.parts["build_numpy"].r2 == pytest.approx(1.0)
    assert (fit.worker_slowdown, fit.python_slowdown) == pytest.approx((3.0, 2.0))
    assert set(fit.table()["parts"]) == {"build_numpy", "prepare"}
