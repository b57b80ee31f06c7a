"""Parameter sweeps: simulate the cross product of varied scenario fields in parallel.

`kvstage sweep SCENARIO --vary decode.staging_pool_mb=512,1024,2048 --vary
workload.rate_per_s=4,16` simulates every combination of the varied values (each
parsed exactly like a `--set` value) on top of the scenario file and its `--set`
overrides, and collects one row per point: the varied keys, a status, the flattened
`kvstage.metrics.rooms.summarize` metrics (`METRICS`) and, for a point that did not run,
the reason. Points run in a local process pool (spawned processes, one point per
task) or on a Ray cluster (kvstage/explore/executor.py); either way the rows come back in the order of the cross
product (the first `--vary` is the outermost loop), whatever order points finish in,
and the simulation is deterministic, so two sweeps of the same input give the same
rows except `wall_s`.

What is bad input and what is a row (the decision this module documents):

* Bad input stops the sweep before anything runs (`SweepError`, exit 2 in the CLI):
  malformed `--vary` / `--set` / `--target`, an unknown key, an unknown metric, a
  value given twice, and any value that its field rejects on its own -- a wrong
  type, out of range, not one of the allowed words, not a power of two, an unknown
  model preset. Such a value could never make a valid point.
* A point whose value is fine on its own but whose *combination* the scenario
  rejects -- a staging pool smaller than one chunk, a TP pair the rank mapping
  cannot express, a prefix that is not page aligned, a links profile without
  numbers for the placement -- becomes a row with status "invalid" and the
  scenario's message as the reason. Finding where a region of the space stops
  being valid is part of what a sweep is for. If *no* point is valid, that is bad
  input again (nothing could be measured).
* A point whose simulation raised is a row with status "error" (a bug, not an
  answer); the CLI then exits 1, as it does when a point broke an invariant.

The target (`--target 'transfer_latency_s.p99<0.5'`, the smallest first-key value that
meets it) is kvstage/explore/sweep_target.py; the figures are `kvstage.explore.figures.plot_sweep`.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstage.explore.executor import STATUS_ERROR, Executor, ExploreError, error_row
from kvstage.fmt import MIB, csv_cell, json_text
from kvstage.shared.scenario import (
    PRESETS,
    Scenario,
    ScenarioError,
    apply_overrides,
    read_scenario_file,
    scenario_from_dict,
)

__all__ = [
    "METRICS",
    "Point",
    "SweepError",
    "SweepResult",
    "Vary",
    "base_data",
    "check_metric",
    "flatten_summary",
    "format_metric",
    "metric_display",
    "parse_vary",
    "plan_points",
    "run_point",
    "run_sweep",
    "write_tables",
]

# The flattened summary metrics of a row, in column order. `--metric` and `--target`
# name one of these. Per-request latencies (kvstage/metrics/rooms.py): transfer_latency_s
# starts at the first prefill forward; kv_transfer_latency_s at the last one's end.
# Decode-side and SLO ([slo] targets) figures are empty where a point lacks them.
_LATENCIES = (
    "transfer_latency_s",
    "ttft_s",
    "kv_transfer_latency_s",
    "prefill_compute_s",
    "queueing_s",
    "staging_wait_s",
    "decode_admission_wait_s",
    "decode_slot_wait_s",
    "tpot_s",
    "itl_s",
    "e2e_s",
)
METRICS: tuple[str, ...] = (
    "requests_done",
    "requests_failed",
    *(f"{key}.{stat}" for key in _LATENCIES for stat in ("p50", "p90", "p99", "mean", "max")),
    "throughput_gbps",
    "payload_bytes",
    "ring_live_peak_bytes",
    "ring_live_peak_fraction",
    "ring_reserved_peak_bytes",
    "ring_reserved_peak_fraction",
    "watermark_stall_s.total",
    "watermark_stall_s.p99",
    "watermark_stall_s.chunks",
    "transfer_requests.total",
    "transfer_requests.per_request",
    "events",
    "sim_time_s",
    "wall_s",
    "invariant_violations",
    "slo_attainment",
    "goodput_rps",
    "goodput_per_gpu_rps",
    "offered_load_rps",
)
# Text columns after METRICS: the bottleneck verdict of each point (kvstage/metrics/bottleneck.py).
VERDICT = ("bottleneck", "bottleneck_why")

STATUS_OK, STATUS_INVALID = "ok", "invalid"  # and STATUS_ERROR, kvstage/explore/executor.py


class SweepError(ExploreError):
    """Bad sweep input: one message for a human, no traceback (the CLI exits 2)."""


# --------------------------------------------------------------------------- input


@dataclass(frozen=True)
class Vary:
    """One `--vary key=v1,v2,...`: the raw texts (as for --set) and the typed values."""

    key: str
    raws: tuple[str, ...]
    values: tuple[Any, ...]

    def overrides(self) -> list[str]:
        return [f"{self.key}={raw}" for raw in self.raws]


def _split_values(text: str) -> list[str]:
    """Split on commas outside brackets and quotes (so `[1, 2]` stays one value)."""
    out, cur, depth, quote = [], [], 0, ""
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
            cur.append(ch)
        elif ch in "[{":
            depth += 1
            cur.append(ch)
        elif ch in "]}":
            depth -= 1
            cur.append(ch)
        elif ch == "," and depth <= 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur).strip())
    return out


def _typed_value(key: str, raw: str) -> Any:
    """The value a `--set key=raw` gives the scenario (string fields keep the text)."""
    node: Any = apply_overrides({}, [f"{key}={raw}"])
    for part in key.split("."):
        node = node[part]
    return node


def parse_vary(spec: str) -> Vary:
    """`key=v1,v2,...` -> Vary. The key is checked against the schema (unknown keys fail
    with the allowed ones); values are parsed like --set values."""
    key, sep, rest = spec.partition("=")
    key = key.strip()
    if not sep or not key or not rest.strip():
        raise SweepError(
            f"--vary {spec!r}: expected dotted.key=v1,v2,... "
            "(e.g. --vary decode.staging_pool_mb=512,1024,2048)"
        )
    raws = _split_values(rest)
    if any(not r for r in raws):
        raise SweepError(f"--vary {spec!r}: empty value in the list (values are comma separated)")
    values = []
    for raw in raws:
        try:
            values.append(_typed_value(key, raw))
        except ScenarioError as exc:
            raise SweepError(f"--vary {spec!r}: {_strip_override_prefix(str(exc))}") from None
    seen: set[str] = set()
    for raw, value in zip(raws, values, strict=True):
        ident = repr(value)
        if ident in seen:
            raise SweepError(f"--vary {key}: value {raw} is given twice")
        seen.add(ident)
    return Vary(key, tuple(raws), tuple(values))


def _strip_override_prefix(message: str) -> str:
    # apply_overrides says "override 'k=v': unknown key ..."; keep the useful part.
    return re.sub(r"^override '[^']*': ", "", message)


def check_metric(name: str, what: str = "--metric") -> str:
    if name not in METRICS:
        raise SweepError(f"{what}: unknown metric {name!r}; allowed: {', '.join(METRICS)}")
    return name


# --------------------------------------------------------------------------- planning


@dataclass
class Point:
    """One combination: its settings, the overrides that make it, and its scenario
    (None with `reason` when the scenario rejected the combination)."""

    index: int
    settings: dict[str, Any]
    overrides: list[str]
    scenario: Scenario | None = None
    reason: str | None = None


def base_data(path: Path, sets: Sequence[str]) -> dict[str, Any]:
    """The scenario file's tables (the real loader's reading, `read_scenario_file`) with
    the `--set` overrides applied, not yet validated: what every point starts from."""
    try:
        raw = read_scenario_file(path)
    except ScenarioError as exc:
        raise SweepError(str(exc)) from None
    try:
        return apply_overrides(raw, list(sets))
    except ScenarioError as exc:
        raise SweepError(f"--set: {exc}") from None


def plan_points(path: str | Path, varies: Sequence[Vary], sets: Sequence[str] = ()) -> list[Point]:
    """Every point of the cross product, validated. Raises SweepError for bad input (see
    the module docstring); a combination the scenario rejects is a Point with a reason."""
    path = Path(path)
    if not varies:
        raise SweepError("nothing to sweep: give at least one --vary key=v1,v2,...")
    keys = [v.key for v in varies]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise SweepError(
            f"--vary {dup[0]} is given more than once; list all its values in one --vary"
        )
    for v in varies:
        if v.key == "model.preset":
            bad = [raw for raw, val in zip(v.raws, v.values, strict=True) if val not in PRESETS]
            if bad:
                raise SweepError(
                    f"--vary model.preset: unknown preset {bad[0]}; allowed: {', '.join(PRESETS)}"
                )
    set_keys = {item.partition("=")[0].strip() for item in sets}
    base = base_data(path, sets)
    base.setdefault("name", path.stem)
    points: list[Point] = []
    for index, combo in enumerate(itertools.product(*(range(len(v.raws)) for v in varies))):
        settings = {v.key: v.values[i] for v, i in zip(varies, combo, strict=True)}
        overrides = [f"{v.key}={v.raws[i]}" for v, i in zip(varies, combo, strict=True)]
        try:
            data = apply_overrides(base, overrides)
        except ScenarioError as exc:  # unknown key (parse_vary checked, but be safe)
            raise SweepError(f"--vary: {exc}") from None
        try:
            scenario = scenario_from_dict(data, path.parent, source=str(path))
        except ScenarioError as exc:
            message = str(exc).removeprefix(f"{path}: ")
            bad = exc.own_values  # the fields whose value alone is rejected, if any
            if bad:
                if bad[0] in keys:
                    raise SweepError(f"--vary {bad[0]}: value rejected: {message}") from None
                if bad[0] in set_keys:
                    raise SweepError(f"--set {bad[0]}: value rejected: {message}") from None
                raise SweepError(str(exc)) from None
            points.append(Point(index, settings, overrides, None, message))
            continue
        points.append(Point(index, settings, overrides, scenario))
    if not any(p.scenario is not None for p in points):
        reasons = sorted({p.reason or "" for p in points})
        raise SweepError(
            "no point of the sweep is a valid scenario:\n  " + "\n  ".join(reasons[:5])
        )
    return points


# --------------------------------------------------------------------------- one point


def flatten_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The METRICS of a summary dict as one flat row (NaN -> None: no samples)."""
    row: dict[str, Any] = {}
    for name in METRICS:
        node: Any = summary
        for part in name.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, float) and not math.isfinite(node):
            node = None
        row[name] = node
    return row


