"""`kvstage hw`: launch the ranks, merge their traces, check, summarise."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvstage.hw.jobcpu import merge as merge_job_cpu
from kvstage.hw.launch import launch
from kvstage.run import conditions
from kvstage.run.expect import check_expectation, print_outcome
from kvstage.run.hw_progress import HwProgress
from kvstage.run.rundir import make_run_dir, write_run
from kvstage.run.summary import run_summary
from kvstage.run.summary_table import print_summary
from kvstage.shared.invariants import check_records
from kvstage.shared.runtime import RankResult, merge_failures, rank_name
from kvstage.shared.scenario import Scenario
from kvstage.shared.trace import TraceRecord
from kvstage.shared.workload import generate_requests


def device_problem(device: str) -> str | None:
    """Why this machine cannot run ranks on `device`, or None: said before any rank is
    spawned, instead of every rank failing on its own."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return f"hardware.device = {device!r} but torch sees no CUDA device here (torch {torch.__version__})"
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"hardware.device = {device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def _clocks(reports: dict[str, dict]) -> dict[str, dict]:
    """Each rank's address and clock against the launcher's, measured at the rendezvous
    (launcher time = rank time + offset) and taken out of its trace times when it is
    larger than its uncertainty (`clock_applied_s`)."""
    keys = ("host", "clock_offset_s", "clock_uncertainty_s", "clock_applied_s")
    return {name: {k: r[k] for k in keys if k in r} for name, r in sorted(reports.items())}


def clock_tolerance(reports: dict[str, dict]) -> float:
    """How far apart the ranks' trace clocks may be: twice the largest uncertainty of an
    offset that was applied (two ranks, each off by up to its own), 0 on one clock."""
    applied = [r.get("clock_uncertainty_s", 0.0) for r in reports.values() if r.get("clock_applied_s")]
    return 2 * max(applied, default=0.0)


def _hardware_figures(scenario: Scenario, by_rank: dict[str, dict]) -> dict:
    """summary.json's hardware-only figures, summed over the ranks' reports."""
    hw = scenario.hardware
    reports = [r for _, r in sorted(by_rank.items())]

    def total(key: str) -> int:
        return sum(r.get(key, 0) for r in reports)

    return {
        "backend": hw.backend,
        "device": hw.device,
        "verify": hw.verify,
        "bytes_verified": total("bytes_verified"),
        "bytes_wrong": total("bytes_wrong"),
        "wrong_rooms": sorted({room for r in reports for room in r.get("wrong_rooms", [])}),
        "transfer_requests_posted": total("requests_posted"),
        "malformed_messages": total("malformed"),
        "unauthenticated_messages": total("unauthenticated"),  # no valid MAC (control plane security)
        "oversize_messages": total("oversize"),
        "replayed_messages": total("replayed"),  # authenticated but not newer than their sender's last
        "clocks": _clocks(by_rank),
        "clock_tolerance_s": clock_tolerance(by_rank),
        # each rank's loop scheduling class (hw/priority.py LoopPriority): "rr:10", or
        # "normal (...)" where the host refused it; the delivery latency depends on it
        "loop_sched": {name: r.get("loop_sched", "?") for name, r in sorted(by_rank.items())},
        # the transfer engine's threads' class (hw/priority.py WritePriority: rr:5 for Mooncake's)
        "engine_sched": {name: r.get("engine_sched", "?") for name, r in sorted(by_rank.items())},
        # the write lanes' class: normal by default, "rr:5 per batch, 1 host slot (N raised,
        # M normal)" with KVSTAGE_WRITE_RT_LANES=slots (hw/priority.py WritePriority)
        "lane_sched": {name: r.get("lane_sched", "?") for name, r in sorted(by_rank.items())},
        # what the ranks' fills, gathers, scatters and NIXL's lane copies cost in CPU, summed
        # per kind (hw/jobcpu.py): kvstage calibrate's fill/copy/write CPU
        "job_cpu": merge_job_cpu([r.get("job_cpu") or {} for r in reports]),
    }


def _run_conditions(before: conditions.Sample, spawned: bool, reports: dict[str, dict]) -> dict:
    """How busy the host was (spawned ranks' CPU time is the run's own), and whether
    every rank loop got its real-time class (a host that refuses it delays control
    messages)."""
    return {**conditions.measure(before, spawned=spawned), "loops_realtime": conditions.loops_realtime(reports)}


def _restarts(scenario: Scenario) -> dict[str, list[float]]:
    """rank -> the delays after which the launcher starts it again, one per kill fault
    with restart_after_s, in the order the kills come."""
    restarts: dict[str, list[float]] = {}
    for k in sorted(scenario.faults.kill, key=lambda k: k.at_s):
        if k.restart_after_s is not None:
            restarts.setdefault(rank_name(k.role, k.rank), []).append(k.restart_after_s)
    return restarts


