"""Run directories: where a run's trace, resolved scenario and summary land, and where
every later tool reads them back (`load_run`)."""

from __future__ import annotations

import json
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvstage.fmt import json_text, mib_to_bytes
from kvstage.run.tracefile import find_trace, read_records, write_trace
from kvstage.shared.scenario import Scenario
from kvstage.shared.trace import TraceRecord


def make_run_dir(
    scenario: Scenario, mode: str, out: Path | None = None, root: Path = Path("runs")
) -> Path:
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
    paths["summary"].write_text(json_text(summary))  # a metric without samples: null
    return paths


def read_summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


class RunError(Exception):
    """A path that is not a readable run directory (one clear message)."""


@dataclass
class Run:
    """A loaded run directory: its records plus summary and resolved scenario."""

    path: Path
    mode: str
    records: list[TraceRecord]
    summary: dict = field(default_factory=dict)
    scenario: dict = field(default_factory=dict)
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.path.name

    @property
    def scenario_name(self) -> str:
        return str(self.summary.get("scenario") or self.scenario.get("name") or "?")

    @property
    def transfer_path(self) -> str:
        path = self.summary.get("transfer_path") or self.scenario.get("transfer", {}).get("path")
        return str(path) if path else "unknown"  # a bare trace file says nothing of it

    @property
    def pool_bytes(self) -> int:
        mb = self.scenario.get("decode", {}).get("staging_pool_mb")
        return (
            mib_to_bytes(mb) if mb is not None else 0
        )  # the scenario's own bytes (Scenario.pool_bytes)

    @property
    def backend(self) -> str | None:
        if self.mode != "hw":
            return None
        return self.summary.get("backend") or self.scenario.get("hardware", {}).get("backend")

    @property
    def device(self) -> str | None:
        if self.mode != "hw":
            return None
        return self.summary.get("device") or self.scenario.get("hardware", {}).get("device")

    def describe(self) -> str:
        parts = [self.scenario_name, self.mode, self.transfer_path]
        if self.mode == "hw":
            parts += [str(self.backend or "?"), str(self.device or "?")]
        return " / ".join(parts)


def load_run(path: Path | str | Run) -> Run:
    """Read a run directory (or a trace file inside one); RunError if it is not one."""
    if isinstance(path, Run):
        return path
    path = Path(path)
    if not path.exists():
        raise RunError(f"{path}: no such run directory")
    try:
        trace = find_trace(path)
    except FileNotFoundError:
        raise RunError(
            f"{path} is not a run directory: it has no trace.parquet or trace.jsonl "
            "(make one with `kvstage sim` or `kvstage hw`)"
        ) from None
    run_dir = trace.parent
    try:
        mode, records = read_records(trace)
    except Exception as exc:  # a corrupt or foreign file: say so, no traceback
        raise RunError(f"{trace}: cannot read the trace ({type(exc).__name__}: {exc})") from None
    summary: dict = {}
    if (run_dir / "summary.json").exists():
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except (OSError, ValueError) as exc:
            raise RunError(f"{run_dir / 'summary.json'}: cannot read it ({exc})") from None
    scenario: dict = {}
    if (run_dir / "scenario.toml").exists():
        try:
            scenario = tomllib.loads((run_dir / "scenario.toml").read_text())
        except (OSError, ValueError) as exc:
            raise RunError(f"{run_dir / 'scenario.toml'}: cannot read it ({exc})") from None
    return Run(
        path=run_dir,
        mode=mode or summary.get("mode", ""),
        records=records,
        summary=summary,
        scenario=scenario,
    )
