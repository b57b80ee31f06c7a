"""`kvstage calibrate --descriptors`: the serving engine's per-descriptor costs and the
interpreter lock, measured with the real NIXL here (hw/probes/descriptors.py), fitted
(kvstage/calibrate/descriptors.py) and written as JSON with each fit's R^2."""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvstage.cli.errors import fail
from kvstage.tables import print_table


def _default_out(memory: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs/calibration") / f"descriptors-nixl-{memory.lower()}-{stamp}.json"


def descriptors_command(backend: str, device: str, out: Path | None, quick: bool) -> None:
    if backend != "nixl":
        fail(
            f"--descriptors measures NIXL's descriptor calls; --backend {backend!r} not allowed (allowed: nixl)"
        )
    from kvstage.calibrate.descriptors import fit_descriptors
    from kvstage.hw.probes.descriptors import DescriptorPlan, measure_descriptors

    quick_plan = {"counts": (256, 1024, 4096, 16384), "reps": 3, "gil_s": 0.5} if quick else {}
    plan = DescriptorPlan(device=device, **quick_plan)
    memory = "host memory" if device == "cpu" else f"GPU memory ({device})"
    console = Console()
    console.print(f"measuring descriptor costs with NIXL (one agent, loopback, {memory})")
    try:
        raw = measure_descriptors(plan)
    except Exception as exc:  # noqa: BLE001 - one clear line, never a traceback
        fail(f"the descriptor probe failed: {exc}", 1)
    fit = fit_descriptors(raw)
    t = Table(
        title="per-descriptor costs: t(n) = per_call + n * per_descriptor", title_justify="left"
    )
    for col in ("part", "ns / descriptor", "us / call", "R^2", "what"):
        t.add_column(col, justify="left" if col in ("part", "what") else "right")
    for name, row in fit.table()["parts"].items():
        t.add_row(name, f"{row['per_descriptor_ns']:,.1f}", f"{row['per_call_us']:,.1f}",
                  f"{row['r2']:.3f}", row["what"])  # fmt: skip
    print_table(console, t)
    console.print(
        f"GIL: a transfer worker beside a busy Python thread runs {fit.worker_slowdown:.1f}x "
        f"slower, the Python thread {fit.python_slowdown:.1f}x slower (a fair share: 2x each)"
    )
    path = out or _default_out(raw.get("memory", "DRAM"))
    doc = {
        "kvstage_descriptors": 1,
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "fit": fit.table(),
        "raw": raw,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
    except OSError as exc:
        fail(f"writing {path}: {exc}", 1)
    console.print(f"fit and raw points: {path}")
