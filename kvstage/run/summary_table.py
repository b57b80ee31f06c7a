"""The short console table at the end of a run (both modes)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvstage.fmt import MIB, ms
from kvstage.run.conditions import describe
from kvstage.shared.serving.compute import describe_efficiency
from kvstage.tables import print_table

# TTFT = queueing + prefill compute + exposed KV transfer + decode slot wait; the
# transfer latency above starts at the first forward, so it holds prefill compute +
# exposed KV transfer. TPOT, ITL and E2E are the clients' (docs/metrics.md).
_BREAKDOWN_ROWS = (
    ("queueing_s", "  queueing (arrival -> first forward)"),
    ("prefill_compute_s", "  prefill compute (first forward -> last forward end)"),
    ("kv_transfer_latency_s", "  exposed KV transfer (last forward end -> decode ready)"),
    ("decode_slot_wait_s", "  decode slot wait (decode ready -> first token)"),
    ("staging_wait_s", "staging wait (a chunk behind the watermark)"),
    # the decode side, when modeled (KV capacity, generation)
    ("decode_admission_wait_s", "decode admission wait (arrival -> KV pages granted)"),
    ("tpot_s", "TPOT ((E2E - TTFT) / (N - 1))"),
    ("itl_s", "ITL (every gap between tokens)"),
    ("e2e_s", "end to end (arrival -> last token)"),
)


def _ring(summary: dict, kind: str) -> str:
    b, f = summary.get(f"ring_{kind}_peak_bytes"), summary.get(f"ring_{kind}_peak_fraction")
    return "-" if b is None else f"{b / MIB:,.1f} MiB ({f:.0%} of pool)"


def _capacity_rows(t: Table, summary: dict) -> None:
    """SLO attainment, goodput, offered load and the bottleneck verdict, when present."""
    if "slo" in summary:
        targets = ", ".join(f"{k} <= {ms(v)}" for k, v in summary["slo"].items())
        missing = summary.get("slo_unmeasured")
        note = f" (no figure of {', '.join(missing)}: counted as missed)" if missing else ""
        t.add_row(f"SLO attainment ({targets})", f"{summary['slo_attainment']:.1%}{note}")
        t.add_row(
            "goodput (met SLO / serving span)",
            f"{summary['goodput_rps']:,.3f} req/s ({summary['goodput_per_gpu_rps']:,.4f} per GPU)",
        )
    if "offered_load_rps" in summary:
        t.add_row("offered load", f"{summary['offered_load_rps']:,.3f} req/s")
    if "bottleneck" in summary:
        b = summary["bottleneck"]
        t.add_row(f"bottleneck ({b['reason']})", b["explanation"])


def print_summary(summary: dict, console: Console, title: str = "summary") -> None:
    t = Table(title=title, show_header=False)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row(
        "requests done / failed",
        f"{summary.get('requests_done', '?')} / {summary.get('requests_failed', '?')} of "
        f"{summary.get('requests', '?')}",
    )
    lat = summary.get("transfer_latency_s") or {}
    if lat.get("count"):  # a measured run has no transfer spans
        t.add_row("transfer latency p50 / p99", f"{ms(lat['p50'])} / {ms(lat['p99'])}")
        t.add_row("transfer latency mean / max", f"{ms(lat['mean'])} / {ms(lat['max'])}")
    ttft = summary.get("ttft_s") or {}
    t.add_row(
        "TTFT (arrival -> first token) p50 / p99", f"{ms(ttft.get('p50'))} / {ms(ttft.get('p99'))}"
    )
    for key, label in _BREAKDOWN_ROWS:
        if (summary.get(key) or {}).get("count"):  # older summaries lack it; none: no sample
            fig = summary[key]
            t.add_row(f"{label} p50 / p99", f"{ms(fig.get('p50'))} / {ms(fig.get('p99'))}")
    for key, label in (("requests_per_s", "req/s"), ("output_tokens_per_s", "output tokens/s")):
        if summary.get(key):
            t.add_row(f"served {label}", f"{summary[key]:,.2f}")
    _capacity_rows(t, summary)
    if summary.get("mode") == "measured":
        print_table(console, t)
        return
    if "serving_model" in summary:  # summaries written before issue 22 lack it
        prefill, decode = describe_efficiency(summary["serving_model"])
        t.add_row("prefill model (GPU, efficiency)", prefill)
        t.add_row("decode model (GPU, efficiency)", decode)
    if "trace_rows" in summary:
        t.add_row(
            "trace", f"{summary['trace_rows_replayed']:,} of {summary['trace_rows']:,} trace rows"
        )
    if summary.get("prefix_hit_fraction") or "trace_rows" in summary:
        t.add_row(
            "prefix cache hits (prompt tokens cached)", f"{summary['prefix_hit_fraction']:.1%}"
        )
    # GB/s, the unit of every bandwidth kvstage prints (summary.json keeps Gbit/s in throughput_gbps)
    t.add_row("throughput", f"{summary['throughput_gbps'] / 8:,.2f} GB/s")
    t.add_row("ring live peak (written, not freed)", _ring(summary, "live"))
    t.add_row("ring reserved peak (handed out)", _ring(summary, "reserved"))
    st = summary["watermark_stall_s"]
    t.add_row("watermark stall total / p99", f"{st['total']:,.4f} s / {ms(st['p99'])}")
    tr = summary["transfer_requests"]
    t.add_row(
        "transfer requests total / per request", f"{tr['total']:,} / {tr['per_request']:,.0f}"
    )
    for key in (
        "events",
        "sim_time_s",
        "wall_s",
        "backend",
        "device",
        "bytes_verified",
        "bytes_wrong",
    ):
        if key in summary:
            v = summary[key]
            t.add_row(
                key,
                f"{v:,.3f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v),
            )
    # host conditions (LOADED / quiet) matter for measured timings only; a simulation's
    # times are simulated, so for sim runs they stay in summary.json, out of the table
    if "conditions" in summary and summary.get("mode") != "sim":
        t.add_row("host during the run", describe(summary["conditions"], short=True))
    print_table(console, t)
