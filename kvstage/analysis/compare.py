"""Compare two runs (sim vs hw, staging vs slice, before vs after) from their traces.

Everything here reads only the run directory (trace, summary.json, scenario.toml),
so a simulated and a measured run go through the same code. `compare_runs` is pure:
it loads both runs and returns a plain dict (JSON-ready), nothing is printed or
written.

Definitions (B is measured relative to A):

- transfer latency of a room: first prefill `room_open` (the first STAGING_REQ) to
  the last decode `room_done` (as in `kvstage.metrics.rooms`); TTFT: arrival to the
  first token at the client (`kvstage.metrics.rooms.request_figures`, docs/metrics.md).
  Matched by room.
- chunk latency of (room, chunk, decode rank): from the moment the last of its
  writers finished computing the chunk (`compute` end; without compute rows, the
  writers' first gather / wm_wait / write start) to the chunk landing in the decode
  KV pool (`scatter` end; on the slice path, `chunk_ready`). Matched by
  (room, chunk, decode rank) where both runs have it.
- relative error of a pair: (b - a) / a; MAPE is the mean of its absolute value,
  bias the mean of the signed value (positive: B slower).
- client figures (`kvstage.analysis.client_compare`): TTFT, TPOT, ITL and E2E at p50,
  p90 and p99 over the requests both finished, and served throughput; the verdict of a
  comparison with a measured run (`kvstage import`) is theirs.
- phase breakdown: total and mean duration per chunk and rank of `wm_wait`, `gather`,
  `write`, `slice_write`, `scatter`, and of the control plane: the req -> rsp gap
  per (prefill rank, room, chunk) and the wait from the last write of a chunk to
  its `chunk_ready` at the decode (including chunk_ready's own duration).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvstage.analysis.client_compare import compare_clients
from kvstage.fmt import json_text
from kvstage.metrics.rooms import percentiles, request_figures, room_latencies
from kvstage.run.conditions import loaded_warnings
from kvstage.run.rundir import Run, load_run
from kvstage.shared.trace import TraceRecord

# Within this MAPE, B "matches" A (the verdict line).
MAPE_OK = 0.15

PHASE_KEYS: tuple[str, ...] = (
    "wm_wait",
    "gather",
    "write",
    "slice_write",
    "scatter",
    "control_req_rsp",
    "control_chunk_ready",
)
PHASE_LABELS: dict[str, str] = {
    "wm_wait": "waiting for watermark",
    "gather": "gather",
    "write": "write (bulk)",
    "slice_write": "slice write",
    "scatter": "scatter",
    "control_req_rsp": "control: req -> rsp",
    "control_chunk_ready": "control: write -> chunk_ready",
}


# --- per-run quantities -----------------------------------------------------------------


def room_metrics(records: Iterable[TraceRecord]) -> dict[int, dict[str, float]]:
    """Per room that completed: {"transfer": s, "ttft": s} (either may be missing)."""
    out: dict[int, dict[str, float]] = {}
    for room, info in room_latencies(records).items():
        if info.get("failed") or "done" not in info:
            continue
        m: dict[str, float] = {}
        if "transfer_start" in info:
            m["transfer"] = info["done"] - info["transfer_start"]
        figures = request_figures(info)
        if figures is not None:
            m["ttft"] = figures["ttft_s"]
        out[room] = m
    return out


def room_status(records: Iterable[TraceRecord]) -> dict[int, str]:
    """Every room seen in the trace: "done", "failed" or "incomplete"."""
    status: dict[int, str] = {}
    for room, info in room_latencies(records).items():
        status[room] = (
            "failed" if info.get("failed") else "done" if "done" in info else "incomplete"
        )
    return status


def chunk_latencies(records: Sequence[TraceRecord]) -> dict[tuple[int, int, int], float]:
    """(room, chunk, decode rank) -> seconds from the chunk computed at its writers to
    the chunk landed in that decode rank's KV pool (see the module docstring)."""
    computed: dict[tuple[int, int, int], float] = {}  # (prefill rank, room, chunk) -> compute end
    first_op: dict[
        tuple[int, int, int], float
    ] = {}  # (prefill rank, room, chunk) -> first op start
    writers: dict[tuple[int, int, int], set[int]] = {}  # (room, chunk, decode) -> prefill ranks
    landed: dict[tuple[int, int, int], float] = {}
    ready: dict[tuple[int, int, int], float] = {}
    for r in records:
        if r.room < 0 or r.chunk < 0:
            continue
        if r.role == "prefill":
            key = (r.rank, r.room, r.chunk)
            if r.phase == "compute":
                computed[key] = max(computed.get(key, -math.inf), r.end)
            elif r.phase in ("wm_wait", "gather", "write", "slice_write"):
                first_op[key] = min(first_op.get(key, math.inf), r.start)
                if r.peer >= 0:
                    writers.setdefault((r.room, r.chunk, r.peer), set()).add(r.rank)
        elif r.role == "decode":
            key = (r.room, r.chunk, r.rank)
            if r.phase == "scatter":
                landed[key] = max(landed.get(key, -math.inf), r.end)
            elif r.phase == "chunk_ready":
                ready[key] = max(ready.get(key, -math.inf), r.end)
    out: dict[tuple[int, int, int], float] = {}
    for key, ranks in writers.items():
        end = landed.get(key, ready.get(key))
        if end is None:
            continue
        room, chunk, _ = key
        starts = [computed.get((p, room, chunk), first_op.get((p, room, chunk))) for p in ranks]
        starts = [s for s in starts if s is not None and math.isfinite(s)]
        if starts:
            out[key] = end - max(starts)
    return out


