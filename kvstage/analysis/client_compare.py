"""Score one run's client figures against another's: TTFT, TPOT and ITL at p50, p90 and
p99, E2E, and the served throughput, the way `kvstage compare MEASURED SIM` judges a
simulation against a measured run (docs/workflow.md).

Over the same requests: requests are matched by room (a measured file's request index,
a simulation's request of the same trace row), and the quantiles are taken over the
requests both runs finished (ITL over every gap of those requests). When one run has
only the distributions its tool reported (no per-request figures), the quantiles both
summaries have are compared instead, and the basis says so. The error of a figure is
(B - A) / A; the verdict holds B to A within `tolerance` on the worst of TTFT, TPOT and
ITL at p50, p90 and p99.
"""

from __future__ import annotations

import math
from typing import Any

from kvstage.fmt import quantile
from kvstage.metrics.rooms import request_figures, room_latencies
from kvstage.run.rundir import Run

METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
SCORED = ("ttft_s", "tpot_s", "itl_s")  # the verdict's figures
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
RATES = ("requests_per_s", "output_tokens_per_s")
LABELS = {"ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "ITL", "e2e_s": "E2E"}


def per_request(run: Run) -> dict[int, dict[str, Any]]:
    """Room -> its client figures (`request_figures`) and its gaps (`itls`)."""
    out = {}
    for room, info in room_latencies(run.records).items():
        figures = request_figures(info)
        if figures is not None:
            out[room] = {**figures, "itls": info.get("itls", [])}
    return out


def _dists_over(reqs: dict[int, dict], rooms: list[int]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key in METRICS:
        if key == "itl_s":
            values = sorted(g for r in rooms for g in reqs[r]["itls"])
        else:
            values = sorted(reqs[r][key] for r in rooms if key in reqs[r])
        if values:
            out[key] = {name: quantile(values, q) for name, q in QUANTILES.items()}
    return out


def _dists_reported(summary: dict) -> dict[str, dict[str, float]]:
    return {
        key: {q: summary[key][q] for q in QUANTILES if summary[key].get(q) is not None}
        for key in METRICS
        if isinstance(summary.get(key), dict)
    }


def _err(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or a == 0:
        return None
    return (b - a) / a


def compare_clients(a: Run, b: Run, *, tolerance: float) -> dict[str, Any]:
    """The client figures of B against A (A the reference: the measured run)."""
    ra, rb = per_request(a), per_request(b)
    common = sorted(set(ra) & set(rb))
    if common:
        da, db = _dists_over(ra, common), _dists_over(rb, common)
        basis = f"the same {len(common)} requests (matched by request index)"
    else:
        da = _dists_over(ra, sorted(ra)) if ra else _dists_reported(a.summary)
        db = _dists_over(rb, sorted(rb)) if rb else _dists_reported(b.summary)
        basis = "each run's own distribution (no request in common)"
    rows = []
    for key in METRICS:
        for q in QUANTILES:
            va, vb = da.get(key, {}).get(q), db.get(key, {}).get(q)
            if va is None and vb is None:
                continue
            rows.append({"metric": key, "quantile": q, "a": va, "b": vb, "error": _err(va, vb)})
    rates = [
        {"metric": k, "a": a.summary.get(k), "b": b.summary.get(k)}
        for k in RATES
        if a.summary.get(k) is not None or b.summary.get(k) is not None
    ]
    for r in rates:
        r["error"] = _err(r["a"], r["b"])
    return {
        "basis": basis,
        "requests": len(common),
        "figures": rows,
        "throughput": rates,
        "verdict": client_verdict(rows, tolerance),
    }


def client_verdict(rows: list[dict], tolerance: float) -> str:
    """B matches A when every scored figure it can be scored on is within `tolerance`."""
    scored = [r for r in rows if r["metric"] in SCORED and r["error"] is not None]
    if not scored:
        return "no client figure to compare (TTFT, TPOT, ITL): neither run has them both"
    worst = max(scored, key=lambda r: abs(r["error"]))
    name = f"{LABELS[worst['metric']]} {worst['quantile']}"
    missing = sorted(
        {LABELS[r["metric"]] for r in rows if r["metric"] in SCORED}
        - {LABELS[r["metric"]] for r in scored}
    )
    note = f"; not scored: {', '.join(missing)}" if missing else ""
    if abs(worst["error"]) <= tolerance:
        return (
            f"B matches A within {tolerance:.0%} on TTFT, TPOT and ITL p50/p90/p99 "
            f"(worst {name}: {worst['error']:+.1%}{note})"
        )
    side = "slower" if worst["error"] > 0 else "faster"
    return (
        f"B misses A: {name} is {abs(worst['error']):.0%} {side} "
        f"(A {worst['a'] * 1e3:,.2f} ms, B {worst['b'] * 1e3:,.2f} ms; tolerance {tolerance:.0%}{note})"
    )
