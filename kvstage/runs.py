"""Run directories: where a run's trace, resolved scenario and summary land."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from kvstage.shared.scenario import Scenario
from kvstage.shared.trace import TraceRecord
from kvstage.tracefile import write_trace


def make_run_dir(scenario: Scenario, mode: str, out: Path | None = None, root: Path = Path("runs")) -> Path:
    """`out` if given, else runs/<scenario>-<mode>-<timestamp>[-n]/ (never reused)."""
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = root / f"{scenario.name}-{mode}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path


def _clean(obj):
    """JSON has no NaN: write null for a metric that had no samples."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_run(
    run_dir: Path,
    scenario: Scenario,
    records: list[TraceRecord],
    summary: dict,
    mode: str,
    trace_format: str = "parquet",
) -> dict[str, Path]:
    run_dir = Path(run_dir)
    paths = {
        "trace": write_trace(run_dir / f"trace.{trace_format}", records, mode),
        "scenario": run_dir / "scenario.toml",
        "summary": run_dir / "summary.json",
    }
    paths["scenario"].write_text(scenario.to_toml())
    paths["summary"].write_text(json.dumps(_clean(summary), indent=2, sort_keys=False) + "\n")
    return paths


def read_summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())
