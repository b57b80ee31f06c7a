"""A decode rank that lands every writer block one head off: test-only corruption.

Used as `rank_wrapper` of a hardware run (tests/test_hw.py) to prove that byte
verification catches a wrong head offset. It is started as
`python corrupt_decode_rank.py <python> -m kvstage.hw.rank.main ARGS...`; prefill ranks
run unchanged.
"""

from __future__ import annotations

import dataclasses
import sys

from kvstage.hw.rank import decode as decode_rank
from kvstage.hw.rank import main as rank_main


def shifted_layout(self, num_pages: int):
    layout = self.g.staging_layout(self.rank, num_pages)
    blocks = []
    for b in layout.blocks:
        room = self.g.decode_heads - b.heads.num_heads + 1
        heads = dataclasses.replace(
            b.heads, dst_head_start=(b.heads.dst_head_start + 1) % max(1, room)
        )
        blocks.append(dataclasses.replace(b, heads=heads))
    return dataclasses.replace(layout, blocks=tuple(blocks))


if __name__ == "__main__":
    argv = sys.argv[1:]
    assert argv[1:3] == ["-m", "kvstage.hw.rank.main"], argv
    decode_rank.DecodeRank.scatter_layout = shifted_layout
    sys.exit(rank_main.main(argv[3:]))
