"""The HTML report (opened in headless Chromium), the Chrome trace export and their CLI."""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
from PIL import Image
from rich.console import Console
from typer.testing import CliRunner

from kvstage.analysis import figures
from kvstage.analysis.chrome_trace import ANCHOR, chrome_events, export_chrome
from kvstage.analysis.compare import room_metrics
from kvstage.analysis.report import build_report
from kvstage.cli.main import app
from kvstage.metrics.rooms import percentiles
from kvstage.run.simrun import run_simulation
from kvstage.run.tracefile import read_records
from kvstage.shared.scenario import load_scenario
from kvstage.shared.trace import TraceRecord

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
SCENARIO = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"
SETS = ["workload.requests=16", "workload.rate_per_s=40", "decode.staging_pool_mb=512"]
IN_CI = os.environ.get("CI") == "true"
# A run directory name a report must escape, not interpret.
ODD_NAME = 'slice <b>&"x"'
IMG_RE = re.compile(r"<img\b[^>]*\bsrc=\"([^\"]*)\"", re.IGNORECASE)
DATA_RE = re.compile(r"data:image/png;base64,[A-Za-z0-9+/=]+")


def simulate(out: Path, extra: list[str] | None = None) -> Path:
    scenario = load_scenario(SCENARIO, overrides=SETS + list(extra or []))
    assert (
        run_simulation(scenario, out=out, progress=False, console=Console(file=io.StringIO())) == 0
    )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("report")
    return {
        "staging": simulate(base / "staging"),
        "slice": simulate(base / ODD_NAME, ["transfer.path=slice"]),
    }


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory) -> Path:
    return build_report(
        [runs["staging"], runs["slice"]], tmp_path_factory.mktemp("html") / "report.html"
    )


# per run: timeline, ring; across runs: CDFs, phase bars, staging vs slice; one comparison
EXPECTED_FIGURES = 2 * 2 + 3 + 1


def decode_png(uri: str) -> Image.Image:
    assert uri.startswith("data:image/png;base64,"), uri[:40]
    raw = base64.b64decode(uri.split(",", 1)[1], validate=True)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(io.BytesIO(raw))
    img.load()
    return img


def test_report_is_self_contained(report):
    text = report.read_text(encoding="utf-8")
    srcs = IMG_RE.findall(text)
    assert len(srcs) == EXPECTED_FIGURES
    for src in srcs:
        img = decode_png(src)
        assert img.width >= 400 and img.height >= 100
    rest = DATA_RE.sub("", text)
    # no external URL at all: no scheme, no protocol-relative address, no CSS url()
    assert not re.search(r"(?i)\b(?:https?|ftp|file|wss?):", rest)
    assert "://" not in rest and "url(" not in rest.lower()
    refs = re.findall(r'(?i)\b(?:src|href)\s*=\s*"([^"]*)"', text)
    assert refs and all(ref.startswith(("data:image/png;base64,", "#")) for ref in refs)
    assert "<script" not in rest.lower() and "<link" not in rest.lower()
    # escaped, never interpreted
    assert ODD_NAME not in text and html.escape(ODD_NAME) in text
    assert "B = " + html.escape(ODD_NAME) in text
    assert report.stat().st_size < 3_000_000
    for heading in ("Run 1:", "Run 2:", "Latency and phases across runs", "Comparison", "B is "):
        assert heading in text


def test_report_prints_the_cdf_percentiles(runs, report):
    """The CDF figure's p50 / p99 are printed as numbers next to it (not only marked)."""
    text = report.read_text(encoding="utf-8")
    section = text[text.index('<section id="all-runs">') :]
    section = section[: section.index("</section>")]
    section = DATA_RE.sub("", section)
    for run in runs.values():
        rooms = room_metrics(read_records(run)[1]).values()
        for key in ("transfer", "ttft"):
            q = percentiles([m[key] for m in rooms if key in m])
            for p in ("p50", "p99"):
                assert f"{q[p] * 1e3:,.2f} ms" in section, (run.name, key, p)
    assert "ring live peak" in text and "ring reserved peak" in text


