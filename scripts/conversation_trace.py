"""Write a synthetic multi-turn conversation trace in Mooncake's format (JSON Lines), and
the same trace without its hash_ids, for the prefix-reuse example (docs/prefix-reuse.md).

    .venv/bin/python scripts/conversation_trace.py /tmp/conv
    # -> /tmp/conv/conv.jsonl and /tmp/conv/conv-bare.jsonl

Every conversation starts with one shared 2048-token system prompt (4 blocks), then 1-4
blocks of its own; each later turn extends the previous turn's prompt by 1-3 blocks.
A prompt ends 0-300 tokens short of its last block. Conversations start 1.5 s apart and
their turns come 6 s apart. The trace is seeded, so the same arguments give the same file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

BLOCK = 512  # tokens per hash id (Mooncake's trace format)


def conversation_rows(conversations: int, turns: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    last = 0

    def new() -> int:
        nonlocal last
        last += 1
        return last

    system = [new() for _ in range(4)]
    rows = []
    for conv in range(conversations):
        ids = system + [new() for _ in range(rng.randint(1, 4))]
        for turn in range(turns):
            rows.append(
                {
                    "timestamp": conv * 1500.0 + turn * 6000.0,
                    "input_length": len(ids) * BLOCK - rng.randint(0, 300),
                    "output_length": 32,
                    "hash_ids": list(ids),
                }
            )
            ids = ids + [new() for _ in range(rng.randint(1, 3))]
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder for conv.jsonl and conv-bare.jsonl")
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    rows = conversation_rows(args.conversations, args.turns, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bare = [{k: v for k, v in r.items() if k != "hash_ids"} for r in rows]
    (args.out / "conv-bare.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bare))
    print(f"{len(rows)} requests, {sum(r['input_length'] for r in rows):,} prompt tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