def _print_rejoins(console: Console, rejoined: list[dict]) -> None:
    for r in rejoined:
        first = f"rooms from {r['first_room']}" if r["first_room"] is not None else "no room"
        console.print(f"rank {r['rank']} rejoined as incarnation {r['incarnation']}, serving {first}, after: "
                      f"{escape(r['after'])}", highlight=False)


def run_hardware(
    scenario: Scenario,
    *,
    out: Path | None = None,
    trace_format: str = "parquet",
    timeout_s: float = 600.0,
    spawn: bool = True,
    port: int = 0,
    console: Console | None = None,
    on_started=None,
    rank_wrapper: list[str] | None = None,
    rejoin_grace_s: float = 0.0,
    **placement: str | None,
) -> tuple[int, Path]:
    """Run `scenario` on real transfers; 0 when every rank finished, every byte verified right,
    no invariant broke and the failed rooms are the ones the scenario's [expect] allows (none
    without one); 1 otherwise. `placement`: host, bind, advertise (hw.launch.launch);
    `rejoin_grace_s`: how long a dead prefill rank may take to rejoin (launch)."""
    console = console or Console()
    hw = scenario.hardware
    run_dir = make_run_dir(scenario, "hw", out)
    scenario_path = run_dir / "scenario.toml"
    scenario_path.write_text(scenario.to_toml())
    g, c = scenario.geometry(), scenario.cluster
    instances = "" if c.single else f"{c.prefill_instances} x "
    console.print(
        f"hardware run: {scenario.name}, {instances}prefill TP{g.prefill_tp} -> "
        f"{'' if c.single else f'{c.decode_instances} x '}decode TP{g.decode_tp}, "
        f"{hw.backend} on {hw.device}, {scenario.workload.requests} requests, {scenario.transfer.path} path"
    )
    before = conditions.sample()  # how busy the host was during the run (kvstage/run/conditions.py)
    rooms = len(generate_requests(scenario))
    with HwProgress(console, g.decode_tp, rooms) as progress:
        result = launch(scenario_path, c.prefill_instances * g.prefill_tp, c.decode_instances * g.decode_tp,
                        run_dir / "logs", backend=hw.backend, device=hw.device, timeout_s=timeout_s, spawn=spawn,
                        port=port, on_started=on_started, rank_wrapper=rank_wrapper, rejoin_grace_s=rejoin_grace_s,
                        restarts=_restarts(scenario), on_progress=progress, **placement)
    records: list[TraceRecord] = []
    for rep in result.reports.values():
        records.extend(TraceRecord(*row) for row in rep.get("records", []))
    records.sort(key=lambda r: (r.end, r.start, r.role, r.rank))
    errors = list(result.errors)
    violations = check_records(records, scenario.transfer.path, clock_tolerance(result.reports)) if result.ok else []
    ranks = [RankResult.from_wire(r) for _, r in sorted(result.reports.items())]
    summary = run_summary(
        scenario, "hw", records, ranks, requests=rooms, wall_s=result.wall_s,
        violations=len(violations),
        extra={
            **_hardware_figures(scenario, result.reports),
            "errors": errors,
            "rejoins": result.rejoined,  # ranks that died (or went silent) and rejoined
            "conditions": _run_conditions(before, spawn, result.reports),
        },
    )
    wrong = summary["bytes_wrong"]
    failures = merge_failures(ranks)
    write_run(run_dir, scenario, records, summary, "hw", trace_format)
    print_summary(summary, console, title=f"{scenario.name} (hardware, {hw.backend}, {hw.device})")
    _print_rejoins(console, result.rejoined)
    console.print(f"run directory: {run_dir}")
    problems = check_expectation(scenario, failures, rooms, "hw", run_failed=bool(errors))
    if scenario.expect.hw_run_fails and not problems:
        console.print(f"[green]expected outcome:[/] the run failed as the scenario expects: {escape(errors[0]) if errors else ''}",
                      highlight=False)
        return 0, run_dir
    code = print_outcome(console, problems, failures)
    for e in errors:
        console.print(f"[bold red]error:[/] {escape(e)}", highlight=False)  # a log tail is not markup
        code = 1
    if wrong:
        console.print(f"[bold red]{wrong} byte(s) wrong[/] in rooms {summary['wrong_rooms'][:10]}")
        code = 1
    if any(summary["ring_used_at_end"].values()):
        console.print(f"[bold red]staging leak:[/] ring bytes at the end {summary['ring_used_at_end']}")
        code = 1
    for v in violations[:10]:
        console.print(v.format(), markup=False, highlight=False)
        code = 1
    return code, run_dir
