"""An adversary that holds the run's secret: what plausibility checks stop, on real
transfers with every byte verified.

Authentication keeps out anyone without the secret (tests/test_control_auth.py). A
peer that has it (a buggy or compromised rank) can still send messages that could
not be true; each must be dropped and counted, and no honest room may suffer: every
room done, 0 bytes wrong, no invariant violated. Forged while a NIXL run is under way:

- WATERMARK with a round far beyond any region handed out, and one past the pool;
- STAGING_RSP with a region outside the staging pool, or of the wrong size;
- CHUNK_READY off the room's chunk grid, beyond its chunks, or from a rank that is
  not a writer of that decode rank;
- WRITER_DONE claiming the wrong chunk count;
- ABORT, STAGING_REQ and CHUNK_READY for rooms that are not in the run.

(A well-timed CHUNK_READY with the right grid from a real writer's identity, or an
ABORT of a real room from its real decode rank, cannot be told from the truth by any
check: only the secret keeps those out.)
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from conftest import require_engine
from test_control_auth import assert_every_room_right
from test_hw import write_scenario

from kvstage.hw.control import ControlPlane, read_secret_file
from kvstage.hw.launch import launch
from kvstage.hw.rendezvous import RendezvousClient
from kvstage.shared.layout import room_pages
from kvstage.shared.protocol import Abort, ChunkReady, StagingReq, StagingRsp, Watermark, WriterDone
from kvstage.shared.scenario import load_scenario
from kvstage.shared.workload import generate_requests

pytestmark = [pytest.mark.hw, pytest.mark.timeout(420)]

FOREIGN = 10**6  # room ids far outside the workload


def _forgeries(s, i: int) -> dict[str, list]:
    """Messages that cannot be true, by destination rank: for every room of the run, so
    that for each some arrive before the true ones (the first STAGING_RSP stands)."""
    out: dict[str, list] = {}
    for room in generate_requests(s):
        for name, msgs in _forged_for(s, room, i).items():
            out.setdefault(name, []).extend(msgs)
    return out


def _forged_for(s, room, i: int) -> dict[str, list]:
    g = s.geometry()
    pool = s.pool_bytes
    pages = room_pages(room.prompt_tokens, room.prefix_tokens, g.page_size)
    chunks = g.chunks(pages)
    size = g.region_bytes(chunks[0].num_pages)
    to_prefill = []
    for p in range(g.prefill_tp):
        to_prefill += [
            Watermark(round=10**9 + i, tail=64, prefill_rank=p, decode_rank=0),
            Watermark(round=1, tail=pool + 4096, prefill_rank=p, decode_rank=0),
            StagingRsp(room.room, 0, 4 * pool, 9, 4 * pool + size, False, p, 0),
            StagingRsp(room.room, 0, 0, 9, size + 4096, False, p, 0),
            Abort(FOREIGN + i, p, 0, "forged: not a room of this run"),
        ]
    to_decode = [
        ChunkReady(room.room, 0, chunks[0].page_start + 7, chunks[0].num_pages, 0, 0, 0),
        ChunkReady(room.room, len(chunks) + 3, 0, 1, 1, 1, 0),
        ChunkReady(
            room.room, 0, chunks[0].page_start, chunks[0].num_pages, 5, 0, 0
        ),  # not a writer
        WriterDone(room.room, len(chunks) + 5, 0, 0, 0),
        StagingReq(FOREIGN + i, 0, 4, 0, 0),
        ChunkReady(FOREIGN + i, 0, 0, 4, 1, 1, 0),
        Abort(FOREIGN + i, 0, 0, "forged"),
    ]
    names = {
        f"prefill{p}": [m for m in to_prefill if m.prefill_rank == p] for p in range(g.prefill_tp)
    }
    names["decode0"] = to_decode
    return names


def test_an_adversary_with_the_secret_harms_no_room(tmp_path):
    require_engine("nixl")
    s = load_scenario(
        write_scenario(tmp_path, 2, 1, 8, requests=30), overrides=["hardware.backend=nixl"]
    )
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "scenario.toml").write_text(s.to_toml())
    sent = {"messages": 0}

    def adversary(address: str) -> None:
        secret = read_secret_file(run_dir / "run.secret")
        client = RendezvousClient(address, secret=secret)
        table, _ = client.query(10)
        client.close()
        forger = ControlPlane(secret=secret)
        for name, info in table.items():
            forger.connect(name, info.control)
        try:
            for i in range(60):
                for name, msgs in _forgeries(s, i).items():
                    for msg in msgs:
                        forger.send(name, msg)
                        sent["messages"] += 1
                time.sleep(0.03)
        except zmq.ZMQError:
            pass  # the run ended first
        finally:
            forger.close()

    def on_started(address, procs):
        threading.Thread(target=adversary, args=(address,), daemon=True).start()

    result = launch(
        run_dir / "scenario.toml",
        2,
        1,
        run_dir / "logs",
        backend="nixl",
        device="cpu",
        timeout_s=300,
        on_started=on_started,
    )
    assert result.ok, result.errors
    assert sent["messages"] > 100
    reports = result.reports
    # every forgery that reached a rank was dropped and counted there, none passed as true
    assert all(r["dropped"] > 0 for r in reports.values()), {
        n: r["dropped"] for n, r in reports.items()
    }
    assert all(r["unauthenticated"] == 0 for r in reports.values())
    records = assert_every_room_right(s, reports)
    reasons = {r.detail.split(" ")[0] for r in records if r.phase == "dropped"}
    assert {"WATERMARK", "STAGING_RSP", "CHUNK_READY"} <= reasons, reasons