def phase_breakdown(records: Sequence[TraceRecord]) -> dict[str, dict[str, float]]:
    """phase -> {"total_s", "count", "mean_s"} for PHASE_KEYS (see module docstring)."""
    totals = {k: 0.0 for k in PHASE_KEYS}
    counts = {k: 0 for k in PHASE_KEYS}
    req: dict[tuple[int, int, int], float] = {}
    rsp: dict[tuple[int, int, int], float] = {}
    last_write: dict[tuple[int, int, int], float] = {}  # (room, chunk, decode) -> last write end
    chunk_ready: dict[tuple[int, int, int], float] = {}
    for r in records:
        if r.phase in ("wm_wait", "gather", "write", "slice_write", "scatter"):
            totals[r.phase] += max(0.0, r.end - r.start)
            counts[r.phase] += 1
            if r.role == "prefill" and r.phase in ("write", "slice_write") and r.peer >= 0:
                key = (r.room, r.chunk, r.peer)
                last_write[key] = max(last_write.get(key, -math.inf), r.end)
        elif r.role == "prefill" and r.phase in ("req", "rsp") and r.room >= 0:
            table = req if r.phase == "req" else rsp
            key = (r.rank, r.room, r.chunk)
            table[key] = min(table.get(key, math.inf), r.start)
        elif r.role == "decode" and r.phase == "chunk_ready" and r.room >= 0:
            key = (r.room, r.chunk, r.rank)
            chunk_ready[key] = max(chunk_ready.get(key, -math.inf), r.end)
    for key, t0 in req.items():
        if key in rsp:
            totals["control_req_rsp"] += max(0.0, rsp[key] - t0)
            counts["control_req_rsp"] += 1
    for key, t1 in chunk_ready.items():
        if key in last_write:
            totals["control_chunk_ready"] += max(0.0, t1 - last_write[key])
            counts["control_chunk_ready"] += 1
    return {
        k: {
            "total_s": totals[k],
            "count": counts[k],
            "mean_s": (totals[k] / counts[k]) if counts[k] else 0.0,
        }
        for k in PHASE_KEYS
    }


# --- error metrics ----------------------------------------------------------------------------


