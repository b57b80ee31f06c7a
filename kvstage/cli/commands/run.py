"""`kvstage validate`, `sim`, `hw`, `hw-rank` and `check`: one scenario, one run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console

from kvstage.cli.errors import fail
from kvstage.cli.options import ProgressOpt, ScenarioArg, SetOpt
from kvstage.shared.machine import TransferPath
from kvstage.shared.scenario import Scenario, ScenarioError, load_scenario
from kvstage.shared.scenario import scaled as scale_down  # `scaled` is a flag here

console = Console()

# Flags with a fixed set of values: anything else is refused, and --help lists them.
Backend = Literal["nixl", "mooncake"]
Verify = Literal["full", "sample", "off"]
TraceFormat = Literal["parquet", "jsonl"]
Role = Literal["prefill", "decode"]
DEVICE_METAVAR = "[cpu|cuda|cuda:N]"  # cuda:N is open-ended: checked by the scenario schema


def _fail(message: str, code: int = 2) -> None:
    fail(message, code)


def _load(path: Path, overrides: list[str] | None, seed: int | None = None) -> Scenario:
    sets = list(overrides or [])
    if seed is not None:
        sets.append(f"workload.seed={seed}")
    try:
        return load_scenario(path, overrides=sets)
    except ScenarioError as exc:
        _fail(str(exc))
    except FileNotFoundError as exc:
        _fail(f"scenario file not found: {exc.filename or path}")
    raise AssertionError("unreachable")


def validate(scenario: ScenarioArg, set_: SetOpt = None) -> None:
    """Print the resolved scenario and its derived layout: per decode rank its writers
    and head slices; bytes per token, chunk and request; how many chunks the staging
    pool holds; and the slice path's transfer requests against the staging path's."""
    from kvstage.analysis.layout_report import layout_report

    s = _load(scenario, set_)
    console.rule(f"scenario {s.name}")
    console.print(s.to_toml(), highlight=False, markup=False)
    console.rule("derived layout")
    layout_report(s, console)
    from kvstage.analysis.workload_report import workload_notes

    for line in workload_notes(s):
        console.print(line, markup=False, highlight=False)


def sim(
    scenario: ScenarioArg,
    set_: SetOpt = None,
    out: Annotated[
        Path | None, typer.Option(help="Run directory (default runs/SCENARIO-sim-TIME/).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Workload seed (overrides workload.seed).")
    ] = None,
    trace_format: Annotated[TraceFormat, typer.Option(help="Trace file format.")] = "parquet",
    scaled: Annotated[
        bool, typer.Option(help="Apply [hardware.scale_down] (to compare with a hw run).")
    ] = False,
    progress: ProgressOpt = True,
) -> None:
    """Simulate the scenario's whole workload in simulated time (SimPy), through the
    same shared state machines the hardware mode runs. Writes trace, resolved scenario
    and summary.json to a run directory; exits 1 if an invariant was violated."""
    from kvstage.run.simrun import run_simulation

    s = _load(scenario, set_, seed)
    from kvstage.shared.cluster import simulated_pipeline_problem

    if problem := simulated_pipeline_problem(s):  # before anything is written
        _fail(problem)
    if scaled:
        # the same scale-down `kvstage hw` applies, so the two runs compare
        if not s.hardware.scale_down.enabled:
            s = _load(scenario, list(set_ or []) + ["hardware.scale_down.enabled=true"], seed)
        s = scale_down(s)
    code = run_simulation(s, out=out, trace_format=trace_format, progress=progress, console=console)
    raise typer.Exit(code)


def hw(
    scenario: ScenarioArg,
    set_: SetOpt = None,
    backend: Annotated[
        Backend | None, typer.Option(help="Transfer engine (default: the scenario's).")
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            metavar=DEVICE_METAVAR, help="Memory the KV lives in (default: the scenario's)."
        ),
    ] = None,
    verify: Annotated[
        Verify | None, typer.Option(help="Which bytes the decode checks (default: the scenario's).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Run directory (default runs/SCENARIO-hw-TIME/).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Workload seed (overrides workload.seed).")
    ] = None,
    scaled: Annotated[
        bool, typer.Option(help="Apply [hardware.scale_down] so it fits host memory.")
    ] = True,
    timeout: Annotated[
        float, typer.Option(help="Fail the run if it is not finished after this many seconds.")
    ] = 600.0,
    spawn: Annotated[
        bool,
        typer.Option(
            help="Start the ranks here; --no-spawn waits for ranks started elsewhere (hw-rank)."
        ),
    ] = True,
    port: Annotated[
        int, typer.Option(help="Rendezvous port (0: any free one; set it with --no-spawn).")
    ] = 0,
    trace_format: Annotated[TraceFormat, typer.Option(help="Trace file format.")] = "parquet",
    host: Annotated[
        str | None,
        typer.Option(
            help="Address the rendezvous and the spawned ranks bind (default $KVSTAGE_HOST, else 127.0.0.1)."
        ),
    ] = None,
    bind: Annotated[
        str | None,
        typer.Option(help="Address the rendezvous binds (default --host; 0.0.0.0: every one)."),
    ] = None,
    advertise: Annotated[
        str | None,
        typer.Option(help="Address ranks connect to for the rendezvous (default --bind)."),
    ] = None,
    secret_file: Annotated[
        Path | None,
        typer.Option(
            help="Use this run secret (a file only its owner can read) instead of drawing one; ranks started elsewhere get the same file, e.g. copied to each node's local disk."
        ),
    ] = None,
    rejoin_grace: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds a prefill rank that died (or went silent) may take to rejoin, started again with hw-rank, before it fails the run (0: a dead rank fails it).",
        ),
    ] = 0.0,
    tool_connections: Annotated[
        int,
        typer.Option(
            help="Connections the rendezvous admits, all together, of tools that hold the run secret but no rank's credential (a script that asks it for t0 or the rejoins). Default 0: only the ranks connect, and a copy of the secret alone opens none.",
        ),
    ] = 0,
    ceiling: Annotated[
        bool,
        typer.Option(
            help="Before the first room, measure each prefill->decode pair's raw write ceiling (one large write in a slot of its own) and print each pair's achieved GB/s against it."
        ),
    ] = True,
    nic_map: Annotated[
        str | None,
        typer.Option(
            help="Each local rank's NIC, e.g. 0=mlx5_0,1=mlx5_1 (default: $KVSTAGE_NIC_MAP, else the NIC on its GPU's PCIe switch, else the interface holding its address; docs/hardware-mode.md)."
        ),
    ] = None,
    baseline: Annotated[
        bool,
        typer.Option(
            help="After the run, run nixlbench, ib_write_bw and Mooncake's transfer_engine_bench where they are on PATH, on the run's NICs, and print them beside the pairs' GB/s (one line each; absent: said so)."
        ),
    ] = False,
    target: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Pass only if every pair achieved at least this fraction of its ceiling (a PASS/FAIL line; FAIL exits 1).",
        ),
    ] = None,
) -> None:
    """Run the scenario on real transfers: P prefill and D decode rank processes on this
    machine move real KV bytes with NIXL or Mooncake, the decode verifies every byte, and
    the same trace and summary as the simulation are written. Exits 1 if a rank failed,
    a byte was wrong, staging leaked or an invariant broke."""
    _nic_map(nic_map)  # first: a flag checked alone, before the scenario loads
    from kvstage.hw.launch.merge import device_problem
    from kvstage.run.hwrun import run_hardware

    sets = list(set_ or [])
    for key, value in (("backend", backend), ("device", device), ("verify", verify)):
        if value is not None:  # the scenario schema checks the device string
            sets.append(f"hardware.{key}={value}")
    s = _load(scenario, sets, seed)
    if scaled and not s.hardware.scale_down.enabled:
        s = _load(scenario, sets + ["hardware.scale_down.enabled=true"], seed)
    s = scale_down(s)
    from kvstage.shared.cluster import hardware_sessions

    try:  # every rank computes the routes itself: only a static router can run
        hardware_sessions(s, [])
    except ValueError as exc:
        _fail(str(exc))
    from kvstage.hw.rank.preflight import launch_problem
    from kvstage.hw.transport.placement import launch_addresses

    # before anything is written or started: the port, and for ranks spawned here (with
    # --no-spawn they run elsewhere and check for themselves) the GPU, RDMA and memory
    problem = launch_problem(
        s,
        spawn=spawn,
        bind=launch_addresses(host, bind, advertise)[0],
        port=port,
        device_problem=device_problem,
    )
    if problem:
        _fail(problem)
    from kvstage.hw.control.rendezvous import check_tool_connections

    try:
        check_tool_connections(tool_connections)
    except ValueError as exc:
        _fail(f"--tool-connections: {exc}")
    extra = {}
    if secret_file is not None:
        from kvstage.hw.control.plane import RunSecretError, read_secret_file

        try:
            extra["secret"] = read_secret_file(secret_file)
        except RunSecretError as exc:
            _fail(f"--secret-file: {exc}")
    if host:
        os.environ["KVSTAGE_HOST"] = host  # the launcher's default bind address
    code, _ = run_hardware(
        s,
        out=out,
        trace_format=trace_format,
        timeout_s=timeout,
        spawn=spawn,
        port=port,
        console=console,
        host=host,
        bind=bind,
        advertise=advertise,
        rejoin_grace_s=rejoin_grace,
        tool_connections=tool_connections,
        ceiling=ceiling,
        target=target,
        baseline=baseline,
        **extra,
    )
    raise typer.Exit(code)


def _nic_map(text: str | None) -> None:
    """--nic-map, checked, for the ranks (they read $KVSTAGE_NIC_MAP: hw/transport/affinity.py)."""
    if text is None:
        return
    from kvstage.hw.transport.affinity import NIC_MAP_ENV, parse_nic_map

    try:
        parse_nic_map(text)
    except ValueError as exc:
        _fail(str(exc))
    os.environ[NIC_MAP_ENV] = text


def hw_rank(
    scenario: ScenarioArg,
    role: Annotated[
        Role | None,
        typer.Option(
            help="This rank's role (default: from SLURM or torchrun, global rank r < P is prefill r, else decode r-P)."
        ),
    ] = None,
    rank: Annotated[
        int | None, typer.Option(help="This rank's index in its role (with --role).")
    ] = None,
    rendezvous: Annotated[
        str | None,
        typer.Option(help="HOST:PORT of the rendezvous (default MASTER_ADDR:MASTER_PORT)."),
    ] = None,
    set_: SetOpt = None,
    backend: Annotated[
        Backend | None, typer.Option(help="Transfer engine (default: the scenario's).")
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            metavar=DEVICE_METAVAR,
            help="Memory the KV lives in; cuda: this rank's GPU (default: the scenario's).",
        ),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            help="Routable address this rank binds and advertises (default $KVSTAGE_HOST, else the one towards MASTER_ADDR, else 127.0.0.1)."
        ),
    ] = None,
    secret_file: Annotated[
        Path | None,
        typer.Option(
            help="The run's secret: RUN_DIR/run.secret, written by `kvstage hw` (default: $KVSTAGE_RUN_SECRET)."
        ),
    ] = None,
    key_file: Annotated[
        Path | None,
        typer.Option(
            help="This rank's credential: RUN_DIR/keys/ROLERANK.key, written by `kvstage hw --no-spawn` (default: the key file of this rank next to --secret-file)."
        ),
    ] = None,
    nic_map: Annotated[
        str | None,
        typer.Option(
            help="Each local rank's NIC, e.g. 0=mlx5_0,1=mlx5_1 (default: $KVSTAGE_NIC_MAP, else the NIC on its GPU's PCIe switch, else the interface holding its address; docs/hardware-mode.md)."
        ),
    ] = None,
    rendezvous_timeout: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Give up (exit 2) when the rendezvous has not answered within this many seconds; the rank says it waits after 5 s.",
        ),
    ] = 60.0,
) -> None:
    """Run one rank alone (for srun, torchrun or mpirun placing ranks on different nodes).
    Give it the run directory's scenario.toml so every rank sees the same resolved scenario."""
    from kvstage.hw.rank.main import main as rank_main

    _nic_map(nic_map)
    argv = [str(scenario)]
    for flag, value in (
        ("--role", role),
        ("--rank", rank),
        ("--rendezvous", rendezvous),
        ("--host", host),
    ):
        argv += [flag, str(value)] if value is not None else []
    for item in set_ or []:
        argv += ["--set", item]
    if backend:
        argv += ["--backend", backend]
    if device:
        argv += ["--device", device]
    if secret_file:
        argv += ["--secret-file", str(secret_file)]
    if key_file:
        argv += ["--key-file", str(key_file)]
    argv += ["--rendezvous-timeout", str(rendezvous_timeout)]
    raise typer.Exit(rank_main(argv))


