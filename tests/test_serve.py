"""`kvstage serve`: the tokenizer rule, the OpenAI face, a real client against it."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

from kvstage.shared.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
P8D2 = ROOT / "scenarios" / "llama3-70b-p8-d2.toml"


def test_the_local_tokenizer_counts_as_the_rule(tmp_path):
    from transformers import AutoTokenizer

    from kvstage.serve.tokenizer import OUTPUT_WORD, count_tokens, write_tokenizer

    tok = AutoTokenizer.from_pretrained(str(write_tokenizer(tmp_path / "tok")))
    text = "To be, or  not to be:\nthat is the question\t[UNK] zebra"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == count_tokens(text) == 12
    for skip in (False, True):  # decoded text counts back to the same number
        assert count_tokens(tok.decode(ids, skip_special_tokens=skip)) == 12
    streamed = OUTPUT_WORD + (" " + OUTPUT_WORD) * 4
    assert len(tok.encode(streamed, add_special_tokens=False)) == 5
    json.loads((tmp_path / "tok" / "tokenizer.json").read_text())


SERVE_SETS = ["decode.max_running_requests=2"]


async def _with_face(fn):
    """Run `fn(client)` against the OpenAI face of a fresh realtime cluster."""
    from aiohttp.test_utils import TestClient, TestServer

    from kvstage.serve.openai_api import OpenAIFace, make_app
    from kvstage.serve.realtime import RealtimeCluster

    done = []
    cluster = RealtimeCluster(load_scenario(P8D2, SERVE_SETS), done.append)
    client = TestClient(TestServer(make_app(OpenAIFace(cluster, "m", 0))))
    await client.start_server()
    pacer = asyncio.create_task(cluster.pace())
    try:
        return await fn(client), done
    finally:
        pacer.cancel()
        await client.close()


def _events(text: str) -> list:
    data = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_a_streamed_completion_sends_one_chunk_a_token_then_usage():
    async def go(client):
        body = {"model": "m", "prompt": "one two three", "max_tokens": 5, "stream": True}
        body["stream_options"] = {"include_usage": True}
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        return _events(await r.text())

    events, done = asyncio.run(_with_face(go))
    chunks, usage = events[:-1], events[-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " ".join(["kv"] * 5)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
    }
    (served,) = done  # the request's timeline: 5 simulated tokens after its arrival
    assert served.prompt_tokens == 3 and len(served.token_s) == 5
    assert served.arrival_s < served.token_s[0] and served.token_s == sorted(served.token_s)
    assert len(served.sent_late_s) == 5 and min(served.sent_late_s) >= 0


def test_chat_streams_the_role_first_and_a_whole_answer_has_usage():
    async def go(client):
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        body = {"messages": msgs, "max_completion_tokens": 3, "stream": True}
        streamed = _events(await (await client.post("/v1/chat/completions", json=body)).text())
        body["stream"] = False
        whole = await (await client.post("/v1/chat/completions", json=body)).json()
        return streamed, whole

    (streamed, whole), done = asyncio.run(_with_face(go))
    deltas = [c["choices"][0]["delta"] for c in streamed]
    assert deltas[0] == {"role": "assistant", "content": "kv"}
    assert deltas[1:] == [{"content": " kv"}] * 2
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "kv kv kv"}
    assert whole["usage"]["prompt_tokens"] == 3 and whole["usage"]["completion_tokens"] == 3
    assert [s.endpoint for s in done] == ["/v1/chat/completions"] * 2


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/completions", {"prompt": "x"}, 400, "max_tokens is missing"),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 0},
            400,
            "max_tokens must be an integer >= 1",
        ),
        ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}, 400, "a batch of 2 prompts"),
        ("/v1/completions", {"max_tokens": 2}, 400, "prompt is missing"),
        ("/v1/completions", {"model": "other", "prompt": "x", "max_tokens": 2}, 404, "served: 'm'"),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 2}, 400, "non-empty list"),
        ("/v1/completions", {"prompt": "x " * 10**6, "max_tokens": 2}, 400, "context: the prompt"),
    ],
)
def test_bad_requests_get_one_message_naming_the_field(path, body, status, message):
    async def go(client):
        r = await client.post(path, json=body)
        return r.status, await r.json()

    (got, answer), done = asyncio.run(_with_face(go))
    assert got == status and message in answer["error"]["message"]
    assert done == []


def test_models_and_health_answer():
    async def go(client):
        models = await (await client.get("/v1/models")).json()
        health = [(await client.get(p)).status for p in ("/health", "/health_generate", "/ping")]
        return models, health

    (models, health), _ = asyncio.run(_with_face(go))
    assert [m["id"] for m in models["data"]] == ["m"] and health == [200, 200, 200]


# --- a real client (AIPerf, the bench-client extra) against `kvstage serve` ------------------
# What the test holds, on this project's loaded 2-core hosts
# (docs/results/2026-12-03-serve-vs-aiperf.md): the counts exactly; no token at the
# client before its simulated time; the client reads the token times the server sent
# (median of client minus as sent, per request for TPOT and per gap for ITL: within
# 0.3 ms at load 10 to 15); and what the server streamed is kvstage's own figures of
# its trace. How far what was sent is from the simulated times is the server's lag,
# recorded per token (served.jsonl `sent_late_s`) and reported, not bounded here: on a
# host at a load of 20 to 30 it reaches tens of ms to a second (TPOT -20 ms, TTFT
# +0.9 s in the median), which says nothing about kvstage's model.
SENT_MEDIAN_TOL_S = 0.005
CLOCK_S = 0.001  # two processes' readings of one monotonic clock


def _bench():
    spec = importlib.util.spec_from_file_location(
        "serve_vs_client", ROOT / "benchmarks" / "serve_vs_client.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One `kvstage serve` for the module (each run of the test replays on it)."""
    bench = _bench()
    run_dir = tmp_path_factory.mktemp("serve") / "run"
    proc, url = bench.start_server(P8D2, [], run_dir)
    yield bench, url, run_dir
    out = bench.stop_server(proc)
    assert proc.returncode == 0, out[-3000:]  # the run ended clean: no invariant broke
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["serve"]["unfinished_at_stop"] == 0
    # what the server streamed is kvstage's own figures of its trace (metrics/rooms.py)
    from kvstage.metrics.rooms import request_figures, room_latencies
    from kvstage.run.tracefile import read_records

    rooms = room_latencies(read_records(run_dir)[1])
    rows = [json.loads(line) for line in (run_dir / "served.jsonl").read_text().splitlines()]
    assert rows and len(rows) == summary["serve"]["requests"]
    for row in rows:
        figures = request_figures(rooms[row["room"]])
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            assert row[key] == pytest.approx(figures[key], abs=1e-9), (row["room"], key)


@pytest.mark.timeout(1200)  # AIPerf starts some ten processes: minutes on a loaded 2-core host
def test_aiperf_measures_what_kvstage_simulated(served, tmp_path):
    from kvstage.fmt import quantile
    from kvstage.serve.agreement import differences

    bench, url, run_dir = served
    pairs = bench.replay_on(url, run_dir, tmp_path, requests=6, gap_ms=120)
    # the client counted the prompt and output tokens the server did, request by request
    assert len(pairs) == 6
    assert all(c.prompt_tokens == r["prompt_tokens"] for c, r in pairs)
    assert all(c.output_tokens == r["output_tokens"] == len(r["token_s"]) for c, r in pairs)
    for client, row in pairs:  # no token reaches the client before its simulated time
        assert client.ttft_s >= row["ttft_s"] - CLOCK_S
        assert client.e2e_s >= row["e2e_s"] - CLOCK_S
    d = differences(pairs)
    for m in ("tpot_s", "itl_s"):
        assert abs(quantile(sorted(d[m]["vs_sent"]), 0.5)) <= SENT_MEDIAN_TOL_S, (m, d[m])
