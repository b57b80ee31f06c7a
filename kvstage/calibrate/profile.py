"""Calibrate a hardware profile from measurements on this machine (`kvstage calibrate`).

The measuring is kvstage/calibrate/measure.py (`kvstage.hw.probes.engine.measure` runs
two real processes over the real engine and returns the raw points). This module fits
them (kvstage/calibrate/fit.py: pure, numpy only, so tests can feed them synthetic
points) and writes the profile:

- bulk writes: the medians of the one-op writes are fitted as
  t = latency + bytes / bandwidth (`fit_latency_bandwidth`);
- per-request overhead: the medians of batches of n ops of s bytes are fitted as
  t = a + n * c, and c - s / bandwidth is the cost of one more request
  (`fit_per_request`);
- control messages: control latency = median round trip / 2;
- gather / scatter: fitted as t = launches * launch + bytes / copy_bandwidth
  (`fit_copy`); the simulator charges 2 * bytes / mem_bandwidth (read + write), so
  mem_bandwidth = 2 * copy_bandwidth;
- the hardware-mode prefill 'forward' (pattern fill): t = latency + KV bytes /
  fill_bandwidth, kept in the sidecar so a scenario can set prefill.tokens_per_s from
  it (`Calibration.tokens_per_s`);
- a matmul for gpu_tflops (required by the profile schema; unused once
  prefill.tokens_per_s is set);
- posting (kvstage/calibrate/posting.py, measured by kvstage.hw.probes.posting): the
  engine's posting cost per batch and per request (fresh descriptors, and prepared
  descriptor lists where the engine has them), the small-write rate after posting, and
  whether two ranks' or two threads' batches serialise; the profile's
  *_per_batch_us, *_per_request_us, *_prep_per_request_us, *_message_rate_mps and
  post_threads come from it;
- the host model (sim/host.py, profile fields host_*): the CPU an idle engine process
  burns (engine_thread_cores), the CPU of one loop event (event_us: the state
  machine's handle() cost, calibrate/measure.py measure_handle_cost, a small simulation measured here and
  handed to the probe as an extra measurement, plus one control message's CPU from the
  control ping), the fill fit (fill_latency_us, fill_bandwidth_gbs), this host's usable
  cores (host_cores), the cores other processes kept busy meanwhile
  (background_cores, kvstage.run.conditions) and hardware mode's rank-loop constants
  (loop_poll_us, forward_nice); the profile sets host_model = "cpu-loop", so a
  scenario naming it simulates ranks as hardware mode's processes on this host.

The profile TOML (same fields as scenarios/profiles/*.toml) holds the fitted numbers,
with the fit quality in comments. The profile loader (shared/scenario.py,
`_ProfileFile`) refuses unknown keys and tables, so the fit quality ([fit]) and the
raw points ([raw]) go to a sidecar JSON beside it: `<profile stem>.fit.json`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstage.calibrate.descriptors import DescriptorFit, fit_descriptors
from kvstage.calibrate.fit import (
    CopyFit,
    LinearFit,
    PerRequestFit,
    fit_copy,
    fit_latency_bandwidth,
    fit_per_request,
    fit_table,
    median_of,
)
from kvstage.calibrate.inrun import CPU_FIELDS, FACTORS, fit_profile, loop_is_realtime
from kvstage.calibrate.measure import measure, rank_loop_constants
from kvstage.calibrate.posting import PostingFit, fit_posting
from kvstage.hw.probes.engine import KIB, MIB, CalibrationPlan
from kvstage.hw.probes.harness import CalibrationError, ProgressFn, usable_cores

__all__ = [
    "ENGINE_WRITE_THREADS",
    "Calibration",
    "CalibrationError",
    "CalibrationPlan",
    "analyse",
    "calibrate",
    "inrun_notes",
    "sidecar_path",
    "write_profile",
]

# Threads a loopback write keeps busy on this host (host model write_cpu_threads): NIXL's
# UCX moves host memory between processes with one copy (shared memory / CMA); Mooncake's
# TCP transport copies through a socket, a sending and a receiving thread at once.
ENGINE_WRITE_THREADS = {"nixl": 1, "mooncake": 2}


def _r(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits, as a float (for the TOML)."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")


@dataclass
class Calibration:
    """Fitted numbers of one calibration, the raw points, and how to write them."""

    backend: str
    device: str
    quick: bool
    host: str
    when: str
    raw: dict[str, Any]
    write: LinearFit
    per_request: PerRequestFit
    control_rtt_s: float
    control_rtt_p90_s: float
    gather: CopyFit
    gather_sub: CopyFit
    scatter: CopyFit
    copy: CopyFit  # gather + scatter fitted together: what the profile's mem numbers say
    fill: LinearFit
    fill_bytes_per_token: int
    gpu_flops: float
    profile: dict[str, Any] = field(default_factory=dict)
    posting: PostingFit | None = None  # None: raw points without the posting probe
    # the serving engine's descriptor costs and the GIL (kvstage/calibrate/descriptors.py);
    # None: raw points without the descriptor probe (`kvstage calibrate --descriptors`)
    descriptors: DescriptorFit | None = None
    inrun: dict[str, Any] = field(default_factory=dict)  # in-run factors' fit ({}: none)

    # --- derived numbers -----------------------------------------------------------
    @property
    def where(self) -> dict[str, str]:
        """Per measurement, "inter-host" or "same-host" (measure.measured_where); raw
        points from before it was recorded were all taken on one host."""
        return self.raw.get("where") or {"write": "same-host"}

    @property
    def inter_host(self) -> bool:
        return self.where.get("write") == "inter-host"

    @property
    def engine_idle_cores(self) -> float:
        """Cores an idle process of this engine keeps busy (its progress threads): CPU
        seconds per second of the receiver while it had nothing to do."""
        idle = self.raw.get("idle_cpu") or {}
        wall = idle.get("wall_s", 0.0)
        return idle.get("cpu_s", 0.0) / wall if wall > 0 else 0.0

    @property
    def message_cpu_s(self) -> float:
        """CPU of one control message in or out (framing, MAC, codec, ZMQ): half the
        pinging process's CPU per ping (0 in raw points taken before it was measured)."""
        return float(self.raw["control"].get("cpu_per_ping_s", 0.0)) / 2

    @property
    def event_s(self) -> float:
        """Loop CPU time of one delivered event: the mean machine.handle() cost plus one
        control message's CPU (an event mostly is a message in, or sends one out)."""
        return float((self.raw.get("handle") or {}).get("mean_s", 0.0)) + self.message_cpu_s

    @property
    def background_cores(self) -> float:
        """Cores other processes kept busy while the probe ran (kvstage.run.conditions)."""
        cond = self.raw.get("conditions") or {}
        share = cond.get("other_cpu_share")
        return float(share) * float(cond.get("cores") or 1) if share is not None else 0.0

    @property
    def rank_loop(self) -> dict[str, float]:
        """Hardware mode's rank loop constants (calibrate/measure.py rank_loop_constants, hw/rank/prefill.py
        FORWARD_NICE), as recorded at calibration; read now for older raw points."""
        return self.raw.get("rank_loop") or rank_loop_constants(self.device)

    @property
    def host_cores(self) -> int:
        """Cores the rank processes of this host share (CPU affinity where known)."""
        return int(self.raw.get("host_cores") or usable_cores())

    @property
    def post_one_s(self) -> float:
        """What the sim charges for posting a one-op write: per batch + one request (with
        hardware mode's fresh descriptors)."""
        p = self.posting
        if p is None:
            return self.per_request.per_request_s
        return p.per_batch_s + p.per_request_s + p.prep_per_request_s

    @property
    def link_latency_s(self) -> float:
        """The sim charges latency + posting + bytes / bw; a one-op write measured
        `write.latency_s` in total, so the link latency is the rest."""
        return max(0.0, self.write.latency_s - self.post_one_s)

    def engine_fields(self) -> dict[str, Any]:
        """The profile's posting fields, per link class (both the same on loopback).

        Hardware-mode ranks build descriptors per write (descriptor_reuse = false) and
        post from their one loop thread (post_threads = 1)."""
        p = self.posting
        per = p.per_request_s if p is not None else self.per_request.per_request_s
        out: dict[str, Any] = {}
        for c in ("inter", "intra"):
            out[f"{c}_per_request_us"] = _r(per * 1e6)
            out[f"{c}_prep_per_request_us"] = (
                _r(p.prep_per_request_s * 1e6) if p is not None else 0.0
            )
            out[f"{c}_per_batch_us"] = _r(p.per_batch_s * 1e6) if p is not None else 0.0
            out[f"{c}_message_rate_mps"] = _r(p.message_rate / 1e6) if p is not None else 0.0
        return {**out, "post_threads": 1, "descriptor_reuse": False}

    def tokens_per_s(self, kv_bytes_per_token: int, chunk_tokens: int) -> float:
        """prefill.tokens_per_s that makes the simulated forward of a `chunk_tokens` chunk
        take what hw mode's pattern fill of it takes, for a prefill rank whose KV is
        `kv_bytes_per_token` bytes per token (2 * layers * heads * head_dim * dtype)."""
        t = self.fill.latency_s + chunk_tokens * kv_bytes_per_token / self.fill.bandwidth_Bps
        return chunk_tokens / t

    def profile_fields(self) -> dict[str, Any]:
        gbps = _r(self.write.bandwidth_Bps * 8 / 1e9)
        lat_us = _r(self.link_latency_s * 1e6)
        return {
            "source": (
                f"kvstage calibrate: {self.backend} on {self.device}, host {self.host}, "
                f"{self.when}{', quick sweep' if self.quick else ''}, "
                f"{'inter-host' if self.inter_host else 'same-host'} writes"
            ),
            "inter_bandwidth_gbps": gbps,
            "inter_latency_us": lat_us,
            "intra_bandwidth_gbps": gbps,
            "intra_latency_us": lat_us,
            **self.engine_fields(),
            "control_latency_us": _r(self.control_rtt_s / 2 * 1e6),
            "gpus_per_nic": 1,
            "mem_bandwidth_gbs": _r(2 * self.copy.bandwidth_Bps / 1e9),
            "kernel_launch_us": _r(self.copy.launch_s * 1e6),
            "gpu_tflops": _r(self.gpu_flops / 1e12),
            "host_model": "cpu-loop",
            "host_cores": self.host_cores,
            "engine_thread_cores": _r(self.engine_idle_cores),
            "event_us": _r(self.event_s * 1e6),
            "fill_latency_us": _r(self.fill.latency_s * 1e6),
            "fill_bandwidth_gbs": _r(self.fill.bandwidth_Bps / 1e9),
            "background_cores": _r(self.background_cores),
            "loop_poll_us": _r(self.rank_loop["busy_poll_s"] * 1e6),
            "forward_nice": _r(float(self.rank_loop["forward_nice"])),
            "loop_rt": loop_is_realtime(self.raw.get("inrun")),
            # host memory over loopback: the engine's threads copy the bytes on this host's cores
            "write_on_cpu": not str(self.device).startswith("cuda"),
            "write_cpu_threads": ENGINE_WRITE_THREADS.get(self.backend, 1),
            "write_rt": loop_is_realtime(self.raw.get("inrun"), "engine_sched"),
            "copy_op_us": _r(self.inrun.get("copy_op_us", 0.0)),
            **{
                name: _r(self.inrun.get("factors", {}).get(name, 1.0))
                for name, _ in FACTORS.values()
            },
        }

    def fit_table(self) -> dict[str, Any]:
        """The [fit] part of the sidecar: every fit with its R^2 and residuals."""

        return {
            "write": {**fit_table(self.write), "model": "t = latency + bytes / bandwidth (one op)"},
            "per_request": {
                **fit_table(self.per_request),
                "model": "t(n) = intercept + n * slope; per_request = slope - op_bytes / bandwidth",
            },
            "per_request_points": self._per_request_points(),
            "link_latency_s": self.link_latency_s,
            "posting": self.posting.table() if self.posting is not None else None,
            "descriptors": self.descriptors.table() if self.descriptors is not None else None,
            "control": {
                "rtt_median_s": self.control_rtt_s,
                "rtt_p90_s": self.control_rtt_p90_s,
                "one_way_s": self.control_rtt_s / 2,
                "pings": len(self.raw["control"]["rtt_s"]),
            },
            "gather": {
                **fit_table(self.gather),
                "model": "t = launch + bytes / bandwidth (4 of 4 heads)",
            },
            "gather_sub": {
                **fit_table(self.gather_sub),
                "model": "t = launch + bytes / bandwidth (2 of 4 heads)",
            },
            "scatter": {
                **fit_table(self.scatter),
                "model": "t = W * launch + bytes / bandwidth (W = 2 blocks)",
            },
            "copy": {
                **fit_table(self.copy),
                "model": "gather + scatter together; mem_bandwidth = 2 * bandwidth",
            },
            "fill": {
                **fit_table(self.fill),
                "bytes_per_token": self.fill_bytes_per_token,
                "model": "hw prefill forward (fill_pattern): t = latency + KV bytes / bandwidth",
            },
            "gpu_flops": self.gpu_flops,
            "engine_idle_cores": self.engine_idle_cores,
            "event_handle": dict(
                self.raw.get("handle", {}),
                model="CPU cost of one state-machine event (machine.handle) in a "
                "rank loop; its mean is the profile's event_us",
            ),
        }

    def _per_request_points(self) -> list[dict[str, float]]:
        """Per batch: (t(n) - (latency + n * s / bandwidth)) / n, the direct estimate."""
        b = self.raw["batch"]
        out = []
        for n, t in zip(b["counts"], median_of(b["seconds"]), strict=True):
            bytes_time = self.write.latency_s + n * b["op_bytes"] / self.write.bandwidth_Bps
            out.append({"ops": n, "median_s": t, "per_request_s": (t - bytes_time) / n})
        return out

    def sidecar(self) -> dict[str, Any]:
        return {
            "kvstage_calibration": 1,
            "backend": self.backend,
            "device": self.device,
            "quick": self.quick,
            "host": self.host,
            "when": self.when,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "profile": self.profile_fields(),
            "measured_where": self.where,  # per measurement: inter-host or same-host
            "fit": self.fit_table(),
            "forward": {
                "fill_latency_s": self.fill.latency_s,
                "fill_bandwidth_Bps": self.fill.bandwidth_Bps,
                "note": "prefill.tokens_per_s = chunk / (fill_latency + chunk * kv_bytes_per_token "
                "/ fill_bandwidth) makes the sim's forward match hw mode's pattern fill",
            },
            "raw": self.raw,
        }

    def profile_toml(self, sidecar_name: str) -> str:
        p = self.profile_fields()
        w, pr, cp = self.write, self.per_request, self.copy

        def q(s: str) -> str:
            return json.dumps(s)  # a JSON string is a valid TOML basic string here

        sizes = self.raw["write"]["sizes"]
        lines = [
            f"# Calibrated by `kvstage calibrate --backend {self.backend} --device {self.device}"
            f"{' --quick' if self.quick else ''}` on {self.host}, {self.when}.",
            *self._where_toml(),
            f"# Fit quality and raw points: {sidecar_name} beside this file (the profile",
            "# loader accepts no extra tables). Numbers are medians; a shared machine is noisy.",
            f"source = {q(p['source'])}",
            "",
            f"# One-op writes {_fmt_bytes(min(sizes))}..{_fmt_bytes(max(sizes))}: t = latency + bytes / bandwidth,",
            f"# total latency {w.latency_s * 1e6:.1f} us, {w.bandwidth_Bps / 1e9:.2f} GB/s, weighted R^2 {w.r2:.4f},",
            f"# max |relative residual| {max(abs(r) for r in w.residuals):.1%}.",
            f"# Batches of n x {_fmt_bytes(self.raw['batch']['op_bytes'])}: t(n) = {pr.intercept_s * 1e6:.1f} us + n * "
            f"{pr.slope_s * 1e6:.2f} us, R^2 {pr.r2:.4f}; per request = slope - op bytes / bandwidth.",
            "# latency_us below is the total minus one write's posting (the sim adds it back).",
            (
                "# inter_* were measured between two hosts; intra_* are the same figure (no"
                " same-host write was measured in this run)."
                if self.inter_host
                else "# inter_* are a SAME-HOST figure (no inter-host run): every process was on"
                " this host; measure across hosts (--peer-host) for an inter-node number."
            ),
            f"inter_bandwidth_gbps = {p['inter_bandwidth_gbps']!r}",
            f"inter_latency_us = {p['inter_latency_us']!r}",
            f"intra_bandwidth_gbps = {p['intra_bandwidth_gbps']!r}",
            f"intra_latency_us = {p['intra_latency_us']!r}",
            "",
            *self._engine_toml(p),
            "",
            "# Half the median round trip of a protocol message over ZMQ PUSH/PULL between two",
            f"# processes (median RTT {self.control_rtt_s * 1e6:.1f} us, p90 {self.control_rtt_p90_s * 1e6:.1f} us, "
            f"{len(self.raw['control']['rtt_s'])} pings).",
            f"control_latency_us = {p['control_latency_us']!r}",
            "gpus_per_nic = 1",
            f"# hw/rank/kernels.py gather + scatter fitted together: {cp.bandwidth_Bps / 1e9:.2f} GB/s copied, "
            f"launch {cp.launch_s * 1e6:.1f} us,",
            f"# R^2 {cp.r2:.4f} (gather alone {self.gather.bandwidth_Bps / 1e9:.2f} GB/s, scatter "
            f"{self.scatter.bandwidth_Bps / 1e9:.2f} GB/s). The sim charges",
            "# launch + 2 * bytes / mem_bandwidth (read + write), so mem_bandwidth = 2 x copy rate.",
            f"mem_bandwidth_gbs = {p['mem_bandwidth_gbs']!r}",
            f"kernel_launch_us = {p['kernel_launch_us']!r}",
            f"gpu_tflops = {p['gpu_tflops']!r}  # {self.raw['kernels']['matmul']['dtype']} matmul "
            f"{self.raw['kernels']['matmul']['n']}^3",
            "# hw mode's prefill forward is a pattern fill: "
            f"{self.fill.latency_s * 1e6:.0f} us + KV bytes / {self.fill.bandwidth_Bps / 1e9:.3f} GB/s",
            "# (set prefill.tokens_per_s from it; see the sidecar's [forward]).",
            "",
            *self._host_toml(p),
        ]
        return "\n".join(lines) + "\n"

    def _where_toml(self) -> list[str]:
        """Where the numbers were measured, for the profile's head."""
        w = self.where
        if not self.inter_host:
            return [
                "# Two processes on this machine, real engine, both on one host: every number"
                " is same-host."
            ]
        return [
            f"# Writes, batches and control pings between two hosts: {w.get('hosts', '?')}, the",
            f"# writes over {w.get('writes_over', '?')}; kernels, posting, the event cost and the"
            " in-run runs on one host.",
        ]

    def _host_toml(self, p: dict[str, Any]) -> list[str]:
        """The host model's fields with what they come from (sim/host.py)."""
        q = json.dumps
        steps_note, copy_note = inrun_notes(self.raw.get("inrun"), self.inrun)
        cpu = self.inrun.get("cpu") or {}
        return [
            "# Host model (sim/host.py): ranks as hw-mode processes (loop, forward, copy threads).",
            f"# {p['host_cores']} usable cores; an idle engine process burns {self.engine_idle_cores:.3f} cores "
            "(its own threads);",
            f"# one event costs {self.event_s * 1e6:.1f} us of loop CPU: machine.handle() "
            f"{(self.event_s - self.message_cpu_s) * 1e6:.1f} us + one control message "
            f"{self.message_cpu_s * 1e6:.1f} us (the probe's CPU per ping / 2);",
            f"# other processes kept {self.background_cores:.2f} cores busy while the probe ran "
            "(background_cores: set it to the load of the runs you compare with);",
            "# the rank loop polls its threads every loop_poll_us, the forward thread runs at +forward_nice.",
            f"host_model = {q(p['host_model'])}",
            f"host_cores = {p['host_cores']!r}",
            f"engine_thread_cores = {p['engine_thread_cores']!r}",
            f"event_us = {p['event_us']!r}",
            f"fill_latency_us = {p['fill_latency_us']!r}",
            f"fill_bandwidth_gbs = {p['fill_bandwidth_gbs']!r}",
            f"background_cores = {p['background_cores']!r}",
            f"loop_poll_us = {p['loop_poll_us']!r}",
            f"forward_nice = {p['forward_nice']!r}",
            "# loop_rt: the in-run hw run's rank loops got a real-time class (summary.json loop_sched).",
            f"loop_rt = {str(p['loop_rt']).lower()}",
            "# write_on_cpu: a write is a copy on a CPU thread of the writer (host memory, loopback).",
            f"write_on_cpu = {str(p['write_on_cpu']).lower()}",
            f"write_cpu_threads = {p['write_cpu_threads']!r}",
            "# write_rt: the in-run hw run's engine threads got a real-time class (summary.json engine_sched).",
            f"write_rt = {str(p['write_rt']).lower()}",
            "# copy_op_us: a copy's fixed CPU in a rank, from the in-run run and its copy of a quarter",
            f"# the bytes (kvstage/calibrate/inrun.py fit_profile): {copy_note}",
            f"copy_op_us = {p['copy_op_us']!r}",
            *(
                [
                    "# The steps' CPU in those runs (summary.json job_cpu) over their time alone, not set",
                    "# (kvstage/calibrate/inrun.py cpu_factors says why): "
                    + ", ".join(f"{k} = {v:.3g}" for k, v in cpu.items() if k in CPU_FIELDS),
                ]
                if cpu
                else []
            ),
            "# In-run factors (kvstage/calibrate/inrun.py), fitted so the simulation of a short hw",
            f"# run (P1 -> D1, and its quarter-heads twin) gives their mean step times: {steps_note}",
            *(f"{name} = {p[name]!r}" for name, _ in FACTORS.values()),
        ]

    def _engine_toml(self, p: dict[str, Any]) -> list[str]:
        """The posting fields with what was measured (kvstage/calibrate/posting.py)."""
        notes = (
            self.posting.toml_lines()
            if self.posting is not None
            else [
                "# Posting: not measured (raw points without the posting probe); per request from the batches."
            ]
        )
        notes += [
            "# Hardware-mode ranks build descriptors per write and post from their one loop",
            "# thread: descriptor_reuse = false, post_threads = 1.",
        ]
        keys = [
            f"{c}_{k}"
            for c in ("inter", "intra")
            for k in ("per_request_us", "prep_per_request_us", "per_batch_us", "message_rate_mps")
        ]
        lines = [f"{k} = {p[k]!r}" for k in keys]
        return [*notes, *lines, f"post_threads = {p['post_threads']!r}", "descriptor_reuse = false"]