def test_ring_panels_share_one_scale(runs):
    fig = figures.ring_occupancy(runs["staging"])
    ylims = {ax.get_ylim() for ax in fig.axes if ax.get_ylabel().startswith("decode")}
    watermark = {ax.get_ylim() for ax in fig.axes if ax.get_ylabel().startswith("watermark")}
    assert len(ylims) == 1 and len(watermark) == 1
    pool_mib = load_scenario(SCENARIO, overrides=SETS).pool_bytes / (1 << 20)
    assert next(iter(ylims))[1] > pool_mib  # reservations above the pool fit on the scale


def test_cli_report_png(runs, tmp_path):
    out, png = tmp_path / "r.html", tmp_path / "png"
    res = CliRunner().invoke(
        app,
        ["report", str(runs["staging"]), str(runs["slice"]), "--out", str(out), "--png", str(png)],
    )
    assert res.exit_code == 0, res.output
    files = sorted(png.glob("*.png"))
    assert len(files) == EXPECTED_FIGURES == len(IMG_RE.findall(out.read_text()))
    assert {"latency-cdf.png", "run1-ring.png", "staging-vs-slice.png"} <= {f.name for f in files}
    for f in files:
        assert Image.open(f).width >= 400
    assert f"figures (PNG) in {png}" in res.output


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


def test_report_in_headless_chromium(report, tmp_path):
    chromium = find_chromium()
    if chromium is None:
        if IN_CI:
            pytest.fail("chromium is required in CI (scripts/setup.sh installs Debian's chromium)")
        pytest.skip("chromium not installed (apt-get install chromium)")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report.png"
    shot.unlink(missing_ok=True)
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=5000",
        "--window-size=1280,7000",
        f"--screenshot={shot}",
        "--dump-dom",
        report.resolve().as_uri(),
    ]
    env = {**os.environ, "DBUS_SESSION_BUS_ADDRESS": "disabled:"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]
    assert not console, "\n".join(console)  # the page has no script: any console line is an error
    dom = proc.stdout
    srcs = IMG_RE.findall(dom)
    assert len(srcs) == EXPECTED_FIGURES  # every figure made it into the rendered document
    for src in srcs:
        decode_png(src)
    assert shot.exists(), "no screenshot"
    img = Image.open(shot)
    assert img.width == 1280
    colors = img.convert("RGB").resize((128, 700)).getcolors(maxcolors=1 << 16)
    assert colors is None or len(colors) > 50  # a rendered page, not a blank one


def test_export_chrome(runs, tmp_path):
    for run in runs.values():
        out = export_chrome(run, tmp_path / f"{run.name}.json")
        doc = json.loads(out.read_text())
        events = doc["traceEvents"]
        _, records = read_records(run)
        anchors = [
            e for e in events if e.get("cat") == ANCHOR
        ]  # zero-length, where an async span's arrow binds
        assert all(e["ph"] == "X" and e["dur"] == 0 for e in anchors)
        body = [
            e for e in events if e["ph"] in ("X", "i", "b") and e.get("cat") != ANCHOR
        ]  # one per trace row
        assert len(body) == len(records)
        assert {e["ph"] for e in events} <= {"M", "X", "i", "b", "e", "C", "s", "f"}
        spans = [e for e in body if e["ph"] in ("X", "b")]
        assert len(spans) == sum(1 for r in records if r.end > r.start)
        assert all(e["dur"] >= 0 for e in spans if e["ph"] == "X")
        assert all(
            isinstance(e["ts"], (int, float)) and e["ts"] >= 0 for e in events if e["ph"] != "M"
        )
        # complete events of one thread never overlap (the JSON format wants them nested)
        lanes = defaultdict(list)
        for e in spans:
            if e["ph"] == "X":
                lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
        for ivs in lanes.values():
            ivs.sort()
            assert all(b0 >= a1 - 1e-6 for (_, a1), (b0, _) in zip(ivs, ivs[1:], strict=False))
        meta = {(e["name"], e["pid"], e["tid"]): e["args"] for e in events if e["ph"] == "M"}
        assert meta[("process_name", 1, 0)] == {"name": "prefill"}
        assert meta[("process_name", 2, 0)] == {"name": "decode"}
        named = {(pid, tid) for name, pid, tid in meta if name == "thread_name"}
        assert {(e["pid"], e["tid"]) for e in body} <= named
        writes = [e for e in spans if e["cat"] in ("write", "slice_write")]
        assert writes and all(e["args"]["bytes"] > 0 and e["args"]["requests"] > 0 for e in writes)
        assert re.fullmatch(r"(slice_)?write r\d+ c\d+", writes[0]["name"])


