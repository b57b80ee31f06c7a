"""Parse `kvstage plan --export sglang`'s launch lines with SGLang's own argument parser.

SGLang's server does not install as a project extra (its dependencies pull a CUDA
torch), so the tests check the router line with sglang-router's parser and this script,
run by hand, checks the server lines with `ServerArgs.add_cli_args` of a SGLang copied
without its dependencies:

    .venv/bin/python -m pip install --no-deps --target /tmp/sgl sglang==0.5.23 \
        psutil pybase64 triton msgspec tqdm IPython traitlets
    .venv/bin/python scripts/check_exports.py /tmp/sgl

For the flagship, a multi-node (prefill TP16), a DP-attention (DeepSeek-V3, decode
EP16 over TP8) and a pipeline (prefill TP8 PP2 over two nodes) scenario it parses both sides' lines (placeholders filled in), and the
Dynamo graph's worker args (`--export dynamo-sglang`: SGLang's flags under
`dynamo.sglang`, which adds ServerArgs.add_cli_args to its parser) with the rendezvous
Dynamo's operator adds, and checks that every flag lands in the ServerArgs field it is
meant for (a multi-node server's nnodes included); it prints one line per side and
form, and exits 1 on a mismatch. 2026-12-03, sglang 0.5.23: every line parsed.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from kvstage.explore.export import sglang_flags
from kvstage.shared.scenario import load_scenario

CASES = (
    ("scenarios/llama3-70b-p8-d2.toml", []),
    ("scenarios/llama3-70b-p16-d4.toml", []),
    ("scenarios/mla/deepseek-v3-p16-d8.toml", ["decode.ep=16", "cluster.decode_instances=2"]),
    ("scenarios/llama3-70b-p8-d2.toml", ["prefill.tp=8", "prefill.pp=2"]),
)
FILL = {
    "$NODE_RANK": "0",
    "$PREFILL_HEAD:5000": "10.0.0.1:5000",
    "$DECODE_HEAD:5000": "10.0.0.2:5000",
}


def _lines(s, side: str) -> list[tuple[str, list[str]]]:
    """(what, SGLang server flags) of one side: the launch line, and the Dynamo
    graph's worker args after `-m dynamo.sglang` with the rendezvous Dynamo's operator
    adds to a multi-node worker (backend_sglang.go getMultinodeFlags: `--dist-init-addr
    LEADER:PORT --nnodes K --node-rank R`)."""
    from kvstage.explore.export import multinode_flags, node_count
    from kvstage.explore.export_dynamo import dynamo_graph

    nodes = node_count(s, side)
    _, flags = sglang_flags(s, side)
    launch = flags + multinode_flags(nodes, "$NODE_RANK", f"${side.upper()}_HEAD:5000")
    worker = dynamo_graph(s, "sglang")["spec"]["services"][side]
    args = worker["extraPodSpec"]["mainContainer"]["args"]
    assert args[:2] == ["-m", "dynamo.sglang"], args[:2]
    count = worker.get("multinode", {"nodeCount": 1})["nodeCount"]
    dynamo = args[2:] + multinode_flags(count, "0", "10.0.0.3:29500")
    return [("launch", launch), ("dynamo", dynamo)]


def main() -> int:
    sys.path.insert(0, sys.argv[1])
    from sglang.srt.server_args import ServerArgs

    from kvstage.explore.export import node_count

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    bad = 0
    for path, sets in CASES:
        s = load_scenario(path, sets)
        for side in ("prefill", "decode"):
            cfg = getattr(s, side)
            want = {
                "disaggregation_mode": side,
                "tp_size": max(cfg.tp, cfg.ep),
                "page_size": s.decode.page_size,
                "disaggregation_transfer_backend": s.hardware.backend,
                "nnodes": node_count(s, side),
                "ep_size": cfg.ep,
                "attn_dp_size": max(1, cfg.ep // cfg.tp),
                "pp_size": s.prefill.pp if side == "prefill" else 1,
            }
            for what, flags in _lines(s, side):
                args = parser.parse_args([FILL.get(w, w) for w in flags])
                got = {k: getattr(args, k) for k in want}
                ok = got == want
                bad += not ok
                print(f"{'ok ' if ok else 'BAD'} {path} {side} ({what}): {shlex.join(flags)}")
                if not ok:
                    print(f"    want {want}\n    got  {got}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
