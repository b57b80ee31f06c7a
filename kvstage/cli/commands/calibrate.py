"""`kvstage calibrate`: measure this machine's engine, write a hardware profile."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstage.cli.commands import calibrate_serving as serving
from kvstage.cli.commands.calibrate_descriptors import descriptors_command
from kvstage.cli.errors import fail
from kvstage.tables import print_table

STAGES = ("writes", "batches", "control", "kernels", "fill")
# a fit below this explains too little of its points to be trusted without a look
MIN_R2 = 0.9


def _check_device(device: str) -> None:
    """One line and exit 2 for a device not allowed or not here, before any work."""
    if device not in ("cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        fail(f"--device {device!r} not allowed (allowed: cpu, cuda, cuda:N)")
    from kvstage.hw.launch.merge import cuda_devices, device_problem

    problem = device_problem(device)  # no GPU: one line, exit 2, before any process starts
    if problem:
        n = cuda_devices()
        allowed = f"cpu, cuda:0..cuda:{n - 1}" if n else "cpu"
        fail(f"--device {device}: {problem.split(' but ', 1)[-1]}; allowed here: {allowed}")


def _default_out(backend: str, device: str) -> Path:
    return (
        Path("runs") / "calibration" / f"{backend}-{device}-{time.strftime('%Y%m%d-%H%M%S')}.toml"
    )


def print_calibration(cal, console: Console) -> None:
    """The fitted numbers and their fit quality, one row each."""
    t = Table(title=f"calibration: {cal.backend} on {cal.device}")
    t.add_column("what")
    t.add_column("fitted", justify="right")
    t.add_column("fit quality", justify="right")

    def worst(res: list[float]) -> str:
        return f"max |res| {max(abs(r) for r in res):.1%}"

    w, pr = cal.write, cal.per_request
    t.add_row(
        "write bandwidth",
        f"{w.bandwidth_Bps / 1e9:.2f} GB/s",
        f"R² {w.r2:.4f}, {worst(w.residuals)}",
    )
    t.add_row("write latency (one op)", f"{w.latency_s * 1e6:.1f} us", "")
    t.add_row(
        "per-request overhead",
        f"{pr.per_request_s * 1e6:.2f} us",
        f"R² {pr.r2:.4f}, {worst(pr.residuals)}",
    )
    t.add_row(
        "control latency (RTT/2)",
        f"{cal.control_rtt_s / 2 * 1e6:.1f} us",
        f"RTT p90 {cal.control_rtt_p90_s * 1e6:.0f} us",
    )
    for name, f in (
        ("gather", cal.gather),
        ("gather (head subset)", cal.gather_sub),
        ("scatter", cal.scatter),
        ("copy (profile)", cal.copy),
    ):
        t.add_row(
            f"{name} copy rate / launch",
            f"{f.bandwidth_Bps / 1e9:.2f} GB/s / {f.launch_s * 1e6:.1f} us",
            f"R² {f.r2:.4f}, {worst(f.residuals)}",
        )
    f = cal.fill
    t.add_row(
        "hw prefill fill rate / latency",
        f"{f.bandwidth_Bps / 1e9:.3f} GB/s / {f.latency_s * 1e6:.0f} us",
        f"R² {f.r2:.4f}, {worst(f.residuals)}",
    )
    t.add_row("matmul", f"{cal.gpu_flops / 1e9:.1f} GFLOP/s", "")
    t.add_row("idle engine process CPU", f"{cal.engine_idle_cores:.2f} cores", "progress threads")
    h = cal.raw.get("handle")
    if h:
        t.add_row(
            "state-machine event (CPU)",
            f"{h['mean_s'] * 1e6:.1f} us mean",
            f"median {h['median_s'] * 1e6:.1f} us, {h['events']} events",
        )
    print_table(console, t)
    for line in weak_fits(cal):
        console.print(f"[bold yellow]warning:[/] {line}", highlight=False)


def weak_fits(cal) -> list[str]:
    """One line per fit with R² below MIN_R2: its numbers may not describe this machine
    (a loaded host, too few points); measure again on a quiet host before trusting them."""
    fits = {
        "write bandwidth / latency": cal.write.r2,
        "per-request overhead": cal.per_request.r2,
        "gather": cal.gather.r2,
        "gather (head subset)": cal.gather_sub.r2,
        "scatter": cal.scatter.r2,
        "copy (profile)": cal.copy.r2,
        "hw prefill fill": cal.fill.r2,
    }
    return [
        f"the {name} fit has R² {r2:.2f} (< {MIN_R2}): its numbers may not describe this machine; "
        "check `uptime` and measure again on a quiet host"
        for name, r2 in fits.items()
        if r2 < MIN_R2
    ]


def _hosts(host: str | None, peer_host: str | None, peer_netns: str | None):
    """The two processes' places (hw/probes/hosts.py), or None: both on loopback here."""
    if peer_host is None and peer_netns is None and host is None:
        return None
    from kvstage.hw.probes.hosts import ProbeHost, ProbeHostError

    if peer_host is None:
        fail("--host / --peer-netns need --peer-host (the receiving process's address)")
    receiver = ProbeHost(peer_host, peer_netns)
    try:
        receiver.check()
    except ProbeHostError as exc:
        fail(str(exc))
    return {"sender": ProbeHost(host or "127.0.0.1"), "receiver": receiver}


