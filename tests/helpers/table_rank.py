"""A rank that writes down the table the rendezvous gave it: test-only.

No rank, and no holder of the run secret, gets the whole rank table from the rendezvous
(issue 39, least exposure): a rank gets its own entry and its peers'. A test of a
`kvstage hw --no-spawn` run, whose launcher is another process, learns a rank's peers
from the rank itself: started as `python table_rank.py OUT.json <python> -m
kvstage.hw.rank.main ARGS...`, the rank runs unchanged and writes its table and t0 to
OUT.json (whole: written beside it, then renamed) once its hello is answered.
"""

from __future__ import annotations

import json
import os
import sys

from kvstage.hw.control import rendezvous
from kvstage.hw.rank import main as rank_main

if __name__ == "__main__":
    out, argv = sys.argv[1], sys.argv[2:]
    assert argv[1:3] == ["-m", "kvstage.hw.rank.main"], argv
    hello = rendezvous.RendezvousClient.hello

    def kept(self, me, timeout_s):
        table, t0 = hello(self, me, timeout_s)
        ranks = {name: info.to_json() for name, info in table.items()}
        with open(f"{out}.part", "w") as f:
            json.dump({"t0": t0, "ranks": ranks}, f)
        os.replace(f"{out}.part", out)
        return table, t0

    rendezvous.RendezvousClient.hello = kept
    sys.exit(rank_main.main(argv[3:]))
