"""Hardware mode for real: rank processes moving bytes with NIXL and Mooncake.

Every run here starts real processes, moves real bytes through the engine over
loopback and verifies every byte of every room at the decode.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import require_engine
from rich.console import Console

from kvstage.run.hwrun import run_hardware
from kvstage.run.rundir import read_summary
from kvstage.run.tracefile import read_records
from kvstage.shared.invariants import check_records
from kvstage.shared.scenario import load_scenario

pytestmark = [pytest.mark.hw, pytest.mark.timeout(420)]


def write_scenario(tmp_path: Path, P: int, D: int, heads: int, **extra) -> Path:
    faults = extra.pop("faults", "")
    requests = extra.pop("requests", 3)
    path = extra.pop("path", "staging")
    text = f"""
name = "hw-p{P}-d{D}-h{heads}"
[model]
layers = 2
kv_heads = {heads}
head_dim = 16
params_b = 0.1
dtype = "bf16"
[prefill]
tp = {P}
chunked_prefill_size = 64
[decode]
tp = {D}
page_size = 16
staging_pool_mb = 1
prefix_tokens = 16
[transfer]
path = "{path}"
room_timeout_s = 30
[links]
profile = "loopback-cpu"
[workload]
requests = {requests}
arrival = "fixed"
rate_per_s = 20
prompt = "uniform"
prompt_min = 150
prompt_max = 300
seed = 3
[faults]
{faults}
"""
    f = tmp_path / "scenario.toml"
    f.write_text(text)
    return f


def run(tmp_path: Path, backend: str, scenario_file: Path, overrides=(), **kw) -> tuple[int, Path]:
    s = load_scenario(scenario_file, overrides=[f"hardware.backend={backend}", *overrides])
    return run_hardware(s, out=tmp_path / "run", timeout_s=300, console=Console(width=120), **kw)


def expected_bytes(s) -> int:
    """Every byte of every room's KV on every decode rank: what a run verifies."""
    from kvstage.shared.layout import room_pages
    from kvstage.shared.workload import generate_requests

    g = s.geometry()
    expected = 0
    for req in generate_requests(s):
        pages = room_pages(req.prompt_tokens, req.prefix_tokens, g.page_size)
        expected += (
            g.decode_tp
            * pages
            * g.page_size
            * 2
            * g.layers
            * g.decode_heads
            * g.head_dim
            * g.dtype_bytes
        )
    return expected


GEOMETRIES = {
    "fan-in-p2-d1": (2, 1, 8),
    "fan-in-p4-d2": (4, 2, 8),
    "fan-out-p1-d2": (1, 2, 8),
    "fan-out-p2-d4": (2, 4, 8),
    "replication-p4-d2-h2": (4, 2, 2),
}


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
@pytest.mark.parametrize("path", ["staging", "slice"])
@pytest.mark.parametrize("case", list(GEOMETRIES))
def test_every_byte_lands(tmp_path, backend, path, case):
    require_engine(backend)
    P, D, H = GEOMETRIES[case]
    code, run_dir = run(tmp_path, backend, write_scenario(tmp_path, P, D, H, path=path))
    summary = read_summary(run_dir)
    assert code == 0, summary.get("errors")
    assert summary["requests_done"] == 3 and summary["requests_failed"] == 0
    assert summary["bytes_wrong"] == 0
    # every transferred byte of every room on every decode rank was checked
    expected = expected_bytes(load_scenario(run_dir / "scenario.toml"))
    assert summary["bytes_verified"] == expected
    # the write tag (transfer.verify_writes = "mac", the default) on both paths: every
    # writer block checked (replicated heads: once per writer), none rejected
    assert summary["verify_writes"] == "mac"
    assert summary["writes_rejected"] == 0 and summary["bytes_checksummed"] >= expected
    assert all(v == 0 for v in summary["ring_used_at_end"].values())
    # the write cipher (transfer.encrypt_writes = "chacha20", the default): every staged
    # byte decrypted out of the ring; the slice path moves pool to pool, in plaintext
    cipher = {"staging": "chacha20", "slice": "none"}[path]
    assert summary["encrypt_writes"] == cipher
    assert (summary["bytes_decrypted"] > 0) == (path == "staging"), summary["bytes_decrypted"]
    if path == "slice":
        assert summary["transfer_requests"]["total"] > 10 * 3 * D
    # every rank says what its engine chose: on one host, NIXL's UCX writes with CMA and
    # Mooncake (no HCA here) over TCP
    used = summary["transport_used"]
    assert set(used) == {f"prefill{r}" for r in range(P)} | {f"decode{r}" for r in range(D)}
    for name, u in used.items():
        if backend == "nixl":
            assert u["source"] == "UCX_PROTO_INFO" and u["over"] == "same-host", (name, u)
            if name.startswith("prefill"):
                assert u["writes"] == {"intra-node": ["cma/memory"]}, (name, u)
        else:
            assert u["protocol"] == "tcp" and u["over"] == "tcp" and u["hcas"] == [], (name, u)