def calibrate(
    backend: Annotated[
        Literal["nixl", "mooncake"], typer.Option(help="Transfer engine to measure.")
    ] = "nixl",
    device: Annotated[
        str,
        typer.Option(
            metavar="[cpu|cuda|cuda:N]", help="Memory the engine moves and kernels run on."
        ),
    ] = "cpu",
    out: Annotated[
        Path | None,
        typer.Option(
            help="Profile TOML to write (default runs/calibration/BACKEND-DEVICE-TIME.toml); "
            "fit quality and raw points go to STEM.fit.json beside it."
        ),
    ] = None,
    quick: Annotated[
        bool, typer.Option(help="A short sweep (a few seconds of measuring).")
    ] = False,
    host: Annotated[
        str | None,
        typer.Option(
            help="Address the sending process binds (with --peer-host; default 127.0.0.1)."
        ),
    ] = None,
    peer_host: Annotated[
        str | None,
        typer.Option(
            help="Address of the receiving process on the other host: writes, batches and control pings then cross hosts, and the profile's inter-node numbers come from them."
        ),
    ] = None,
    peer_netns: Annotated[
        str | None,
        typer.Option(
            help="Network namespace (ip netns) the receiving process enters: two namespaces joined by a veth as two hosts on one machine (for NIXL set UCX_TLS=tcp)."
        ),
    ] = None,
    fit_serving: serving.FitServing = None,  # the serving fit (calibrate_serving.py)
    prefill_tokens_per_s: serving.PrefillTokensPerS = None,
    prompt_tokens: serving.PromptTokens = None,
    decode_step_ms: serving.DecodeStepMs = None,
    decode_batch: serving.DecodeBatch = None,
    decode_context: serving.DecodeContext = None,
    from_runs: serving.FromRuns = None,
    serving_profile: serving.ServingProfile = None,
    descriptors: Annotated[
        bool,
        typer.Option(
            help="Measure only a serving engine's per-descriptor costs (numpy build, NIXL prepare and post) and the GIL between a Python thread and a transfer worker; write their fit (JSON, R^2) to --out."
        ),
    ] = False,
) -> None:
    """Measure this machine between two real processes over the real engine (write
    latency and bandwidth, per-request overhead, ZMQ control round trip, gather /
    scatter kernels, hw prefill fill rate), fit them, and write a hardware profile
    that a scenario can name with `links.profile = "PATH"`. With --fit-serving, fit
    the serving efficiencies to one prefill and/or one decode measurement instead."""
    if descriptors:  # kvstage/cli/commands/calibrate_descriptors.py
        _check_device(device)
        return descriptors_command(backend, device, out, quick)
    if fit_serving is not None and from_runs:
        return serving.fit_from_runs_command(fit_serving, from_runs, serving_profile)
    if fit_serving is not None:
        pre, dec = (
            (prefill_tokens_per_s, prompt_tokens),
            (decode_step_ms, decode_batch, decode_context),
        )
        return serving.fit_serving_command(fit_serving, pre, dec)
    from kvstage.calibrate.profile import CalibrationError, write_profile
    from kvstage.calibrate.profile import calibrate as run_calibration

    console = Console()
    _check_device(device)
    hosts = _hosts(host, peer_host, peer_netns)
    path = out or _default_out(backend, device)
    bar = Progress(
        TextColumn("[bold]{task.description:<8}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    tasks: dict[str, int] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)

    console.print(
        f"calibrating {backend} on {device}{' (quick)' if quick else ''}: "
        "starting two measuring processes"
    )
    try:
        with bar:
            cal = run_calibration(backend, device, quick=quick, progress=progress, hosts=hosts)
    except CalibrationError as exc:
        fail(str(exc), 1)
    print_calibration(cal, console)
    try:
        toml_path, side = write_profile(cal, path)
    except Exception as exc:  # noqa: BLE001 - one clear line, never a traceback
        fail(f"writing the profile {path}: {exc}", 1)
    where = cal.where
    console.print(
        f"writes measured {where.get('write')}"
        + (f" ({where['hosts']}, over {where.get('writes_over')})" if "hosts" in where else "")
        + ("" if cal.inter_host else ": the profile's inter-node numbers are a same-host figure"),
        highlight=False,
    )
    console.print(f"profile: {toml_path}\nfit and raw points: {side}")
    console.print(f"use it: kvstage sim SCENARIO --set links.profile={toml_path.resolve()}")


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)
