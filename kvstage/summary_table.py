"""The short console table at the end of a run (both modes)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _ms(x) -> str:
    return "-" if x is None or x != x else f"{x * 1e3:,.2f} ms"


def print_summary(summary: dict, console: Console, title: str = "summary") -> None:
    t = Table(title=title, show_header=False)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("requests done / failed", f"{summary['requests_done']} / {summary['requests_failed']} of {summary['requests']}")
    lat = summary["transfer_latency_s"]
    t.add_row("transfer latency p50 / p99", f"{_ms(lat['p50'])} / {_ms(lat['p99'])}")
    t.add_row("transfer latency mean / max", f"{_ms(lat['mean'])} / {_ms(lat['max'])}")
    ttft = summary["ttft_s"]
    t.add_row("TTFT (arrival -> decode ready) p50 / p99", f"{_ms(ttft['p50'])} / {_ms(ttft['p99'])}")
    t.add_row("throughput", f"{summary['throughput_gbps']:,.2f} Gb/s")
    t.add_row("ring peak", f"{summary['ring_peak_bytes'] / (1 << 20):,.1f} MiB ({summary['ring_peak_fraction']:.0%})")
    st = summary["watermark_stall_s"]
    t.add_row("watermark stall total / p99", f"{st['total']:,.4f} s / {_ms(st['p99'])}")
    tr = summary["transfer_requests"]
    t.add_row("transfer requests total / per request", f"{tr['total']:,} / {tr['per_request']:,.0f}")
    for key in ("events", "sim_time_s", "wall_s", "backend", "device", "bytes_verified", "bytes_wrong"):
        if key in summary:
            v = summary[key]
            t.add_row(key, f"{v:,.3f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v))
    console.print(t)
