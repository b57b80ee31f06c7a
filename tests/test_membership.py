"""The rendezvous's membership as a pure machine (hw/control/membership.py): every
ordering of registrations, beats, deaths, rejoins and reports, with time and messages
given by the test. No socket, no thread, no clock."""

from __future__ import annotations

import json

import pytest

from kvstage.hw.control.membership import MAX_SPEAKERS, REJOIN_ACK_S, Membership, RankInfo

P0, P1, D0 = b"conn-p0", b"conn-p1", b"conn-d0"
NEW, STRANGER = b"conn-new", b"conn-stranger"


def hello(role: str, rank: int, incarnation: int = 100) -> dict:
    info = RankInfo(
        role, rank, f"tcp://127.0.0.1:{6000 + rank}", f"{role}{rank}", b"meta", {}, incarnation
    )
    return {"kind": "hello", **info.to_json(), "key": "cd" * 32}


class Run:
    """A Membership, and the messages sent to it, numbered per signer as a client does."""

    def __init__(self, names=("prefill0", "decode0"), **kw) -> None:
        self.m = Membership(list(names), **kw)
        self.now = 1000.0
        self.seq: dict[str, int] = {}
        self.sent: list[tuple[bytes, dict]] = []

    def say(self, conn: bytes, signer: str, msg: dict, incarnation: int = 100, seq=None, **kw):
        """`kw`: proven (with the signer's credential; default yes), origin."""
        if seq is None:
            seq = self.seq[signer] = self.seq.get(signer, 0) + 1
        self.m.message(conn, signer, incarnation, seq, msg, self.now, 5e8 + self.now, **kw)
        return self.out()

    def tick(self, dt: float = 0.0):
        self.now += dt
        self.m.tick(self.now, 5e8 + self.now)
        return self.out()

    def out(self) -> list[tuple[bytes, dict]]:
        sent = self.m.take_sends()
        self.sent += sent
        return sent

    def register(self, *who: tuple[bytes, str, int]) -> None:
        for conn, name, rank in who:
            role = name.rstrip("0123456789")
            assert self.say(conn, name, hello(role, rank)) == []
        tables = self.tick()
        assert sorted(c for c, msg in tables if msg["kind"] == "table") == sorted(
            c for c, _, _ in who
        )


def refused(sent) -> str:
    ((_, msg),) = sent
    assert msg["kind"] == "refused", msg
    return msg["reason"]


def started(**kw) -> Run:
    run = Run(**kw)
    run.register((P0, "prefill0", 0), (D0, "decode0", 0))
    return run


def test_every_rank_in_then_each_gets_the_table_and_a_start_after_the_probe():
    run = Run(probe_slots=2, probe_slot_s=0.25)
    run.say(P0, "prefill0", hello("prefill", 0))
    assert run.tick() == [] and not run.m.started
    run.say(D0, "decode0", hello("decode", 0))
    sent = run.tick()
    assert [c for c, _ in sent] == [P0, D0]
    msg = sent[0][1]
    assert msg["t0"] == 5e8 + run.now + 0.5 + 0.5 and msg["probe"]["start"] == msg["t0"] - 0.5
    assert sorted(r["agent"] for r in msg["ranks"]) == ["decode0", "prefill0"]


def test_who_may_speak_for_a_rank_is_asked_before_its_replay_floor_moves():
    """Issue 39: three queries signed for prefill0 with the largest number, from another
    connection, made every later message of the real prefill0 look replayed."""
    run = Run()
    # before it registers: only a hello may be signed for it elsewhere than its connection
    why = refused(run.say(STRANGER, "prefill0", {"kind": "query"}, seq=2**64 - 1))
    assert "not prefill0's registered one" in why
    run.register((P0, "prefill0", 0), (D0, "decode0", 0))
    for _ in range(3):
        why = refused(run.say(STRANGER, "prefill0", {"kind": "query"}, seq=2**64 - 1))
        assert "not prefill0's registered one" in why
    # a hello with the largest incarnation is refused (the rank is live) and moves nothing
    why = refused(run.say(STRANGER, "prefill0", hello("prefill", 0, 2**63 - 1), 2**63 - 1))
    assert "registered and live" in why
    (answer,) = run.say(P0, "prefill0", {"kind": "query"})
    assert answer == (P0, {"kind": "table", "ranks": answer[1]["ranks"], "t0": run.m.t0,
                           "incarnations": {"prefill0": 100, "decode0": 100},
                           "rejoins": []})  # fmt: skip
    assert run.say(P0, "prefill0", {"kind": "report", "role": "prefill", "rank": 0}) == []
    assert "prefill0" in run.m.reports


