"""What keeps hardware mode's transfers at the engine's speed on a small CPU host.

- A NIXL agent's progress thread sleeps when idle (NIXL's Python API would make it spin
  a whole core per agent).
- The forward thread of a prefill rank on the CPU runs at a lower priority than the
  transfer path.
- benchmarks/hw_transfer.py sizes the slice run's room timeout from the workload.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from kvstage.hw.rank import prefill as prefill_rank
from kvstage.hw.transport import nixl as nixl_transport
from kvstage.hw.transport.base import probe_engine

REPO = Path(__file__).resolve().parents[1]


def _load_benchmark():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            "hw_transfer", REPO / "benchmarks" / "hw_transfer.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def _require_nixl() -> None:
    reason = probe_engine("nixl")
    if reason and not os.environ.get("CI"):
        pytest.skip(reason)


def test_nixl_agent_does_not_spin_when_idle(monkeypatch):
    _require_nixl()
    monkeypatch.delenv(nixl_transport.PROGRESS_DELAY_ENV, raising=False)
    transport = nixl_transport.NixlTransport(f"idle-{os.getpid()}")
    try:
        time.sleep(0.3)  # let the progress thread settle
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        used = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    finally:
        transport.close()
    # A spinning progress thread takes most of a core (0.93 measured); a sleeping one ~0.02.
    assert used < 0.3, f"an idle NIXL agent used {used:.2f} of a core"


def test_nixl_progress_delay_from_the_environment(monkeypatch):
    monkeypatch.setenv(nixl_transport.PROGRESS_DELAY_ENV, "250")
    assert nixl_transport.progress_delay_us() == 250
    monkeypatch.setenv(nixl_transport.PROGRESS_DELAY_ENV, "")
    assert nixl_transport.progress_delay_us() == nixl_transport.PROGRESS_DELAY_US
    monkeypatch.setenv(nixl_transport.PROGRESS_DELAY_ENV, "soon")
    with pytest.raises(ValueError, match=nixl_transport.PROGRESS_DELAY_ENV):
        nixl_transport.progress_delay_us()


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's"
)
def test_forward_thread_runs_at_a_lower_priority():
    seen: dict[str, int] = {}

    def worker() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        prefill_rank._lower_priority()
        seen["before"], seen["after"] = before, os.getpriority(os.PRIO_PROCESS, tid)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["after"] == min(19, seen["before"] + prefill_rank.FORWARD_NICE)
    assert (
        os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == seen["before"]
    )  # only that thread


def test_benchmark_sizes_the_slice_room_timeout_from_the_workload():
    bench = _load_benchmark()
    s = bench.scenario("nixl", "slice", 4, 2048)
    # 4 rooms x 4 chunks x 2 writers x (2 x 32 layers x 512 tokens): one request per token
    assert bench.slice_requests(s) == 4 * 4 * 2 * 2 * 32 * 512
    assert bench.payload_bytes(s) == 1 << 30
    timeout = bench.room_timeout_s(s)
    assert timeout >= bench.slice_requests(s) * bench.SLICE_S_PER_REQUEST
    assert timeout > 60.0  # the scenario's default, which Mooncake's slice run used to hit
    small = bench.scenario("nixl", "slice", 1, 512)
    assert bench.room_timeout_s(small) == pytest.approx(
        bench.MIN_ROOM_TIMEOUT_S + bench.slice_requests(small) * bench.SLICE_S_PER_REQUEST
    )
    applied = bench.scenario("nixl", "slice", 4, 2048, timeout)
    assert applied.transfer.room_timeout_s == pytest.approx(round(timeout))
