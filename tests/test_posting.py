"""The transfer engine's posting and the NIC message rate: the posting probe's fits on
synthetic points (kvstage/calibrate/posting.py), the profile fields that carry them
(shared/scenario/profiles.py), and what they do to a simulation (sim/links.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvstage.calibrate.fit import fit_line
from kvstage.calibrate.posting import fit_posting, overlap
from kvstage.shared.scenario import scenario_from_dict
from kvstage.sim.driver import Simulation

COUNTS = [1, 16, 128, 1024, 4096, 16384]


def synthetic_raw(per_batch: float, fresh: float, prepped: float | None, after: float,
                  pair: float, threads: float, rng: np.random.Generator) -> dict:  # fmt: skip
    """Raw points as measure_posting returns them, from known costs with 2% noise."""

    def reps(t: float) -> list[float]:
        return list(t * (1 + 0.02 * rng.standard_normal(5)))

    def mode(per: float) -> dict:
        post = [reps(per_batch + n * per) for n in COUNTS]
        return {
            "post_s": post,
            "done_s": [[p + n * after for p in ps] for n, ps in zip(COUNTS, post, strict=True)],
        }

    alone = [(1e-3, 2e-3)] * 5
    return {
        "backend": "test",
        "cores": 16,
        "pair_ops": 4096,
        "sweep": {
            "op_bytes": 64,
            "counts": COUNTS,
            "fresh": mode(fresh),
            **({"prepped": mode(prepped)} if prepped is not None else {}),
        },
        "two_ranks": {"alone": alone, "pairs": [[(1e-3, 2e-3), (1e-3, 2e-3 * pair)]] * 5},
        "threads": {"alone": alone, "pairs": [[(1e-3, 2e-3 * threads), (1e-3, 2e-3)]] * 5},
    }


@pytest.mark.parametrize("seed", range(4))
def test_posting_costs_recovered(seed: int) -> None:
    rng = np.random.default_rng(seed)
    raw = synthetic_raw(
        per_batch=12e-6, fresh=1.5e-6, prepped=0.4e-6, after=0.05e-6, pair=1.0, threads=2.0, rng=rng
    )
    fit = fit_posting(raw)
    assert fit.per_batch_s == pytest.approx(12e-6, rel=0.1)
    assert fit.per_request_s == pytest.approx(0.4e-6, rel=0.05)
    assert fit.prep_per_request_s == pytest.approx(1.1e-6, rel=0.08)
    assert fit.fresh.r2 > 0.99 and fit.prepped is not None and fit.prepped.r2 > 0.99
    assert fit.message_rate == pytest.approx(1 / 0.05e-6, rel=0.05)
    assert fit.two_ranks.verdict == "overlap" and fit.two_ranks.done_ratio == pytest.approx(1.0)
    assert fit.two_threads.verdict == "serialise" and fit.two_threads.done_ratio == pytest.approx(
        2.0
    )
    table = fit.table()
    assert table["two_threads"]["verdict"] == "serialise" and table["fresh"]["r2"] == fit.fresh.r2
    assert any("two ranks at once" in line for line in fit.toml_lines())


def test_writes_done_while_posting_have_no_separate_message_rate() -> None:
    raw = synthetic_raw(
        per_batch=10e-6,
        fresh=1e-6,
        prepped=None,
        after=1e-9,
        pair=1.5,
        threads=1.5,
        rng=np.random.default_rng(9),
    )
    fit = fit_posting(raw)
    assert fit.prepped is None and fit.prep_per_request_s == 0.0
    assert fit.per_request_s == pytest.approx(1e-6, rel=0.05)
    assert fit.message_rate == 0.0  # 1 ns per write after a 1 us post: not separable
    assert fit.two_ranks.verdict == "partial"


def test_fit_line_and_overlap_checks() -> None:
    exact = fit_line([1, 10, 100], [2e-6 + n * 1e-7 for n in (1, 10, 100)])
    assert exact.intercept_s == pytest.approx(2e-6) and exact.slope_s == pytest.approx(1e-7)
    assert exact.r2 == pytest.approx(1.0)
    with pytest.raises(ValueError):
        fit_line([1], [1e-6])
    with pytest.raises(ValueError):
        fit_line([1, 2], [1e-6, 0.0])
    with pytest.raises(ValueError):
        overlap([], [])


# --------------------------------------------------------------------------- profiles


def _scenario(path: str = "slice", requests: int = 1, **links: object):
    return scenario_from_dict(
        {
            "model": {"preset": "llama-3.1-8b"},
            "prefill": {"tp": 2},
            "decode": {"tp": 4},
            "transfer": {"path": path},
            "links": {"profile": "rdma-400g", **links},
            "workload": {
                "requests": requests,
                "arrival": "burst",
                "burst_size": requests,
                "rate_per_s": 1e-3,
                "prompt": "fixed",
                "prompt_tokens": 1024,
            },
        }
    )


def test_engine_fields_resolve_to_si() -> None:
    r = _scenario(
        inter_per_request_us=0.5,
        inter_prep_per_request_us=2.0,
        inter_per_batch_us=10.0,
        inter_message_rate_mps=50.0,
        post_threads=3,
        descriptor_reuse=False,
    ).links.resolved()
    assert r.link.per_request_s == pytest.approx(2.5e-6)  # preparation paid: no reuse
    assert r.link.per_batch_s == pytest.approx(10e-6)
    assert r.link.message_rate == pytest.approx(50e6)
    assert r.link.post_threads == 3
    reused = _scenario(
        inter_per_request_us=0.5, inter_prep_per_request_us=2.0, descriptor_reuse=True
    ).links.resolved()
    assert reused.link.per_request_s == pytest.approx(0.5e-6)
    unlimited = _scenario(inter_message_rate_mps=0.0, post_threads=0).links.resolved()
    assert unlimited.link.message_rate == math.inf and unlimited.link.post_threads == 0


@pytest.mark.parametrize("name", ["rdma-400g", "rdma-400g-mooncake", "roce-200g", "tcp-25g"])
def test_every_inter_profile_sets_the_engine(name: str) -> None:
    link = _scenario(profile=name).links.resolved().link
    assert link.per_request_s > 0 and link.per_batch_s > 0 and link.post_threads == 1
    assert 0 < link.message_rate < math.inf


# --------------------------------------------------------------------------- simulation


def _slice_ttft(requests: int, **links: object) -> float:
    result = Simulation(_scenario("slice", requests, **links), check=False).run()
    assert result.rooms_done == requests
    ends = [r.end for r in result.records if r.phase == "room_done" and r.role == "decode"]
    return max(ends)


def test_one_rank_posting_queues_its_batches() -> None:
    # One prompt, TP2 -> TP4: each prefill rank posts 2 slice writes of 65,536 requests.
    per, batch = 1e-6, 20e-6
    sets = {
        "inter_per_request_us": per * 1e6,
        "inter_per_batch_us": batch * 1e6,
        "inter_message_rate_mps": 0.0,
    }
    serial = _slice_ttft(1, post_threads=1, **sets)
    parallel = _slice_ttft(1, post_threads=2, **sets)
    # One thread: post, post, then the second write's 32 MiB alone (the first one's
    # bytes moved while the second was posting). Two threads: both post at once, then
    # their 64 MiB share the prefill NIC. Difference: one posting minus one write's bytes.
    post, one_write = batch + 65_536 * per, (32 << 20) / (370e9 / 8)
    assert serial - parallel == pytest.approx(post - one_write, rel=1e-6)


def test_slice_runs_are_deterministic() -> None:
    a = Simulation(_scenario("slice", 8), check=False).run().records
    b = Simulation(_scenario("slice", 8), check=False).run().records
    assert a == b