def _nan_to_none(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def error_metrics(pairs: Sequence[tuple[float, float]]) -> dict:
    """Error of b relative to a over matched (a, b) pairs (pairs with a <= 0 are skipped
    for the relative metrics)."""
    a_vals = [a for a, _ in pairs]
    b_vals = [b for _, b in pairs]
    rel = [(b - a) / a for a, b in pairs if a > 0]
    pa, pb = percentiles(a_vals), percentiles(b_vals)
    out: dict = {
        "count": len(pairs),
        "mape": (sum(abs(e) for e in rel) / len(rel)) if rel else math.nan,
        "bias": (sum(rel) / len(rel)) if rel else math.nan,
        "max_abs_rel_error": max((abs(e) for e in rel), default=math.nan),
        "mean_abs_error_s": (sum(abs(b - a) for a, b in pairs) / len(pairs)) if pairs else math.nan,
        "a": pa,
        "b": pb,
    }
    for q in ("p50", "p90", "p99", "mean", "max"):
        diff = pb[q] - pa[q]
        out[q] = {
            "a": pa[q],
            "b": pb[q],
            "diff_s": diff,
            "rel": (diff / pa[q]) if pa[q] and math.isfinite(pa[q]) else math.nan,
        }
    return out


def verdict(metrics: dict, *, what: str = "transfer latency", tolerance: float = MAPE_OK) -> str:
    n = metrics.get("count", 0)
    mape, bias = metrics.get("mape", math.nan), metrics.get("bias", math.nan)
    if not n or mape is None or not math.isfinite(mape):
        return f"no {what} to compare: the runs have no completed room in common"
    if mape <= tolerance:
        return f"B within {tolerance:.0%} MAPE of A ({what}: MAPE {mape:.1%}, bias {bias:+.1%}, {n} rooms)"
    direction = "slower" if bias > 0 else "faster"
    size = f"{abs(bias):.1%}" if 0.995 <= abs(bias) < 1 else f"{abs(bias):.0%}"
    factor = f", B/A = {1 + bias:.3g}x" if abs(bias) >= 0.5 else ""
    return (
        f"B is {size} {direction} than A (bias{factor}; {what}: MAPE {mape:.1%}, "
        f"bias {bias:+.1%}, {n} rooms)"
    )


# Resolved-scenario fields that do not change what is transferred (so not worth a warning).
_IGNORED_FIELDS = ("name", "description", "links.source", "hardware.", "faults.", "expect.")


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


# Fields a mode does not use: a hardware run moves real bytes over real links, so the
# link model (profile, bandwidths, latencies, host model) means nothing to it.
_UNUSED_BY_MODE: dict[str, tuple[str, ...]] = {"hw": ("links.",)}


def scenario_diff(
    a: dict, b: dict, modes: tuple[str, str] = ("", "")
) -> list[tuple[str, object, object]]:
    """(field, value in A, value in B) for every resolved-scenario field that differs,
    leaving out names, notes, hardware / fault settings and the fields either run's
    mode does not use (`_UNUSED_BY_MODE`, e.g. the link model for a hardware run)."""
    fa, fb = _flatten(a), _flatten(b)
    unused = tuple(p for m in modes for p in _UNUSED_BY_MODE.get(m, ()))
    out = []
    for key in sorted(set(fa) | set(fb)):
        if (
            key.startswith(_IGNORED_FIELDS)
            or key in _IGNORED_FIELDS
            or (unused and key.startswith(unused))
        ):
            continue
        if fa.get(key) != fb.get(key):
            out.append((key, fa.get(key), fb.get(key)))
    return out


def unused_fields_note(a: Run, b: Run) -> str:
    """One line saying which differing fields were left out because a run's mode does
    not use them ("" when none were)."""
    if not (a.scenario and b.scenario):
        return ""
    modes = (a.mode, b.mode)
    prefixes = sorted({p for m in modes for p in _UNUSED_BY_MODE.get(m, ())})
    if not prefixes:
        return ""
    fa, fb = _flatten(a.scenario), _flatten(b.scenario)
    n = sum(
        1 for k in set(fa) | set(fb) if k.startswith(tuple(prefixes)) and fa.get(k) != fb.get(k)
    )
    if not n:
        return ""
    hw = [tag for tag, m in (("A", a.mode), ("B", b.mode)) if m == "hw"]
    runs = f"the hardware run ({hw[0]}) does" if len(hw) == 1 else "hardware runs (A and B) do"
    fields = ", ".join(p + "*" for p in prefixes)
    return f"{n} {fields} field(s) differ but are not compared: {runs} not use the link model"


def _room_list(rooms: Iterable[int], cap: int = 200) -> list[int]:
    return sorted(rooms)[:cap]


def _room_sets(ra: dict, rb: dict, sa: dict, sb: dict) -> dict[str, set[int]]:
    """Rooms by where they are: only in one trace, or in both but completed in only one
    of them (failed / unfinished in the other)."""
    only_a = set(sa) - set(sb)
    only_b = set(sb) - set(sa)
    return {
        "only_a": only_a,
        "only_b": only_b,
        "done_only_a": (set(ra) - set(rb)) - only_a,
        "done_only_b": (set(rb) - set(ra)) - only_b,
    }


def _room_pairs(ra: dict, rb: dict, both: list[int], metric: str) -> list[tuple[float, float]]:
    return [(ra[k][metric], rb[k][metric]) for k in both if metric in ra[k] and metric in rb[k]]


def _per_room(ra: dict, rb: dict, both: list[int]) -> list[dict]:
    return [
        {
            "room": k,
            "a_transfer_s": ra[k].get("transfer"),
            "b_transfer_s": rb[k].get("transfer"),
            "a_ttft_s": ra[k].get("ttft"),
            "b_ttft_s": rb[k].get("ttft"),
        }
        for k in both
    ]


def _phase_comparison(a: Run, b: Run) -> dict[str, dict]:
    pha, phb = phase_breakdown(a.records), phase_breakdown(b.records)
    phases = {}
    for k in PHASE_KEYS:
        ta, tb = pha[k]["total_s"], phb[k]["total_s"]
        phases[k] = {
            "label": PHASE_LABELS[k],
            "a": pha[k],
            "b": phb[k],
            "total_ratio": (tb / ta) if ta > 0 else (math.nan if tb == 0 else math.inf),
        }
    return phases


def _verdict_notes(a: Run, b: Run, rooms: dict[str, set[int]], diff: list) -> list[str]:
    """What the verdict line should warn of: rooms one run lacks, different scenarios."""
    notes = []
    if rooms["only_a"] or rooms["only_b"]:
        notes.append(f"rooms only in A: {len(rooms['only_a'])}, only in B: {len(rooms['only_b'])}")
    if a.scenario_name != b.scenario_name:
        notes.append(f"different scenarios: {a.scenario_name} vs {b.scenario_name}")
    elif diff:
        shown = ", ".join(f"{k} {va} vs {vb}" for k, va, vb in diff[:4])
        more = f" (+{len(diff) - 4} more)" if len(diff) > 4 else ""
        notes.append(f"scenario fields differ: {shown}{more}")
    if rooms["done_only_a"] or rooms["done_only_b"]:
        notes.append(
            f"completed only in A: {len(rooms['done_only_a'])}, only in B: {len(rooms['done_only_b'])}"
        )
    return notes


def _run_info(run: Run, status: dict, chunks: dict) -> dict:
    return {
        "path": str(run.path),
        "name": run.name,
        "scenario": run.scenario_name,
        "mode": run.mode,
        "transfer_path": run.transfer_path,
        "backend": run.backend,
        "device": run.device,
        "rooms": len(status),
        "rooms_done": sum(1 for s in status.values() if s == "done"),
        "rooms_failed": sum(1 for s in status.values() if s == "failed"),
        "chunks": len(chunks),
    }


def _rooms_section(both: list[int], rooms: dict[str, set[int]]) -> dict:
    return {
        "matched": len(both),
        "only_in_a": len(rooms["only_a"]),
        "only_in_b": len(rooms["only_b"]),
        "only_in_a_rooms": _room_list(rooms["only_a"]),
        "only_in_b_rooms": _room_list(rooms["only_b"]),
        "completed_only_in_a": len(rooms["done_only_a"]),
        "completed_only_in_b": len(rooms["done_only_b"]),
        "completed_only_in_a_rooms": _room_list(rooms["done_only_a"]),
        "completed_only_in_b_rooms": _room_list(rooms["done_only_b"]),
    }


def compare_runs(
    run_a: Path | str | Run, run_b: Path | str | Run, *, tolerance: float = MAPE_OK
) -> dict:
    """Compare run B with run A (A is the reference). Returns a JSON-ready dict with
    per-room and per-chunk errors, a phase breakdown and a verdict line."""
    a, b = load_run(run_a), load_run(run_b)
    ra, rb = room_metrics(a.records), room_metrics(b.records)
    sa, sb = room_status(a.records), room_status(b.records)
    both = sorted(set(ra) & set(rb))
    rooms = _room_sets(ra, rb, sa, sb)

    ca, cb = chunk_latencies(a.records), chunk_latencies(b.records)
    chunk_keys = sorted(set(ca) & set(cb))
    chunk_pairs = [(ca[k], cb[k]) for k in chunk_keys]

    transfer = error_metrics(_room_pairs(ra, rb, both, "transfer"))
    client = compare_clients(a, b, tolerance=tolerance)
    # a measured run has no transfer spans: it is judged on the client's figures
    measured = "measured" in (a.mode, b.mode)
    line = client["verdict"] if measured else verdict(transfer, tolerance=tolerance)
    diff = (
        scenario_diff(a.scenario, b.scenario, (a.mode, b.mode)) if a.scenario and b.scenario else []
    )
    notes = _verdict_notes(a, b, rooms, diff)
    if notes:
        line += " [" + "; ".join(notes) + "]"

    return {
        "a": _run_info(a, sa, ca),
        "b": _run_info(b, sb, cb),
        "rooms": _rooms_section(both, rooms),
        "transfer_latency": transfer,
        "client": client,
        "ttft": error_metrics(_room_pairs(ra, rb, both, "ttft")),
        "chunk_latency": {
            **error_metrics(chunk_pairs),
            "only_in_a": len(set(ca) - set(cb)),
            "only_in_b": len(set(cb) - set(ca)),
        },
        "phases": _phase_comparison(a, b),
        "scenario_diff": [{"field": k, "a": va, "b": vb} for k, va, vb in diff],
        "scenario_diff_note": unused_fields_note(a, b),
        "conditions": {"a": a.summary.get("conditions"), "b": b.summary.get("conditions")},
        "warnings": loaded_warnings(
            [("A", a.mode, a.summary.get("conditions")), ("B", b.mode, b.summary.get("conditions"))]
        ),
        "per_room": _per_room(ra, rb, both),
        "per_chunk": [
            {"room": k[0], "chunk": k[1], "decode_rank": k[2], "a_s": ca[k], "b_s": cb[k]}
            for k in chunk_keys
        ],
        "verdict": line,
        "tolerance": tolerance,
    }


def to_json(result: dict) -> str:
    """JSON text of a compare result (NaN / inf written as null)."""
    return json_text(result)
