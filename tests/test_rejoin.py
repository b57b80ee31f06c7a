"""A prefill rank that dies and is started again rejoins its run as a new incarnation.

What a restart promises, in both modes: the rooms the lost incarnation left in flight
(and those that arrived while it was gone) fail with a reason naming it; the rooms
that arrive after the rejoin are served by the new incarnation and finish; every room
of the workload ends exactly once; nothing stays in a staging ring; the old
incarnation's late frames are dropped once the rejoin is known. And the launcher of a
`--no-spawn` run notices a rank that went silent within seconds, naming it.

The simulation and rendezvous tests here are fast; the hardware ones start real rank
processes, SIGKILL one prefill rank mid-run, start it again with `hw-rank` and check
every byte of every room that finished.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import require_engine, start_by_hand
from test_control_auth import _free_port, _push, serving
from test_hw import run, write_scenario

from kvstage.hw.control.plane import ControlPlane, new_secret, read_secret_file
from kvstage.hw.control.rendezvous import (
    MAX_TOOL_CONNECTIONS,
    RankInfo,
    RendezvousClient,
    RendezvousError,
    RendezvousServer,
)
from kvstage.run.rundir import read_summary
from kvstage.run.tracefile import read_records
from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import OpenRoom, PeerLost, PeerRejoined, RoomFailed, Send
from kvstage.shared.invariants import check_records
from kvstage.shared.layout import room_pages
from kvstage.shared.protocol import Abort, Bootstrap, encode
from kvstage.shared.scenario import load_scenario
from kvstage.shared.workload import generate_requests
from kvstage.sim.driver import Simulation

ROOT = Path(__file__).resolve().parents[1]
KILL_RESTART = ROOT / "scenarios" / "faults" / "kill-restart-prefill.toml"
TABLE_RANK = Path(__file__).parent / "helpers" / "table_rank.py"
HOST_MODEL = [
    "links.host_model=cpu-loop",
    "links.host_cores=2",
    "links.engine_thread_cores=0.5",
    "links.event_us=40",
    "links.fill_latency_us=200",
    "links.fill_bandwidth_gbs=2",
]


# --- the decode's machine ------------------------------------------------------------------


def _failed(actions) -> dict[int, str]:
    return {a.room: a.reason for a in actions if type(a) is RoomFailed}


def test_decode_machine_serves_a_rejoined_writer_from_its_first_room_on():
    """After PeerLost, PeerRejoined(first_room=5): a room before 5 that opens fails naming
    the lost writer (and is not aborted to the new incarnation, which never knew it); room
    5 opens and bootstraps the writer. A loss of the older incarnation that comes late is
    ignored; a rejoin not newer than the known one too; the new incarnation's own loss
    fails every room that needs it."""
    s = load_scenario(KILL_RESTART)
    m = DecodeMachine(0, s.geometry(), s.pool_bytes)
    opened = m.handle(OpenRoom(0, 200, 16), 0.0)
    assert {a.msg.prefill_rank for a in opened if type(a) is Send and type(a.msg) is Bootstrap} == {
        0,
        1,
    }
    assert _failed(m.handle(PeerLost("prefill", 1, "killed", incarnation=0), 3.0)) == {
        0: "writer prefill rank 1 is gone: killed"
    }
    assert m.handle(PeerRejoined("prefill", 1, 1, first_room=5), 4.0) == []
    early = m.handle(OpenRoom(4, 200, 16), 4.1)
    assert _failed(early) == {4: "decode rank 0: writer prefill1 is gone"}
    assert [a.msg.prefill_rank for a in early if type(a) is Send and type(a.msg) is Abort] == [0]
    late = m.handle(OpenRoom(5, 200, 16), 4.2)
    assert not _failed(late)
    assert {a.msg.prefill_rank for a in late if type(a) is Send and type(a.msg) is Bootstrap} == {
        0,
        1,
    }
    assert m.handle(PeerLost("prefill", 1, "the old one, late", incarnation=0), 4.3) == []  # stale
    assert m.handle(PeerRejoined("prefill", 1, 1, first_room=9), 4.4) == []  # not newer: ignored
    assert _failed(m.handle(OpenRoom(6, 200, 16), 4.5)) == {}
    assert set(
        _failed(m.handle(PeerLost("prefill", 1, "the new one died", incarnation=1), 5.0))
    ) == {5, 6}


def test_a_rejoin_before_the_loss_was_detected_fails_the_old_incarnations_rooms_only():
    s = load_scenario(KILL_RESTART)
    m = DecodeMachine(0, s.geometry(), s.pool_bytes)
    m.handle(OpenRoom(0, 200, 16), 0.0)
    m.handle(OpenRoom(1, 200, 16), 0.0)
    failed = _failed(m.handle(PeerRejoined("prefill", 1, 7, first_room=1), 1.0))
    assert failed == {
        0: "writer prefill rank 1 is gone: prefill rank 1 restarted as a new incarnation: its "
        "earlier incarnation is gone"
    }
    assert m.live_rooms == 1  # room 1 is the new incarnation's


# --- simulation ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["staging", "slice", "staging-host"])
def test_simulated_restart_fails_the_rooms_in_flight_and_serves_the_later_ones(variant):
    sets = [f"transfer.path={variant.removesuffix('-host')}"] + (
        HOST_MODEL if variant.endswith("-host") else []
    )
    s = load_scenario(KILL_RESTART, overrides=sets)
    sim = Simulation(s)
    result = sim.run()
    assert not result.violations, "\n".join(v.format() for v in result.violations[:3])
    assert set(result.failures) == {0, 1}
    assert all("writer prefill rank 1 is gone" in r for r in result.failures.values()), (
        result.failures
    )
    assert result.rooms_done == 2
    restarted = sim.prefill[1]
    assert (
        not restarted.dead
        and restarted.first_room == 2
        and [r.room for r in restarted.requests] == [2, 3]
    )
    assert restarted.result().rooms_done == 2
    assert result.faults_injected == {"restart:prefill": 1}
    assert all(rt.machine.ring.empty for rt in sim.decode)


def test_simulated_restart_before_detection_and_the_stale_loss_after_it():
    """Restarted 1 s after the kill, before its peers' failure detectors (3 s) fire: the
    rejoin itself fails the rooms in flight, naming the restart; the modeled detection of
    the old incarnation at 3 s comes after the rejoin and changes nothing."""
    s = load_scenario(
        KILL_RESTART,
        overrides=['faults.kill=[{role = "prefill", rank = 1, at_s = 0.0, restart_after_s = 1.0}]'],
    )
    result = Simulation(s).run()
    assert not result.violations
    assert set(result.failures) == {0, 1}
    assert all(
        "prefill rank 1 restarted as a new incarnation" in r for r in result.failures.values()
    )
    assert result.rooms_done == 2


@pytest.mark.parametrize("restart_after_s", [1.0, 3.5])
def test_every_room_ends_once_across_a_restart_mid_run(restart_after_s):
    """P4->D2, prefill rank 2 killed at 1 s with rooms in flight (10 requests a second),
    started again before or after its loss was detected: every room ends exactly once on
    each decode rank; the failed ones all came before the rejoin and name the lost rank;
    every room from the first one the new incarnation serves finishes."""
    s = load_scenario(
        KILL_RESTART,
        overrides=[
            "prefill.tp=4",
            "decode.tp=2",
            "workload.arrival=fixed",
            "workload.rate_per_s=10",
            "workload.requests=60",
            f'faults.kill=[{{role = "prefill", rank = 2, at_s = 1.0, restart_after_s = {restart_after_s}}}]',
        ],
    )
    sim = Simulation(s)
    result = sim.run()
    assert not result.violations, "\n".join(v.format() for v in result.violations[:3])
    first = sim.prefill[2].first_room
    assert 10 < first < 60
    for d in (0, 1):
        ends = [
            (r.room, r.phase)
            for r in result.records
            if r.role == "decode" and r.rank == d and r.phase in ("room_done", "room_failed")
        ]
        assert sorted(room for room, _ in ends) == list(range(60))  # each room once
    failed = set(result.failures)
    assert (
        failed and max(failed) < first and min(failed) >= 9
    )  # in flight at the kill, or arrived while it was gone
    assert all(
        "prefill rank 2" in reason or "prefill2" in reason for reason in result.failures.values()
    )
    assert result.rooms_done + result.rooms_failed == 60
    assert all(rt.machine.ring.empty for rt in sim.decode)


# --- the rendezvous --------------------------------------------------------------------------


def _until(done, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = done()
        if value:
            return value
        assert time.monotonic() < deadline, "not there in time"
        time.sleep(0.02)


def _info(role: str, rank: int, incarnation: int) -> RankInfo:
    return RankInfo(
        role,
        rank,
        f"tcp://127.0.0.1:{6000 + incarnation % 1000}",
        f"agent-{role}{rank}-{incarnation}",
        b"meta",
        {},
        incarnation,
        "cd" * 32,
    )


def _register(
    server: RendezvousServer, secret: bytes, infos: list[RankInfo]
) -> dict[str, RendezvousClient]:
    clients = {
        i.name: RendezvousClient(
            server.address, secret=secret, credential=server.credential(i.name)
        )
        for i in infos
    }
    threads = [threading.Thread(target=clients[i.name].hello, args=(i, 20)) for i in infos]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert server.started
    return clients


def test_rendezvous_lets_a_restarted_prefill_rank_rejoin_and_refuses_the_rest():
    secret = new_secret()
    server = RendezvousServer(
        ["prefill0", "decode0"], secret=secret, rejoin_grace_s=30, tools=MAX_TOOL_CONNECTIONS
    )
    clients: list[RendezvousClient] = []
    try:
        with serving(server) as on_server:
            ranks = _register(server, secret, [_info("prefill", 0, 100), _info("decode", 0, 100)])
            clients += ranks.values()
            # the restarted prefill0 registers again under a newer incarnation: refused
            # while the one registered is live (its hello asks again) ...
            new = RendezvousClient(
                server.address, secret=secret, credential=server.credential("prefill0")
            )
            clients.append(new)
            got: dict = {}
            hello = threading.Thread(
                target=lambda: got.update(table=new.hello(_info("prefill", 0, 200), 20))
            )
            hello.start()
            _until(lambda: any("registered and live" in r for r in server.refusals))
            assert not ranks["decode0"].poll_notices()
            # ... until the launcher saw it die
            on_server(lambda: server.mark_down("prefill0", "rank prefill0 died (signal 9)"))
            # ... its decode peer hears of it (a notice, never mistaken for an answer) and says
            # which room the new incarnation serves from
            (notice,) = _until(lambda: ranks["decode0"].poll_notices())
            assert (
                notice["kind"] == "rejoin" and RankInfo.from_json(notice["rank"]).incarnation == 200
            )
            ranks["decode0"].ack_rejoin("prefill0", 200, 7)
            hello.join(20)
            table, t0 = got["table"]
            assert table["prefill0"].incarnation == 200 and t0 == server.t0
            assert new.rejoin == {
                "incarnation": 200,
                "first_room": 7,
                "answered": ["decode0"],
                "silent": [],
            }
            assert server.rejoins == [
                {
                    "rank": "prefill0",
                    "incarnation": 200,
                    "first_room": 7,
                    "after": "rank prefill0 died (signal 9)",
                }
            ]
            stranger = RendezvousClient(server.address, secret=secret)
            clients.append(stranger)
            assert stranger.rejoins(5) == server.rejoins
            # everything else stays refused, even with the rank's credential
            for info, why in [
                (_info("prefill", 0, 150), "replayed message: signed for prefill0 incarnation 150"),
                (_info("decode", 0, 300), "only a prefill rank can rejoin"),
                (_info("prefill", 0, 250), "registered and live"),
            ]:
                stranger.speak_as(info.name, info.incarnation, server.credential(info.name))
                stranger.send({"kind": "hello", **info.to_json()})
                with pytest.raises(RendezvousError, match=why):
                    stranger.recv(5, "the refusal")
            ranks["prefill0"].send(
                {"kind": "report", "role": "prefill", "rank": 0}
            )  # the old connection
            _until(lambda: "signed for prefill0 incarnation 100 number" in server.refusals[-1])
            # a rank declared gone (its grace over) cannot come back
            on_server(lambda: server.mark_down("prefill0", "rank prefill0 died", grace_s=0))
            assert server.gone == {"prefill0": "rank prefill0 died"}
            stranger.speak_as("prefill0", 400, server.credential("prefill0"))
            stranger.send({"kind": "hello", **_info("prefill", 0, 400).to_json()})
            with pytest.raises(RendezvousError, match="declared gone, too late to rejoin"):
                stranger.recv(5, "the refusal")
    finally:
        for c in clients:
            c.close()
        server.close()


def test_rendezvous_declares_a_silent_rank_down_then_gone_after_its_grace():
    """A registered rank that stops saying it is alive is down after `silent_s`, gone once
    its grace is over (the run then fails naming it); one that keeps beating is neither."""
    secret = new_secret()
    server = RendezvousServer(
        ["prefill0", "decode0"], secret=secret, silent_s=0.5, rejoin_grace_s=0.5
    )
    clients: list[RendezvousClient] = []
    stop = threading.Event()
    try:
        with serving(server):
            ranks = _register(server, secret, [_info("prefill", 0, 1), _info("decode", 0, 1)])
            clients += ranks.values()

            def beat() -> None:
                while not stop.is_set():
                    ranks["decode0"].alive()
                    time.sleep(0.1)

            threading.Thread(target=beat, daemon=True).start()
            why = _until(lambda: server.gone.get("prefill0"))
            assert why.startswith("rank prefill0 stopped answering the rendezvous")
            assert "decode0" not in server.gone and not server.all_reported
            # a rank that says it will be quiet a while (building its report) is not down
            ranks["decode0"].alive(quiet_s=60)
            stop.set()
            time.sleep(1.5)
            assert "decode0" not in server.down and "decode0" not in server.gone
            ranks["decode0"].send({"kind": "report", "role": "decode", "rank": 0})
            _until(lambda: server.all_reported)
    finally:
        stop.set()
        for c in clients:
            c.close()
        server.close()


# --- hardware --------------------------------------------------------------------------------


def _rank_cmd(
    run_dir: Path, address: str, backend: str, role: str, rank: int, *extra: str
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvstage.hw.rank.main",
        str(run_dir / "scenario.toml"),
        "--role",
        role,
        "--rank",
        str(rank),
        "--rendezvous",
        address,
        "--secret-file",
        str(run_dir / "run.secret"),
        "--backend",
        backend,
        "--host",
        "127.0.0.1",
        *extra,
    ]


def _restart_and_replay(
    run_dir: Path,
    address: str,
    backend: str,
    kill,
    kill_at: float,
    register_after_s: float,
    box: dict,
) -> None:
    """SIGKILL prefill1 at `kill_at` (epoch s) and start it again (`hw-rank`), registering
    `register_after_s` later (negative: started before the kill, registering that long
    after it); once it rejoined, replay a frame of its old incarnation at decode0: an
    ABORT of the workload's last room, which must change nothing."""
    try:
        secret = read_secret_file(run_dir / "run.secret")
        client = RendezvousClient(address, secret=secret)  # a tool: sees the rejoins
        table = box["table"]  # the launcher's (on_table): no rank, no tool gets it whole
        old = table["prefill1"]
        if register_after_s < 0:  # started before the kill: it is ready when its time comes
            box["proc"] = _start(run_dir, address, backend, kill_at + -register_after_s)
        time.sleep(max(0.0, kill_at - time.time()))
        kill()
        if register_after_s >= 0:
            box["proc"] = _start(run_dir, address, backend, time.time() + register_after_s)
        rejoins = _until(lambda: client.rejoins(10), timeout_s=120)
        box["rejoin"] = rejoins[0]
        last = box["requests"] - 1
        push = _push(table["decode0"].control, secret)
        # a frame under the old incarnation's name and number (signed with a key of the
        # tool's own: the old process's key pair is gone with it)
        old_self = ControlPlane(secret=secret, name="prefill1")
        old_self.connect("decode0", table["decode0"].control, table["decode0"].identity)
        push.send_multipart(
            old_self.seal(
                "decode0",
                encode(Abort(last, 1, 0, "replayed from the old incarnation")),
                incarnation=old.incarnation,
                seq=1 << 40,
            )
        )
        push.close(linger=2000)
        old_self.close()
        client.close()
        box["replayed"] = True
    except BaseException as exc:  # seen by the test's assertions
        box["error"] = repr(exc)


