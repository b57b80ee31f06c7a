"""A rank whose clock is off by a given number of seconds: test-only.

Used as `rank_wrapper` of a hardware run (tests/test_placement.py, tests/test_netns.py):
`python skewed_rank.py NAME=SECONDS[,NAME=SECONDS] <python> -m kvstage.hw.rank.main ARGS...`.
The named ranks run with `clock_skew_s` (their wall clock reads that much more); the
others run unchanged. The offset each rank measures at the rendezvous must undo it.
"""

from __future__ import annotations

import sys

from kvstage.hw.rank import main as rank_main

if __name__ == "__main__":
    skews = dict(item.split("=") for item in sys.argv[1].split(","))
    argv = sys.argv[2:]
    assert argv[1:3] == ["-m", "kvstage.hw.rank.main"], argv
    args = argv[3:]
    name = (
        args[args.index("--role") + 1] + args[args.index("--rank") + 1] if "--role" in args else ""
    )
    sys.exit(rank_main.main(args, clock_skew_s=float(skews.get(name, 0.0))))
