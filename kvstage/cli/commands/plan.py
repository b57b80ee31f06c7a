"""`kvstage plan`: the fewest GPUs that meet a scenario's SLOs at its load.

The search is `kvstage.explore.plan` (imported when the command runs); this module is the
command line: options, progress bar, tables, files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstage.cli.errors import fail as _fail
from kvstage.cli.options import ProgressOpt, RayOpt, SetOpt, WorkersOpt
from kvstage.fmt import num, secs
from kvstage.tables import print_table

console = Console()

ListOpt = Annotated[
    str | None,
    typer.Option(metavar="V1,V2,...", help="Values to search, comma separated (defaults below)."),
]


def _skipped_table(groups: list[dict[str, Any]]) -> Table:
    t = Table(title="skipped before simulating", title_justify="left")
    t.add_column("configs", justify="right")
    t.add_column("e.g.")
    t.add_column("why", overflow="fold")
    for g in groups:
        t.add_row(str(g["count"]), escape(g["example"]), escape(g["reason"]))
    return t


def _ep(row: dict[str, Any], key: str) -> str:
    return f" EP{row[key]}" if (row.get(key) or 1) > 1 else ""


def _local(row: dict[str, Any]) -> str:
    """Conditional disaggregation in the decode column: prompts it prefills itself."""
    v = row.get("cluster.max_local_prefill_length")
    return "" if v in (None, "off") else f", prefills <= {v}"


def _front_table(result: Any) -> Table:
    q = result.qname
    costs = any(r.get("cost_per_hour") is not None for r in result.front)
    t = Table(
        title=f"Pareto front: GPUs, goodput per GPU and TTFT {q} over the steady window (no other "
        "point is as good in all three and better in one beyond the 95% intervals)",
        title_justify="left",
    )
    for col, right in (
        ("prefill", False),
        ("decode", False),
        ("pool MiB", True),
        ("GPUs", True),
        ("attain.", True),
        ("goodput/GPU", True),
        (f"TTFT {q}", True),
        ("95% interval", True),
        (f"TPOT {q}", True),
        (f"ITL {q}", True),
        *((("$/M in", True), ("$/M out", True)) if costs else ()),
        ("busiest stage", False),
        ("", False),
    ):
        t.add_column(col, justify="right" if right else "left")
    for r in result.front:
        mark = (
            "[bold green]winner[/]"
            if r["winner"]
            else ("meets" if r["meets"] else "[yellow]misses[/]")
        )
        util = r.get("busiest_utilization")
        t.add_row(
            f"{r['cluster.prefill_instances']} x TP{r['prefill.tp']}{_ep(r, 'prefill.ep')}"
            f"{_ep(r, 'prefill.pp').replace('EP', 'PP')}",
            f"{r['cluster.decode_instances']} x TP{r['decode.tp']}{_ep(r, 'decode.ep')}{_local(r)}",
            f"{r['decode.staging_pool_mb']:g}",
            str(r["gpus"]),
            num(r["slo_attainment"], spec=".0%"),
            num(r["goodput_per_gpu_rps"]),
            secs(r[f"ttft_s.{q}"]),
            f"{secs(r.get(f'ttft_s.{q}_lo'))} .. {secs(r.get(f'ttft_s.{q}_hi'))}",
            secs(r[f"tpot_s.{q}"]),
            secs(r.get(f"itl_s.{q}")),
            *(
                (num(r.get("cost_per_m_input_tokens")), num(r.get("cost_per_m_output_tokens")))
                if costs
                else ()
            ),
            f"{r['busiest_stage']} {util:.0%}" if util is not None else "-",
            mark,
            style="bold" if r["winner"] else None,
        )
    return t


def _colocated_table(result: Any) -> Table:
    """Per GPU count simulated, the colocated configuration that did best there."""
    q = result.qname
    t = Table(
        title="colocated (prefill chunks mixed into decode batches, same GPUs): the best per GPU count",
        title_justify="left",
    )
    for col in ("instances", "chunk", "GPUs", "attain.", "goodput/GPU", f"TTFT {q}", f"TPOT {q}"):
        t.add_column(col, justify="left" if col == "instances" else "right")
    t.add_column("")
    per: dict[int, dict[str, Any]] = {}
    for r in result.colocated:
        if r["status"] != "ok":
            continue
        key = (r["slo_attainment"] or 0.0, r["goodput_per_gpu_rps"] or 0.0)
        old = per.get(r["gpus"])
        if old is None or key > (old["slo_attainment"] or 0.0, old["goodput_per_gpu_rps"] or 0.0):
            per[r["gpus"]] = r
    for g in sorted(per):
        r = per[g]
        t.add_row(
            f"{r['colocated.instances']} x TP{r['colocated.tp']}{_ep(r, 'colocated.ep')}",
            str(r["prefill.chunked_prefill_size"]),
            str(g),
            num(r["slo_attainment"], spec=".0%"),
            num(r["goodput_per_gpu_rps"]),
            secs(r.get(f"ttft_s.{q}")),
            secs(r.get(f"tpot_s.{q}")),
            "[bold green]best[/]"
            if r["best"]
            else ("meets" if r["meets"] else "[yellow]misses[/]"),
        )
    return t


def _print_colocated(result: Any) -> None:
    console.print(_colocated_table(result))
    c = result.comparison
    color = "green" if c["pays"] else "yellow"
    console.print(
        f"[bold {color}]colocated vs disaggregated:[/] {escape(c['text'])}",
        highlight=False,
        soft_wrap=True,
    )


def _progress_bar(progress: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]planning[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        disable=not progress,
        transient=True,
    )


def _grid(*values: str | None) -> dict[str, str | None]:
    """The searched grid: each option's values (KEYS order) or its default."""
    from kvstage.explore.plan import DEFAULT_GRID

    given = dict(zip(DEFAULT_GRID, values, strict=True))
    return {k: v if v is not None else DEFAULT_GRID[k] for k, v in given.items()}


