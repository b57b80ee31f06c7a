"""The `kvstage` command line: the app, its subcommands (kvstage/cli/commands/) and the
entry point."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

from kvstage.cli.commands import register_all
from kvstage.cli.errors import click_exceptions, err, usage_error

app = typer.Typer(
    name="kvstage",
    help=(
        "Staged KV-cache transfer between prefill and decode with different TP sizes: "
        "validate scenarios, simulate them (SimPy), run them on real NIXL / Mooncake "
        "transfers, and check the protocol's invariants."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)
console = Console()


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        console.print(f"kvstage {version('kvstage')}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_version, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Staged KV-cache transfer between prefill and decode with different TP sizes:
    validate scenarios, simulate them (SimPy), run them on real NIXL / Mooncake
    transfers, and check the protocol's invariants."""


register_all(app)


def main() -> None:
    # standalone_mode=False: click's usage errors come back here, to be printed like
    # every other error (kvstage/cli/errors.py) instead of as a panel in a CI log
    cx = click_exceptions()
    try:
        code = app(standalone_mode=False)
    except cx.NoArgsIsHelpError as exc:
        console.print(exc.ctx.get_help(), markup=False, highlight=False)
        code = 2
    except cx.ClickException as exc:
        code = usage_error(exc)
    except (getattr(cx, "Abort", typer.Abort), typer.Abort):
        err.print("aborted")
        code = 1
    except KeyboardInterrupt:
        err.print("interrupted")
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
