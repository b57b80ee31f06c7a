"""Simulation soak: 10,000 requests with 1% of every message fault of every type."""

from __future__ import annotations

from pathlib import Path

from kvstage.shared.faults import MESSAGE_NAMES
from kvstage.shared.scenario import load_scenario
from kvstage.sim.driver import Simulation

BASE = Path(__file__).resolve().parents[1] / "scenarios" / "faults" / "drop-rsp-watermark.toml"
N = 10_000


def test_soak_10k_requests_one_percent_of_each_message_fault():
    types = ", ".join(f"{name} = 0.01" for name in MESSAGE_NAMES.values())
    sets = [f"workload.requests={N}", "workload.rate_per_s=40", "transfer.room_timeout_s=2"]
    sets += [f"faults.{kind}={{ {types} }}" for kind in ("drop", "duplicate", "delay")]
    sim = Simulation(load_scenario(BASE, overrides=sets))
    result = sim.run()
    # the live checker saw no violation: safety, exactly once, no leak, liveness,
    # monotone watermark
    assert not result.violations, "\n".join(v.format() for v in result.violations[:5])
    # every rank ended every room: done, or failed with a reason
    for rt in sim.runtimes:
        assert rt.rooms_ended == N, rt.name
        assert rt.settled and rt.machine.settled
    for rt in sim.decode:
        ring = rt.machine.ring
        assert ring.empty and ring.watermark == ring.head
    assert all(reason.strip() for reason in result.failures.values())
    # lost RSP / WATERMARK are recovered; a lost CHUNK_READY or WRITER_DONE (no
    # acknowledgement in the protocol) fails its room by timeout: most rooms finish
    assert result.rooms_done > N // 2
    for kind in ("drop", "duplicate", "delay"):
        for name in MESSAGE_NAMES.values():
            assert result.faults_injected.get(f"{kind}:{name}", 0) > 0, f"{kind}:{name} never injected"