def inrun_notes(inrun: dict | None, fit: dict) -> tuple[str, str]:
    """The profile's comments on the in-run runs (`inrun`: as measure_inrun returned it;
    `fit`: fit_profile's): the step means fitted to, and the copies copy_op came from."""
    inrun = inrun or {}
    if not fit:
        why = "; ".join(inrun.get("errors") or []) or "not measured"
        steps = f"none ({why[:60]}), all 1."
    else:
        steps = (
            "hw "
            + ", ".join(f"{k} {fit['target'][k] * 1e3:.2f} ms" for k in FACTORS)
            + (
                " (the geometric mean of the two; copy: the first's)."
                if inrun.get("small")
                else "."
            )
        )
    small = inrun.get("small") or {}
    if not small.get("ok"):
        return steps, "not measured, 0."
    copy = (fit.get("target") or {}).get("copy", math.nan)
    return steps, (
        f"mean copy {copy * 1e3:.2f} ms at {inrun.get('copy_bytes', 0) / 1024:.0f} KiB, "
        f"{small['steps'].get('copy', math.nan) * 1e3:.2f} ms at {small.get('copy_bytes', 0) / 1024:.0f} KiB."
    )


def _fmt_bytes(n: int) -> str:
    if n >= MIB and n % MIB == 0:
        return f"{n // MIB} MiB"
    if n >= KIB and n % KIB == 0:
        return f"{n // KIB} KiB"
    return f"{n} B"


