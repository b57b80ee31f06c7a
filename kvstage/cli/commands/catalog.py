"""`kvstage presets` and `kvstage profiles`: what `[model] preset` and `[links] profile`
can name, in a table each (the numbers behind them and where they come from)."""

from __future__ import annotations

from functools import partial
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvstage.fmt import num
from kvstage.tables import print_table

console = Console()


_num = partial(num, spec=",.4g")  # the catalogue's figures, four digits


def presets_table() -> Table:
    """One row per model preset: KV geometry, KV bytes per token (bf16), parameters,
    context length (max_position_embeddings)."""
    from kvstage.shared.scenario.presets import PRESETS

    t = Table(
        title="model presets (\\[model] preset = NAME; explicit fields override them)",
        title_justify="left",
    )
    for col in (
        "preset",
        "layers",
        "KV heads",
        "head_dim",
        "KV KiB/token (bf16)",
        "params (B)",
        "active (B)",
        "context",
        "note",
        "config source",
    ):
        t.add_column(col, justify="left" if col in ("preset", "note", "config source") else "right")
    for name, p in PRESETS.items():
        kv = p.kv_elems_per_token * 2  # bf16: K and V heads, or the MLA latent once
        t.add_row(
            name,
            str(p.layers),
            str(p.kv_heads),
            str(p.head_dim),
            f"{kv / 1024:,.0f}",
            _num(p.params_b),
            _num(p.active_params_b) if p.active_params_b else "= params",
            f"{p.context_tokens:,}" if p.context_tokens else "-",
            p.note,
            p.source and f"huggingface.co/{p.source}",
        )
    return t


def gpus_table() -> Table:
    """One row per catalogue GPU (`prefill.gpu` / `decode.gpu`): datasheet numbers."""
    from kvstage.shared.serving.gpus import DEFAULT_GPU, GPUS

    t = Table(
        title=f"GPUs (\\[prefill] / \\[decode] gpu = NAME; default {DEFAULT_GPU}; dense FLOP/s)",
        title_justify="left",
    )
    for col in (
        "gpu",
        "memory GiB",
        "HBM GB/s",
        "bf16 TFLOP/s",
        "fp8 TFLOP/s",
        "scale-up GB/s",
        "source",
    ):
        t.add_column(col, justify="left" if col in ("gpu", "source") else "right")
    for g in GPUS.values():
        t.add_row(
            g.name,
            _num(g.memory_gib),
            _num(g.hbm_gbs),
            _num(g.bf16_tflops),
            _num(g.fp8_tflops) if g.fp8_tflops else "- (bf16 rate)",
            f"{_num(g.scaleup_gbs)} ({g.scaleup})",
            g.source,
        )
    return t


def efficiency_table() -> Table:
    """The achieved-efficiency defaults (gpus.Efficiency) and the fields that override them."""
    from kvstage.shared.serving.engine_step import DECODE_ENGINES
    from kvstage.shared.serving.gpus import DEFAULT_EFFICIENCY as e

    t = Table(
        title="achieved efficiency (defaults; sources in shared/serving/gpus.py)",
        title_justify="left",
    )
    for col in ("what", "default", "override"):
        t.add_column(col)
    mfu = ", ".join(f"{m:.0%} at {n:,}" for n, m in e.prefill_mfu)
    t.add_row("prefill MFU by forward tokens", mfu, "prefill.mfu, prefill.tflops")
    t.add_row("decode share of HBM bandwidth", f"{e.decode_hbm:.0%}", "decode.hbm_efficiency")
    t.add_row(
        "decode per-step overhead (no engine named)",
        f"{e.step_overhead_s * 1e3:g} ms",
        "decode.step_overhead_ms",
    )
    for name, eng in DECODE_ENGINES.items():
        hidden = "under the GPU's step" if eng.overlapped else "after the GPU's step"
        t.add_row(f"decode host work a step, {name}", f"{eng.host_s * 1e3:g} ms, {hidden}",
                  f'decode.engine = "{name}"')  # fmt: skip
    t.add_row("TP all-reduce share of the scale-up link", f"{e.allreduce:.0%}", "-")
    t.add_row(
        "copy kernels (gather, scatter) share of HBM",
        f"{e.copy_hbm:.0%}",
        "links.mem_bandwidth_gbs",
    )
    return t


