"""The bandwidth verdict of a hardware run: what each pair achieved against its ceiling.

- **Ceiling**: before the first room, each prefill rank writes one large block into
  each decode peer's staging ring (unused until the first room: a writer overwrites
  its region before any chunk is ready, so the probe's bytes are never read), in a
  time slot of its own so that no two pairs share a link (hw/rank/prefill.py `_probe`,
  slots from the rendezvous), from a buffer the prefill registers for it. Best of
  PROBE_WRITES writes after one small warm-up write that sets up the connection.
- **Achieved**: a pair's bytes over the time its writes were busy: the union of the
  intervals of its `write` and `slice_write` trace rows (idle gaps between chunks are
  not counted against it), in GB/s (10^9 bytes per second) everywhere.
- **Verdict** (`kvstage hw --target F`): PASS when every pair achieved at least F of
  its own ceiling, naming the lowest pair either way.
- **Limit** (`limits`): per host, the bytes its busiest NIC moved (counters) over the
  time the writes touching that host were busy, against the NIC's link rate (the
  ranks' affinity records, hw/transport/affinity.py): at NIC_BOUND of the link or more the NIC
  was the limit; below, the engine was (its writes reached the given share of the
  engine's own ceiling). A virtual device (veth, loopback) has no link rate: the
  engine, and the host's CPUs that copy for it, are the limit there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

PROBE_BYTES = 64 << 20  # at most; less where a ring or send buffer is smaller
PROBE_MIN_BYTES = 1 << 20  # a smaller write measures latency, not bandwidth: no ceiling then
PROBE_WRITES = 3
PROBE_SLOT_S = 0.25  # one pair's slot: the warm-up and the writes, at >= 1 GB/s for 64 MiB x 3
WRITE_PHASES = ("write", "slice_write")
GB = 1e9
NIC_BOUND = 0.8  # [A] a NIC carrying >= 80% of its link rate while busy is the limit


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of [start, end] intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _achieved(records: Iterable[Any], key: Callable[[Any], Any]) -> dict[Any, dict[str, float]]:
    """Per `key` of the prefill write rows: bytes, busy_s and GB/s (bytes over busy time)."""
    spans: dict[Any, list[tuple[float, float]]] = {}
    moved: dict[Any, int] = {}
    for r in records:
        if r.role == "prefill" and r.phase in WRITE_PHASES and r.peer >= 0 and r.end > r.start:
            spans.setdefault(key(r), []).append((r.start, r.end))
            moved[key(r)] = moved.get(key(r), 0) + r.bytes
    out = {}
    for k in sorted(spans):
        busy = busy_seconds(spans[k])
        out[k] = {
            "bytes": moved[k],
            "busy_s": busy,
            "gbs": moved[k] / busy / GB if busy > 0 else 0.0,
        }
    return out


def achieved_by_pair(records: Iterable[Any]) -> dict[tuple[int, int], dict[str, float]]:
    """(prefill rank, decode rank) -> bytes, busy_s and GB/s of its writes (prefill rows)."""
    return _achieved(records, lambda r: (r.rank, r.peer))


def achieved_by_rank(records: Iterable[Any]) -> dict[int, dict[str, float]]:
    """prefill rank -> bytes, busy_s and GB/s of all its writes together."""
    return _achieved(records, lambda r: r.rank)


def probe_pairs(sessions: Any) -> list[tuple[int, int]]:
    """The (prefill rank, decode rank) pairs that write, in probe-slot order: every rank
    of the run computes the same list from the scenario (shared/cluster.py Sessions)."""
    return [(p, d) for p in range(sessions.ranks("prefill")) for d in sessions.all_targets(p)]


def probe_bytes(ring_bytes: int) -> int:
    """How much one probe write moves: PROBE_BYTES, or less where the decode's ring is
    smaller; 0 (no probe) when that is under PROBE_MIN_BYTES."""
    n = min(PROBE_BYTES, ring_bytes)
    return n if n >= PROBE_MIN_BYTES else 0


@dataclass(frozen=True)
class PairFigure:
    prefill: int
    decode: int
    achieved_gbs: float
    ceiling_gbs: float | None
    bytes: int

    @property
    def ratio(self) -> float | None:
        return self.achieved_gbs / self.ceiling_gbs if self.ceiling_gbs else None


def pair_figures(
    records: Iterable[Any], ceilings: Mapping[str, Mapping[str, Any]]
) -> list[PairFigure]:
    """Every pair that wrote, with its achieved rate and the ceiling its prefill measured
    (`ceilings`: prefill rank name -> decode rank name -> {"gbs": ...})."""
    out = []
    for (p, d), a in achieved_by_pair(records).items():
        ceiling = (ceilings.get(f"prefill{p}") or {}).get(f"decode{d}") or {}
        out.append(PairFigure(p, d, a["gbs"], ceiling.get("gbs"), int(a["bytes"])))
    return out


def verdict(figures: list[PairFigure], target: float) -> tuple[bool, str]:
    """(passed, the line that says so): every pair at or above `target` of its ceiling."""
    if not figures:
        return False, "bandwidth: FAIL: no pair wrote anything to judge"
    missing = [f for f in figures if f.ratio is None]
    if missing:
        names = ", ".join(f"prefill{f.prefill}->decode{f.decode}" for f in missing[:4])
        return False, (
            f"bandwidth: FAIL: no ceiling measured for {len(missing)} pair(s) ({names}): the probe "
            f"did not run or its write was under {PROBE_MIN_BYTES >> 20} MiB"
        )
    low = min(figures, key=lambda f: f.ratio)
    head = (
        f"lowest prefill{low.prefill}->decode{low.decode} {low.achieved_gbs:.2f} of "
        f"{low.ceiling_gbs:.2f} GB/s ({low.ratio:.0%})"
    )
    if low.ratio >= target:
        return (
            True,
            f"bandwidth: PASS: every pair reached at least {target:.0%} of its ceiling; {head}",
        )
    below = sum(1 for f in figures if f.ratio < target)
    return (
        False,
        f"bandwidth: FAIL: {below} of {len(figures)} pair(s) below {target:.0%} of their ceiling; {head}",
    )


def bandwidth_summary(
    records: list[Any], reports: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """summary.json's `bandwidth`: per pair achieved and ceiling GB/s, per prefill rank its
    achieved GB/s, and per host (network namespace, by its address) the bytes each NIC
    moved while its first rank ran."""
    ceilings = {name: r.get("ceiling") or {} for name, r in reports.items()}
    pairs = [
        {
            "prefill": f"prefill{f.prefill}",
            "decode": f"decode{f.decode}",
            "bytes": f.bytes,
            "achieved_gbs": round(f.achieved_gbs, 4),
            "ceiling_gbs": f.ceiling_gbs,
            "ratio": round(f.ratio, 4) if f.ratio is not None else None,
        }
        for f in pair_figures(records, ceilings)
    ]
    ranks = {
        f"prefill{r}": {
            "bytes": a["bytes"],
            "busy_s": round(a["busy_s"], 6),
            "achieved_gbs": round(a["gbs"], 4),
        }
        for r, a in achieved_by_rank(records).items()
    }
    nic: dict[str, Any] = {}
    for name, r in sorted(reports.items()):
        host = r.get("host", "?")
        if host not in nic and r.get("nic") is not None:
            nic[host] = {"read_by": name, "devices": r.get("nic") or {}}
    return {
        "unit": "GB/s (1e9 bytes/s)",
        "pairs": pairs,
        "ranks": ranks,
        "nic": nic,
        "limits": limits(records, reports, nic, pairs),
    }


def _host_busy_s(records: list[Any], reports: Mapping[str, Mapping[str, Any]], host: str) -> float:
    """How long writes from or to a rank on `host` were busy (the union of their rows)."""
    here = {n for n, r in reports.items() if r.get("host") == host}
    return busy_seconds(
        (r.start, r.end)
        for r in records
        if r.role == "prefill"
        and r.phase in WRITE_PHASES
        and r.end > r.start
        and (f"prefill{r.rank}" in here or f"decode{r.peer}" in here)
    )


def limits(
    records: list[Any],
    reports: Mapping[str, Mapping[str, Any]],
    nic: Mapping[str, Any],
    pairs: list[dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Per host: its busiest NIC's GB/s while the writes were busy, the link rate, and
    which was the limit, "nic" or "engine" (see the module docstring)."""
    ratios = [p["ratio"] for p in pairs if p.get("ratio") is not None]
    out = {}
    for host, n in sorted(nic.items()):
        devices = n.get("devices") or {}
        if not devices:
            continue
        dev = max(devices, key=lambda d: max(devices[d]["tx_bytes"], devices[d]["rx_bytes"]))
        moved = max(devices[dev]["tx_bytes"], devices[dev]["rx_bytes"])
        busy = _host_busy_s(records, reports, host)
        links = [
            (r.get("affinity") or {}).get("link_gbs")
            for r in reports.values()
            if r.get("host") == host and (r.get("affinity") or {}).get("nic") == dev.split("/")[0]
        ]
        link = next((x for x in links if x), None)
        gbs = moved / busy / GB if busy > 0 else 0.0
        out[host] = {
            "device": dev,
            "bytes": moved,
            "busy_s": round(busy, 6),
            "nic_gbs": round(gbs, 4),
            "link_gbs": link,
            "limit": "nic" if link and gbs >= NIC_BOUND * link else "engine",
            "lowest_of_ceiling": round(min(ratios), 4) if ratios else None,
        }
    return out


def limit_lines(lims: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per host: what carried the bytes and whether the NIC or the engine was the limit."""
    out = []
    for host, x in lims.items():
        link = (
            f"{x['nic_gbs'] / x['link_gbs']:.0%} of its {x['link_gbs']:.2f} GB/s link"
            if x["link_gbs"]
            else "no link rate (a virtual device, or sysfs does not say)"
        )
        ceiling = (
            f"; the writes reached {x['lowest_of_ceiling']:.0%} of the engine's ceiling (lowest pair)"
            if x["lowest_of_ceiling"] is not None
            else ""
        )
        who = "the NIC" if x["limit"] == "nic" else "the engine, not the NIC"
        out.append(
            f"limit on {host}: {who}: {x['device']} carried {x['nic_gbs']:.2f} GB/s while the writes "
            f"were busy, {link}{ceiling}"
        )
    return out
