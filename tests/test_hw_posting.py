"""hardware.posting: which thread of a prefill rank does a write's descriptor work
(hw/rank/prefill.py). Real ranks, NIXL over loopback: every byte checked at the decode,
and the rank's report says which thread built and posted each write."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import require_engine
from rich.console import Console
from test_hw import write_scenario

from kvstage.run import hwrun
from kvstage.run.rundir import read_summary
from kvstage.shared.layout import room_pages
from kvstage.shared.scenario import load_scenario
from kvstage.shared.workload import generate_requests

pytestmark = [pytest.mark.hw, pytest.mark.timeout(300)]


def _expected_bytes(s) -> int:
    """Every byte of every room on every decode rank (the decode verifies them all)."""
    g = s.geometry()
    per_token = 2 * g.layers * g.decode_heads * g.head_dim * g.dtype_bytes
    return (
        sum(
            g.decode_tp * room_pages(r.prompt_tokens, r.prefix_tokens, g.page_size) * g.page_size
            for r in generate_requests(s)
        )
        * per_token
    )


def _run(tmp_path: Path, path: str, posting: str, monkeypatch) -> tuple[int, dict, dict]:
    """(exit code, summary, prefill rank name -> its report's posting figures)."""
    f = write_scenario(tmp_path, 2, 4, 8, path=path)
    s = load_scenario(f, overrides=["hardware.backend=nixl", f"hardware.posting={posting}"])
    reports: dict[str, dict] = {}
    launch = hwrun.launch

    def keep_reports(*args, **kw):  # the real launcher; its rank reports kept for the test
        result = launch(*args, **kw)
        reports.update(result.reports)
        return result

    monkeypatch.setattr(hwrun, "launch", keep_reports)
    code, run_dir = hwrun.run_hardware(
        s, out=tmp_path / "run", timeout_s=240, console=Console(width=120)
    )
    summary = read_summary(run_dir)
    assert code == 0, summary.get("errors")
    assert summary["requests_failed"] == 0 and summary["bytes_wrong"] == 0
    assert summary["bytes_verified"] == _expected_bytes(s)
    posting = {n: r["posting"] for n, r in reports.items() if n.startswith("prefill")}
    assert len(posting) == 2
    return code, summary, posting


@pytest.mark.parametrize(
    "path,posting",
    [("slice", "lane"), ("slice", "loop"), ("slice", "worker"), ("staging", "worker")],
)
def test_posting_thread_and_every_byte(tmp_path, monkeypatch, path, posting):
    require_engine("nixl")
    _, summary, ranks = _run(tmp_path, path, posting, monkeypatch)
    writes = 0
    for name, p in ranks.items():
        assert p["mode"] == posting
        threads, loop = p["threads"], p["loop_thread"]
        assert threads, f"{name} posted nothing"
        assert set(p["seconds"]) == set(threads)  # the time each posting thread spent
        writes += sum(threads.values())
        if posting == "worker":  # every write built and posted on the rank's posting thread
            assert all(t.startswith(f"{name}-post") for t in threads), threads
            assert loop not in threads
        else:  # on the loop thread
            assert set(threads) == {loop}
        # NIXL's descriptors made on the posting thread only with "loop" (else on the lane)
        assert p["prepared_inline"] == (sum(threads.values()) if posting == "loop" else 0)
    if path == "slice":  # many requests per write: the slice path, not one block
        assert summary["transfer_requests_posted"] > 10 * writes
