"""Export a run's trace as a Chrome / Perfetto trace (JSON object format).

Open the file in https://ui.perfetto.dev or chrome://tracing. Timestamps are in
microseconds from the run start. Processes are the two roles (prefill, decode).

Tracks, per rank, a fixed few:
- one thread per kind of work ("prefill 3 · compute", "· gather", "· write",
  "· watermark wait"; "decode 0 · chunk ready", "· scatter") plus "· messages &
  events" for instants (and spans of any other phase). A span is a complete ("X")
  event on its kind's thread; the JSON format wants the complete events of a thread
  to nest, so a span that overlaps one already there (a second chunk waiting for the
  watermark, two writes in flight) becomes an async slice ("b"/"e") on that rank's
  one async track of the kind ("prefill 3 · watermark wait (overlapping)"), where
  overlap is allowed: at most two tracks per kind and rank, never a row per overlap;
- per decode rank three counter tracks ("C"): ring live bytes (written, not yet
  freed), ring reserved bytes (regions handed out, may exceed the pool) and the
  watermark in ring rounds (round + tail / pool), from `kvstage.metrics.rooms.ring_series`;
- flow arrows ("s" -> "f") from each bulk write to the scatter of the same
  (room, chunk) on its decode rank, one per writer. An arrow binds to a thread
  slice, so a write or scatter drawn as an async slice gets a zero-length slice
  (category "flow anchor") on its kind's thread where the write lands or the
  scatter starts, and the arrow binds there.

Instants are "i" events; metadata events name and order processes and threads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvstage.metrics.rooms import ring_series
from kvstage.run.rundir import Run, load_run
from kvstage.shared.trace import TraceRecord

PIDS = {"prefill": 1, "decode": 2}
# kind of work per phase: its thread within the rank (index, name)
_LANES: dict[str, tuple[int, str]] = {
    "compute": (1, "compute"),
    "gather": (2, "gather"),
    "write": (3, "write"),
    "slice_write": (3, "write"),
    "wm_wait": (4, "watermark wait"),
    "chunk_ready": (5, "chunk ready"),
    "scatter": (6, "scatter"),
}
_EVENTS_LANE = (0, "messages & events")  # instants and any other span
_TIDS_PER_RANK = 100  # tid = rank * _TIDS_PER_RANK + lane
COUNTERS = ("ring live bytes", "ring reserved bytes", "watermark (ring rounds)")
ANCHOR = "flow anchor"  # category of the zero-length slices that anchor arrows of async spans


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


class _Builder:
    """Places every record on its rank's track, then adds counters and flows."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.threads: dict[tuple[int, int], str] = {}  # (pid, tid) -> name
        self.lane_end: dict[tuple[int, int], int] = {}  # (pid, tid) -> end (ns) of its last X event
        self.slices: dict[
            tuple, tuple[int, int, int, int]
        ] = {}  # flow ends: key -> (pid, tid, t0, t1) in ns
        self.async_ids = 0

    def add(self, r: TraceRecord) -> None:
        pid = PIDS.get(r.role, 3)
        rank = max(r.rank, 0)
        t0, t1 = (
            _ns(r.start),
            _ns(r.end),
        )  # whole ns written as us: back-to-back spans stay adjacent
        span = t1 > t0
        lane, lane_name = _LANES.get(r.phase, _EVENTS_LANE) if span else _EVENTS_LANE
        tid = rank * _TIDS_PER_RANK + lane
        self.threads[(pid, tid)] = f"{r.role} {rank} \u00b7 {lane_name}"
        base = {"cat": r.phase, "pid": pid, "tid": tid, "ts": t0 / 1000}
        if not span:
            self.events.append({"name": _name(r), "ph": "i", "s": "t", **base, "args": _args(r)})
            return
        key = self._flow_key(r)
        if self.lane_end.get((pid, tid), -1) <= t0:  # fits after the thread's last slice
            self.lane_end[(pid, tid)] = t1
            self.events.append(
                {"name": _name(r), "ph": "X", "dur": (t1 - t0) / 1000, **base, "args": _args(r)}
            )
            if key is not None:
                self.slices[key] = (pid, tid, t0, t1)
            return
        # overlaps the thread's last slice: an async slice on the rank's overlap track of this kind
        self.async_ids += 1
        name = f"{r.role} {rank} \u00b7 {lane_name} (overlapping)"
        ident = f"0x{self.async_ids:x}"
        self.events.append(
            {"name": name, "ph": "b", "id": ident, **base, "args": {"span": _name(r), **_args(r)}}
        )
        self.events.append({"name": name, "ph": "e", "id": ident, **base, "ts": t1 / 1000})
        if key is not None:
            # an arrow binds to a thread slice: a zero-length anchor on the kind's thread where the
            # write lands (its end) or the scatter starts, nested in whatever slice runs there
            t = t1 if r.phase == "write" else t0
            self.events.append(
                {
                    "name": f"{_name(r)} ({'lands' if r.phase == 'write' else 'starts'})",
                    "ph": "X",
                    "dur": 0,
                    **base,
                    "cat": ANCHOR,
                    "ts": t / 1000,
                    "args": _args(r),
                }
            )
            self.slices[key] = (pid, tid, t, t)

    @staticmethod
    def _flow_key(r: TraceRecord) -> tuple | None:
        """Where an arrow starts (a bulk write) or ends (a scatter), else None."""
        if r.phase == "write" and r.role == "prefill" and r.peer >= 0:
            return ("write", r.room, r.chunk, r.peer, r.rank, r.writer)
        if r.phase == "scatter" and r.role == "decode":
            return ("scatter", r.room, r.chunk, r.rank)
        return None

    def flows(self) -> None:
        """An arrow from each write to the scatter of its (room, chunk) at its decode rank,
        placed mid-slice (or on the anchor of an async span) so that both ends bind there."""
        n = 0
        for key, (pid, tid, t0, t1) in sorted(self.slices.items(), key=lambda kv: kv[1][2]):
            if key[0] != "write":
                continue
            _, room, chunk, decode, prefill, writer = key
            target = self.slices.get(("scatter", room, chunk, decode))
            if target is None:
                continue
            n += 1
            common = {
                "name": "write -> scatter",
                "cat": "flow",
                "id": n,
                "args": {
                    "room": room,
                    "chunk": chunk,
                    "prefill": prefill,
                    "writer": writer,
                    "decode": decode,
                },
            }
            self.events.append(
                {"ph": "s", "pid": pid, "tid": tid, "ts": (t0 + t1) // 2 / 1000, **common}
            )
            dpid, dtid, d0, d1 = target
            self.events.append(
                {
                    "ph": "f",
                    "bp": "e",
                    "pid": dpid,
                    "tid": dtid,
                    "ts": (d0 + d1) // 2 / 1000,
                    **common,
                }
            )

    def counters(self, records: Sequence[TraceRecord], pool_bytes: int) -> None:
        """Per decode rank: live bytes, reserved bytes and the watermark as counters."""
        pid = PIDS["decode"]
        for rank, s in ring_series(records).items():
            names = [f"decode {rank} \u00b7 {c}" for c in COUNTERS]
            for t, v in s.live:
                self.events.append(
                    {
                        "name": names[0],
                        "ph": "C",
                        "pid": pid,
                        "ts": _ns(t) / 1000,
                        "args": {"bytes": v},
                    }
                )
            for t, v in s.reserved:
                self.events.append(
                    {
                        "name": names[1],
                        "ph": "C",
                        "pid": pid,
                        "ts": _ns(t) / 1000,
                        "args": {"bytes": v},
                    }
                )
            for t, rd, tail in s.watermark:
                pos = rd + (tail / pool_bytes if pool_bytes else 0.0)
                self.events.append(
                    {
                        "name": names[2],
                        "ph": "C",
                        "pid": pid,
                        "ts": _ns(t) / 1000,
                        "args": {"rounds": round(pos, 6)},
                    }
                )

    def metadata(self) -> list[dict]:
        meta: list[dict] = []
        pids = {p for p, _ in self.threads} | {e["pid"] for e in self.events}
        for role, pid in PIDS.items():
            if pid in pids:
                meta.append(
                    {
                        "name": "process_name",
                        "ph": "M",
                        "pid": pid,
                        "tid": 0,
                        "args": {"name": role},
                    }
                )
                meta.append(
                    {
                        "name": "process_sort_index",
                        "ph": "M",
                        "pid": pid,
                        "tid": 0,
                        "args": {"sort_index": pid},
                    }
                )
        for (pid, tid), name in sorted(self.threads.items()):
            meta.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            )
            meta.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        return meta


def chrome_events(
    records: Sequence[TraceRecord], *, mode: str = "", scenario: str = "", pool_bytes: int = 0
) -> dict:
    """The trace as a Chrome JSON object: {"traceEvents": [...], ...} (see the module
    docstring for the tracks). `pool_bytes` scales the watermark counter to ring rounds."""
    b = _Builder()
    order = sorted(
        range(len(records)),
        key=lambda i: (records[i].start, -(records[i].end - records[i].start), i),
    )
    for i in order:
        b.add(records[i])
    b.flows()
    b.counters(records, pool_bytes)
    return {
        "traceEvents": b.metadata() + b.events,
        "displayTimeUnit": "ms",
        "otherData": {
            "mode": mode,
            "scenario": scenario,
            "rows": len(records),
            "source": "kvstage export-trace",
        },
    }


def export_chrome(run_dir: Path | str | Run, out: Path | str | None = None) -> Path:
    """Write the run's trace as Chrome / Perfetto JSON; default `<run>/trace.chrome.json`."""
    run = load_run(run_dir)
    out = Path(out) if out is not None else run.path / "trace.chrome.json"
    doc = chrome_events(
        run.records, mode=run.mode, scenario=run.scenario_name, pool_bytes=run.pool_bytes
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    return out