def _resolve(links_config, name: str, base_dir: str | None):
    """The profile's numbers; an intra-node-only profile (nvlink) by its intra link."""
    context = {"base_dir": base_dir}
    try:
        return links_config.model_validate({"profile": name}, context=context).resolved()
    except ValueError:
        return links_config.model_validate(
            {"profile": name, "placement": "intra"}, context=context
        ).resolved()


def profiles_table(base_dir: str | None = None) -> Table:
    """One row per hardware profile found (profile_dirs): its resolved link numbers."""
    from kvstage.shared.scenario import ScenarioError
    from kvstage.shared.scenario.profiles import available_profiles, profile_dirs
    from kvstage.shared.scenario.schema import LinksConfig

    dirs = ", ".join(str(d) for d in profile_dirs(base_dir) if d.is_dir())
    t = Table(
        title=f"hardware profiles (\\[links] profile = NAME; from {dirs})", title_justify="left"
    )
    for col in (
        "profile",
        "NIC Gb/s",
        "NIC latency",
        "per request",
        "NIC Mmsg/s",
        "NVLink GB/s",
        "GPU TFLOP/s",
        "source",
    ):
        t.add_column(col, justify="left" if col in ("profile", "source") else "right")
    for name in available_profiles(base_dir):
        try:
            r = _resolve(LinksConfig, name, base_dir)
        except (ScenarioError, ValueError) as exc:
            t.add_row(name, *["-"] * 6, f"cannot load: {str(exc).splitlines()[-1]}")
            continue
        inter, intra = r.inter, r.intra
        t.add_row(
            name,
            _num(inter and inter.bandwidth_bytes_s, scale=8e-9),
            _num(inter and inter.latency_s, " us", 1e6),
            _num(inter and inter.per_request_s, " us", 1e6),
            _num(inter and inter.message_rate, scale=1e-6),
            _num(intra and intra.bandwidth_bytes_s, scale=1e-9),
            _num(r.gpu_flops, scale=1e-12),
            r.source,
        )
    return t


def engines_table() -> Table:
    """One row per serving-engine preset (`[engine] preset`): where the descriptor work
    of a KV transfer runs and what each part costs (shared/scenario/engines.py)."""
    from kvstage.shared.scenario.engines import ENGINE_PRESETS

    t = Table(
        title="engine presets (\\[engine] preset = NAME; the prefill host, sim/engine_host.py)",
        title_justify="left",
    )
    cols = ("preset", "posts on", "queues x pool", "descriptors", "build ns", "prepare ns")
    cols += ("post ns", "per call us", "launch us", "request us", "overlap", "summary")
    for col in cols:
        t.add_column(col, justify="left" if col in ("preset", "posts on", "summary") else "right")
    for name, p in ENGINE_PRESETS.items():
        t.add_row(
            name,
            p.post_on,
            f"{p.queues} x {p.pool}" if p.queues else "-",
            "per block" if p.granularity == "block" else "layout",
            _num(p.build_ns),
            _num(p.prepare_ns),
            _num(p.post_ns),
            _num(p.post_call_us),
            _num(p.launch_us),
            _num(p.request_us),
            "yes" if p.overlap else "no",
            p.summary,
        )
    return t


def presets() -> None:
    """List the model presets (layers, KV heads, head_dim, KV bytes per token, total and
    MoE active parameters, the published config), the GPUs `prefill.gpu` / `decode.gpu`
    can name with their datasheet numbers, the achieved-efficiency defaults, and the
    serving-engine presets `[engine] preset` can name."""
    print_table(console, presets_table())
    print_table(console, gpus_table())
    print_table(console, efficiency_table())
    print_table(console, engines_table())


def profiles(
    scenario_dir: Annotated[
        str | None,
        typer.Option(
            help="Also list the profiles a scenario in this folder can name (its profiles/ and ../profiles/)."
        ),
    ] = None,
) -> None:
    """List the hardware profiles `[links] profile` can name: NIC bandwidth, latency and
    posting cost per work request, message rate, NVLink bandwidth, GPU FLOP/s, source."""
    print_table(console, profiles_table(scenario_dir))


def register(app: typer.Typer) -> None:
    app.command("presets")(presets)
    app.command("profiles")(profiles)