def run_point(scenario: Scenario, keep_dir: str | None = None) -> dict[str, Any]:
    """Simulate one point and return its flat metrics (plus "status").

    Runs in a worker process (local pool or Ray): module-level and picklable by
    reference. Records stay in memory unless `keep_dir` is given, where the run
    directory (trace, scenario.toml, summary.json) is written.
    """
    try:
        from kvstage.metrics.rooms import room_latencies
        from kvstage.run.summary import capacity_figures, simulation_summary
        from kvstage.sim.shard import simulate_scenario

        result = simulate_scenario(scenario)
        summary = simulation_summary(scenario, result)
        if "bottleneck" not in summary:  # a point without [slo] or decode side: judge it anyway
            summary.update(
                capacity_figures(
                    scenario,
                    room_latencies(result.records),
                    summary,
                    requests=len(result.requests),
                    workload=result.requests,
                    always=True,
                )
            )
        if keep_dir is not None:
            from kvstage.run.rundir import write_run

            Path(keep_dir).mkdir(parents=True, exist_ok=True)
            write_run(Path(keep_dir), scenario, result.records, summary, "sim")
        row = flatten_summary(summary)
        row["bottleneck"] = summary["bottleneck"]["stage"]
        row["bottleneck_why"] = summary["bottleneck"]["explanation"]
        row["status"] = STATUS_OK
        if result.violations:
            row["reason"] = "; ".join(v.format() for v in result.violations[:3])
        return row
    except Exception as exc:  # a simulator bug: report it as the point's row
        return error_row(exc)


