"""Where the suite's wall time goes: each worker's tests on one clock, and the CPU beside.

Runs the README's test command (scripts/test.sh, arguments passed on) with a pytest plugin
of this file that notes when each test starts and ends on which xdist worker, while a
thread reads /proc/stat once a second. Prints, for the parallel part and the `alone` part:
wall time, each worker's time in tests and when its last test ended (a worker idle at the
end waited for the other's long tail), the time before the first test (start-up and
collection), the CPU's busy share over the run (idle CPU is what another worker could
use), and the longest tests.

    .venv/bin/python benchmarks/suite_timeline.py                       # the whole suite
    KVSTAGE_TEST_WORKERS=3 .venv/bin/python benchmarks/suite_timeline.py
    .venv/bin/python benchmarks/suite_timeline.py tests/test_hw.py      # part of it

The machine is shared: it prints the load average before and after, and the figures are
only comparable between runs on an equally quiet host.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG_ENV = "KVSTAGE_SUITE_TIMELINE"


# --- the pytest plugin (loaded in every worker with -p suite_timeline) -------------------
_controller = False  # an xdist controller replays its workers' hooks: it notes nothing


def pytest_configure(config) -> None:
    global _controller
    _controller = not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _note("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    _note("end", nodeid)


def pytest_collection_finish(session) -> None:
    _note("collected", str(len(session.items)))


def _note(what: str, nodeid: str) -> None:
    path = os.environ.get(LOG_ENV)
    if not path or _controller:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    line = json.dumps({"t": time.time(), "w": worker, "what": what, "id": nodeid})
    with open(path, "a") as fh:  # one short line per append: whole lines under O_APPEND
        fh.write(line + "\n")


# --- the driver -----------------------------------------------------------------------------
def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _sample_cpu(samples: list, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        samples.append((time.time(), *_cpu_times()))


def _busy_share(samples: list, t0: float, t1: float) -> float | None:
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if len(inside) < 2:
        return None
    busy = inside[-1][1] - inside[0][1]
    total = inside[-1][2] - inside[0][2]
    return busy / total if total else None


def _report(part: str, events: list[dict], samples: list, begin: float | None = None) -> None:
    starts: dict[tuple[str, str], float] = {}
    spans: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if e["what"] == "start":
            starts[(e["w"], e["id"])] = e["t"]
        elif e["what"] == "end" and (e["w"], e["id"]) in starts:
            spans[e["w"]].append((starts.pop((e["w"], e["id"])), e["t"], e["id"]))
    if not spans:
        return
    t0 = begin if begin is not None else min(e["t"] for e in events)
    t1 = max(e["t"] for e in events)
    first = min(s for runs in spans.values() for s, _, _ in runs)
    share = _busy_share(samples, t0, t1)
    print(f"\n{part}: {t1 - t0:.1f} s from its start to its last test's end")
    print(f"  before the first test (set-up, start-up, collection): {first - t0:.1f} s")
    if share is not None:
        print(f"  CPU busy over it: {100 * share:.0f}% of {os.cpu_count()} cores")
    for w in sorted(spans):
        runs = spans[w]
        busy = sum(e - s for s, e, _ in runs)
        last = max(e for _, e, _ in runs)
        print(
            f"  {w}: {len(runs)} tests, {busy:.1f} s in tests, last ended at {last - t0:.1f} s "
            f"({t1 - last:.1f} s before the part's end)"
        )
    longest = sorted((e - s, w, i) for w, runs in spans.items() for s, e, i in runs)[-12:]
    print("  longest:")
    for d, w, i in reversed(longest):
        print(f"    {d:6.1f} s  {w:5}  {i}")


def main() -> int:
    load0 = os.getloadavg()
    samples: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_cpu, args=(samples, stop), daemon=True)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "timeline.jsonl"
        env = {
            **os.environ,
            LOG_ENV: str(log),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p
            ),
            # in the environment, not the arguments: every xdist worker loads it, and
            # scripts/test.sh still sees the arguments it was given
            "PYTEST_ADDOPTS": f"{os.environ.get('PYTEST_ADDOPTS', '')} -p suite_timeline",
        }
        sampler.start()
        t = time.time()
        rc = subprocess.call(["bash", "scripts/test.sh", *sys.argv[1:]], cwd=ROOT, env=env)
        wall = time.time() - t
        stop.set()
        used = resource.getrusage(resource.RUSAGE_CHILDREN)  # the suite's processes, reaped
        events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    # the parallel part's workers are gw0..; the alone part runs in the main process
    _report("parallel part", [e for e in events if e["w"] != "main"], samples, begin=t)
    _report("alone part", [e for e in events if e["w"] == "main"], samples)
    load1 = os.getloadavg()
    cpu = used.ru_utime + used.ru_stime
    print(f"\nwhole command: {wall:.1f} s (set-up included), exit {rc}")
    print(
        f"its own CPU: {cpu:.0f} s ({used.ru_utime:.0f} user + {used.ru_stime:.0f} sys), "
        f"{100 * cpu / (wall * (os.cpu_count() or 1)):.0f}% of {os.cpu_count()} cores over "
        f"its wall time (the rest: idle, or taken by other processes)"
    )
    print(
        f"load average before {load0[0]:.2f} / {load0[1]:.2f}, after {load1[0]:.2f} / {load1[1]:.2f}"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