def _start(run_dir: Path, address: str, backend: str, register_at: float):
    return start_by_hand(
        _rank_cmd(run_dir, address, backend, "prefill", 1, "--register-at", f"{register_at}"),
        run_dir / "prefill1-by-hand.log",
    )


def _assert_rejoined(run_dir: Path, box: dict) -> None:
    """The run's outcome after prefill1 was killed and rejoined (see the module doc)."""
    assert "error" not in box and box.get("replayed"), box
    summary = read_summary(run_dir)
    s = load_scenario(run_dir / "scenario.toml")
    n = s.workload.requests
    assert summary["errors"] == [], summary[
        "errors"
    ]  # it died, but rejoined: not a failure of the run
    (rejoin,) = summary["rejoins"]
    first = rejoin["first_room"]
    assert (
        rejoin["rank"] == "prefill1" and first == box["rejoin"]["first_room"] and 0 < first < n - 1
    )
    _, records = read_records(run_dir)
    ends: dict[int, str] = {}
    for r in records:
        if r.role == "decode" and r.phase in ("room_done", "room_failed"):
            assert r.room not in ends, f"room {r.room} ended twice"
            ends[r.room] = r.detail if r.phase == "room_failed" else ""
    assert sorted(ends) == list(range(n))  # every room of the workload ended, exactly once
    failed = {room for room, why in ends.items() if why}
    assert failed and max(failed) < first  # the rooms after the rejoin all finished
    assert all("prefill rank 1" in ends[room] or "prefill1" in ends[room] for room in failed), {
        room: ends[room] for room in failed
    }
    assert summary["requests_failed"] == len(failed) and summary["requests_done"] == n - len(failed)
    # the replayed ABORT of the old incarnation was dropped: the last room finished
    # (a key of no rank of the table: refused at the handshake, hw/control/zap.py; or, had
    # it connected, dropped as replayed)
    assert n - 1 not in failed
    assert summary["refused_connections"] + summary["replayed_messages"] >= 1
    # every byte of every room that finished was checked, and right
    g = s.geometry()
    done = [r for r in generate_requests(s) if r.room not in failed]
    expected = sum(room_pages(r.prompt_tokens, r.prefix_tokens, g.page_size) for r in done)
    assert (
        summary["bytes_verified"]
        == expected * g.page_size * 2 * g.layers * g.decode_heads * g.head_dim * g.dtype_bytes
    )
    assert summary["bytes_wrong"] == 0
    assert all(v == 0 for v in summary["ring_used_at_end"].values())
    assert not check_records(records, s.transfer.path, summary["clock_tolerance_s"])
    # the new incarnation served the rooms from `first` on, and only those
    served = {
        r.room for r in records if r.role == "prefill" and r.rank == 1 and r.phase == "room_done"
    }
    assert served and min(served) >= first


