"""The conditions a run was taken under: how busy the host was with other work.

A hardware run on a loaded host measures the host, not the transfer path (the same
scenario differed by 9.7% per room on a quiet host and by 48.7% on a loaded one), so
every run records, in summary.json under `conditions`:

- `cores`: the host's logical CPUs (`os.cpu_count()`);
- `loadavg_before` / `loadavg_after`: the 1, 5 and 15 minute load averages
  (`os.getloadavg()`) just before and just after the run;
- `cpu_busy_s`: CPU time every process on the host spent during the run: the
  non-idle jiffies of /proc/stat's `cpu` line (user, nice, system, irq, softirq,
  steal; idle and iowait are idle), divided by the clock tick;
- `cpu_own_s`: CPU time of this run's own process tree over the same interval:
  `os.times()` user + system of this process plus that of its children it has
  waited for. A hardware run's rank processes are children of the launcher, which
  waits for every one of them before the run ends, so their CPU time counts as the
  run's own; with `--no-spawn` they are not, and the CPU the ranks on this host
  report for themselves is added instead (`cpu_ranks_here_s`); ranks forked by the
  fork server (hw/launch/forkserver.py) are its children, not the launcher's: the CPU time
  the fork server measured for each as it exited is added (`cpu_forked_s`); a
  simulation is this process alone;
- `cpu_other_s` = max(0, busy - own): what other processes took;
- `other_cpu_share`: cpu_other_s / (wall_s x cores), the share of the host's whole
  CPU capacity that other processes took during the run (0.5 = half the cores);
- `loaded`: other_cpu_share > LOADED_SHARE (0.25: other processes took more than a
  quarter of the cores). None where /proc/stat cannot be read (not Linux).

`compare` and `report` warn when a hardware run was `loaded` (recomputed from the
numbers, so a summary without the flag is judged the same way); a simulation's
figures are simulated time, which a busy host does not change, so it gets no warning.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

LOADED_SHARE = 0.25
_PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class Sample:
    """One reading of the clocks the conditions are computed from."""

    wall: float  # time.monotonic()
    busy_s: float | None  # host-wide non-idle CPU seconds since boot (None: no /proc/stat)
    own_s: float  # this process + waited-for children, user + system seconds
    loadavg: tuple[float, float, float] | None


def _host_busy_s() -> float | None:
    try:
        with _PROC_STAT.open() as fh:
            line = fh.readline()
    except OSError:
        return None
    parts = line.split()
    if not parts or parts[0] != "cpu":
        return None
    ticks = [int(x) for x in parts[1:9]]
    ticks += [0] * (8 - len(ticks))
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())  # type: ignore[return-value]
    except OSError:
        return None


def sample() -> Sample:
    """Read the clocks now (call once before the run, then `measure(before)` after)."""
    return Sample(time.monotonic(), _host_busy_s(), _own_s(), _loadavg())


def measure(
    before: Sample,
    after: Sample | None = None,
    *,
    spawned: bool = True,
    ranks_cpu_s: float = 0.0,
    forked_cpu_s: float = 0.0,
) -> dict:
    """summary.json's `conditions` for the interval from `before` to `after` (default: now).
    `spawned=False`: a hardware run whose ranks were started elsewhere (`--no-spawn`), so
    they are not this process's children; `ranks_cpu_s`, the CPU time those of them on
    this host report for themselves (`rank_cpu_here`), then counts as the run's own, not
    as other processes' (said in `note`). `forked_cpu_s`: the CPU time of the ranks the
    fork server started for this run (children of the fork server, not of this process)."""
    after = after or sample()
    cores = os.cpu_count() or 1
    wall = max(after.wall - before.wall, 0.0)
    own = max(after.own_s - before.own_s, 0.0) + (0.0 if spawned else ranks_cpu_s)
    own += forked_cpu_s
    out: dict = {
        "cores": cores,
        "loadavg_before": list(before.loadavg) if before.loadavg else None,
        "loadavg_after": list(after.loadavg) if after.loadavg else None,
        "wall_s": round(wall, 4),
        "cpu_busy_s": None,
        "cpu_own_s": round(own, 4),
        "cpu_other_s": None,
        "other_cpu_share": None,
        "loaded": None,
        "loaded_if_share_above": LOADED_SHARE,
    }
    if forked_cpu_s:
        out["cpu_forked_s"] = round(forked_cpu_s, 4)
    if not spawned:
        out["cpu_ranks_here_s"] = round(ranks_cpu_s, 4)
        out["note"] = (
            "ranks started elsewhere (--no-spawn): the CPU time the ranks on this host report for "
            "themselves counts as the run's own"
        )
    if before.busy_s is not None and after.busy_s is not None:
        busy = max(after.busy_s - before.busy_s, 0.0)
        other = max(busy - own, 0.0)
        share = other / (wall * cores) if wall > 0 else 0.0
        out.update(
            cpu_busy_s=round(busy, 4),
            cpu_other_s=round(other, 4),
            other_cpu_share=round(share, 4),
            loaded=share > LOADED_SHARE,
        )
    return out


def rank_cpu_here(reports: dict[str, dict], hostname: str | None = None) -> float:
    """CPU seconds the ranks on this host (same hostname: same kernel, network
    namespaces included) report for themselves (hw/rank/process.py `cpu_s`)."""
    here = socket.gethostname() if hostname is None else hostname
    return sum(float(r.get("cpu_s") or 0.0) for r in reports.values() if r.get("hostname") == here)


def is_loaded(conditions: dict | None) -> bool | None:
    """True when other processes took more than LOADED_SHARE of the cores during the
    run; None when the run recorded no such figure."""
    share = (conditions or {}).get("other_cpu_share")
    if share is None:
        return None
    return share > LOADED_SHARE


def all_realtime(classes) -> bool:
    """Whether every scheduling class a rank reported (hw/rank/process.py ThreadPriority: "rr:10",
    "fifo:5", "rr:5 (3 of 4 threads)", "normal (... refused ...)") is a real-time one;
    False for none."""
    classes = [str(c) for c in classes]
    return bool(classes) and all(c.startswith(("rr:", "fifo:")) for c in classes)


def loops_realtime(reports: dict[str, dict]) -> bool | None:
    """Whether every rank's loop ran in a real-time class (its report's loop_sched,
    hw/rank/priority.py LoopPriority); None without reports."""
    if not reports:
        return None
    return all_realtime(r.get("loop_sched", "") for r in reports.values())


def describe(conditions: dict | None, *, short: bool = False) -> str:
    """One line: cores, load before -> after, other processes' share, loaded or quiet."""
    if not conditions:
        return "not recorded"
    parts = [f"{conditions.get('cores', '?')} cores"]
    la, lb = conditions.get("loadavg_before"), conditions.get("loadavg_after")
    if la and lb:
        parts.append(f"load {la[0]:.2f} -> {lb[0]:.2f}")
    share = conditions.get("other_cpu_share")
    if share is not None:
        state = "LOADED" if is_loaded(conditions) else "quiet"
        parts.append(
            f"others {share:.0%}: {state}"
            if short
            else f"other processes took {share:.0%} of the cores: {state}"
        )
    return ", ".join(parts)


def loaded_warnings(runs: list[tuple[str, str, dict | None]]) -> list[str]:
    """A warning per measured run (label, mode, conditions) taken on a loaded host.
    A simulation is left out: its simulated times do not depend on the host (only
    its wall_s does), so a busy host does not make its figures wrong."""
    out = []
    for label, mode, cond in runs:
        if mode == "hw" and is_loaded(cond):
            out.append(
                f"{label} was taken on a loaded host: other processes took {cond['other_cpu_share']:.0%} of "
                f"the {cond.get('cores', '?')} cores (more than {LOADED_SHARE:.0%}); its timings measure the "
                "host as much as the transfer path"
            )
        if mode == "hw" and (cond or {}).get("loops_realtime") is False:
            out.append(
                f"{label} ran its rank loops without a real-time class (refused by the host, or "
                "KVSTAGE_LOOP_RT=0; summary.json loop_sched says which): its control messages waited for "
                "a CPU behind the copies, so its control latencies are not comparable with a run whose loops had one"
            )
    return out
