"""Run tests many times in one pytest process and count the failures: the flake hunt.

A test that crosses threads or processes must pass every time, not most times. This
repeats each collected test N times (a pytest plugin of this file parametrizes it)
and prints, per test, how many of its N runs failed, with the first failure's message.

    .venv/bin/python benchmarks/repeat_tests.py tests/test_rejoin.py -n 200
    .venv/bin/python benchmarks/repeat_tests.py tests/test_rejoin.py -k rendezvous -n 50
    .venv/bin/python benchmarks/repeat_tests.py tests/test_rejoin.py -m hw -n 10

It prints the host's load average before and after: a flake that shows only on a
loaded host is still a flake, but the figure says what the runs saw. Exit code 1 when
any run failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

import pytest

REPEAT_ARG = "_repeat_run"


class Repeat:
    """pytest plugin: every collected test N times, as N parametrizations of it (each run
    has its own fixtures), and a tally of outcomes per test."""

    def __init__(self, times: int) -> None:
        self.times = times
        self.runs: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.first_failure: dict[str, str] = {}

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        metafunc.fixturenames.append(REPEAT_ARG)
        metafunc.parametrize(
            REPEAT_ARG, range(self.times), ids=[f"run{i}" for i in range(self.times)]
        )

    @staticmethod
    def _test(nodeid: str) -> str:
        """The node id without its run number: `t[run3]` -> `t`, `t[a-run3]` -> `t[a]`."""
        base, _, params = nodeid.partition("[")
        params = "-".join(p for p in params.rstrip("]").split("-") if not p.startswith("run"))
        return f"{base}[{params}]" if params else base

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test = self._test(report.nodeid)
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.runs[test] += 1
        if report.failed:
            self.failed[test] += 1
            text = str(report.longrepr).strip().splitlines()
            self.first_failure.setdefault(test, text[-1] if text else "?")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="+", help="test files or node ids, as pytest takes them")
    p.add_argument("-n", "--times", type=int, default=200, help="runs of each test (default 200)")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("-m", default=None, help="pytest -m marker expression (e.g. 'not hw')")
    args = p.parse_args(argv)
    if args.times < 1:
        p.error(f"--times must be at least 1, not {args.times}")
    plugin = Repeat(args.times)
    extra = (["-k", args.k] if args.k else []) + (["-m", args.m] if args.m else [])
    load0 = os.getloadavg()
    start = time.monotonic()
    pytest.main(["-q", "-p", "no:cacheprovider", *extra, *args.targets], plugins=[plugin])
    wall = time.monotonic() - start
    load1 = os.getloadavg()
    print(f"\n{'test':<90} {'failed':>7} / runs")
    for nodeid in sorted(plugin.runs):
        print(f"{nodeid:<90} {plugin.failed[nodeid]:>7} / {plugin.runs[nodeid]}")
        if nodeid in plugin.first_failure:
            print(f"    first failure: {plugin.first_failure[nodeid][:200]}")
    total_failed = sum(plugin.failed.values())
    print(
        f"{total_failed} failed of {sum(plugin.runs.values())} runs in {wall:.0f}s; "
        f"load average {load0[0]:.1f} before, {load1[0]:.1f} after, {os.cpu_count()} cores"
    )
    return 1 if total_failed else 0


if __name__ == "__main__":
    sys.exit(main())