def _log_line(text: str) -> None:
    console.print(escape(text), highlight=False, soft_wrap=True)


EXPORTS = ("sglang", "vllm", "lws", "dynamo-sglang", "dynamo-vllm", "llm-d")


def _print_export(result: Any, cands: Any, target: str) -> None:
    """The winner as `target`: SGLang launch lines and the router's
    (kvstage/explore/export.py), vLLM serve lines (export_vllm.py), LeaderWorkerSet
    manifests (export_k8s.py), a Dynamo graph (export_dynamo.py) or llm-d Helm values
    (export_llmd.py)."""
    from kvstage.explore.export import ExportError, sglang_commands
    from kvstage.explore.export_dynamo import dynamo_yaml
    from kvstage.explore.export_k8s import lws_yaml
    from kvstage.explore.export_llmd import llmd_yaml
    from kvstage.explore.export_vllm import vllm_commands
    from kvstage.explore.plan import KEYS

    w = result.winner
    if w is None:
        console.print(f"[yellow]--export {target}: no winner to export[/]")
        return
    point = next(p for p in cands.points if all(p.settings[k] == w[k] for k in KEYS))
    make = {
        "sglang": sglang_commands,
        "vllm": vllm_commands,
        "lws": lws_yaml,
        "dynamo-sglang": lambda s: dynamo_yaml(s, "sglang"),
        "dynamo-vllm": lambda s: dynamo_yaml(s, "vllm"),
        "llm-d": llmd_yaml,
    }[target]
    try:
        text = make(point.scenario)
    except ExportError as exc:
        _fail(str(exc))
    console.print(escape(text), highlight=False, soft_wrap=True)
    local = point.scenario.cluster.max_local_prefill_length
    if local is not None:  # on stderr: the export itself may be piped into its tool
        typer.echo(
            f"note: the winner prefills prompts of at most {local} uncached tokens on its "
            "decode instances (cluster.max_local_prefill_length); this export does not "
            "carry that: set it in the router that decides where a prompt is prefilled",
            err=True,
        )


_SEARCH_TEXT = {
    "halving": "successive halving (short windows first, the best third on)",
    "levels": "GPU counts smallest first, stopping one count above the first that meets the SLO",
    "exhaustive": "every candidate on the whole workload",
}


