"""The subcommands, a module each.

Every module here defines its commands as plain functions and `register(app)`, which
adds them with `app.command(name)(function)`; `register_all` calls the modules in the
order `kvstage --help` lists them, so a command's code, help and options stay in one
file.
"""

from __future__ import annotations

import importlib

import typer

# `kvstage --help` order: one run, then looking at runs, calibrating, the catalogue,
# and the many-run commands.
MODULES = (
    "run",
    "serve",
    "analysis",
    "measured",
    "calibrate",
    "catalog",
    "plan",
    "autoscale",
    "sweep",
)


def register_all(app: typer.Typer) -> None:
    for name in MODULES:
        importlib.import_module(f"{__name__}.{name}").register(app)