def test_wrong_head_offset_is_caught(tmp_path):
    require_engine("nixl")
    f = write_scenario(tmp_path, 4, 2, 8)
    helper = Path(__file__).parent / "helpers" / "corrupt_decode_rank.py"
    code, run_dir = run(tmp_path, "nixl", f, rank_wrapper=[sys.executable, str(helper)])
    summary = read_summary(run_dir)
    assert code == 1
    assert summary["bytes_wrong"] > 0 and summary["wrong_rooms"]


def test_abort_mid_transfer_releases_staging_and_others_finish(tmp_path):
    require_engine("mooncake")
    f = write_scenario(
        tmp_path,
        2,
        1,
        8,
        requests=4,
        faults='abort = [{room = 1, phase = "write"}]\n[expect]\nfailed_rooms = [1]',
    )
    code, run_dir = run(tmp_path, "mooncake", f)
    summary = read_summary(run_dir)
    assert code == 0, summary.get("errors")
    assert summary["requests_failed"] == 1 and summary["requests_done"] == 3
    assert "1" in summary["failures"] and "mid-transfer" in summary["failures"]["1"]
    assert summary["bytes_wrong"] == 0
    assert all(v == 0 for v in summary["ring_used_at_end"].values())
    _, records = read_records(run_dir)
    assert not check_records(records)


def test_killed_rank_its_rooms_fail_the_others_finish_nothing_left(tmp_path):
    """A rank killed mid-run: its peers' failure detectors declare it lost, its rooms fail
    with that reason, the surviving ranks finish the run and report; the run exits 1
    naming the dead rank; no process is left."""
    require_engine("nixl")
    f = write_scenario(tmp_path, 2, 1, 8, requests=100)  # 5 s of arrivals: killed mid-run
    procs_seen = {}

    def on_started(address, procs):
        procs_seen.update(procs)

        def killer():
            # every rank registered: let the run get going, then kill one
            time.sleep(1.5)
            victim = procs["prefill1"]
            if victim.poll() is None:
                os.kill(victim.pid, signal.SIGKILL)

        threading.Thread(target=killer, daemon=True).start()

    t = time.monotonic()
    code, run_dir = run(tmp_path, "nixl", f, on_started=on_started)
    elapsed = time.monotonic() - t
    summary = read_summary(run_dir)
    assert code == 1
    assert any("prefill1" in e and "died" in e for e in summary["errors"]), summary["errors"]
    # the survivors finished: rooms before the kill done, the rest failed naming the loss
    assert summary["requests_done"] > 0 and summary["requests_failed"] > 0
    assert summary["requests_done"] + summary["requests_failed"] == 100
    assert all(
        "prefill rank 1" in r or "gone" in r or "stopped answering" in r
        for r in summary["failures"].values()
    ), summary["failures"]
    assert summary["bytes_wrong"] == 0
    # the invariants are checked on a failed run too, over the survivors' records
    assert summary["unreported_ranks"] == ["prefill1"]
    assert summary["invariant_violations"] == 0
    assert elapsed < 120
    assert procs_seen and all(p.poll() is not None for p in procs_seen.values())


def test_hw_trace_reads_like_a_sim_trace(tmp_path):
    require_engine("nixl")
    from kvstage.run.simrun import run_simulation

    f = write_scenario(tmp_path, 2, 1, 8)
    code, run_dir = run(tmp_path, "nixl", f)
    assert code == 0
    mode, records = read_records(run_dir)
    assert mode == "hw" and records
    assert not check_records(records)
    s = load_scenario(f)
    assert run_simulation(s, out=tmp_path / "sim", progress=False, console=Console(width=120)) == 0
    sim_mode, sim_records = read_records(tmp_path / "sim")
    assert sim_mode == "sim"
    # same row type and phase vocabulary, the same rooms done
    from kvstage.shared.trace import PHASES

    assert {r.phase for r in records} <= set(PHASES) and {r.phase for r in sim_records} <= set(
        PHASES
    )
    assert {r.phase for r in records} >= {
        "req",
        "rsp",
        "gather",
        "write",
        "scatter",
        "free",
        "room_done",
    }
    assert {r.room for r in records if r.phase == "room_done"} == {
        r.room for r in sim_records if r.phase == "room_done"
    }


def _forwards(records) -> dict[int, list[tuple[float, float, frozenset[int]]]]:
    """Each prefill rank's forwards from its "compute" rows (start: the forward's start,
    end: its chunks' ForwardDone), in order: (start, end, the rooms in it)."""
    spans: dict[tuple[int, float, float], set[int]] = {}
    for r in records:
        if r.phase == "compute" and r.role == "prefill":
            spans.setdefault((r.rank, r.start, r.end), set()).add(r.room)
    out: dict[int, list[tuple[float, float, frozenset[int]]]] = {}
    for (rank, start, end), rooms in sorted(spans.items()):
        out.setdefault(rank, []).append((start, end, frozenset(rooms)))
    return out


