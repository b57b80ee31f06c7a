"""A control plane nobody can fool: authenticated control and rendezvous frames, a
rendezvous that refuses instead of dying, ranks that end with their launcher.

Real ZMQ sockets and real processes throughout; the hardware tests run real NIXL
transfers and verify every byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from conftest import require_engine
from test_hw import write_scenario
from test_outcome import kvstage_cmd
from zmq.utils import z85

from kvstage.hw.control.keys import rank_key
from kvstage.hw.control.plane import (
    MAX_CONTROL_FRAMES,
    SECRET_ENV,
    TO_LAUNCHER,
    ZMQ_MAX_CONTROL_FRAME,
    ControlPlane,
    FrameMac,
    RunSecretError,
    curve_client,
    frame_header,
    new_secret,
    read_secret_file,
    write_secret_file,
)
from kvstage.hw.control.rendezvous import (
    MAX_TOOL_CONNECTIONS,
    RankInfo,
    RendezvousClient,
    RendezvousError,
    RendezvousServer,
)
from kvstage.hw.control.zap import MAX_CONNECTIONS_PER_KEY
from kvstage.hw.launch.launcher import launch
from kvstage.hw.rank.main import main as rank_main
from kvstage.shared.invariants import check_records
from kvstage.shared.layout import room_pages
from kvstage.shared.protocol import Abort, ChunkReady, Watermark, encode
from kvstage.shared.scenario import load_scenario
from kvstage.shared.trace import TraceRecord
from kvstage.shared.workload import generate_requests


def _push(
    address: str, secret: bytes | None = None, admitted_by: ControlPlane | None = None
) -> zmq.Socket:
    """A plain PUSH to `address`; with `secret`, a CURVE client holding the run secret
    (and no pair key), with a key of its own that `admitted_by`'s inbox admits (as it
    admits its peers': a compromised rank of its table) or, without, admits nobody."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    if secret is not None:
        public, private = (z85.decode(k) for k in zmq.curve_keypair())
        if admitted_by is not None:
            admitted_by.gate.admit(public)
        curve_client(sock, secret, (public, private))
    sock.connect(address)
    return sock