def _print_intro(
    scenario: Path, cands: Any, attainment: float, where: str, search: str = "levels"
) -> None:
    from kvstage.explore.plan import skip_reasons

    gpus = sorted({_gpus(p.settings) for p in cands.points})
    slo = ", ".join(f"{k} <= {secs(v)}" for k, v in cands.targets.items())
    console.print(
        f"plan [bold]{escape(str(scenario))}[/]: {len(cands.points) + len(cands.skipped)} configurations, "
        f"{len(cands.skipped)} skipped, {len(cands.points)} to search over {len(gpus)} GPU counts "
        f"({gpus[0]}..{gpus[-1]}); SLO {slo} for >= {attainment:.0%} of requests; search: "
        f"{_SEARCH_TEXT[search]}; on {where}",
        highlight=False,
        soft_wrap=True,
    )
    s = cands.points[0].scenario
    if (
        {"tpot_s", "e2e_s"} & set(cands.targets)
        and not s.workload.output_tokens
        and not s.workload.trace
    ):
        console.print(
            "note: workload.output_tokens is 0: no request has a TPOT or end-to-end figure, so those "
            "targets are missed everywhere",
            highlight=False,
        )
    if cands.skipped:
        print_table(console, _skipped_table(skip_reasons(cands.skipped)))


def _gpus(settings: dict[str, Any]) -> int:
    from kvstage.explore.plan_point import gpus_of

    return gpus_of(settings)