def check(
    run: Annotated[Path, typer.Argument(help="Run directory or trace file.")],
    path: Annotated[
        TransferPath | None,
        typer.Option(
            "--path",
            help="Transfer path of a bare trace file (a run directory's scenario.toml says it).",
        ),
    ] = None,
) -> None:
    """Check a run's trace against the protocol invariants (safety, exactly once, no
    leak, liveness, monotone watermark); print each violation and exit 1 if any."""
    from kvstage.run.tracefile import read_records
    from kvstage.shared.invariants import check_records
    from kvstage.shared.scenario import load_scenario

    try:
        mode, records = read_records(run)
    except FileNotFoundError as exc:
        _fail(str(exc))
    summary_file = run / "summary.json" if run.is_dir() else None
    if not mode and summary_file is not None and summary_file.exists():
        mode = json.loads(summary_file.read_text()).get("mode", "")  # an empty trace
    if mode == "measured":
        _fail(
            f"{run} is a measured run (kvstage import): a client's or server's figures, no "
            "transfer-path trace whose invariants could be checked"
        )
    if path is None:
        resolved = run / "scenario.toml" if run.is_dir() else None
        if resolved is None or not resolved.exists():
            _fail(
                f"{run} is a trace without its run directory: say its transfer path with --path staging|slice"
            )
        path = TransferPath(load_scenario(resolved).transfer.path)
    tolerance = 0.0
    if (
        run.is_dir() and (run / "summary.json").exists()
    ):  # hardware across hosts: the clocks' uncertainty
        tolerance = float(
            json.loads((run / "summary.json").read_text()).get("clock_tolerance_s") or 0.0
        )
    found = check_records(records, path.value, tolerance)
    if not found:
        console.print(f"[green]ok[/]: {len(records)} records ({mode}), no invariant violated")
        return
    for v in found[:50]:
        console.print(v.format(), markup=False, highlight=False)
    console.print(f"[red]{len(found)} violation(s)[/]")
    raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    for name, command in (
        ("validate", validate),
        ("sim", sim),
        ("hw", hw),
        ("hw-rank", hw_rank),
        ("check", check),
    ):
        app.command(name)(command)
