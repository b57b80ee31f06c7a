"""An insider that holds the run's secret, on real transfers with every byte verified.

Authentication keeps out anyone without the secret (tests/test_control_auth.py). The
attacks of issue 25's table came from a process that holds it and speaks under the
real ranks' names; each then corrupted rooms or broke a safety invariant. Per-pair
keys (hw/control/keys.py) make a frame's MAC prove its sender and receiver, so every one of
them is now dropped before it is decoded, and counted. Sent while a run is under way,
under the real names, for every room of the run:

- a believable WATERMARK (the next rounds, tails inside the pool) under the decode's name;
- STAGING_RSP of the right size at another room's offset, racing the real one;
- CHUNK_READY with real writer ids on the room's own chunk grid;
- ABORT of a live room under its writer's name;
- HEARTBEATs under a real peer's name (once, these made 784 honest frames look like
  replays: replay state now follows the proven sender);
- and the implausible ones (rounds far off, regions outside the pool, chunks off the
  grid, foreign rooms).

Since issue 39 (item 4) the forgers do not even get a connection: a rank's inbox admits
only its peers' keys from the rank table (hw/control/zap.py), and the forgers' planes
have keys of their own. The MACs beneath hold for a rank of the table that forges
(tests/test_control_auth.py, a key the inbox admits).

Asserted: every room done, 0 bytes wrong, no invariant violated, no honest frame
dropped as a replay, the forgers' connections refused at every rank, and no
honest write rejected by the write tag (transfer.verify_writes = "mac", the default;
tests/test_verify_writes.py has the writes it rejects). Both
engines. Below the MACs, the core's capabilities (shared/capability.py) hold without
them: tests/test_capabilities.py is the simulated twin, the same attacks under the real
names, without the nonces, and no MACs at all. What a rank that holds its own pair keys
can still do is limited to its own rooms: it knows only its own nonces, and the
write tag keeps its bytes out of other writers' blocks (tests/test_verify_writes.py).

Registration (issue 39, item 1): a rank's name is bound to a credential only its process
is handed (hw/control/credentials.py), so an impostor holding the secret that says
hello as prefill0 and decode0 before the real ranks do (it registered first, 6 of 6
tries, before) is refused every time, and the real ranks run every room.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import zmq
from conftest import require_engine
from test_control_auth import _free_port, _push, assert_every_room_right
from test_hw import write_scenario

from kvstage.hw.control.membership import RankInfo
from kvstage.hw.control.plane import ControlPlane, new_secret, read_secret_file
from kvstage.hw.control.rendezvous import RendezvousClient, RendezvousError
from kvstage.hw.launch.launcher import launch
from kvstage.shared.layout import room_pages
from kvstage.shared.protocol import (
    Abort,
    ChunkReady,
    Heartbeat,
    StagingReq,
    StagingRsp,
    Watermark,
    WriterDone,
    encode,
)
from kvstage.shared.scenario import load_scenario
from kvstage.shared.workload import generate_requests

pytestmark = [pytest.mark.hw, pytest.mark.timeout(420)]

FOREIGN = 10**6  # room ids far outside the workload


def _forgeries(s, i: int) -> dict[tuple[str, str], list]:
    """The attacks, by (the rank they speak for, the rank they go to)."""
    out: dict[tuple[str, str], list] = {}
    for room in generate_requests(s):
        for key, msgs in _forged_for(s, room, i).items():
            out.setdefault(key, []).extend(msgs)
    return out


def _forged_for(s, room, i: int) -> dict[tuple[str, str], list]:
    g = s.geometry()
    pool = s.pool_bytes
    pages = room_pages(room.prompt_tokens, room.prefix_tokens, g.page_size)
    chunks = g.chunks(pages)
    size = g.region_bytes(chunks[0].num_pages)
    other = (room.room * 7 + 3) % max(1, pool // size) * size  # another room's offset
    out: dict[tuple[str, str], list] = {}
    for p in range(g.prefill_tp):
        out[("decode0", f"prefill{p}")] = [
            # believable: the next rounds, a tail inside the pool
            Watermark(round=1 + i % 3, tail=size * (1 + i % 4), prefill_rank=p, decode_rank=0),
            Watermark(round=10**9 + i, tail=64, prefill_rank=p, decode_rank=0),
            Watermark(round=1, tail=pool + 4096, prefill_rank=p, decode_rank=0),
            StagingRsp(room.room, 0, other, i % 2, other + size, False, p, 0),
            StagingRsp(room.room, 0, 4 * pool, 9, 4 * pool + size, False, p, 0),
            Abort(room.room, p, 0, "forged: under the decode's name"),
            Heartbeat(p, 0, True),
        ]
        out[(f"prefill{p}", "decode0")] = [
            *(ChunkReady(room.room, c.index, c.page_start, c.num_pages, p, p, 0) for c in chunks),
            WriterDone(room.room, len(chunks), p, p, 0),
            Abort(room.room, p, 0, "forged: under a live writer's name"),
            Heartbeat(p, 0, False),
            ChunkReady(room.room, 0, chunks[0].page_start + 7, chunks[0].num_pages, p, p, 0),
            StagingReq(FOREIGN + i, 0, 4, p, 0),
            Abort(FOREIGN + i, p, 0, "forged"),
        ]
    return out


def _attack(s, run_dir, table: dict, sent: dict) -> None:
    """`table`: every rank's entry, from the launcher (no rank, and no holder of the
    secret, gets it from the rendezvous: only its peers' entries)."""
    secret = read_secret_file(run_dir / "run.secret")
    # one control plane per name it speaks under: the real ranks' names, its own keys
    planes = {name: ControlPlane(secret=secret, name=name) for name in table}
    # a connection per (speaker, rank) with a CURVE key of its own (no rank's of the table)
    pushes = {
        (speaker, to): _push(table[to].control, secret)
        for speaker in table
        for to in table
        if to != speaker
    }
    try:
        for speaker, cp in planes.items():
            for name, info in table.items():
                if name != speaker:
                    cp.connect(name, info.control, info.identity)
        for i in range(40):
            for (speaker, to), msgs in _forgeries(s, i).items():
                for msg in msgs:
                    sent["messages"] += 1  # tried; refused at the handshake, it queues here
                    with contextlib.suppress(zmq.Again):
                        frames = planes[speaker].seal(to, encode(msg))
                        pushes[(speaker, to)].send_multipart(frames, zmq.NOBLOCK)
            time.sleep(0.03)
    finally:
        for sock in pushes.values():
            sock.close(linger=0)
        for cp in planes.values():
            cp.close()


