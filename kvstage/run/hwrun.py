"""A hardware run: `launch_run` spawns (or waits for) the ranks, merges their reports
(kvstage/hw/launch/merge.py) and gives the run's RunResult (kvstage/run/result.py); `kvstage hw`
(`run_hardware`) shows its progress and ends it with `finish_run`: run directory,
summary table, exit code."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvstage.hw.launch.environment import write_environment
from kvstage.hw.launch.launcher import RunProgress, launch
from kvstage.hw.launch.merge import clock_tolerance, hardware_figures, merge_records
from kvstage.hw.transport.affinity import table_lines
from kvstage.hw.transport.bandwidth import (
    PairFigure,
    bandwidth_summary,
    limit_lines,
    probe_pairs,
    verdict,
)
from kvstage.hw.transport.used import rdma_asked, rdma_problem
from kvstage.run import conditions
from kvstage.run.hw_progress import HwProgress
from kvstage.run.result import RunResult, finish_run
from kvstage.run.rundir import make_run_dir
from kvstage.run.summary import run_summary
from kvstage.shared.admission import admit, context_limits
from kvstage.shared.cluster import hardware_sessions
from kvstage.shared.invariants import check_records
from kvstage.shared.runtime import RankResult, merge_failures, rank_name
from kvstage.shared.scenario import Scenario
from kvstage.shared.serving.capacity import scenario_gpus
from kvstage.shared.workload import generate_requests


def _run_conditions(
    before: conditions.Sample, spawned: bool, reports: dict[str, dict], forked_cpu_s: float
) -> dict:
    """How busy the host was (spawned and forked ranks' CPU time is the run's own), and whether
    every rank loop got its real-time class (a host that refuses it delays control
    messages)."""
    return {
        **conditions.measure(
            before,
            spawned=spawned,
            ranks_cpu_s=conditions.rank_cpu_here(reports),
            forked_cpu_s=forked_cpu_s,
        ),
        "loops_realtime": conditions.loops_realtime(reports),
    }


def _restarts(scenario: Scenario) -> dict[str, list[float]]:
    """rank -> the delays after which the launcher starts it again, one per kill fault
    with restart_after_s, in the order the kills come."""
    restarts: dict[str, list[float]] = {}
    for k in sorted(scenario.faults.kill, key=lambda k: k.at_s):
        if k.restart_after_s is not None:
            restarts.setdefault(rank_name(k.role, k.rank), []).append(k.restart_after_s)
    return restarts


def _missing_ranks(scenario: Scenario, ranks: list[RankResult]) -> set[tuple[str, int]]:
    """(role, rank) of every rank of the run that sent no report."""
    prefill, decode = scenario_gpus(scenario)
    expected = {("prefill", p) for p in range(prefill)} | {("decode", d) for d in range(decode)}
    return expected - {(r.role, r.rank) for r in ranks}


def launch_run(
    scenario: Scenario,
    run_dir: Path,
    *,
    timeout_s: float = 600.0,
    spawn: bool = True,
    port: int = 0,
    on_started=None,
    on_progress: Callable[[RunProgress], None] | None = None,
    rank_wrapper: list[str] | None = None,
    rejoin_grace_s: float = 0.0,
    ceiling: bool = False,
    on_affinity: Callable[[dict], None] | None = None,
    on_table: Callable[[dict, float], None] | None = None,
    tool_connections: int = 0,
    **placement: str | None,
) -> RunResult:
    """Run `scenario` on real transfers, the ranks' logs and scenario.toml in `run_dir`
    (which must exist); prints nothing. `placement`: host, bind, advertise
    (hw.launch.launch); `rejoin_grace_s`: how long a dead prefill rank may take to rejoin;
    `ceiling`: measure each pair's raw write ceiling before the first room (hw/transport/bandwidth.py);
    `on_affinity`: each rank's NIC, GPU and NUMA node, once every rank registered;
    `on_table`: the whole rank table and t0, then (launch's: no rank gets it whole);
    `tool_connections`: connections the rendezvous admits of tools (default none)."""
    hw = scenario.hardware
    scenario_path = Path(run_dir) / "scenario.toml"
    scenario_path.write_text(scenario.to_toml())
    # versions, GPUs, NICs, engine variables (hw/launch/environment.py)
    write_environment(Path(run_dir))
    before = conditions.sample()  # how busy the host was during the run (kvstage/run/conditions.py)
    requests = generate_requests(scenario)
    rooms = len(requests)
    # requests that can never fit: they never reach a rank (hw/rank/process.py)
    rejected = admit(requests, context_limits(scenario))[1]
    probe_slots = len(probe_pairs(hardware_sessions(scenario, requests)[0])) if ceiling else 0
    result = launch(
        scenario_path,
        *scenario_gpus(scenario),
        Path(run_dir) / "logs",
        backend=hw.backend,
        device=hw.device,
        timeout_s=timeout_s,
        spawn=spawn,
        port=port,
        on_started=on_started,
        rank_wrapper=rank_wrapper,
        rejoin_grace_s=rejoin_grace_s,
        restarts=_restarts(scenario),
        on_progress=on_progress,
        probe_slots=probe_slots,
        on_affinity=on_affinity,
        on_table=on_table,
        tool_connections=tool_connections,
        **placement,
    )
    records = merge_records(result.reports)
    errors = list(result.errors)
    ranks = [RankResult.from_wire(r) for _, r in sorted(result.reports.items())]
    # checked on every run, failed ranks or not: over what the ranks that reported
    # recorded (shared/invariants.py `check_records`, `missing`)
    missing = _missing_ranks(scenario, ranks)
    violations = check_records(
        records, scenario.transfer.path, clock_tolerance(result.reports), missing
    )
    figures = hardware_figures(scenario, result.reports)
    # asked for RDMA, moved over TCP: the run fails closed, naming the ranks (hw/transport/used.py)
    wrong_transport = rdma_problem(rdma_asked(hw), figures["transport_used"])
    if wrong_transport and result.ok:
        errors.append(wrong_transport)
    summary = run_summary(
        scenario,
        "hw",
        records,
        ranks,
        requests=rooms,
        wall_s=result.wall_s,
        violations=len(violations),
        rejected=rejected,
        extra={
            **figures,
            "affinity": {n: r.get("affinity") for n, r in sorted(result.reports.items())},
            "bandwidth": bandwidth_summary(records, result.reports),
            "errors": errors,
            # ranks that sent no report: the invariants were checked without their records
            "unreported_ranks": [f"{role}{rank}" for role, rank in sorted(missing)],
            "rejoins": result.rejoined,  # ranks that died (or went silent) and rejoined
            "conditions": _run_conditions(before, spawn, result.reports, result.forked_cpu_s),
        },
    )
    return RunResult(
        scenario,
        "hw",
        records,
        ranks,
        violations,
        errors,
        merge_failures(ranks),
        result.wall_s,
        rooms,
        summary,
        rejoined=result.rejoined,
        rejected=rejected,
    )


def run_hardware(
    scenario: Scenario,
    *,
    out: Path | None = None,
    trace_format: str = "parquet",
    console: Console | None = None,
    target: float | None = None,
    baseline: bool = False,
    **launch_options,
) -> tuple[int, Path]:
    """`kvstage hw`: `launch_run` under a progress display, then `finish_run`; (exit code,
    run directory). 0 when every rank finished, every byte verified right, no invariant
    broke and the failed rooms are the ones the scenario's [expect] allows (none without
    one); 1 otherwise. `target`: the share of its ceiling every pair must reach (a
    PASS/FAIL line; FAIL exits 1; implies the probe); `baseline`: the vendors' benchmarks
    beside the run's figures (hw/probes/baseline.py). `launch_options`: launch_run's."""
    console = console or Console()
    hw = scenario.hardware
    run_dir = make_run_dir(scenario, "hw", out)
    g, c = scenario.geometry(), scenario.cluster
    instances = "" if c.single else f"{c.prefill_instances} x "
    requests = len(generate_requests(scenario))  # a whole trace when requests is unset
    console.print(
        f"hardware run: {scenario.name}, {instances}prefill TP{g.prefill_tp} -> "
        f"{'' if c.single else f'{c.decode_instances} x '}decode TP{g.decode_tp}, "
        f"{hw.backend} on {hw.device}, {requests} requests, {scenario.transfer.path} path"
    )
    with HwProgress(console, g.decode_tp, requests) as progress:
        if target is not None:
            launch_options["ceiling"] = True
        result = launch_run(
            scenario,
            run_dir,
            on_progress=progress,
            on_affinity=lambda rows: print_affinity(console, rows),
            **launch_options,
        )
    code = finish_run(result, run_dir, trace_format=trace_format, console=console)
    print_bandwidth(console, result.summary["bandwidth"])
    for line in limit_lines(result.summary["bandwidth"].get("limits") or {}):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    if baseline:
        print_baselines(console, result.summary, run_dir)
    if target is not None and not _print_verdict(console, result, target):
        code = 1
    return code, run_dir


def print_baselines(console: Console, summary: dict, run_dir: Path) -> None:
    """nixlbench, ib_write_bw, transfer_engine_bench on the run's NICs, where found
    (hw/probes/baseline.py), one line each beside the pairs' figures; kept in baseline.json."""
    import json

    from kvstage.hw.probes.baseline import baseline_lines, baselines

    entries = baselines(summary.get("affinity") or {})
    (run_dir / "baseline.json").write_text(json.dumps(entries, indent=1) + "\n")
    for line in baseline_lines(entries, summary["bandwidth"].get("pairs") or []):
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def print_affinity(console: Console, rows: dict) -> None:
    """Each rank's host, GPU, NUMA node and NIC, and whether GPU and NIC share a PCIe
    switch (hw/transport/affinity.py), as the ranks said at the rendezvous."""
    for line in table_lines(rows):
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def print_bandwidth(console: Console, bw: dict) -> None:
    """Per pair, what it achieved (bytes over the time its writes were busy) against the
    raw ceiling its prefill measured before the first room, in GB/s."""
    pairs = bw.get("pairs") or []
    if not pairs:
        return
    console.print(
        "pair                     achieved GB/s   ceiling GB/s   achieved/ceiling", highlight=False
    )
    for p in pairs:
        ceiling = f"{p['ceiling_gbs']:.2f}" if p["ceiling_gbs"] else "-"
        ratio = f"{p['ratio']:.0%}" if p["ratio"] is not None else "-"
        console.print(
            f"{p['prefill'] + ' -> ' + p['decode']:<24} {p['achieved_gbs']:>13.2f}   {ceiling:>12}"
            f"   {ratio:>16}",
            highlight=False,
        )


def _print_verdict(console: Console, result: RunResult, target: float) -> bool:
    """The PASS/FAIL line of `--target` (hw/transport/bandwidth.py); True when it passed."""
    pairs = [
        PairFigure(
            int(p["prefill"][7:]),
            int(p["decode"][6:]),
            p["achieved_gbs"],
            p["ceiling_gbs"],
            p["bytes"],
        )
        for p in result.summary["bandwidth"]["pairs"]
    ]
    passed, line = verdict(pairs, target)
    console.print(f"[{'green' if passed else 'bold red'}]{escape(line)}[/]", highlight=False)
    return passed
