"""`kvstage calibrate --fit-serving SCENARIO`: the options and the printout of the serving
fit (kvstage/calibrate/serving.py); calibrate.py hands its options here."""

from __future__ import annotations

import tempfile
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


FromRuns = Annotated[
    list[Path] | None,
    typer.Option(
        "--from",
        help="--fit-serving: a measured run directory (kvstage import) to fit to; repeat it. "
        "Decode logs fit decode.hbm_efficiency and step_overhead_ms, prefill logs "
        "prefill.mfu, a client's requests the per-request cost; every 4th point is held out.",
    ),
]
ServingProfile = Annotated[
    Path | None,
    typer.Option(
        help="--fit-serving --from: write the fit as a serving profile a scenario names "
        'with [serving] profile = "FILE".'
    ),
]


def fit_from_runs_command(path: Path, runs: list[Path], profile: Path | None) -> None:
    """Fit the serving model to the measured runs' points; print each fit with its
    held-out error; write the profile when asked. One line per bad input (exit 2)."""
    from kvstage.calibrate.serving import (
        ServingFitError,
        fit_decode_points,
        fit_prefill_points,
        fit_request_points,
        profile_text,
        ttft_under_load,
    )
    from kvstage.calibrate.serving_points import points_from_runs
    from kvstage.run.rundir import RunError, load_run
    from kvstage.shared.scenario import ScenarioError

    try:
        loaded = [load_run(r) for r in runs]
    except RunError as exc:
        fail(str(exc))
    pts = points_from_runs(loaded)
    console = Console()
    for note in pts.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
    fits = []
    try:
        if pts.decode:
            fits.append(fit_decode_points(path, pts.decode))
        if pts.prefill:
            fits.append(fit_prefill_points(path, pts.prefill))
        sets = [f"{k}={v}" for f in fits for k, v in f.values.items()]
        if pts.requests:
            fits.append(fit_request_points(path, pts.requests, sets))
        with tempfile.TemporaryDirectory() as tmp:
            for reqs in pts.loaded:
                fits.append(ttft_under_load(path, reqs, sets, Path(tmp)))
    except (ServingFitError, ScenarioError) as exc:
        fail(str(exc))
    if not fits:
        fail(
            "the runs hold no decode step, prefill forward or idle request to fit "
            "(import an SGLang log or a client's per-request file with kvstage import)"
        )
    for f in fits:
        err = "-" if f.held_out_mape is None else f"{f.held_out_mape:.1%}"
        values = ", ".join(f"{k} = {v:.4g}" for k, v in f.values.items())
        line = (
            f"{f.what}: {values} ({f.fitted} points; held-out error {err} over {f.held_out})"
            if f.values
            else f"{f.what}: error {err} over {f.held_out} requests, with the fit above"
        )
        console.print(line, highlight=False, markup=False)
    if profile is not None:
        profile.parent.mkdir(parents=True, exist_ok=True)
        profile.write_text(profile_text(fits, [str(r) for r in runs], path))
        console.print(f"serving profile: {profile}", highlight=False, markup=False)


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