def test_the_run_secret_alone_registers_as_no_rank_and_moves_nothing():
    """Issue 39: registration was first come, first served for any holder of run.secret.
    Unproven (the run secret, not the rank's credential), no message signed for a rank
    of the run is taken, before or after it registers, and none moves its floor."""
    run = Run()
    for kind in ("hello", "query", "alive", "report"):
        msg = hello("prefill", 0, 2**63 - 1) if kind == "hello" else {"kind": kind}
        run.say(STRANGER, "prefill0", msg, 2**63 - 1, 2**64 - 1, proven=False)
        assert "with the run secret but not prefill0's own credential" in run.m.refusals[-1]
    assert not run.m.hellos and not run.m.registered
    run.register((P0, "prefill0", 0), (D0, "decode0", 0))  # number 1 is new: nothing moved
    assert run.m.hellos["prefill0"][0] == P0
    why = refused(run.say(NEW, "prefill0", hello("prefill", 0, 200), 200, proven=False))
    assert "not prefill0's own credential" in why and not run.m.duplicates
    # a tool's own name needs no credential
    (answer,) = run.say(STRANGER, "tool-1", {"kind": "query"}, proven=False)
    assert answer[1]["kind"] == "table"


def test_a_second_claim_of_a_registered_name_names_both_claimants():
    """Two processes proving one rank's credential (a key file read by another process
    of the run's user): refused, kept in `duplicates` for the launcher to fail the run,
    and both named: where each came from, its control address, incarnation and key."""
    run = Run()
    run.say(P0, "prefill0", hello("prefill", 0), origin="10.0.0.1")
    impostor = {**hello("prefill", 0, 300), "control": "tcp://10.0.0.9:7000", "key": "ef" * 32}
    why = refused(run.say(STRANGER, "prefill0", impostor, 300, origin="10.0.0.9"))
    assert "prefill0 is already registered" in why
    assert "registered: connection " + P0.hex()[:16] + " from 10.0.0.1 (control" in why
    assert "from 10.0.0.1 (control tcp://127.0.0.1:6000, incarnation 100, key cdcdcd" in why
    assert "refused: connection " + STRANGER.hex()[:16] + " from 10.0.0.9 (control " in why
    assert "tcp://10.0.0.9:7000, incarnation 300, key efefef" in why
    (claim,) = run.m.duplicates
    assert claim in why and claim in run.m.events
    assert run.m.hellos["prefill0"][0] == P0  # the first claimant keeps it
    # once the run started: a decode rank claimed again is a duplicate too; a prefill
    # rank's newer incarnation is a restart the launcher has not seen yet (retried), and
    # its refusal names both as well
    run.say(D0, "decode0", hello("decode", 0))
    run.tick()
    why = refused(run.say(NEW, "decode0", hello("decode", 0, 200), 200, origin="10.0.0.9"))
    assert "only a prefill rank can rejoin" in why and len(run.m.duplicates) == 2
    sent = run.say(NEW, "prefill0", hello("prefill", 0, 400), 400, origin="10.0.0.2")
    assert sent[0][1]["retry"] is True and "from 10.0.0.2 (control" in refused(sent)
    assert len(run.m.duplicates) == 2


def test_a_message_sent_again_is_refused_and_a_rank_speaks_only_for_itself():
    run = started()
    run.say(P0, "prefill0", {"kind": "alive"}, seq=50)
    assert run.m.refusals == []
    assert run.say(P0, "prefill0", {"kind": "alive"}, seq=50) == []  # alive: never answered
    assert "replayed message: signed for prefill0 incarnation 100 number 50" in run.m.refusals[-1]
    why = refused(run.say(P0, "decode0", {"kind": "report", "role": "decode", "rank": 0}))
    assert "a rank speaks only for itself" in why or "not decode0's registered one" in why
    why = refused(run.say(P0, "tool-1", {"kind": "query"}))
    assert "a rank speaks only for itself" in why
    # a tool (a name not of this run) has its own floor
    (answer,) = run.say(STRANGER, "tool-2", {"kind": "query"}, seq=7)
    assert answer[1]["kind"] == "table"
    assert "replayed" in refused(run.say(STRANGER, "tool-2", {"kind": "query"}, seq=7))


