"""`kvstage serve`: the scenario's cluster behind an OpenAI-compatible server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvstage.cli.commands.run import ScenarioArg, SetOpt, _fail, _load

console = Console()


def serve(
    scenario: ScenarioArg,
    set_: SetOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 8000,
    model: Annotated[
        str | None, typer.Option(help="The model name served (default: the scenario's name).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Run directory (default runs/SCENARIO-serve-TIME/).")
    ] = None,
) -> None:
    """Answer OpenAI-compatible requests (/v1/completions, /v1/chat/completions, streamed
    or not) as the scenario's PD cluster would, on the simulated clock run in real time:
    each request joins the simulation when it arrives and its tokens leave at their
    simulated times. Prompts are counted one token per whitespace-separated word; the
    run directory's tokenizer/ is that rule for a client. Ctrl-C (or SIGTERM) stops the
    server and writes the run directory as `kvstage sim` does."""
    from kvstage.run.rundir import make_run_dir
    from kvstage.serve.server import serve as run_server

    if not 0 <= port <= 65535:
        _fail(f"--port {port}: allowed 0..65535")
    s = _load(scenario, set_)
    run_dir = make_run_dir(s, "serve", out)
    code = run_server(s, run_dir, host=host, port=port, model=model or s.name, console=console)
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
