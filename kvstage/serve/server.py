"""`kvstage serve`: the scenario's PD cluster behind an OpenAI-compatible HTTP server.

At start the run directory gets the client's tokenizer (`tokenizer/`, and `hf-cache/`
holding it as `kvstage/words` for a client that loads names offline; see
kvstage/serve/tokenizer.py) and the server prints `listening on http://HOST:PORT` (the
port the system gave when asked for 0). Every request that ends adds its line to
`served.jsonl` (kvstage/serve/timeline.py: arrival, token times and the client figures,
in simulated seconds since the start). On SIGINT or SIGTERM the server stops taking
requests, runs what is in flight to its end in simulated time, and writes the run as
`kvstage sim` does (trace, scenario.toml, summary.json, with the server's own lag under
`serve`), so `check`, `compare` and `report` read it.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

from aiohttp import web
from rich.console import Console

from kvstage.metrics.rooms import percentiles, room_latencies
from kvstage.run.result import finish_run
from kvstage.run.simrun import run_result
from kvstage.run.summary import capacity_figures, simulation_summary
from kvstage.serve.openai_api import OpenAIFace, make_app
from kvstage.serve.realtime import RealtimeCluster
from kvstage.serve.timeline import Served
from kvstage.serve.tokenizer import write_hub_cache, write_tokenizer
from kvstage.shared.scenario import Scenario

__all__ = ["serve"]


def serve(
    scenario: Scenario, run_dir: Path, *, host: str, port: int, model: str, console: Console
) -> int:
    """Serve until SIGINT / SIGTERM; the exit code of the run (as `kvstage sim`'s)."""
    return asyncio.run(
        _serve(scenario, run_dir, host=host, port=port, model=model, console=console)
    )


async def _serve(
    scenario: Scenario, run_dir: Path, *, host: str, port: int, model: str, console: Console
) -> int:
    tokenizer = write_tokenizer(run_dir / "tokenizer")
    write_hub_cache(run_dir / "hf-cache")
    rows = (run_dir / "served.jsonl").open("w")
    late: list[float] = []  # every token's lag, wall seconds

    def done(served: Served) -> None:
        late.extend(served.sent_late_s)
        rows.write(json.dumps(served.row()) + "\n")
        rows.flush()

    cluster = RealtimeCluster(scenario, done)
    face = OpenAIFace(cluster, model, scenario.workload.output_tokens)
    runner = web.AppRunner(make_app(face), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]  # the port asked for 0 is the system's
    console.print(f"model {model!r}, tokenizer {tokenizer}", highlight=False, markup=False)
    print(f"listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pacer = asyncio.create_task(cluster.pace())
    await stop.wait()
    pacer.cancel()
    await runner.cleanup()
    rows.close()
    in_flight = cluster.in_flight
    result = cluster.close()
    summary = simulation_summary(scenario, result)
    # the offered load and bottleneck of the requests served, not of the scenario's workload
    rooms = room_latencies(result.records)
    served = dict(requests=len(result.requests), workload=result.requests)
    summary.update(capacity_figures(scenario, rooms, summary, **served))
    summary["serve"] = {
        "requests": len(result.requests),
        "unfinished_at_stop": in_flight,
        "sent_late_s": percentiles(late),
    }
    run = run_result(scenario, result, summary)
    return finish_run(run, run_dir, trace_format="jsonl", console=console)