def test_a_silent_rank_is_down_then_gone_after_its_grace_unless_it_said_it_would_be_quiet():
    run = started(silent_s=5.0, rejoin_grace_s=3.0)
    run.say(D0, "decode0", {"kind": "alive", "quiet_s": 60})
    run.tick(5.5)
    assert "prefill0" in run.m.down and "decode0" not in run.m.down
    assert run.m.take_events() == [
        "rank prefill0 is down: rank prefill0 stopped answering the rendezvous (nothing from "
        "it for 5.5s): dead, hung or cut off; it may rejoin within 3s"
    ]
    run.tick(2.9)
    assert "prefill0" in run.m.down and not run.m.gone
    run.tick(0.2)
    assert list(run.m.gone) == ["prefill0"] and not run.m.down
    assert run.m.take_events() == ["rank prefill0 is gone (it did not rejoin in time)"]
    run.tick(60.0)
    assert "decode0" in run.m.gone  # its quiet time over: down, and gone (no grace for a decode)


def test_a_dead_decode_rank_is_gone_at_once_and_the_run_ends_with_the_others_reports():
    run = started(rejoin_grace_s=30.0)
    assert run.m.mark_down("decode0", "rank decode0 died (exit code 1)", run.now)
    assert run.m.gone == {"decode0": "rank decode0 died (exit code 1)"}
    assert not run.m.mark_down("decode0", "again", run.now)
    assert not run.m.all_reported
    run.say(P0, "prefill0", {"kind": "report", "role": "prefill", "rank": 0})
    assert run.m.all_reported
    run.m.release()
    assert run.out() == [(P0, {"kind": "bye"})]


def test_reports_only_from_a_ranks_own_connection_and_once():
    run = started()
    why = refused(run.say(STRANGER, "tool-1", {"kind": "report", "role": "decode", "rank": 0}))
    assert "registered no rank" in why
    why = refused(run.say(D0, "decode0", {"kind": "report", "role": "prefill", "rank": 0}))
    assert "report for prefill0 from the connection of decode0" in why
    assert run.say(D0, "decode0", {"kind": "report", "role": "decode", "rank": 0}) == []
    assert "already reported" in refused(
        run.say(D0, "decode0", {"kind": "report", "role": "decode", "rank": 0})
    )


def test_a_rank_thought_silent_that_reports_after_all_is_not_down():
    run = started(silent_s=5.0, rejoin_grace_s=30.0)
    run.tick(6.0)
    assert "prefill0" in run.m.down
    run.say(P0, "prefill0", {"kind": "report", "role": "prefill", "rank": 0})
    assert "prefill0" not in run.m.down and "prefill0" in run.m.reports


def _rejoin_asked(run: Run, incarnation: int = 200) -> dict:
    """prefill0's new incarnation registers on NEW once the old one is down: decode0 is
    asked; returns the notice."""
    ((conn, notice),) = run.say(NEW, "prefill0", hello("prefill", 0, incarnation), incarnation)
    assert conn == D0 and notice["kind"] == "rejoin"
    assert notice["rank"]["incarnation"] == incarnation
    return notice


def test_rejoin_after_a_death_the_launcher_saw():
    run = started(rejoin_grace_s=30.0)
    run.m.mark_down(
        "prefill0", "rank prefill0 died (killed by signal 9); its log x:\n  tail", run.now
    )
    _rejoin_asked(run)
    run.say(D0, "decode0", {"kind": "rejoin_ack", "rank": "prefill0", "incarnation": 200,
                            "first_room": 7})  # fmt: skip
    (sent,) = run.tick()
    assert sent[0] == NEW and sent[1]["rejoin"] == {
        "incarnation": 200,
        "first_room": 7,
        "answered": ["decode0"],
        "silent": [],
    }
    assert run.m.rejoins == [
        {
            "rank": "prefill0",
            "incarnation": 200,
            "first_room": 7,
            "after": "rank prefill0 died (killed by signal 9)",
        }
    ]
    # the old incarnation's connection speaks for nobody now
    why = refused(run.say(P0, "prefill0", {"kind": "report", "role": "prefill", "rank": 0}))
    assert "signed for prefill0 incarnation 100 number" in why
    assert run.say(NEW, "prefill0", {"kind": "report", "role": "prefill", "rank": 0},
                   incarnation=200) == []  # fmt: skip
    assert "prefill0" in run.m.reports


def test_rejoin_asked_before_the_death_is_seen_waits_until_the_rank_is_down():
    run = started(silent_s=5.0, rejoin_grace_s=30.0)
    for _ in range(3):  # the new incarnation asks again every 0.5 s (RETRY_S)
        sent = run.say(NEW, "prefill0", hello("prefill", 0, 200), 200)
        assert sent[0][1]["retry"] is True and "registered and live" in refused(sent)
        run.say(D0, "decode0", {"kind": "alive"})
        run.tick(0.5)
    run.say(D0, "decode0", {"kind": "alive"})
    run.tick(4.0)  # the old one silent for 5.5 s: down
    assert "prefill0" in run.m.down
    _rejoin_asked(run)