@pytest.mark.hw
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_killed_prefill_rank_started_again_rejoins_nixl(tmp_path):
    """`kvstage hw` (NIXL, P2->D1, --rejoin-grace): prefill1 SIGKILLed 1.5 s into the run
    and started again by hand (its replacement starts up beforehand, so a slow start
    cannot eat the run); it registers 4 s after the kill, after its peers declared it lost."""
    require_engine("nixl")
    f = write_scenario(tmp_path, 2, 1, 8, requests=160)  # 8 s of arrivals
    box: dict = {"requests": 160}
    procs: dict = {}

    def on_started(address, spawned):
        procs.update(spawned)
        victim = spawned["prefill1"]
        box["thread"] = threading.Thread(
            target=_restart_and_replay,
            daemon=True,
            args=(
                tmp_path / "run",
                address,
                "nixl",
                lambda: os.kill(victim.pid, signal.SIGKILL),
                time.time() + 1.5,
                -4.0,
                box,
            ),
        )
        box["thread"].start()

    try:
        code, run_dir = run(
            tmp_path,
            "nixl",
            f,
            on_started=on_started,
            on_table=lambda table, t0: box.update(table=table),
            rejoin_grace_s=60,
            tool_connections=1,  # the replay thread asks for the rejoins as a tool
        )
        assert box["proc"].wait(timeout=60) == 0  # the rank started by hand finished and exited
        # the replay thread's last steps (the frame, closing its sockets) may still run
        # when the run ends: its outcome is read once it is over, not while it goes on
        box["thread"].join(timeout=60)
        assert not box["thread"].is_alive(), "the restart-and-replay thread did not end"
    finally:
        if "proc" in box and box["proc"].poll() is None:
            box["proc"].kill()
    assert code == 1  # rooms failed, and the scenario allows none (the assertions below say which)
    _assert_rejoined(run_dir, box)
    assert all(p.poll() is not None for p in procs.values())