# --------------------------------------------------------------------------- the sweep


@dataclass
class SweepResult:
    varies: list[Vary]
    rows: list[dict[str, Any]]
    columns: list[str]
    backend: str
    workers: int
    wall_s: float
    points: list[Point] = field(repr=False, default_factory=list)

    def row_at(self, idx: Sequence[int]) -> dict[str, Any]:
        """The row of the point with value indices `idx` (one per varied key)."""
        flat = 0
        for v, i in zip(self.varies, idx, strict=True):
            flat = flat * len(v.values) + i
        return self.rows[flat]

    def count(self, status: str) -> int:
        return sum(1 for r in self.rows if r["status"] == status)

    @property
    def violated(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == STATUS_OK and r.get("invariant_violations")]


def run_sweep(
    path: str | Path,
    varies: Sequence[Vary],
    sets: Sequence[str] = (),
    *,
    workers: int | None = None,
    ray_address: str | None = None,
    keep_traces_dir: str | Path | None = None,
    on_start: Callable[[int], None] | None = None,
    on_point: Callable[[int, dict[str, Any]], None] | None = None,
    points: list[Point] | None = None,
) -> SweepResult:
    """Plan (unless `points` is given) and run a sweep; rows in cross-product order.

    `workers`: processes (local) or CPUs of a local Ray instance; default os.cpu_count().
    `ray_address`: None for the local process pool, "local" or a cluster address for
    Ray (an already initialised Ray is used as is). `keep_traces_dir`: write each
    point's run directory to <dir>/point-NNNN/. `on_start(n)` / `on_point(i, row)`
    report progress (n valid points; each point as it finishes, in any order).
    """
    if workers is not None and workers < 1:
        raise SweepError(f"--workers {workers}: must be at least 1")
    nworkers = workers or os.cpu_count() or 1
    if points is None:
        points = plan_points(path, varies, sets)
    keep = Path(keep_traces_dir) if keep_traces_dir is not None else None
    jobs = [
        (p.index, p.scenario, str(keep / f"point-{p.index:04d}") if keep else None)
        for p in points
        if p.scenario is not None
    ]
    results: dict[int, dict[str, Any]] = {}

    def done(index: int, row: dict[str, Any]) -> None:
        results[index] = row
        if on_point is not None:
            on_point(index, row)

    if on_start is not None:
        on_start(len(jobs))
    t0 = time.perf_counter()
    with Executor(workers, ray_address, jobs=len(jobs)) as executor:
        executor.run(run_point, [(index, (scenario, keep)) for index, scenario, keep in jobs], done)
    wall = time.perf_counter() - t0

    columns = [v.key for v in varies] + ["status", *METRICS, *VERDICT, "reason"]
    rows = []
    for p in points:
        row: dict[str, Any] = dict(p.settings)
        row["status"] = STATUS_INVALID
        row.update(dict.fromkeys((*METRICS, *VERDICT)))
        row["reason"] = p.reason
        if p.scenario is not None:
            got = results.get(p.index, {"status": STATUS_ERROR, "reason": "no result came back"})
            row.update({k: got.get(k) for k in ("status", *METRICS, *VERDICT, "reason")})
        rows.append({c: row.get(c) for c in columns})
    return SweepResult(list(varies), rows, columns, executor.backend, nworkers, wall, points)