def _receive_until(cp: ControlPlane, done, timeout_s: float = 10.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while not done(got) and time.monotonic() < deadline:
        got += cp.receive(0.05)
    return got


def _pair(a: ControlPlane, b: ControlPlane, a_calls_b: str = "inbox") -> None:
    """`a` sends to `b` as `a_calls_b` and accepts b's frames (what a table does)."""
    a.connect(a_calls_b, b.address, b.identity)
    b.connect(a.name, a.address, a.identity)


def test_control_plane_drops_what_it_cannot_authenticate():
    """A process without the run secret gets no connection (CURVE): nothing it sends
    arrives, however big. One that holds the secret, with a key of the table but no
    pair key (a compromised rank), is dropped and counted: no MAC or a wrong one
    (unauthenticated), too many frames (oversize); a frame over ZMQ's bound cuts its
    connection before its bytes are buffered."""
    secret = new_secret()
    inbox = ControlPlane(secret=secret, name="inbox")
    honest = ControlPlane(secret=secret, name="honest")
    other_run = ControlPlane(secret=new_secret(), name="other")
    stranger = _push(inbox.address)
    holder = _push(inbox.address, secret, admitted_by=inbox)
    again = _push(inbox.address, secret, admitted_by=inbox)
    try:
        _pair(honest, inbox)
        _pair(other_run, inbox)  # its key pair is known, its run secret is not this run's
        forged = Abort(room=0, prefill_rank=0, decode_rank=0, reason="forged")
        attempts = [
            encode(forged),  # no MAC
            [*encode(forged), os.urandom(32)],  # a wrong MAC
            [b"x"] * (MAX_CONTROL_FRAMES + 1),  # too many frames to look at
        ]
        for frames in attempts:
            holder.send_multipart(frames)
        for frames in [*attempts, [b"x" * (64 << 20)]]:
            try:  # queued at the stranger at most: its handshake never completes
                stranger.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                pass
        holder.send(b"x" * (ZMQ_MAX_CONTROL_FRAME + 1))  # ZMQ cuts the connection off
        honest.send("inbox", Watermark(round=1, tail=2, prefill_rank=0, decode_rank=0))
        other_run.send("inbox", forged)  # another run's secret: no connection either
        got = _receive_until(inbox, lambda got: inbox.unauthenticated + inbox.oversize >= 3 and got)
        got += _receive_until(inbox, lambda _: False, timeout_s=0.5)  # nothing more comes
        assert got == [Watermark(round=1, tail=2, prefill_rank=0, decode_rank=0)]
        assert inbox.counters() == {
            "malformed": 0,
            "unauthenticated": 2,
            "misattributed": 0,
            "oversize": 1,
            "replayed": 0,
            "refused_connections": 0,
        }
        # a frame list signed for this pair that does not decode is malformed, as before
        again.send_multipart(honest.seal("inbox", [b"KVS?", b"junk"]))
        assert _receive_until(inbox, lambda _: inbox.malformed == 1) == []
        assert inbox.received == 1
    finally:
        for sock in (stranger, holder, again):
            sock.close(linger=0)
        for cp in (inbox, honest, other_run):
            cp.close()


def test_an_inbox_admits_only_its_peers_keys_and_few_connections_of_each():
    """ZAP (hw/control/zap.py): a holder of the run secret whose key is no peer's gets no
    connection, however many it opens; a peer that connects before the inbox knows its
    key waits (its handshake held) and gets through once it is known; a peer's key gets
    MAX_CONNECTIONS_PER_KEY connections, a sender never more."""
    secret = new_secret()
    inbox = ControlPlane(secret=secret, name="decode0")
    early = ControlPlane(secret=secret, name="prefill0")
    wm = Watermark(round=1, tail=2, prefill_rank=0, decode_rank=0)
    socks = []
    try:
        early.connect("inbox", inbox.address, inbox.identity)
        early.send("inbox", wm)  # before the inbox read the table that names it: held
        inbox.connect("prefill0", early.address, early.identity)
        assert _receive_until(inbox, lambda got: got) == [wm]
        inbox.gate.seal()
        strangers = [_push(inbox.address, secret) for _ in range(64)]
        socks += strangers
        for sock in strangers:
            with contextlib.suppress(zmq.Again):  # queued here at most: never delivered
                sock.send_multipart([b"x" * 1024] * 8, zmq.NOBLOCK)
        assert _receive_until(inbox, lambda _: inbox.gate.refused >= 64) == []
        # (a refused client may try again: each try is refused and counted)
        assert inbox.counters()["refused_connections"] >= 64 and inbox.received == 1
        refused = inbox.gate.refused
        # one key of the table, many connections: MAX_CONNECTIONS_PER_KEY of them
        public, private = (z85.decode(k) for k in zmq.curve_keypair())
        inbox.gate.admit(public)
        for _ in range(MAX_CONNECTIONS_PER_KEY + 2):
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            curve_client(sock, secret, (public, private))
            sock.connect(inbox.address)
            socks.append(sock)
        assert _receive_until(inbox, lambda _: inbox.gate.refused >= refused + 2) == []
        assert inbox.gate.connections[public] == MAX_CONNECTIONS_PER_KEY
    finally:
        for sock in socks:
            sock.close(linger=0)
        for cp in (inbox, early):
            cp.close()


def test_a_frame_proves_its_sender_and_its_receiver():
    """Per-pair keys: a third party that holds the run secret, and even knows both
    public keys, can neither speak for a rank nor reuse a frame captured on its way to
    another rank; a rank that speaks for a rank other than itself is dropped."""
    secret = new_secret()
    decode0 = ControlPlane(secret=secret, name="decode0", role="decode")
    decode1 = ControlPlane(secret=secret, name="decode1", role="decode")
    prefill0 = ControlPlane(secret=secret, name="prefill0", role="prefill")
    prefill1 = ControlPlane(secret=secret, name="prefill1", role="prefill")
    # a secret holder that says it is prefill0 (its own key pair: not prefill0's)
    impostor = ControlPlane(secret=secret, name="prefill0", role="prefill")
    planes = (decode0, decode1, prefill0, prefill1, impostor)
    # and one that relays captured frames with a key the decodes admit (a compromised rank)
    raw0 = _push(decode0.address, secret, admitted_by=decode0)
    raw1 = _push(decode1.address, secret, admitted_by=decode1)
    try:
        for d in (decode0, decode1):
            for p in (prefill0, prefill1):
                p.connect(d.name, d.address, d.identity)
                d.connect(p.name, p.address, p.identity)
            d.gate.seal()  # every peer known: a key of no peer is refused at once
        impostor.connect("decode0", decode0.address, decode0.identity)
        ready = ChunkReady(
            room=3, chunk=0, page_start=0, num_pages=4, prefill_rank=0, writer=0, decode_rank=0
        )
        impostor.send("decode0", ready)  # its key is no peer's: no connection (ZAP)
        # a frame prefill0 signed for decode1, sent to decode0 instead
        for_decode1 = dataclasses.replace(ready, decode_rank=1)
        to_decode1 = prefill0.seal("decode1", encode(for_decode1))
        raw0.send_multipart(to_decode1)
        assert _receive_until(decode0, lambda _: decode0.unauthenticated >= 1) == []
        assert _receive_until(decode0, lambda _: decode0.gate.refused >= 1) == []
        assert decode0.unauthenticated == 1 and decode0.counters()["refused_connections"] == 1
        raw1.send_multipart(to_decode1)  # where it was meant to go it counts (once)
        raw1.send_multipart(to_decode1)
        assert _receive_until(decode1, lambda _: decode1.replayed >= 1) == [for_decode1]
        # prefill1 holds a pair key with decode0, yet cannot speak for prefill0 with it,
        # nor for decode0 to decode1's peers
        prefill1.send("decode0", ready)
        prefill1.send("decode0", dataclasses.replace(ready, decode_rank=1, prefill_rank=1))
        assert _receive_until(decode0, lambda _: decode0.misattributed >= 2) == []
        prefill0.send("decode0", ready)
        assert _receive_until(decode0, lambda got: got) == [ready]
        assert decode0.counters()["misattributed"] == 2
    finally:
        raw0.close(linger=0)
        raw1.close(linger=0)
        for cp in planes:
            cp.close()


def test_a_captured_frame_sent_again_is_dropped_as_replayed():
    """Frames carry their sender, incarnation and sequence under the MAC: a captured
    frame sent again, or an older one, is dropped and counted. Honest frames in order
    all arrive."""
    secret = new_secret()
    inbox = ControlPlane(secret=secret, name="decode0")
    honest = ControlPlane(secret=secret, name="prefill0")
    raw = _push(inbox.address, secret, admitted_by=inbox)
    try:
        _pair(honest, inbox)
        wm = [Watermark(round=1, tail=t, prefill_rank=0, decode_rank=0) for t in range(4)]
        for m in wm[:3]:
            honest.send("inbox", m)
        assert _receive_until(inbox, lambda got: len(got) == 3) == wm[:3]
        # an eavesdropper's copies of frames 1 and 3, sent again
        first = honest.seal("inbox", encode(wm[0]), seq=1)
        third = honest.seal("inbox", encode(wm[2]), seq=3)
        for frames in (first, third, first):
            raw.send_multipart(frames)
        assert _receive_until(inbox, lambda _: inbox.replayed >= 3) == []
        assert inbox.replayed == 3
        honest.send("inbox", wm[3])  # the honest sender is unaffected
        assert _receive_until(inbox, lambda got: got) == [wm[3]]
    finally:
        raw.close(linger=0)
        for cp in (inbox, honest):
            cp.close()


def test_once_a_restart_is_known_the_old_incarnation_is_dropped_before_the_new_one_speaks():
    """A rank that learns a peer restarted (the rendezvous tells it the new identity)
    drops every later frame of the old incarnation at once: not only once the new
    process has sent something. The new incarnation's frames all arrive."""
    secret = new_secret()
    inbox = ControlPlane(secret=secret, name="decode0")
    old = ControlPlane(secret=secret, name="prefill1")
    try:
        _pair(old, inbox)
        wm = [Watermark(round=1, tail=t, prefill_rank=1, decode_rank=0) for t in range(4)]
        old.send("inbox", wm[0])
        assert _receive_until(inbox, lambda got: got) == [wm[0]]
        new = ControlPlane(secret=secret, name="prefill1")
        assert new.incarnation > old.incarnation
        inbox.connect("prefill1", new.address, new.identity)  # what a rejoin notice does
        old.send("inbox", wm[1])  # a late frame of the old process, newer than its last
        raw = _push(inbox.address, secret, admitted_by=inbox)
        raw.send_multipart(old.seal("inbox", encode(wm[2]), seq=1 << 40))  # any sequence number
        assert _receive_until(inbox, lambda _: inbox.replayed >= 2) == []
        assert inbox.replayed == 2
        new.connect("inbox", inbox.address, inbox.identity)
        new.send("inbox", wm[3])
        assert _receive_until(inbox, lambda got: got) == [wm[3]]
        raw.close(linger=0)
        new.close()
        with pytest.raises(RuntimeError, match="fixed once a peer is connected"):
            old.renew_incarnation(old.incarnation + 1)
    finally:
        for cp in (inbox, old):
            cp.close()


def test_a_control_plane_needs_the_run_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(RuntimeError, match="no run secret"):
        ControlPlane()
    monkeypatch.setenv(SECRET_ENV, new_secret().hex())
    ControlPlane().close()


def test_a_rank_without_a_secret_does_not_start(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    argv = [
        str(tmp_path / "scenario.toml"),
        "--role",
        "decode",
        "--rank",
        "0",
        "--rendezvous",
        "127.0.0.1:9",
    ]
    assert rank_main(argv) == 2
    assert "decode0: error: no run secret: give --secret-file" in capsys.readouterr().err
    assert rank_main([*argv, "--secret-file", str(tmp_path / "missing")]) == 2
    assert "cannot read the run secret file" in capsys.readouterr().err
    (tmp_path / "short").write_text("abcd\n")
    (tmp_path / "short").chmod(0o600)
    assert rank_main([*argv, "--secret-file", str(tmp_path / "short")]) == 2
    assert "too short" in capsys.readouterr().err
    write_secret_file(tmp_path / "shared", new_secret())
    (tmp_path / "shared").chmod(0o644)
    assert rank_main([*argv, "--secret-file", str(tmp_path / "shared")]) == 2
    err = capsys.readouterr().err
    assert (
        "can be read by others (mode 0644)" in err and "chmod 600" in err and "Traceback" not in err
    )


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_secret_file_others_can_read_is_refused(tmp_path, mode):
    f = tmp_path / "run.secret"
    write_secret_file(f, new_secret())
    assert len(read_secret_file(f)) == 32  # the owner's own file is fine
    f.chmod(mode)
    with pytest.raises(RunSecretError, match=f"can be read by others \\(mode {mode:04o}\\)"):
        read_secret_file(f)


def test_the_secret_file_is_never_written_through_a_planted_link(tmp_path):
    """A run directory used again gets a fresh 0600 file; a symlink planted where the
    secret goes is removed, not followed: its target keeps its bytes."""
    target = tmp_path / "elsewhere"
    target.write_text("not yours\n")
    f = tmp_path / "run.secret"
    f.symlink_to(target)
    secret = new_secret()
    write_secret_file(f, secret)
    assert not f.is_symlink() and f.stat().st_mode & 0o777 == 0o600
    assert read_secret_file(f) == secret and target.read_text() == "not yours\n"
    f.chmod(0o644)  # a file left with a wider mode is replaced, not reused
    write_secret_file(f, new_secret())
    assert f.stat().st_mode & 0o777 == 0o600 and read_secret_file(f) != secret


@contextmanager
def serving(server: RendezvousServer):
    """The server handles messages in a thread of its own, the only one that changes it,
    as in the launcher. The test reads its state; to change it (say, mark a rank down),
    it hands a call to that thread with the `call` this yields and gets its result."""
    stop = threading.Event()
    calls: queue.Queue = queue.Queue()

    def serve() -> None:
        while not stop.is_set():
            server.poll(0.02)
            while not calls.empty():
                fn, box, done = calls.get()
                box.append(fn())
                done.set()

    def call(fn):
        box: list = []
        done = threading.Event()
        calls.put((fn, box, done))
        assert done.wait(10), "the serving thread did not take the call"
        return box[0]

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield call
    finally:
        stop.set()
        thread.join(5)


def _refused(server: RendezvousServer, client: RendezvousClient, msg: dict) -> str:
    """Send `msg`; the reason the server refused it with (which the client was told)."""
    client.send(msg)
    with pytest.raises(RendezvousError, match="refused this rank") as err:
        client.recv(5, "the refusal")
    assert server.refusals[-1] in str(err.value)
    return server.refusals[-1]


def _until(done, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "not there in time"
        time.sleep(0.01)


KEY = "ab" * 32  # a public key (its private half plays no part here)


def _hello(role: str, rank: int, /, **change) -> dict:
    return {
        "kind": "hello",
        **RankInfo(
            role, rank, "tcp://127.0.0.1:1", f"agent-{role}{rank}", b"meta", key=KEY
        ).to_json(),
        **change,
    }


def test_by_default_the_run_secret_alone_opens_no_connection_to_the_rendezvous():
    """Issue 39, item 4: the rendezvous's ZAP handler admits only the ranks' own keys
    unless tools are asked for (`kvstage hw --tool-connections`): a holder of the run
    secret alone is refused at the handshake, before a byte of it is queued (so not even
    a message of endless frames), and told why in one line; a rank holding its
    credential registers as ever."""
    secret = new_secret()
    server = RendezvousServer(["prefill0"], secret=secret)
    tool = RendezvousClient(server.address, secret=secret)
    rank = RendezvousClient(server.address, secret=secret, credential=server.credential("prefill0"))
    try:
        with serving(server):
            # refused at the handshake, before it asks anything (libzmq may not connect
            # again: a send then finds no connection, and must not wait for ever); libzmq
            # reports it as a refused key, or as a closed connection, or not at all: each
            # way the tool is told, naming the setting
            _until(lambda: server.gate.refused >= 1)
            with pytest.raises(RendezvousError, match="started with --tool-connections"):
                tool.query(5)
            me = RankInfo("prefill", 0, "tcp://127.0.0.1:5000", "agent-prefill0", b"m", key=KEY)
            table, t0 = rank.hello(me, timeout_s=20)
            assert sorted(table) == ["prefill0"] and t0 == server.t0
            assert server.gate.others_admitted == 0
    finally:
        tool.close()
        rank.close()
    with pytest.raises(ValueError, match="allowed 0 .* to 16"):
        RendezvousServer(["prefill0"], secret=secret, tools=17)


def test_rendezvous_refuses_strangers_and_still_serves_honest_ranks():
    secret = new_secret()
    # tools admitted (--tool-connections): what the run secret alone may then say
    server = RendezvousServer(["prefill0", "decode0"], secret=secret, tools=MAX_TOOL_CONNECTIONS)
    stranger = RendezvousClient(
        server.address, secret=secret
    )  # holds the secret, registers nothing
    clients: list[RendezvousClient] = [stranger]
    try:
        with serving(server):
            missing = _hello("prefill", 0)
            del missing["control"]
            assert "no 'control'" in _refused(server, stranger, missing)
            assert "not tcp://HOST:PORT" in _refused(
                server, stranger, _hello("prefill", 0, control=7 * "x")
            )
            assert "'rank' is str" in _refused(server, stranger, _hello("prefill", 0, rank="0"))
            assert "not base64" in _refused(server, stranger, _hello("prefill", 0, metadata="#"))
            assert "is not part of this run" in _refused(server, stranger, _hello("prefill", 7))
            assert "no such rank" in _refused(server, stranger, _hello("verify", 0))
            assert "unknown message kind" in _refused(
                server, stranger, {"kind": "table", "ranks": []}
            )
            assert "registered no rank" in _refused(
                server, stranger, {"kind": "report", "role": "prefill", "rank": 0}
            )
            # garbage, and a hello without a MAC: from a plain socket (no connection: never
            # even refused), and from one that holds the secret (refused)
            for with_secret in (False, True):
                raw = zmq.Context.instance().socket(zmq.DEALER)
                raw.setsockopt(zmq.LINGER, 0)
                if with_secret:
                    curve_client(raw, secret)
                raw.connect(f"tcp://{server.address}")
                raw.send(b"\xff not json at all")
                raw.send(json.dumps(_hello("prefill", 0)).encode())
                if with_secret:
                    _until(lambda: sum("unauthenticated" in r for r in server.refusals) == 2)
                else:
                    time.sleep(0.5)
                    assert not any("unauthenticated" in r for r in server.refusals)
                raw.close()
            # a rank with another run's secret is refused, and says why
            wrong = RendezvousClient(server.address, secret=new_secret())
            clients.append(wrong)
            wrong.send(_hello("decode", 0))
            with pytest.raises(
                RendezvousError,
                match="cannot authenticate: this rank's run secret is not the launcher's",
            ):
                wrong.recv(5, "the table")
            assert not server.hellos and not server.started

            # the honest ranks register and get the table
            tables: dict[str, tuple] = {}

            def register(role: str, rank: int) -> None:
                client = RendezvousClient(
                    server.address, secret=secret, credential=server.credential(f"{role}{rank}")
                )
                clients.append(client)
                me = RankInfo(
                    role,
                    rank,
                    f"tcp://127.0.0.1:{5000 + rank}",
                    f"agent-{role}{rank}",
                    b"meta",
                    key=KEY,
                )
                tables[me.name] = client.hello(me, timeout_s=20)

            threads = [
                threading.Thread(target=register, args=rk) for rk in (("prefill", 0), ("decode", 0))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            assert sorted(tables) == ["decode0", "prefill0"]
            assert all(
                sorted(table) == ["decode0", "prefill0"] and t0 == server.t0
                for table, t0 in tables.values()
            )
            # a tool's query sees every rank's incarnation and t0, no entry of the table
            # (issue 39, least exposure); a registered rank's, its own and its peers'
            table, t0 = stranger.query(5)
            assert table == {} and t0 == server.t0
            assert stranger.incarnations(5) == {"prefill0": 0, "decode0": 0}
            # a second hello for a registered rank is refused
            assert "a rank registers only itself" in _refused(server, stranger, _hello("decode", 0))
            # the run secret alone registers as no rank (issue 39: it was first come,
            # first served); a second holder of the rank's credential is a duplicate,
            # refused, and named with the rank registered
            impostor = RendezvousClient(
                server.address, secret=secret, name="decode0", incarnation=5
            )
            clients.append(impostor)
            assert "not decode0's own credential" in _refused(
                server, impostor, _hello("decode", 0, incarnation=5)
            )
            assert not server.duplicates
            impostor.speak_as("decode0", 5, server.credential("decode0"))
            why = _refused(server, impostor, _hello("decode", 0, incarnation=5))
            assert "decode0 is already registered" in why
            assert "control tcp://127.0.0.1:5000, incarnation 0" in why  # the one registered
            assert "control tcp://127.0.0.1:1, incarnation 5" in why  # the claim refused
            assert why.count("from 127.0.0.1 (") == 2  # where each connected from
            assert server.duplicates and "decode0 claimed twice" in server.duplicates[0]
            # a message captured and sent again is refused: a replayed query tells nothing
            raw = zmq.Context.instance().socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            curve_client(raw, secret)
            raw.connect(f"tcp://{server.address}")
            mac = FrameMac(rank_key(secret, TO_LAUNCHER, "tool-x", 7), b"")
            query = mac.sign(
                [b"tool-x", frame_header(7, 1), json.dumps({"kind": "query"}).encode()]
            )
            raw.send_multipart(query)
            assert raw.poll(5000)
            raw.recv_multipart()  # the table, once
            raw.send_multipart(query)
            _until(lambda: "replayed message: signed for tool-x" in server.refusals[-1])
            # a query signed for a rank of the run from another connection is refused before
            # that rank's replay state is touched (issue 39: else it raised prefill0's floor),
            # with the run secret alone or with the rank's credential
            for cred, why in (
                (b"", "not prefill0's own credential"),
                (server.credential("prefill0"), "not prefill0's registered one"),
            ):
                mac = FrameMac(rank_key(secret, TO_LAUNCHER, "prefill0", 7, cred), b"")
                raw.send_multipart(
                    mac.sign(
                        [
                            b"prefill0",
                            frame_header(7, 2**64 - 1),
                            json.dumps({"kind": "query"}).encode(),
                        ]
                    )
                )
                _until(lambda why=why: why in server.refusals[-1])
            raw.close()
            prefill0 = next(c for c in clients if c.name == "prefill0")
            table, _ = prefill0.query(5)  # prefill0 itself is still heard
            assert sorted(table) == ["decode0", "prefill0"]
            # a report for a rank from a connection other than its own is refused
            assert "registered no rank" in _refused(
                server, stranger, {"kind": "report", "role": "decode", "rank": 0}
            )
            assert not server.reports
    finally:
        for c in clients:
            c.close()
        server.close()


@pytest.mark.hw
@pytest.mark.timeout(420)
def test_forged_control_messages_during_a_run_change_nothing(tmp_path):
    """WATERMARK and ABORT forged with another secret (and without one) at every rank's
    control address while a run is under way: dropped and counted, every byte right."""
    require_engine("nixl")
    s = load_scenario(
        write_scenario(tmp_path, 2, 1, 8, requests=30), overrides=["hardware.backend=nixl"]
    )
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "scenario.toml").write_text(s.to_toml())
    sent = {"messages": 0, "ranks": []}

    def forge_round(liar, socks: dict, names: list, i: int) -> None:
        # never blocks: a plain PUSH that sends at once after connecting to a rank's
        # CURVE inbox waits in its first send for ever (seen here, and alone with pyzmq),
        # which hung this forger before it counted anything. A message that cannot be
        # queued is tried, and lost.
        for name in names:
            forged = [
                Watermark(round=1000 + i, tail=i, prefill_rank=p, decode_rank=0) for p in (0, 1)
            ]
            forged += [
                Abort(room=i % s.workload.requests, prefill_rank=p, decode_rank=0, reason="forged")
                for p in (0, 1)
            ]
            for msg in forged:
                sealed, raw = socks[name]
                for sock, frames in ((sealed, liar.seal(name, encode(msg))), (raw, encode(msg))):
                    sent["messages"] += 1
                    with contextlib.suppress(zmq.Again):
                        sock.send_multipart(frames, zmq.NOBLOCK)

    def forge_on(liar, socks: dict, names: list) -> None:
        for i in range(1, 60):
            forge_round(liar, socks, names, i)
            time.sleep(0.02)
        liar.close()
        for pair in socks.values():
            for sock in pair:
                sock.close(linger=0)

    def on_table(table, t0):
        # the launcher's whole table, to find the ranks: no rank has it. The first round
        # goes out here, before the launcher goes on: every rank has registered and the
        # workload starts at t0 (0.5 s on), so it is tried while the ranks run, however
        # late the thread that sends the rest gets the CPU.
        assert t0 is not None
        wrong = new_secret()
        liar = ControlPlane(secret=wrong)  # signs with keys of another secret
        for name, info in table.items():
            liar.connect(name, info.control, info.identity)
        # per rank: a CURVE client of the other secret, and a plain PUSH
        socks = {
            name: (_push(info.control, wrong), _push(info.control)) for name, info in table.items()
        }
        sent["ranks"] = names = sorted(table)
        forge_round(liar, socks, names, 0)
        threading.Thread(target=forge_on, args=(liar, socks, names), daemon=True).start()

    result = launch(
        run_dir / "scenario.toml",
        2,
        1,
        run_dir / "logs",
        backend="nixl",
        device="cpu",
        timeout_s=300,
        on_table=on_table,
    )
    assert result.ok, result.errors
    assert sent["ranks"] == ["decode0", "prefill0", "prefill1"] and sent["messages"] > 0
    reports = result.reports
    assert sorted(reports) == sent["ranks"]
    # without the run secret no connection is made (CURVE): not one forgery reached a
    # rank's MAC check
    assert all(r["unauthenticated"] == 0 and r["malformed"] == 0 for r in reports.values()), {
        n: (r["unauthenticated"], r["malformed"]) for n, r in reports.items()
    }
    assert_every_room_right(s, reports)
    assert (run_dir / "run.secret").stat().st_mode & 0o777 == 0o600


def assert_every_room_right(s, reports: dict[str, dict]) -> list[TraceRecord]:
    """A P2->D1 run's reports: no room failed, every room done, every byte verified and
    right, nothing left in the ring, no invariant violated. Returns the merged trace."""
    assert all(r["failures"] == {} and r["rooms_failed"] == 0 for r in reports.values()), {
        n: r["failures"] for n, r in reports.items()
    }
    assert reports["decode0"]["rooms_done"] == s.workload.requests
    assert sum(r.get("bytes_wrong", 0) for r in reports.values()) == 0
    assert sum(r.get("bytes_verified", 0) for r in reports.values()) == _bytes_to_verify(s)
    assert reports["decode0"]["ring_used"] == 0
    records = sorted(
        (TraceRecord(*row) for r in reports.values() for row in r["records"]),
        key=lambda r: (r.end, r.start, r.role, r.rank),
    )
    assert not check_records(records, s.transfer.path)
    return records


def _bytes_to_verify(s) -> int:
    g = s.geometry()
    pages = sum(
        room_pages(r.prompt_tokens, r.prefix_tokens, g.page_size) for r in generate_requests(s)
    )
    return (
        g.decode_tp
        * pages
        * g.page_size
        * 2
        * g.layers
        * g.decode_heads
        * g.head_dim
        * g.dtype_bytes
    )


# --- a rank ends with its launcher -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _ranks_of(launcher: int) -> list[int]:
    """The launcher's rank processes: its children, or (forked, hw/launch/forkserver.py) its fork
    server's."""
    ranks = []
    for pid in _children(launcher):
        try:
            forkserver = (
                b"kvstage.hw.launch.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
            )
        except OSError:
            continue
        ranks += _children(pid) if forkserver else [pid]
    return ranks


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) == "Z"
    except OSError:
        return True


def _wait_registered(
    address: str, secret_file: Path, launcher: subprocess.Popen, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while not secret_file.exists():
        assert launcher.poll() is None and time.monotonic() < deadline, "the launcher did not start"
        time.sleep(0.1)
    client = RendezvousClient(address, secret=read_secret_file(secret_file))
    try:
        while True:
            assert launcher.poll() is None and time.monotonic() < deadline, (
                "the ranks did not register"
            )
            try:
                if client.query(5)[1] is not None:
                    return
            except RendezvousError:
                pass
            time.sleep(0.2)
    finally:
        client.close()


@pytest.mark.hw
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
@pytest.mark.slow
def test_killed_launcher_takes_every_rank_with_it(tmp_path, sig):
    require_engine("nixl")
    f = write_scenario(tmp_path, 2, 1, 8, requests=400)  # 20 s of arrivals: killed mid-run
    port = _free_port()
    out = tmp_path / "run"
    with (tmp_path / "launcher.log").open("w") as log:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstage.cli",
                "hw",
                str(f),
                "--backend",
                "nixl",
                "--out",
                str(out),
                "--port",
                str(port),
                "--tool-connections",  # _wait_registered asks as a tool
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    ranks: list[int] = []
    try:
        _wait_registered(f"127.0.0.1:{port}", out / "run.secret", launcher, timeout_s=180)
        ranks = _ranks_of(launcher.pid)
        assert len(ranks) == 3, ranks
        os.kill(launcher.pid, sig)
        deadline = time.monotonic() + 20
        while not all(_gone(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in ranks), [pid for pid in ranks if not _gone(pid)]
        code = launcher.wait(timeout=60)
        if sig == signal.SIGTERM:  # the run failed, saying why, after cleaning up
            assert code == 1
            assert "received SIGTERM" in (tmp_path / "launcher.log").read_text()
    finally:
        for pid in [launcher.pid, *ranks]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=10)


@pytest.mark.hw
@pytest.mark.slow
def test_kvstage_hw_takes_its_secret_from_a_file(tmp_path):
    """`kvstage hw --secret-file F` runs with that secret (the ranks of the run use it:
    RUN_DIR/run.secret holds it) instead of drawing one; a file it cannot read is one
    clear error before anything starts."""
    require_engine("nixl")
    secret = os.urandom(32)
    f = tmp_path / "mine.secret"
    write_secret_file(f, secret)
    scenario = write_scenario(tmp_path, 1, 1, 8, requests=3)
    cmd = [*kvstage_cmd(), "hw", str(scenario), "--backend", "nixl", "--timeout", "120"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path / "run"), "--secret-file", str(f)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "run" / "run.secret").read_text().strip() == secret.hex()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["bytes_wrong"] == 0
    bad = subprocess.run(
        [*cmd, "--out", str(tmp_path / "bad"), "--secret-file", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        bad.returncode == 2
        and "--secret-file: cannot read the run secret file" in bad.stdout + bad.stderr
    )
    assert "Traceback" not in bad.stdout + bad.stderr and not (tmp_path / "bad").exists()
