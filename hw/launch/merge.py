"""One hardware run out of its ranks' reports: the merged trace, the clocks, the
hardware-only figures of summary.json; and whether this machine can run ranks on a
device at all (`device_problem`, asked before any rank is spawned).

Each rank reports its trace rows, counters and scheduling classes to the launcher at
the end of the run (hw/rank/process.py); `kvstage.run.hwrun` turns the merged run into the
same RunResult a simulation gives.
"""

from __future__ import annotations

from typing import Any

from kvstage.hw.transport.jobcpu import merge as merge_job_cpu
from kvstage.shared.scenario import Scenario
from kvstage.shared.trace import TraceRecord

__all__ = [
    "clock_tolerance",
    "cuda_devices",
    "device_problem",
    "hardware_figures",
    "merge_records",
]


def device_problem(device: str) -> str | None:
    """Why this machine cannot run ranks on `device`, or None: said before any rank is
    spawned, instead of every rank failing on its own."""
    if not device.startswith("cuda"):
        return None
    cpu_build = _cpu_only_torch()
    if cpu_build is not None:  # known without importing torch (2.4 s)
        return (
            f"hardware.device = {device!r} but torch sees no CUDA device here (torch {cpu_build})"
        )
    import torch

    if not torch.cuda.is_available():
        return f"hardware.device = {device!r} but torch sees no CUDA device here (torch {torch.__version__})"
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"hardware.device = {device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def cuda_devices() -> int:
    """How many CUDA devices torch sees here (0 for a CPU-only build, told without
    importing torch)."""
    if _cpu_only_torch() is not None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cpu_only_torch() -> str | None:
    """The version of the installed torch where its package says it is a CPU-only build
    (the `+cpu` local version of PyTorch's CPU wheels, torch==2.13.0 here), read from its
    metadata without importing it; None otherwise (torch is asked)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torch")
    except PackageNotFoundError:
        return None
    return found if found.endswith("+cpu") else None


def merge_records(reports: dict[str, dict]) -> list[TraceRecord]:
    """Every rank's trace rows in one list, by end time (then start, role, rank)."""
    records: list[TraceRecord] = []
    for rep in reports.values():
        records.extend(TraceRecord(*row) for row in rep.get("records", []))
    records.sort(key=lambda r: (r.end, r.start, r.role, r.rank))
    return records


def _clocks(reports: dict[str, dict]) -> dict[str, dict]:
    """Each rank's address and clock against the launcher's, measured at the rendezvous
    (launcher time = rank time + offset) and taken out of its trace times when it is
    larger than its uncertainty (`clock_applied_s`)."""
    keys = ("host", "clock_offset_s", "clock_uncertainty_s", "clock_applied_s")
    return {name: {k: r[k] for k in keys if k in r} for name, r in sorted(reports.items())}


def clock_tolerance(reports: dict[str, dict]) -> float:
    """How far apart the ranks' trace clocks may be: twice the largest uncertainty of an
    offset that was applied (two ranks, each off by up to its own), 0 on one clock."""
    applied = [
        r.get("clock_uncertainty_s", 0.0) for r in reports.values() if r.get("clock_applied_s")
    ]
    return 2 * max(applied, default=0.0)


def hardware_figures(scenario: Scenario, by_rank: dict[str, dict]) -> dict[str, Any]:
    """summary.json's hardware-only figures, summed over the ranks' reports."""
    hw = scenario.hardware
    reports = [r for _, r in sorted(by_rank.items())]

    def total(key: str) -> int:
        return sum(r.get(key, 0) for r in reports)

    return {
        "backend": hw.backend,
        "device": hw.device,
        "verify": hw.verify,
        "bytes_verified": total("bytes_verified"),
        "bytes_wrong": total("bytes_wrong"),
        "wrong_rooms": sorted({room for r in reports for room in r.get("wrong_rooms", [])}),
        # writer blocks that failed their write tag (hw/rank/writemac.py): never scattered,
        # their rooms failed; and the bytes the decodes checked against tags
        "verify_writes": scenario.transfer.verify_writes,
        # staging blocks encrypted in the ring (hw/rank/cipher.py): the cipher ("none" on
        # the slice path, which moves pool to pool), and the bytes the decodes decrypted
        # out of their rings
        "encrypt_writes": scenario.transfer.ring_cipher,
        "bytes_decrypted": total("bytes_decrypted"),
        "writes_rejected": total("writes_rejected"),
        "bytes_checksummed": total("bytes_checksummed"),
        # of them, hashed by the moves themselves (a GPU pool's gather and scatter)
        "bytes_hashed_in_moves": total("bytes_hashed_in_moves"),
        "transfer_requests_posted": total("requests_posted"),
        "malformed_messages": total("malformed"),
        "unauthenticated_messages": total(
            "unauthenticated"
        ),  # no valid MAC (control plane security)
        "oversize_messages": total("oversize"),
        # authenticated, but speaking for another rank than its signer (or to another rank)
        "misattributed_messages": total("misattributed"),
        "replayed_messages": total(
            "replayed"
        ),  # authenticated but not newer than their sender's last
        # control connections refused at the handshake: a client key of no peer (ZAP)
        "refused_connections": total("refused_connections"),
        "clocks": _clocks(by_rank),
        "clock_tolerance_s": clock_tolerance(by_rank),
        # each rank's loop scheduling class (hw/rank/priority.py LoopPriority): "rr:10", or
        # "normal (...)" where the host refused it; the delivery latency depends on it
        "loop_sched": {name: r.get("loop_sched", "?") for name, r in sorted(by_rank.items())},
        # the transfer engine's threads' class (hw/rank/priority.py WritePriority: rr:5 for Mooncake's)
        "engine_sched": {name: r.get("engine_sched", "?") for name, r in sorted(by_rank.items())},
        # the write lanes' class: normal by default, "rr:5 per batch, 1 host slot (N raised,
        # M normal)" with KVSTAGE_WRITE_RT_LANES=slots (hw/rank/priority.py WritePriority)
        "lane_sched": {name: r.get("lane_sched", "?") for name, r in sorted(by_rank.items())},
        # what the ranks' fills, gathers, scatters and NIXL's lane copies cost in CPU, summed
        # per kind (hw/transport/jobcpu.py): kvstage calibrate's fill/copy/write CPU
        "job_cpu": merge_job_cpu([r.get("job_cpu") or {} for r in reports]),
        # per rank, what its engine chose to move the bytes (hw/transport/used.py)
        "transport_used": {
            name: r.get("transport_used") or {} for name, r in sorted(by_rank.items())
        },
    }
