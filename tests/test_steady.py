"""The steady window (warm-up and drain cut) and its figures: quantiles with intervals,
attainment and goodput over the window, on hand-built rooms whose answer is known."""

from __future__ import annotations

import random

from kvstage.metrics.steady import quantile_interval, quantile_name, steady_figures, steady_window
from kvstage.shared.workload import Request


def _rooms(n: int = 200, warm: int = 30, e2e: float = 10.0, seed: int = 1) -> dict:
    """Arrivals every second; TTFT grows over the first `warm` requests (empty queues
    filling), then hovers around 0.5 s; every request lives `e2e` seconds."""
    rng = random.Random(seed)
    rooms = {}
    for i in range(n):
        ttft = 0.05 + 0.45 * min(1.0, i / warm) + rng.uniform(-0.05, 0.05)
        a = float(i)
        rooms[i] = {
            "arrival": a,
            "done": a + ttft,
            "generate_start": a + ttft,
            "generate_end": a + e2e,
            "output_tokens": 100,
        }
    return rooms


def _requests(n: int = 200) -> list[Request]:
    return [
        Request(room=i, arrival_s=float(i), prompt_tokens=1000, prefix_tokens=0, output_tokens=100)
        for i in range(n)
    ]


def test_window_cuts_warmup_and_drain():
    rooms = _rooms()
    w = steady_window(rooms)
    assert w.warmup >= 10  # at least 5% and the ramp: MSER drops the filling queue
    first = min(w.rooms)
    assert first >= 20  # the first 20 requests are well below the plateau
    # the drain: requests arriving less than a median e2e (10 s) before the last arrival
    assert max(w.rooms) == 199 - 10 and w.drain == 10
    assert w.start_s == float(first) and w.end_s == 189.0


def test_goodput_is_over_the_window_not_the_drain():
    rooms = _rooms()
    f = steady_figures(rooms, _requests(), {"ttft_s": 1.0}, 0.9, gpus=4)
    assert f["slo_attainment"] == 1.0
    assert abs(f["goodput_rps"] - 1.0) < 1e-9  # 1 req/s offered, all meet; the drain is not counted
    assert abs(f["goodput_per_gpu_rps"] - 0.25) < 1e-9
    assert (
        abs(f["input_tokens_per_gpu_s"] - 250) < 1e-6
        and abs(f["output_tokens_per_gpu_s"] - 25) < 1e-6
    )
    assert abs(f["tokens_per_user_s"] - 100 / (10 - f["ttft_s.p50"])) < 5  # 1 / TPOT p50
    assert f["window_requests"] + f["warmup_requests"] + f["drain_requests"] == 200


def test_quantile_columns_follow_the_attainment():
    f = steady_figures(_rooms(), _requests(), {"ttft_s": 1.0}, 0.99, gpus=4)
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        for q in ("p50", "p90", "p99", "p99_lo", "p99_hi"):
            assert f"{key}.{q}" in f
    assert quantile_name(0.95) == "p95" and quantile_name(0.999) == "p99.9"
    f95 = steady_figures(_rooms(), _requests(), {"ttft_s": 1.0}, 0.95, gpus=4)
    assert f95["ttft_s.p90"] <= f95["ttft_s.p95"] <= f95["ttft_s.p99"]


def test_quantile_interval_brackets_and_narrows():
    rng = random.Random(7)
    small = [rng.expovariate(1.0) for _ in range(300)]
    large = [rng.expovariate(1.0) for _ in range(30000)]
    for xs in (small, large):
        est, lo, hi = quantile_interval(xs, 0.9)
        assert lo <= est <= hi
    (_, lo_s, hi_s), (_, lo_l, hi_l) = quantile_interval(small, 0.9), quantile_interval(large, 0.9)
    assert hi_l - lo_l < (hi_s - lo_s) / 3  # 100 times the samples: ~10 times narrower
    # the true p90 of Exp(1) is ln(10) = 2.303: inside the large sample's interval
    assert lo_l <= 2.302585 <= hi_l


def test_correlated_samples_widen_the_interval():
    """Requests queued behind each other: a slowly wandering series has fewer effective
    samples than its length, and batch means see it."""
    rng = random.Random(3)
    iid = [rng.random() for _ in range(2000)]
    level, walk = 0.5, []
    for _ in range(2000):
        level = min(1.0, max(0.0, level + rng.uniform(-0.02, 0.02)))
        walk.append(level)
    _, lo_i, hi_i = quantile_interval(iid, 0.5)
    _, lo_w, hi_w = quantile_interval(walk, 0.5)
    assert (hi_w - lo_w) / max(walk) > 2 * (hi_i - lo_i) / max(iid)