class _NoSpawnRun:
    """`kvstage hw --no-spawn` on a free port with `flags`, its output to `stdout`; then
    (`start_ranks`) prefill0, prefill1 and decode0 started by hand as `kvstage hw-rank`."""

    def __init__(
        self, tmp_path: Path, scenario: Path, backend: str, flags: list[str], stdout
    ) -> None:
        self.tmp_path, self.backend = tmp_path, backend
        self.run_dir, port = tmp_path / "run", _free_port()
        self.address = f"127.0.0.1:{port}"
        self.ranks: dict = {}  # subprocess.Popen or ForkedProcess (start_by_hand)
        self.launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstage.cli",
                "hw",
                str(scenario),
                "--backend",
                backend,
                "--no-spawn",
                "--port",
                str(port),
                "--tool-connections",  # start_ranks (t0) and the replay thread ask as tools
                "2",
                "--out",
                str(self.run_dir),
                *flags,
            ],
            stdout=stdout,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def start_ranks(self) -> float:
        """Start the ranks once the launcher wrote the run's files; the run's t0."""
        run_dir = self.run_dir
        _until(
            lambda: (run_dir / "run.secret").exists() and (run_dir / "scenario.toml").exists(), 60
        )
        for role, rank in (("prefill", 0), ("prefill", 1), ("decode", 0)):
            cmd = _rank_cmd(run_dir, self.address, self.backend, role, rank)
            if (role, rank) == ("prefill", 1):  # it writes down its table (its peers')
                cmd = [sys.executable, str(TABLE_RANK), str(self.tmp_path / "table.json"), *cmd]
            self.ranks[f"{role}{rank}"] = start_by_hand(cmd, self.tmp_path / f"{role}{rank}.log")
        client = RendezvousClient(self.address, secret=read_secret_file(run_dir / "run.secret"))
        t0 = _until(lambda: client.query(10)[1], 120)
        client.close()
        return t0


