"""Export a run's trace as a Chrome / Perfetto trace (JSON object format).

Open the file in https://ui.perfetto.dev or chrome://tracing. One event per trace
row: an "X" (complete) event for a span, an "i" (instant) event for a row with
start == end; timestamps in microseconds from the run start. Processes are the two
roles (prefill, decode), threads their ranks. The JSON format wants the complete
events of one thread to nest, while a rank's spans overlap (a write in flight while
the next chunk computes; several chunks waiting for the watermark at once), so a
rank gets a thread per kind of work ("prefill 3 · compute", "· transfer",
"· watermark wait", ...) and, where spans of one kind still overlap, extra threads
numbered "#2", "#3" next to it. Metadata events name and order processes and threads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvstage.compare import Run, load_run
from kvstage.shared.trace import TraceRecord

PIDS = {"prefill": 1, "decode": 2}
# kind of work per phase: its thread within the rank (index, name)
_LANES: dict[str, tuple[int, str]] = {
    "compute": (1, "compute"),
    "gather": (2, "transfer"),
    "write": (2, "transfer"),
    "slice_write": (2, "transfer"),
    "scatter": (2, "transfer"),
    "wm_wait": (3, "watermark wait"),
    "chunk_ready": (4, "chunk ready"),
}
_EVENTS_LANE = (0, "messages & events")  # instants and any other span
_SUB = 100  # threads per lane: tid = rank * 10000 + lane * _SUB + overlap index


def _name(r: TraceRecord) -> str:
    parts = [r.phase]
    if r.room >= 0:
        parts.append(f"r{r.room}")
    if r.chunk >= 0 and r.phase not in ("room_open",):
        parts.append(f"c{r.chunk}")
    if r.phase == "watermark" and r.wm_round >= 0:
        parts.append(f"round {r.wm_round} tail {r.wm_tail}")
    return " ".join(parts)


def _args(r: TraceRecord) -> dict:
    args: dict = {}
    if r.room >= 0:
        args["room"] = r.room
    if r.chunk >= 0:
        args["chunk_count" if r.phase == "room_open" else "chunk"] = r.chunk
    for key in ("writer", "peer", "offset", "ring_used", "wm_round", "wm_tail"):
        value = getattr(r, key)
        if value >= 0:
            args[key] = value
    if r.bytes:
        args["bytes"] = r.bytes
    if r.requests:
        args["requests"] = r.requests
    if r.detail:
        args["detail"] = r.detail
    return args


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def chrome_events(records: Sequence[TraceRecord], *, mode: str = "", scenario: str = "") -> dict:
    """The trace as a Chrome JSON object: {"traceEvents": [...], ...}."""
    events: list[dict] = []
    lane_ends: dict[tuple[str, int, int], list[float]] = {}  # (role, rank, lane) -> end per overlap thread
    threads: dict[tuple[int, int], str] = {}  # (pid, tid) -> name
    order = sorted(range(len(records)), key=lambda i: (records[i].start, -(records[i].end - records[i].start), i))
    for i in order:
        r = records[i]
        pid = PIDS.get(r.role, 3)
        rank = max(r.rank, 0)
        span = r.end > r.start
        lane, lane_name = _LANES.get(r.phase, _EVENTS_LANE) if span else _EVENTS_LANE
        sub = 0
        if span:
            ends = lane_ends.setdefault((r.role, rank, lane), [])
            sub = next((j for j, end in enumerate(ends) if end <= r.start), len(ends))
            if sub == len(ends):
                ends.append(r.end)
            ends[sub] = r.end
        tid = rank * 10000 + lane * _SUB + sub
        suffix = f" #{sub + 1}" if sub else ""
        threads[(pid, tid)] = f"{r.role} {rank} \u00b7 {lane_name}{suffix}"
        # whole nanoseconds, written as microseconds: back-to-back spans stay exactly adjacent
        t0 = _ns(r.start)
        event = {"name": _name(r), "cat": r.phase, "pid": pid, "tid": tid, "ts": t0 / 1000, "args": _args(r)}
        if span:
            event["ph"] = "X"
            event["dur"] = max(0, _ns(r.end) - t0) / 1000
        else:
            event["ph"] = "i"
            event["s"] = "t"
        events.append(event)
    meta: list[dict] = []
    for role, pid in PIDS.items():
        if any(p == pid for p, _ in threads):
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": role}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for (pid, tid), name in sorted(threads.items()):
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"mode": mode, "scenario": scenario, "rows": len(records), "source": "kvstage export-trace"},
    }


def export_chrome(run_dir: Path | str | Run, out: Path | str | None = None) -> Path:
    """Write the run's trace as Chrome / Perfetto JSON; default `<run>/trace.chrome.json`."""
    run = load_run(run_dir)
    out = Path(out) if out is not None else run.path / "trace.chrome.json"
    doc = chrome_events(run.records, mode=run.mode, scenario=run.scenario_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    return out