def test_rejoin_with_no_decode_answer_goes_on_after_its_wait_serving_nothing():
    run = started(rejoin_grace_s=30.0)
    run.m.mark_down("prefill0", "died", run.now)
    _rejoin_asked(run)
    assert run.tick(REJOIN_ACK_S - 0.1) == []
    ((conn, table),) = run.tick(0.2)
    assert conn == NEW and table["rejoin"]["first_room"] is None
    assert table["rejoin"]["silent"] == ["decode0"]


def test_rejoin_completes_when_the_asked_decode_rank_goes_down_meanwhile():
    run = Run(names=("prefill0", "decode0", "decode1"), rejoin_grace_s=30.0)
    run.register((P0, "prefill0", 0), (D0, "decode0", 0), (b"conn-d1", "decode1", 1))
    run.m.mark_down("prefill0", "died", run.now)
    sent = run.say(NEW, "prefill0", hello("prefill", 0, 200), 200)
    assert sorted(c for c, msg in sent if msg["kind"] == "rejoin") == [D0, b"conn-d1"]
    ack = {"kind": "rejoin_ack", "rank": "prefill0", "incarnation": 200, "first_room": 4}
    run.say(b"conn-d1", "decode1", ack)
    assert run.tick() == []  # decode0 has not answered
    run.m.mark_down("decode0", "died too", run.now)
    ((conn, table),) = run.tick()
    assert conn == NEW and table["rejoin"]["first_room"] == 4
    assert table["rejoin"]["answered"] == ["decode1"] and table["rejoin"]["silent"] == []


def test_a_rank_that_dies_while_rejoining_rejoins_no_more():
    run = started(rejoin_grace_s=30.0)
    run.m.mark_down("prefill0", "died", run.now)
    _rejoin_asked(run)
    run.m.mark_down("prefill0", "died again", run.now)
    assert run.tick(REJOIN_ACK_S + 1) == [] and run.m.rejoins == []
    assert "prefill0" in run.m.down


@pytest.mark.parametrize(
    ("state", "incarnation", "why"),
    [
        ("down", 100, "needs a newer one, not 100"),
        ("down", 50, "replayed message: signed for prefill0 incarnation 50"),
        ("gone", 300, "declared gone, too late to rejoin"),
        ("finished", 300, "finished: nothing to rejoin"),
    ],
)
def test_a_rejoin_is_refused_when_it_cannot_be(state, incarnation, why):
    run = started(rejoin_grace_s=30.0)
    if state == "down":
        run.m.mark_down("prefill0", "died", run.now)
    elif state == "gone":
        run.m.mark_down("prefill0", "died", run.now, grace_s=0)
    else:
        run.say(P0, "prefill0", {"kind": "report", "role": "prefill", "rank": 0}, seq=5)
    seq = 10 if incarnation == 100 else 1
    assert why in refused(run.say(NEW, "prefill0", hello("prefill", 0, incarnation),
                                  incarnation, seq=seq))  # fmt: skip
    assert not [s for s in run.sent if s[1]["kind"] == "rejoin"]


def test_a_decode_rank_never_rejoins_and_acks_come_only_from_the_asked():
    run = started(rejoin_grace_s=30.0)
    run.m.mark_down("decode0", "died", run.now, grace_s=30)
    why = refused(run.say(NEW, "decode0", hello("decode", 0, 200), 200))
    assert "only a prefill rank can rejoin" in why
    run = started(rejoin_grace_s=30.0)
    run.m.mark_down("prefill0", "died", run.now)
    _rejoin_asked(run)
    ack = {"kind": "rejoin_ack", "rank": "prefill0", "incarnation": 999, "first_room": 1}
    assert run.say(D0, "decode0", ack) == []  # not answered, only refused
    assert "no such rejoin asked of it" in run.m.refusals[-1]


