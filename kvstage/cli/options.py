"""The command-line options more than one command takes, declared once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["ProgressOpt", "RayOpt", "ScenarioArg", "SetOpt", "WorkersOpt"]

ScenarioArg = Annotated[Path, typer.Argument(help="Scenario TOML file (see scenarios/README.md).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override a scenario field, e.g. --set decode.staging_pool_mb=512 (repeatable; "
        "sweep and plan: at every point).",
    ),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option(
        help="Parallel simulations: local processes, or CPUs of --ray local (default: all CPUs)."
    ),
]
RayOpt = Annotated[
    str | None,
    typer.Option(
        "--ray",
        metavar="ADDRESS",
        help='Run the points on Ray: "local" starts a private instance here; else a cluster '
        "address (host:port, auto, ray://...).",
    ),
]
ProgressOpt = Annotated[bool, typer.Option(help="Show a progress bar.")]