def _launch_p2_d1(run_dir, backend: str, **kw):
    """The P2->D1 run of `run_dir/scenario.toml` on the CPU (`kw`: launch's)."""
    return launch(
        run_dir / "scenario.toml", 2, 1, run_dir / "logs", backend=backend, device="cpu",
        timeout_s=300, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
@pytest.mark.slow
def test_an_insider_with_the_secret_harms_no_room(tmp_path, backend):
    require_engine(backend)
    s = load_scenario(
        write_scenario(tmp_path, 2, 1, 8, requests=30),
        overrides=[f"hardware.backend={backend}"],  # verify_writes: the default, "mac"
    )
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "scenario.toml").write_text(s.to_toml())
    sent = {"messages": 0}

    def on_table(table, t0):
        threading.Thread(target=_attack, args=(s, run_dir, table, sent), daemon=True).start()

    result = _launch_p2_d1(run_dir, backend, on_table=on_table)
    assert result.ok, result.errors
    assert sent["messages"] > 1000
    reports = result.reports
    # every forger was refused its connection at every rank (its key is no peer's), so
    # no forgery reached a MAC check, let alone the core; no honest frame was dropped
    assert all(r["refused_connections"] > 0 for r in reports.values()), {
        n: r["refused_connections"] for n, r in reports.items()
    }
    assert all(
        r["unauthenticated"] == 0 and r["replayed"] == 0 and r["misattributed"] == 0
        for r in reports.values()
    )
    assert all(r["dropped"] == 0 for r in reports.values()), {
        n: r["dropped"] for n, r in reports.items()
    }
    assert_every_room_right(s, reports)
    assert reports["decode0"]["writes_rejected"] == 0
    assert reports["decode0"]["bytes_checksummed"] > 0


def _impostor(secret: bytes, address: str, started: threading.Event, said: dict) -> None:
    """Say hello as prefill0 and decode0, holding the run secret, again and again from
    before the real ranks are up until the run started, then once more."""
    client = RendezvousClient(address, secret=secret)
    names = [("prefill", 0), ("decode", 0)]
    try:
        while True:
            last = started.is_set()
            for role, rank in names:
                me = RankInfo(role, rank, "tcp://127.0.0.1:1", "impostor", b"m", key="ab" * 32)
                try:
                    client.hello(me, timeout_s=5)
                    said["registered"].append(me.name)  # must never happen
                except RendezvousError as exc:
                    if "refused this rank:" in str(exc):  # not a timeout before it listens
                        said["refused"].append((me.name, last, str(exc)))
            if last:
                return
    finally:
        client.close()


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_the_run_secret_alone_registers_as_no_rank(tmp_path, backend):
    """An impostor with the run secret says hello as prefill0 and decode0 from before
    the real ranks start: refused each time, naming why; the real ranks register, and
    every room is done with every byte right."""
    require_engine(backend)
    s = load_scenario(
        write_scenario(tmp_path, 2, 1, 8, requests=20), overrides=[f"hardware.backend={backend}"]
    )
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "scenario.toml").write_text(s.to_toml())
    secret, port = new_secret(), _free_port()
    started, said = threading.Event(), {"registered": [], "refused": []}
    impostor = threading.Thread(
        target=_impostor, args=(secret, f"127.0.0.1:{port}", started, said), daemon=True
    )
    impostor.start()  # before the launcher: its hellos wait for the rendezvous to listen
    # the impostor's connection admitted as a tool's (--tool-connections): what is left to
    # refuse it is the credential (by default the handshake itself refuses it)
    result = _launch_p2_d1(
        run_dir,
        backend,
        secret=secret,
        port=port,
        on_started=lambda *_: started.set(),
        tool_connections=2,
    )
    impostor.join(30)
    assert result.ok, result.errors
    assert said["registered"] == []
    for name in ("prefill0", "decode0"):
        refusals = [(after, why) for n, after, why in said["refused"] if n == name]
        assert any(not after for after, _ in refusals)  # tried before the run started ...
        assert any(after for after, _ in refusals)  # ... and after
        assert all(
            f"with the run secret but not {name}'s own credential" in why for _, why in refusals
        ), refusals[:2]
    assert_every_room_right(s, result.reports)
