"""`kvstage calibrate --fit-serving SCENARIO`: the options and the printout of the serving
fit (kvstage/calibrate/serving.py); calibrate.py hands its options here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvstage.cli.errors import fail

PREFILL_OPTS = ("--prefill-tokens-per-s", "--prompt-tokens")
DECODE_OPTS = ("--decode-step-ms", "--decode-batch", "--decode-context")

FitServing = Annotated[
    Path | None,
    typer.Option(
        metavar="SCENARIO",
        help="Measure nothing: fit prefill.mfu and decode.hbm_efficiency of SCENARIO's "
        "GPUs and model to the figures given with the options below, print the lines to paste.",
    ),
]
PrefillTokensPerS = Annotated[
    float | None, typer.Option(help="--fit-serving: measured tokens/s of one prefill instance.")
]
PromptTokens = Annotated[
    int | None, typer.Option(help="--fit-serving: the prompt length of that throughput.")
]
DecodeStepMs = Annotated[
    float | None, typer.Option(help="--fit-serving: one measured decode step (ITL), ms.")
]
DecodeBatch = Annotated[
    int | None, typer.Option(help="--fit-serving: requests running in that step.")
]
DecodeContext = Annotated[
    int | None, typer.Option(help="--fit-serving: KV tokens per request in that step.")
]


def fit_serving_command(path: Path, prefill: tuple, decode: tuple) -> None:
    """One line per bad input (exit 2), else the fitted lines."""
    from kvstage.calibrate.serving import ServingFitError, fit_serving
    from kvstage.shared.scenario import ScenarioError

    given = []
    for values, names in ((prefill, PREFILL_OPTS), (decode, DECODE_OPTS)):
        missing = [n for n, v in zip(names, values, strict=True) if v is None]
        if len(missing) == len(names):
            given.append(None)
        elif missing:
            fail(f"{', '.join(missing)} missing: give all of {', '.join(names)} or none")
        else:
            given.append(values)
    p, d = given
    if d is not None:
        d = (d[0] / 1e3, d[1], d[2])
    try:
        fit = fit_serving(path, prefill=p, decode=d)
    except (ServingFitError, ScenarioError) as exc:
        fail(str(exc))
    console = Console()
    console.print(f"fitted to {path} (paste into its tables):", highlight=False)
    for line in fit.toml_lines():
        console.print(line, highlight=False, markup=False)