def _parts(report: dict, size: int) -> list[dict]:
    text = json.dumps(report)
    n = -(-len(text) // size)
    return [
        {"kind": "report_part", "part": i, "parts": n, "text": text[i * size : (i + 1) * size]}
        for i in range(n)
    ]


def test_a_report_in_parts_is_held_for_its_rank_alone_and_up_to_the_bound():
    """Issue 39 item 4: a report too big for one message comes in parts, in order, on the
    rank's own connection; what is held for a rank is bounded; a bad part drops its parts
    and is refused, naming why, and the rank may send its report again."""
    run = started(max_report_bytes=2000)
    report = {"role": "decode", "rank": 0, "records": [[i, "x" * 10] for i in range(40)]}
    parts = _parts(report, 200)
    assert len(parts) > 3
    # from a connection that registered no rank, signed as a tool: refused
    assert "registered no rank" in refused(run.say(STRANGER, "tool-1", parts[0]))
    # signed for decode0 from prefill0's connection: refused before decode0's state moves
    assert "speaks only for itself" in refused(run.say(P0, "decode0", parts[0]))
    # out of order: refused, parts dropped
    assert run.say(D0, "decode0", parts[0]) == []
    assert "parts come in order" in refused(run.say(D0, "decode0", parts[2]))
    # over the bound: refused, naming it
    big = _parts({**report, "pad": "y" * 3000}, 900)
    for part in big[:2]:
        assert run.say(D0, "decode0", part) == []
    why = refused(run.say(D0, "decode0", big[2]))
    assert "at most 2000 a rank" in why and "its parts dropped" in why
    assert not run.m._parts and "decode0" not in run.m.reports
    # not text
    assert "'text' a string" in refused(run.say(D0, "decode0", {**parts[0], "text": 7}))
    # the whole report, in order: taken as the rank's report
    for part in parts:
        assert run.say(D0, "decode0", part) == []
    assert run.m.reports["decode0"][1] == report
    assert "already reported" in refused(run.say(D0, "decode0", parts[0]))


def test_a_flood_of_tool_names_never_evicts_a_ranks_replay_floor():
    """Tools' replay floors are bounded (the oldest dropped); a rank's are kept apart."""
    run = started()
    assert run.say(P0, "prefill0", {"kind": "clock", "t1": 1.0}, seq=50)[0][1]["kind"] == "clock"
    for i in range(MAX_SPEAKERS + 10):
        run.say(STRANGER, f"tool-{i}", {"kind": "clock", "t1": 1.0}, seq=1)
    assert len(run.m._tools) == MAX_SPEAKERS
    assert "replayed message" in refused(
        run.say(P0, "prefill0", {"kind": "clock", "t1": 1.0}, seq=50)
    )


def test_each_rank_gets_only_its_peers_entries_and_a_tool_no_entry():
    """Issue 39 item 3, least exposure: two pairs (prefill0 -> decode0, prefill1 ->
    decode1). Each rank's table, its query and a rejoin's table hold its own entry and its
    peers'; a rejoin asks only the rejoining rank's decode peers; a tool's query gets every
    rank's incarnation, t0 and the rejoins, and no entry."""
    P1_, D1 = b"conn-p1", b"conn-d1"
    peers = {"prefill0": {"decode0"}, "prefill1": {"decode1"}}
    peers |= {"decode0": {"prefill0"}, "decode1": {"prefill1"}}
    run = Run(("prefill0", "prefill1", "decode0", "decode1"), peers=peers, rejoin_grace_s=30.0)
    for conn, name, rank in ((P0, "prefill0", 0), (P1_, "prefill1", 1), (D0, "decode0", 0),
                             (D1, "decode1", 1)):  # fmt: skip
        run.say(conn, name, hello(name.rstrip("01"), rank))
    tables = {
        conn: sorted(e["role"] + str(e["rank"]) for e in msg["ranks"]) for conn, msg in run.tick()
    }
    assert tables == {
        P0: ["decode0", "prefill0"],
        P1_: ["decode1", "prefill1"],
        D0: ["decode0", "prefill0"],
        D1: ["decode1", "prefill1"],
    }
    ((_, mine),) = run.say(D1, "decode1", {"kind": "query"})
    assert sorted(e["role"] + str(e["rank"]) for e in mine["ranks"]) == ["decode1", "prefill1"]
    ((_, tool),) = run.say(STRANGER, "tool-1", {"kind": "query"})
    assert tool["ranks"] == [] and tool["t0"] == run.m.t0
    assert tool["incarnations"] == dict.fromkeys(peers, 100)
    # prefill1 rejoins: only decode1 is asked, and its table is its view
    run.m.mark_down("prefill1", "rank prefill1 died", run.now)
    asked = run.say(NEW, "prefill1", hello("prefill", 1, incarnation=200), incarnation=200)
    assert [(conn, msg["kind"]) for conn, msg in asked] == [(D1, "rejoin")]
    run.say(D1, "decode1", {"kind": "rejoin_ack", "rank": "prefill1", "incarnation": 200,
                            "first_room": 3})  # fmt: skip
    ((conn, table),) = run.tick()
    assert conn == NEW and table["rejoin"]["answered"] == ["decode1"]
    assert sorted(e["role"] + str(e["rank"]) for e in table["ranks"]) == ["decode1", "prefill1"]