# --------------------------------------------------------------------------- files


def write_json(path: Path, obj: Any) -> Path:
    path.write_text(json_text(obj))
    return path


def write_tables(result: SweepResult, out_dir: Path) -> dict[str, Path]:
    """sweep.csv and sweep.parquet: one row per point, columns as `result.columns`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "sweep.csv"
    with csv_path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(result.columns)
        for row in result.rows:
            w.writerow([csv_cell(row[c]) for c in result.columns])
    arrays = {}
    for c in result.columns:
        col = [row[c] for row in result.rows]
        try:
            arrays[c] = pa.array(col)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed types in a varied key
            arrays[c] = pa.array([None if v is None else str(v) for v in col])
    pq_path = out_dir / "sweep.parquet"
    pq.write_table(pa.table(arrays), pq_path)
    return {"csv": csv_path, "parquet": pq_path}


# --------------------------------------------------------------------------- display


def metric_display(metric: str, values: Sequence[float | None]) -> tuple[float, str, str]:
    """(scale, unit, label) to show `metric`: seconds as ms when all are below 1 s,
    bytes as MiB, fractions of the pool as %."""
    base, _, stat = metric.partition(".")
    nice = {
        "transfer_latency_s": "transfer latency",
        "ttft_s": "TTFT",
        "kv_transfer_latency_s": "exposed KV transfer",
        "prefill_compute_s": "prefill compute",
        "staging_wait_s": "staging wait",
        "watermark_stall_s": "watermark stall",
        "transfer_requests": "transfer requests",
        "ring_live_peak_bytes": "ring live peak",
        "ring_live_peak_fraction": "ring live peak / pool",
        "ring_reserved_peak_bytes": "ring reserved peak",
        "ring_reserved_peak_fraction": "ring reserved peak / pool",
        "throughput_gbps": "throughput",
        "payload_bytes": "payload",
        "sim_time_s": "simulated time",
        "wall_s": "wall time",
        "tpot_s": "TPOT",
        "itl_s": "ITL",
        "e2e_s": "end to end",
        "slo_attainment": "SLO attainment",
        "goodput_rps": "goodput (req/s)",
    }.get(base, base.replace("_", " "))
    label = f"{nice} {stat}".strip()
    nums = [v for v in values if v is not None]
    if base.endswith("_s") and stat not in ("chunks",):
        if nums and max(abs(v) for v in nums) < 1.0:
            return 1e3, "ms", label
        return 1.0, "s", label
    if base.endswith("_bytes"):
        return 1 / MIB, "MiB", label
    if base.endswith("_peak_fraction") or base == "slo_attainment":
        return 100.0, "%", label
    if base == "throughput_gbps":
        return 1.0, "Gbit/s", label
    return 1.0, "", label


def fmt_number(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def format_metric(metric: str, value: Any, scale_unit: tuple[float, str] | None = None) -> str:
    if value is None:
        return "-"
    if scale_unit is None:
        scale, unit, _ = metric_display(metric, [value])
    else:
        scale, unit = scale_unit
    text = fmt_number(float(value) * scale)
    return f"{text} {unit}".rstrip()
