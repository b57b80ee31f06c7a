"""`kvstage import`: a measured file (a benchmark client's output, a server log or
metrics scrape) into a run directory that `compare`, `report` and `calibrate` read."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvstage.cli.errors import fail as _fail

console = Console()


def import_(
    file: Annotated[Path, typer.Argument(help="The measured file.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory to write.")],
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="sglang-bench, vllm-bench, genai-bench, aiperf-records, aiperf-summary, "
            "sglang-log or prometheus (default: detected from the content).",
        ),
    ] = None,
) -> None:
    """Read FILE (sglang.bench_serving JSONL, vllm bench serve JSON, genai-bench JSON,
    AIPerf profile_export.jsonl / profile_export_aiperf.json, an SGLang server log, a
    Prometheus scrape of SGLang) into the run directory OUT: a trace of the client's
    rows and a summary.json with TTFT, TPOT, ITL and E2E as the clients define them
    (docs/metrics.md). A bad or partial file: one line naming the file, the line and
    the field, exit 2."""
    from kvstage.measured.formats import read_measured
    from kvstage.measured.measurement import MeasuredError
    from kvstage.measured.rundir import write_measured_run
    from kvstage.run.summary_table import print_summary

    if out.exists() and any(out.iterdir()):
        _fail(f"{out} exists and is not empty: name a new run directory")
    try:
        m = read_measured(file, fmt)
    except MeasuredError as exc:
        _fail(str(exc))
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"{file}: cannot read it ({exc})")
    path = write_measured_run(m, out)
    from kvstage.run.rundir import read_summary

    print_summary(read_summary(path), console, title=f"{m.format}: {file.name}")
    for note in m.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
    console.print(f"run directory: {path}", highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    app.command("import")(import_)