def test_forward_delay_packs_queued_short_prompts_as_the_simulator(tmp_path):
    """hardware.forward_delay: the chunks queued when a forward starts share it by the
    simulator's rule (shared/serving/prefill_batch.py): room 0's full chunk alone, then
    the six short prompts that arrived during it, four a forward (16 computed tokens
    each, chunk_tokens 64) and the last two; every byte lands right."""
    require_engine("nixl")
    from kvstage.run.simrun import run_simulation

    trace = tmp_path / "arrivals.csv"
    # room 0: one full chunk (64 tokens computed past the 16-token prefix), alone
    # whatever else is queued, 1 s at 64 tokens/s; the six short ones arrive 0.05 s in,
    # all fed in one loop turn (hw/rank/process.py), before that forward can end
    trace.write_text("arrival_s,prompt_tokens\n0.0,80\n" + "0.05,20\n" * 6)
    overrides = [
        'workload.arrival="trace"',
        'workload.prompt="trace"',
        f'workload.trace="{trace}"',
        "hardware.forward_delay=true",
        "prefill.tokens_per_s=64",
    ]
    f = write_scenario(tmp_path, 2, 1, 8, requests=7)
    code, run_dir = run(tmp_path, "nixl", f, overrides)
    summary = read_summary(run_dir)
    assert code == 0, summary.get("errors")
    assert summary["requests_done"] == 7 and summary["requests_failed"] == 0
    assert summary["bytes_wrong"] == 0
    s = load_scenario(f, overrides=overrides)
    assert summary["bytes_verified"] == expected_bytes(s)
    _, records = read_records(run_dir)
    assert not check_records(records)
    assert summary["invariant_violations"] == 0
    assert run_simulation(s, out=tmp_path / "sim", progress=False, console=Console(width=120)) == 0
    _, sim_records = read_records(tmp_path / "sim")
    hw, sim = _forwards(records), _forwards(sim_records)
    packs = [frozenset({0}), frozenset({1, 2, 3, 4}), frozenset({5, 6})]
    for forwards in (*hw.values(), *sim.values()):
        # each chunk of a forward has the forward's start and end: one row a forward
        assert [rooms for _, _, rooms in forwards] == packs, forwards
    assert sorted(hw) == sorted(sim) == [0, 1]


def test_lost_and_duplicated_messages_on_real_engines(tmp_path):
    """Drop a fifth of STAGING_RSP and WATERMARK, duplicate CHUNK_READY: retries and
    idempotence bring every room home, every byte right, nothing leaked."""
    require_engine("nixl")
    faults = (
        "seed = 5\n"
        "drop = { STAGING_RSP = 0.2, WATERMARK = 0.2 }\n"
        "duplicate = { CHUNK_READY = 0.3, STAGING_REQ = 0.2 }\n"
        "delay = { WRITER_DONE = 0.5 }\n"
    )
    f = write_scenario(tmp_path, 2, 1, 8, requests=4, faults=faults)
    code, run_dir = run(tmp_path, "nixl", f)
    summary = read_summary(run_dir)
    assert code == 0, summary.get("errors")
    assert summary["requests_done"] == 4 and summary["bytes_wrong"] == 0
    assert all(v == 0 for v in summary["ring_used_at_end"].values())
    _, records = read_records(run_dir)
    assert not check_records(records)


@pytest.mark.parametrize("how", ["fork", "spawn"])
@pytest.mark.slow
def test_ranks_start_by_fork_or_by_spawn_as_set(tmp_path, monkeypatch, how):
    """$KVSTAGE_RANK_START: ranks forked from the fork server (the default) or spawned
    as new interpreters; the run is the same, and forked ranks' CPU time is the run's
    own (conditions: `cpu_forked_s`, measured by the fork server)."""
    import subprocess

    from kvstage.hw.launch.forkserver import ForkedProcess

    require_engine("nixl")
    monkeypatch.setenv("KVSTAGE_RANK_START", how)
    f = write_scenario(tmp_path, 1, 1, 8)
    seen = {}
    code, run_dir = run(tmp_path, "nixl", f, on_started=lambda _a, procs: seen.update(procs))
    summary = read_summary(run_dir)
    assert code == 0 and summary["requests_done"] == 3 and summary["bytes_wrong"] == 0
    kind = ForkedProcess if how == "fork" else subprocess.Popen
    assert sorted(seen) == ["decode0", "prefill0"]
    assert all(isinstance(p, kind) for p in seen.values()), seen
    forked = summary["conditions"].get("cpu_forked_s")
    assert (forked is not None and forked > 0) if how == "fork" else forked is None


def test_a_bad_rank_start_setting_fails_the_run_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTAGE_RANK_START", "exec")
    f = write_scenario(tmp_path, 1, 1, 8)
    code, run_dir = run(tmp_path, "nixl", f)
    assert code == 1
    errors = read_summary(run_dir)["errors"]
    assert any("KVSTAGE_RANK_START='exec'" in e and "fork, spawn" in e for e in errors), errors