def analyse(raw: dict[str, Any], backend: str, device: str, quick: bool) -> Calibration:
    """Fit every measurement of `raw` (as `measure` returns it)."""
    wr = raw["write"]
    write = fit_latency_bandwidth(wr["sizes"], median_of(wr["seconds"]))
    b = raw["batch"]
    per = fit_per_request(
        b["counts"],
        median_of(b["seconds"]),
        op_bytes=b["op_bytes"],
        bandwidth_Bps=write.bandwidth_Bps,
    )
    rtts = raw["control"]["rtt_s"]
    k = raw["kernels"]
    gather = fit_copy(k["gather"]["bytes"], median_of(k["gather"]["seconds"]))
    gather_sub = fit_copy(k["gather_sub"]["bytes"], median_of(k["gather_sub"]["seconds"]))
    w = k["scatter"]["launches"]
    scatter = fit_copy(
        k["scatter"]["bytes"], median_of(k["scatter"]["seconds"]), [w] * len(k["scatter"]["bytes"])
    )
    copy = fit_copy(
        [*k["gather"]["bytes"], *k["scatter"]["bytes"]],
        [*median_of(k["gather"]["seconds"]), *median_of(k["scatter"]["seconds"])],
        [1] * len(k["gather"]["bytes"]) + [w] * len(k["scatter"]["bytes"]),
    )
    fill = fit_latency_bandwidth(k["fill"]["bytes"], median_of(k["fill"]["seconds"]))
    mm = k["matmul"]
    flops = 2.0 * mm["n"] ** 3 / statistics.median(mm["seconds"])
    cal = Calibration(
        backend=backend,
        device=device,
        quick=quick,
        host=socket.gethostname(),
        when=time.strftime("%Y-%m-%d %H:%M:%S"),
        raw=raw,
        write=write,
        per_request=per,
        control_rtt_s=float(statistics.median(rtts)),
        control_rtt_p90_s=float(np.percentile(rtts, 90)),
        gather=gather,
        gather_sub=gather_sub,
        scatter=scatter,
        copy=copy,
        fill=fill,
        fill_bytes_per_token=int(k["fill"]["bytes_per_token"]),
        gpu_flops=flops,
        posting=fit_posting(raw["posting"]) if raw.get("posting") else None,
        descriptors=fit_descriptors(raw["descriptors"]) if raw.get("descriptors") else None,
    )
    cal.inrun = fit_profile(cal.profile_fields(), raw.get("inrun"))
    return cal


