"""`kvstage hw` says where a run stands while it runs: ranks registered, rooms ended."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from conftest import require_engine
from rich.console import Console

from kvstage.hw.launch.launcher import RunProgress
from kvstage.run.hw_progress import HwProgress, rooms_ended

REPO = Path(__file__).resolve().parents[1]


def test_rooms_ended_is_the_least_rank_per_decode_instance():
    # decode TP2, two instances: decode0/1 are instance 0, decode2/3 instance 1
    rooms = {
        "decode0": (5, 10),
        "decode1": (3, 10),
        "decode2": (7, 9),
        "decode3": (9, 9),
        "prefill0": (10, 10),
    }
    assert rooms_ended(rooms, 2) == (3 + 7, 10 + 9)
    # an instance whose ranks have not all spoken yet does not count; none complete: nothing to say
    assert rooms_ended({"decode0": (5, 10), "decode1": (3, 10), "decode2": (7, 9)}, 2) == (3, 10)
    assert rooms_ended({"decode0": (5, 10), "prefill0": (1, 10)}, 2) is None


def _progress(**kw) -> RunProgress:
    base = {
        "registered": 3,
        "expected": 3,
        "started": True,
        "rooms": {},
        "reported": 0,
        "elapsed_s": 1.0,
    }
    return RunProgress(**{**base, **kw})


def test_off_a_terminal_it_prints_milestones_once():
    out = io.StringIO()
    console = Console(file=out, width=200)
    with HwProgress(console, decode_tp=1, total_rooms=8) as progress:
        progress(_progress(registered=1, started=False))
        progress(_progress(rooms={"decode0": (0, 8)}))
        progress(_progress(rooms={"decode0": (1, 8)}))  # under a quarter: nothing new
        progress(_progress(rooms={"decode0": (2, 8)}, elapsed_s=2.5))
        progress(_progress(rooms={"decode0": (2, 8)}))  # the same quarter again: said once
        progress(_progress(rooms={"decode0": (7, 8)}, elapsed_s=4.0))
    assert out.getvalue().splitlines() == [
        "hw: all 3 ranks registered after 1.0s; 8 rooms to run",
        "hw: rooms ended 2/8 after 2.5s",
        "hw: rooms ended 7/8 after 4.0s",
    ]


def test_on_a_terminal_it_is_a_live_bar():
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=True)
    with HwProgress(console, decode_tp=1, total_rooms=8) as progress:
        progress(_progress(registered=2, started=False))
        assert "ranks registered 2/3" in str(progress.bar.tasks[0].description)
        progress(_progress(rooms={"decode0": (5, 8)}))
        assert progress.bar.tasks[0].completed == 5


@pytest.mark.hw
@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_hardware_run_reports_its_progress(tmp_path):
    """Real ranks beat to the rendezvous with their room counts: the launcher's log shows them."""
    from kvstage.run.hwrun import run_hardware
    from kvstage.shared.scenario import load_scenario, scaled

    require_engine("nixl")
    # [hardware.scale_down] as `kvstage hw --scaled` applies it: 4 layers, 2k-token prompts
    # (the progress lines are under test, not how many bytes a room moves)
    s = scaled(
        load_scenario(
            REPO / "scenarios/llama3-8b-p4-d2.toml",
            overrides=[
                "prefill.tp=2",
                "decode.tp=1",
                "workload.requests=8",
                "workload.rate_per_s=2",
                "workload.arrival=fixed",
                "hardware.backend=nixl",
                "hardware.scale_down.enabled=true",
            ],
        )
    )
    out = io.StringIO()
    code, _ = run_hardware(
        s, out=tmp_path / "run", console=Console(file=out, width=200), timeout_s=150
    )
    text = out.getvalue()
    assert code == 0, text
    assert "hw: all 3 ranks registered after" in text and "8 rooms to run" in text
    # rooms arrive every 0.5 s over 3.5 s, and ranks beat every 0.5 s: some count came in before the end
    assert "hw: rooms ended " in text, text