@pytest.mark.hw
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_killed_prefill_rank_started_again_rejoins_a_no_spawn_run_mooncake(tmp_path):
    """`kvstage hw --no-spawn` (Mooncake, P2->D1): every rank started by hand (`hw-rank`);
    prefill1 SIGKILLed and its replacement, started beforehand, tries to register 0.5 s
    after the kill: before its peers (3 s) or the launcher (5 s) noticed it was gone. It
    is refused while the old one counts as live (nobody takes over a live rank), asks
    again, and rejoins once the launcher declared the old one down."""
    require_engine("mooncake")
    f = write_scenario(tmp_path, 2, 1, 8, requests=240)  # 12 s of arrivals
    box: dict = {"requests": 240}
    with (tmp_path / "launcher.log").open("w") as log:
        run = _NoSpawnRun(
            tmp_path, f, "mooncake", ["--timeout", "240", "--rejoin-grace", "60"], log
        )
    run_dir, address, launcher, ranks = run.run_dir, run.address, run.launcher, run.ranks
    try:
        t0 = run.start_ranks()
        # prefill1's own table: its entry and decode0's (no process gets the whole one)
        seen = tmp_path / "table.json"
        _until(seen.exists, 60)
        box["table"] = {
            n: RankInfo.from_json(d) for n, d in json.loads(seen.read_text())["ranks"].items()
        }
        assert sorted(box["table"]) == ["decode0", "prefill1"]
        victim = ranks["prefill1"]
        _restart_and_replay(
            run_dir,
            address,
            "mooncake",
            lambda: os.kill(victim.pid, signal.SIGKILL),
            max(time.time(), t0) + 3.0,
            -0.5,
            box,
        )
        launcher.wait(timeout=200)
        for name, p in ranks.items():
            assert p.wait(timeout=60) == (0 if name != "prefill1" else -signal.SIGKILL), name
        assert box["proc"].wait(timeout=60) == 0
    finally:
        for p in [launcher, *ranks.values(), box.get("proc")]:
            if p is not None and p.poll() is None:
                p.kill()
    out = (tmp_path / "launcher.log").read_text()
    assert "rank prefill1 rejoined the run" in out, out[-3000:]
    _assert_rejoined(run_dir, box)