def _tracks_per_rank(events: list[dict]) -> dict[tuple[int, int], set]:
    """(pid, rank) -> its tracks: threads of its slices and instants, async and counter tracks."""
    tracks: dict[tuple[int, int], set] = defaultdict(set)
    for e in events:
        if e["ph"] in ("X", "i"):
            tracks[(e["pid"], e["tid"] // 100)].add(("thread", e["tid"]))
        elif e["ph"] in ("b", "C"):
            rank = int(re.match(r"(?:prefill|decode) (\d+) ", e["name"]).group(1))
            tracks[(e["pid"], rank)].add((e["ph"], e["name"]))
    return tracks


def test_chrome_trace_tracks_counters_and_flows(runs, tmp_path):
    """Few tracks per rank (one per kind of work, plus async and counter tracks); counters
    of live bytes, reservations and the watermark per decode rank; an arrow from each
    write slice to the scatter slice of the same (room, chunk) at its decode rank."""
    doc = json.loads(export_chrome(runs["staging"], tmp_path / "t.json").read_text())
    events = doc["traceEvents"]
    _, records = read_records(runs["staging"])
    decode_ranks = sorted({r.rank for r in records if r.role == "decode"})
    for (pid, rank), tracks in _tracks_per_rank(events).items():
        threads = [t for t in tracks if t[0] == "thread"]
        assert len(threads) <= 5, (
            pid,
            rank,
            tracks,
        )  # one per kind: messages, compute, gather, write, wm_wait
        assert len(tracks) <= 8, (pid, rank, tracks)
    counters = [e for e in events if e["ph"] == "C"]
    names = {e["name"] for e in counters}
    for d in decode_ranks:
        assert {
            f"decode {d} \u00b7 ring live bytes",
            f"decode {d} \u00b7 ring reserved bytes",
            f"decode {d} \u00b7 watermark (ring rounds)",
        } <= names
    pool = load_scenario(SCENARIO, overrides=SETS).pool_bytes
    live = [e["args"]["bytes"] for e in counters if "live" in e["name"]]
    reserved = [e["args"]["bytes"] for e in counters if "reserved" in e["name"]]
    assert max(live) <= pool < max(reserved)  # this pool overcommits; live bytes never exceed it
    _check_flows(events)
    # every bulk write has its arrow: from its slice on the write thread, or, where it
    # overlaps another write of its rank (chunks packed into one forward are gathered and
    # written together), from its anchor where it lands
    slices = [e for e in events if e["ph"] == "X" and e["cat"] == "write"]
    anchors = [e for e in events if e.get("cat") == ANCHOR and e["name"].endswith("(lands)")]
    writes = [r for r in records if r.phase == "write" and r.role == "prefill" and r.peer >= 0]
    assert len(slices) + len(anchors) == len(writes)
    assert len([e for e in events if e["ph"] == "s"]) == len(writes)


def _check_flows(events: list[dict]) -> None:
    """Every "s" has one "f" with its id; each binds to a slice (innermost at its time on
    its thread) of a write and of the scatter of the same (room, chunk) at the write's
    decode rank; every write whose chunk was scattered at that rank has its arrow."""
    slices = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            slices[(e["pid"], e["tid"])].append(e)

    def enclosing(e: dict) -> dict:
        found = [
            x for x in slices[(e["pid"], e["tid"])] if x["ts"] <= e["ts"] <= x["ts"] + x["dur"]
        ]
        assert found, e
        return min(found, key=lambda x: x["dur"])

    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts and starts.keys() == ends.keys()
    for fid, s in starts.items():
        w, sc = enclosing(s), enclosing(ends[fid])
        assert (
            w["name"].startswith("write ")
            and sc["name"].startswith("scatter ")
            and ends[fid]["bp"] == "e"
        )
        assert (w["args"]["room"], w["args"]["chunk"]) == (sc["args"]["room"], sc["args"]["chunk"])
        assert (
            w["args"]["peer"] == int(sc["tid"]) // 100
        )  # the scatter is at the write's decode rank
    writes = [e for e in events if e.get("cat") == "write" and e["ph"] in ("X", "b")]
    scattered = {
        (e["args"]["room"], e["args"]["chunk"], e["tid"] // 100)
        for e in events
        if e.get("cat") == "scatter" and e["ph"] in ("X", "b")
    }
    assert len(starts) == sum(
        1 for w in writes if (w["args"]["room"], w["args"]["chunk"], w["args"]["peer"]) in scattered
    )


def test_chrome_trace_overlapping_spans_stay_on_few_tracks():
    """Four writes of one rank in flight at once, and four scatters overlapping: one
    thread and one async track per kind, and still an arrow from every write."""
    recs = [
        TraceRecord(
            "prefill",
            0,
            "write",
            0.1 * i,
            1.0 + 0.1 * i,
            room=1,
            chunk=i,
            writer=0,
            peer=0,
            offset=0,
            bytes=100,
            requests=1,
        )
        for i in range(4)
    ]
    recs += [
        TraceRecord(
            "decode", 0, "scatter", 1.5 + 0.1 * i, 2.5 + 0.1 * i, room=1, chunk=i, bytes=100
        )
        for i in range(4)
    ]
    recs += [
        TraceRecord(
            "decode",
            0,
            "free",
            2.6 + 0.1 * i,
            2.6 + 0.1 * i,
            room=1,
            chunk=i,
            offset=0,
            bytes=100,
            ring_used=0,
            wm_round=0,
            wm_tail=100 * (i + 1),
        )
        for i in range(4)
    ]
    events = chrome_events(recs, pool_bytes=400)["traceEvents"]
    tracks = _tracks_per_rank(events)
    assert len(tracks[(1, 0)]) == 2  # prefill 0: the write thread and one async track
    assert len(tracks[(2, 0)]) == 3 + 3  # decode 0: events, scatter, scatter async; three counters
    assert sum(1 for e in events if e["ph"] == "b") == 3 + 3
    _check_flows(events)
    assert sum(1 for e in events if e["ph"] == "s") == 4


def test_cli_report_and_export(runs, tmp_path):
    runner = CliRunner()
    out = tmp_path / "r.html"
    res = runner.invoke(
        app, ["report", str(runs["staging"]), "--out", str(out), "--max-rooms", "4"]
    )
    assert res.exit_code == 0, res.output
    assert len(IMG_RE.findall(out.read_text())) == 2 + 2  # one run: no slice / comparison figures
    res = runner.invoke(
        app, ["export-trace", str(runs["staging"]), "--chrome", "--out", str(tmp_path / "t.json")]
    )
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    res = runner.invoke(app, ["export-trace", str(runs["staging"])])
    assert res.exit_code == 2 and "--chrome" in res.output
    for args in (
        ["report", str(tmp_path)],
        ["export-trace", str(tmp_path), "--chrome"],
        ["compare", str(tmp_path), str(runs["staging"])],
    ):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, args
        assert "is not a run directory" in res.output
        assert res.exception is None or isinstance(res.exception, SystemExit)


def test_staging_vs_slice_puts_exposed_transfer_beside_ttft(runs):
    """The main job's chart: TTFT, then the exposed KV transfer inside it, each panel
    saying which span it measures, with bars matching the runs' own per-request figures."""
    from kvstage.analysis.figures import staging_vs_slice
    from kvstage.fmt import quantile
    from kvstage.metrics.rooms import request_breakdown, room_latencies
    from kvstage.run.rundir import load_run

    loaded = [load_run(runs["staging"]), load_run(runs["slice"])]
    fig = staging_vs_slice(loaded)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("TTFT") and "arrival -> first token" in titles[0]
    assert titles[1].startswith("exposed KV transfer") and "last forward end" in titles[1]
    # bar heights: p50 and p99 per run, in ms, from the same breakdown summary.json uses
    heights = [round(p.get_height(), 6) for p in fig.axes[1].patches]
    want = []
    for q in (0.5, 0.99):
        for run in loaded:
            spans = sorted(request_breakdown(room_latencies(run.records))["kv_transfer_latency_s"])
            want.append(round(quantile(spans, q) * 1e3, 6))
    assert heights == want
    ttft = [p.get_height() for p in fig.axes[0].patches]
    assert all(t > e for t, e in zip(ttft, heights, strict=True))  # a part of TTFT, not beside it