def calibrate(
    backend: str,
    device: str = "cpu",
    *,
    quick: bool = False,
    plan: CalibrationPlan | None = None,
    progress: ProgressFn | None = None,
    hosts: dict[str, Any] | None = None,
) -> Calibration:
    """Measure on this machine and fit. Raises CalibrationError when it cannot measure.
    `hosts`: where the two measuring processes run (hw/probes/hosts.py)."""
    plan = plan or (CalibrationPlan.quick_plan() if quick else CalibrationPlan.full())
    raw = measure(backend, device, plan, progress, hosts)
    raw["plan"] = asdict(plan)
    return analyse(raw, backend, device, plan.quick)


def sidecar_path(profile_path: str | Path) -> Path:
    """Where the fit and raw points of a profile live: `<stem>.fit.json` beside it."""
    p = Path(profile_path)
    return p.with_name(p.stem + ".fit.json")


def check_profile_loads(path: str | Path) -> None:
    """Load a tiny scenario naming the profile by path: raises ScenarioError if refused."""
    from kvstage.shared.scenario import scenario_from_dict

    scenario_from_dict(
        {
            "model": {"layers": 2, "kv_heads": 2, "head_dim": 16, "params_b": 0.1},
            "prefill": {"tp": 1},
            "decode": {"tp": 1, "staging_pool_mb": 64},
            "links": {"profile": str(Path(path).resolve())},
        },
        source=f"calibrated profile {path}",
    )


def write_profile(cal: Calibration, path: str | Path) -> tuple[Path, Path]:
    """Write the profile TOML and its sidecar JSON; check that the profile loads."""
    path = Path(path)
    if path.suffix != ".toml":
        path = path.with_name(path.name + ".toml")
    path.parent.mkdir(parents=True, exist_ok=True)
    side = sidecar_path(path)
    path.write_text(cal.profile_toml(side.name))
    side.write_text(json.dumps(cal.sidecar(), indent=1) + "\n")
    check_profile_loads(path)
    return path, side


def load_sidecar(profile_path: str | Path) -> dict[str, Any]:
    return json.loads(sidecar_path(profile_path).read_text())


if __name__ == "__main__":  # pragma: no cover - `kvstage calibrate` is the entry point
    sys.exit("use: kvstage calibrate --backend nixl|mooncake")