@pytest.mark.hw
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_no_spawn_launcher_notices_a_dead_rank_within_seconds(tmp_path):
    """`kvstage hw --no-spawn`, ranks started by hand, prefill1 SIGKILLed and not
    restarted: the launcher, which cannot see the process, notices it is silent and ends
    the run naming it as soon as the others finished, not at its --timeout (600 s)."""
    require_engine("nixl")
    f = write_scenario(tmp_path, 2, 1, 8, requests=60)  # 3 s of arrivals
    run = _NoSpawnRun(tmp_path, f, "nixl", [], subprocess.PIPE)
    run_dir, launcher, ranks = run.run_dir, run.launcher, run.ranks
    try:
        t0 = run.start_ranks()
        time.sleep(max(0.0, t0 + 1.0 - time.time()))
        os.kill(ranks["prefill1"].pid, signal.SIGKILL)
        killed = time.monotonic()
        out, _ = launcher.communicate(timeout=200)
        ended_after = time.monotonic() - killed
        codes = {
            name: p.wait(timeout=60) for name, p in ranks.items()
        }  # the others exit once released
    finally:
        for p in [launcher, *ranks.values()]:
            if p.poll() is None:
                p.kill()
    assert launcher.returncode == 1, out[-3000:]
    assert ended_after < 120, ended_after  # a hang would wait for --timeout (600 s)
    flat = " ".join(out.split())
    assert "rank prefill1 stopped answering the rendezvous" in flat, out[-3000:]
    summary = read_summary(run_dir)
    assert any(
        e.startswith("rank prefill1 stopped answering the rendezvous") for e in summary["errors"]
    )
    assert codes == {"prefill0": 0, "prefill1": -signal.SIGKILL, "decode0": 0}
    assert (
        summary["requests_done"] + summary["requests_failed"] == 60 and summary["bytes_wrong"] == 0
    )