def _print_result(result: Any, files: dict[str, Path], out_dir: Path) -> None:
    from kvstage.explore.plan import verdict, warnings

    print_table(console, _front_table(result))
    line = verdict(result)
    color = "green" if result.winner else "yellow"
    console.print(
        f"[bold {color}]{escape(line.split(':', 1)[0])}:[/]{escape(line.split(':', 1)[1])}",
        highlight=False,
        soft_wrap=True,
    )
    for text in warnings(result):
        console.print(f"[bold yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=True)
    if result.search == "halving":
        rungs = " -> ".join(f"{n} ({r:,} requests)" for n, r in result.rungs)
        search = (
            f"successive halving, simulations per rung: {rungs}; "
            f"{result.count('pruned')} pruned on a short window"
        )
    elif result.stopped_at is not None:
        search = (
            f"stopped after {result.stopped_at} GPUs, one count above the first that meets the SLO; "
            f"{result.count('not run')} larger configuration(s) not run"
        )
    else:
        search = "every candidate simulated"
    console.print(
        f"{len(result.simulated) + result.count('pruned')} configurations simulated in {result.wall_s:.1f} s on "
        f"{result.backend} ({search}); files in {out_dir}: {', '.join(p.name for p in files.values())}",
        highlight=False,
        soft_wrap=True,
    )
    errors = result.count("error")
    if errors:
        console.print(
            f"[bold red]{errors} configuration(s) failed to simulate[/] (status error in plan.csv)"
        )


def _meta(
    scenario: Path,
    sets: list[str],
    cands: Any,
    max_gpus: int | None,
    search: str,
    screen: bool,
    prices: dict[str, float] | None,
) -> dict[str, Any]:
    """plan.json's description of the search."""
    return {
        "scenario": str(scenario),
        "scenario_name": scenario.stem,
        "set": sets,
        "grid": {v.key: list(v.values) for v in cands.varies},
        "max_gpus": max_gpus,
        "exhaustive": search == "exhaustive",
        "screen": screen,
        "gpu_hour_cost": prices,
    }


def _check_options(scenario: Path, workers: int | None, attainment: float, search: str) -> str:
    """The plain options' errors (exit 2); the search method."""
    from kvstage.explore.plan import SEARCHES

    if not scenario.is_file():
        _fail(f"scenario file not found: {scenario}")
    if workers is not None and workers < 1:
        _fail(f"--workers {workers}: must be at least 1")
    if not 0 < attainment <= 1:
        _fail(f"--attainment {attainment}: a share of the requests in (0, 1], e.g. 0.9")
    if search not in SEARCHES:
        _fail(f"--search {search!r}: one of {', '.join(SEARCHES)}")
    return search


def plan(
    scenario: Annotated[
        Path,
        typer.Argument(help="Scenario TOML file with an [slo] table (see scenarios/README.md)."),
    ],
    set_: SetOpt = None,
    prefill_tp: ListOpt = None,
    decode_tp: ListOpt = None,
    prefill_instances: ListOpt = None,
    decode_instances: ListOpt = None,
    pool_mb: Annotated[
        str | None,
        typer.Option(
            metavar="V1,V2,...", help="Staging pool per decode rank, MiB (default: the scenario's)."
        ),
    ] = None,
    chunk: Annotated[
        str | None,
        typer.Option(
            metavar="V1,V2,...",
            help="Chunked prefill sizes, tokens (prefill.chunked_prefill_size; default: the scenario's).",
        ),
    ] = None,
    router: Annotated[
        str | None,
        typer.Option(
            metavar="R1,R2,...",
            help="Routers: round-robin, least-outstanding, staging-aware (default: the scenario's).",
        ),
    ] = None,
    path: Annotated[
        str | None,
        typer.Option(
            metavar="P1,P2,...", help="Transfer paths: staging, slice (default: the scenario's)."
        ),
    ] = None,
    prefill_ep: Annotated[
        str | None,
        typer.Option(
            metavar="V1,V2,...",
            help="Expert-parallel sizes of the prefill side (prefill.ep; above the TP: DP "
            "attention; default: the scenario's).",
        ),
    ] = None,
    decode_ep: Annotated[
        str | None,
        typer.Option(
            metavar="V1,V2,...",
            help="Expert-parallel sizes of the decode side (decode.ep; default: the scenario's).",
        ),
    ] = None,
    max_local_prefill: Annotated[
        str | None,
        typer.Option(
            metavar="V1,V2,...",
            help="Conditional disaggregation: prompts of at most this many uncached tokens "
            "prefilled on their decode instance (cluster.max_local_prefill_length; off: "
            "none; default: the scenario's), e.g. off,512,2048.",
        ),
    ] = None,
    prefill_pp: Annotated[
        str | None,
        typer.Option(
            metavar="V1,V2,...",
            help="Pipeline-parallel stages of a prefill instance (prefill.pp; an instance is "
            "TP x PP GPUs, each stage sending its layers' KV; default: the scenario's), e.g. "
            "1,2 for a model one node cannot hold.",
        ),
    ] = None,
    search: Annotated[
        str,
        typer.Option(
            metavar="METHOD",
            help="halving (successive halving: short windows first, the best third on), levels "
            "(GPU counts smallest first, one count above the first that meets) or exhaustive.",
        ),
    ] = "halving",
    screen: Annotated[
        bool,
        typer.Option(
            help="Skip configurations whose offered load exceeds a stage's capacity (bottleneck model) before simulating."
        ),
    ] = True,
    gpu_hour_cost: Annotated[
        str | None,
        typer.Option(
            metavar="GPU=PRICE,...",
            help="Price per GPU-hour by GPU name, e.g. h100-sxm=2.5,h200=3.6: adds cost per million input and output tokens.",
        ),
    ] = None,
    export: Annotated[
        str | None,
        typer.Option(
            metavar="TARGET",
            help="Print the winner for a deployment: sglang (launch lines, multi-node flags, "
            "the router in PD mode), vllm (serve lines with --kv-transfer-config), lws "
            "(Kubernetes LeaderWorkerSet manifests), dynamo-sglang / dynamo-vllm (a Dynamo "
            "DynamoGraphDeployment) or llm-d (llm-d ModelService Helm values).",
        ),
    ] = None,
    max_gpus: Annotated[
        int | None, typer.Option(help="Skip configurations with more GPUs than this.")
    ] = None,
    colocated: Annotated[
        bool,
        typer.Option(
            help="Also search colocated serving (prefill chunks mixed into decode batches on the "
            "same GPUs) and say whether disaggregation pays."
        ),
    ] = True,
    colocated_instances: Annotated[
        str,
        typer.Option(
            metavar="N1,N2,...",
            help="Colocated instance counts (their TPs: the --prefill-tp and --decode-tp values).",
        ),
    ] = "1,2,3,4,6,8,12,16",
    attainment: Annotated[
        float,
        typer.Option(
            help="A configuration meets the SLO when at least this share of requests meets every [slo] target (0.9: TTFT target = its p90)."
        ),
    ] = 0.9,
    exhaustive: Annotated[
        bool,
        typer.Option(help="Simulate every candidate on the whole workload (--search exhaustive)."),
    ] = False,
    workers: WorkersOpt = None,
    ray: RayOpt = None,
    out: Annotated[
        Path | None, typer.Option(help="Output directory (default runs/SCENARIO-plan-TIME/).")
    ] = None,
    progress: ProgressOpt = True,
) -> None:
    """Search prefill TP, decode TP, instance counts, staging pool, chunk, router and
    transfer path for the fewest GPUs that meet the scenario's [slo] targets at its
    workload (rate or trace).

    Defaults: --prefill-tp 1,2,4,8 --decode-tp 1,2,4,8 --prefill-instances 1,2,3,4,6
    --decode-instances 1,2,3,4,6, the scenario's pool, chunk, router and path.
    Configurations the scenario rejects (TP mapping vs KV heads, pool < one chunk,
    decode memory < weights) are skipped with the reason, and so (--screen) are those
    whose offered load exceeds a stage's capacity. --search halving (default)
    simulates every configuration on a short window (its length from the
    configuration's utilization), keeps the best third and lengthens; levels runs GPU
    counts smallest first; exhaustive runs all on the whole workload. Figures are over
    the steady window with 95% intervals. Prints the Pareto front and the winner
    (fewest GPUs; ties: most goodput per GPU) with its bottleneck; writes plan.csv,
    plan.json and plan_front.png (`kvstage report OUT` shows them); --export sglang,
    vllm or lws prints the winner for a deployment. --colocated (default) also simulates the same
    GPUs serving prefill and decode together (chunks mixed into decode batches;
    instances x TP x chunk), prints the best per GPU count and whether disaggregation
    pays, and writes colocated.csv. Off a terminal, progress goes to the log (a line
    per quarter or per minute, with an ETA). Exits 1 when nothing meets the SLO or a
    point failed."""
    from kvstage.explore.colocated import colocated_from_plan
    from kvstage.explore.costs import parse_gpu_costs
    from kvstage.explore.executor import ExploreError, require_ray
    from kvstage.explore.plan import plan_candidates, planned_work, run_plan, write_plan
    from kvstage.explore.progress import ProgressLog

    sets = list(set_ or [])
    search = _check_options(scenario, workers, attainment, "exhaustive" if exhaustive else search)
    if export is not None and export not in EXPORTS:
        _fail(f"--export {export!r}: one of {', '.join(EXPORTS)}")
    try:
        prices = parse_gpu_costs(gpu_hour_cost)
        if ray is not None:
            require_ray()
        grid = _grid(
            prefill_tp,
            decode_tp,
            prefill_instances,
            decode_instances,
            pool_mb,
            chunk,
            router,
            path,
            prefill_ep,
            decode_ep,
            max_local_prefill,
            prefill_pp,
        )
        cands = plan_candidates(scenario, grid, sets, max_gpus, screen=screen)
        colo = (
            colocated_from_plan(cands, colocated_instances, max_gpus, screen) if colocated else None
        )
    except ExploreError as exc:  # PlanError, SweepError, --ray, --gpu-hour-cost
        _fail(str(exc))
    where = f"Ray ({ray})" if ray else f"up to {workers or os.cpu_count()} local processes"
    _print_intro(scenario, cands, attainment, where, search)
    jobs, work = planned_work(cands, attainment, search)
    terminal = console.is_terminal
    bar = _progress_bar(progress and terminal)
    task = bar.add_task("", total=work)
    log = ProgressLog(jobs, work, _log_line) if progress and not terminal else None

    def on_point(row: dict[str, Any]) -> None:
        n = row.get("requests") or 0
        bar.update(task, advance=n, description=f"{row['gpus']} GPUs")
        if log is not None:
            log.advance(n)

    try:
        with bar:
            result = run_plan(
                scenario,
                cands,
                attainment=attainment,
                workers=workers,
                ray_address=ray,
                search=search,
                on_point=on_point,
                gpu_costs=prices,
                colocated=colo,
            )
    except ExploreError as exc:  # PlanError, SweepError, --ray
        _fail(str(exc))
    if log is not None:
        log.finish()
    from kvstage.run.rundir import make_run_dir

    meta = _meta(scenario, sets, cands, max_gpus, search, screen, prices)
    try:
        out_dir = make_run_dir(cands.points[0].scenario, "plan", out)
        files = write_plan(result, out_dir, meta)
    except OSError as exc:
        _fail(f"cannot write the plan to {out or 'runs/'}: {exc}")
    _print_result(result, files, out_dir)
    if result.comparison is not None:
        _print_colocated(result)
    if export is not None:
        _print_export(result, cands, export)
    raise typer.Exit(0 if result.winner is not None and not result.count("error") else 1)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
