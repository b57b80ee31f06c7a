"""A `Measurement` as a run directory: a trace of the client's rows and a summary.json
whose figures come from the same code as a simulated run's (kvstage/metrics/rooms.py),
so `kvstage compare` and `kvstage report` read it like any run (docs/workflow.md).

Rows (role `client`, rank 0, `room` = the request's index in the file): `request`
(start: arrival; end: last token, or the error; `requests`: output tokens; `bytes`:
prompt tokens), `first_token` (an instant), `token` (an instant per later token, when
the file has the gaps) and `room_failed` (`detail`: the tool's error). A file with only
aggregate figures gives an empty trace and its figures in summary.json.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvstage.fmt import json_text
from kvstage.measured.measurement import MeasuredRequest, Measurement
from kvstage.metrics.rooms import summarize
from kvstage.run.tracefile import write_trace
from kvstage.shared.trace import TraceRecord

MODE = "measured"


def request_rows(room: int, r: MeasuredRequest) -> list[TraceRecord]:
    """The trace rows of one measured request (see the module docstring)."""
    t0 = r.arrival_s
    rows = []
    if r.error or r.ttft_s is None:
        end = t0 + (r.e2e_s or 0.0)
        rows.append(TraceRecord("client", 0, "request", t0, end, room=room, bytes=r.prompt_tokens))
        rows.append(
            TraceRecord("client", 0, "room_failed", end, end, room=room, detail=r.error or "failed")
        )
        return rows
    first = t0 + r.ttft_s
    tokens = []
    if r.itls_s:
        t = first
        for gap in r.itls_s:
            t += gap
            tokens.append(t)
    e2e = r.e2e_s if r.e2e_s is not None else (tokens[-1] - t0 if tokens else r.ttft_s)
    rows.append(
        TraceRecord(
            "client",
            0,
            "request",
            t0,
            t0 + e2e,
            room=room,
            requests=r.output_tokens,
            bytes=r.prompt_tokens,
        )
    )
    rows.append(TraceRecord("client", 0, "first_token", first, first, room=room))
    rows += [TraceRecord("client", 0, "token", t, t, room=room) for t in tokens]
    return rows


def measured_summary(m: Measurement, records: list[TraceRecord]) -> dict[str, Any]:
    """summary.json of a measured run: the figures kvstage computes from the requests
    (when the file has them), the tool's own under `reported`, and where it came from."""
    if m.requests:
        summary = summarize(records, mode=MODE, pool_bytes=0, requests=len(m.requests))
    else:  # only aggregates: the tool's figures are the run's
        summary = {
            "mode": MODE,
            "requests": m.reported.get("requests", 0),
            "requests_done": m.reported.get("requests_done", 0),
            "requests_failed": m.reported.get("requests_failed", 0),
            **{k: v for k, v in m.reported.items() if k.endswith("_s") and isinstance(v, dict)},
        }
        for key in ("requests_per_s", "output_tokens_per_s"):
            if key in m.reported:
                summary[key] = m.reported[key]
    summary |= {
        "scenario": m.path.name,
        "source": {"file": str(m.path), "format": m.format, "tool": m.tool},
        "reported": m.reported,
    }
    if m.decode_steps or m.prefill_batches:
        summary["server_log"] = {
            "decode_steps": [asdict(s) for s in m.decode_steps],
            "prefill_batches": [asdict(b) for b in m.prefill_batches],
        }
    if m.notes:
        summary["notes"] = m.notes
    return summary


def write_measured_run(m: Measurement, out: Path) -> Path:
    """Write `m` as a run directory at `out` (created); returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = [row for i, r in enumerate(m.requests) for row in request_rows(i, r)]
    records.sort(key=lambda r: (r.start, r.room))
    write_trace(out / "trace.parquet", records, MODE)
    (out / "summary.json").write_text(json_text(measured_summary(m, records)))
    return out
