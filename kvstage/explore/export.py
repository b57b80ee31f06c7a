"""A plan's winner as SGLang launch commands: `kvstage plan --export sglang`.

One `python -m sglang.launch_server` line for the prefill instances and one for the
decode instances, with the flags as SGLang's ServerArgs names them ([C] read in
sgl-project/sglang python/sglang/srt/server_args.py at commit
001067fffe33427bee0ed2f007fb7551a1d76b44: a flag is its field name with dashes):

* `--disaggregation-mode prefill|decode` (field disaggregation_mode);
* `--tp-size N` (tp_size; alias --tp): the side's TP;
* `--chunked-prefill-size N` (prefill): prefill.chunked_prefill_size;
* `--page-size N` on both sides (the KV page; SGLang's two sides must agree):
  decode.page_size;
* `--disaggregation-transfer-backend nixl|mooncake` (one of its
  DISAGG_TRANSFER_BACKEND_CHOICES): hardware.backend;
* `--mem-fraction-static F`: the side's memory_utilization (the share of GPU memory
  for weights and the KV pool, which is what SGLang's static fraction holds);
* `--max-running-requests N` (decode): decode.max_running_requests.

The staging buffer. At that commit ServerArgs has no staging flag; SGLang reads its
environment ([C] python/sglang/srt/environ.py: SGLANG_DISAGG_STAGING_BUFFER (bool,
default off), SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB (prefill side, per worker, default
64) and SGLANG_DISAGG_STAGING_POOL_SIZE_MB (the decode rank's ring, default 4096);
documented in docs/advanced_features/pd_disaggregation.md by sgl-project/sglang PR
#21921). So with transfer.path = "staging" the lines carry
`SGLANG_DISAGG_STAGING_BUFFER=1` on both sides and the decode's pool as
`SGLANG_DISAGG_STAGING_POOL_SIZE_MB`; the prefill's per-worker buffer keeps SGLang's
default (kvstage does not model it). The slice path sets none of them (SGLang's
direct per-page transfer). SGLang uses the staging buffer for MHA/GQA models only
(an MLA model's latent is the same on every rank), as kvstage does.

Multi-node and MoE ([C] the same ServerArgs, checked with its own parser, `ServerArgs.
add_cli_args` of PyPI sglang 0.5.23, by scripts/check_exports.py):

* a side whose TP spans nodes (tp > cluster.gpus_per_node) runs each instance as
  `--nnodes K --node-rank R --dist-init-addr HEAD:PORT` (fields nnodes, node_rank,
  dist_init_addr), one line per node, the head's address a placeholder;
* pipeline parallelism on the prefill side (`prefill.pp` > 1): `--pp-size N` (pp_size;
  alias --pipeline-parallel-size), a server of tp x pp GPUs (x ep / tp with DP
  attention) over as many nodes as that fills ([C] SGLang's PD prefill takes a PP size
  with any decode TP: sgl-project/sglang PR #8846, "Support PD disaggregation with
  Prefill PP");
* expert parallelism: `--ep-size E` (ep_size); with DP attention (kvstage's ep > tp:
  ep / tp instances of TP tp share one expert group) one SGLang server spans the whole
  group: `--tp-size E --attn-dp-size E/tp --ep-size E` (tp_size is the server's GPUs,
  attn_dp_size its attention groups of tp GPUs each; sglang 0.5.23 server_args.py
  resolves enable_dp_attention from attn_dp_size > 1 and deprecates
  `--enable-dp-attention --dp-size`), so instances / (E/tp) servers.

The router line (`sglang_router_command`): `python -m sglang_router.launch_router
--pd-disaggregation --prefill URL BOOTSTRAP_PORT ... --decode URL ... --policy P`
([C] PyPI sglang-router 0.3.2, sglang_router/router_args.py `RouterArgs.add_cli_args`:
pd_disaggregation, prefill (nargs + : URL and optional bootstrap port), decode,
policy in random / round_robin / cache_aware / power_of_two / manual; the tests parse
the line with its `launch_router.parse_router_args`). kvstage's routers map to round_robin,
cache_aware, or (least-outstanding, staging-aware: no such policy there) power_of_two,
the router's load-aware choice. The prefill's bootstrap port is SGLang's default
`--disaggregation-bootstrap-port` 8998 (ServerArgs.disaggregation_bootstrap_port).
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = [
    "ROUTER_POLICY",
    "ExportError",
    "node_count",
    "server_gpus",
    "servers",
    "sglang_commands",
    "sglang_flags",
    "sglang_router_command",
]

MODEL_PLACEHOLDER = "MODEL"
BOOTSTRAP_PORT = 8998  # [C] ServerArgs.disaggregation_bootstrap_port's default
SERVER_PORT = 30000  # [C] ServerArgs.port's default
DIST_PORT = 5000  # [A] the head node's rendezvous port (any free port)
ROUTER_POLICY = {
    "round-robin": "round_robin",
    "cache-aware": "cache_aware",
    "least-outstanding": "power_of_two",
    "staging-aware": "power_of_two",
}


class ExportError(ValueError):
    """A configuration the target cannot express: one line for a human."""


def server_gpus(s: Scenario, side: str) -> int:
    """GPUs of one server of `side`: its TP group, the expert group with DP attention,
    times the prefill's pipeline stages (`prefill.pp`)."""
    cfg = getattr(s, side)
    return max(cfg.tp, cfg.ep) * (s.prefill.pp if side == "prefill" else 1)


def node_count(s: Scenario, side: str) -> int:
    """Nodes one server of `side` spans (1 when its GPUs fit one node)."""
    gpus = server_gpus(s, side)
    per = s.cluster.gpus_per_node
    if gpus <= per:
        return 1
    if gpus % per:
        raise ExportError(
            f"{side}: {gpus} GPUs per server do not fill whole nodes of {per} "
            "(cluster.gpus_per_node)"
        )
    return gpus // per


def servers(s: Scenario, side: str) -> int:
    """SGLang servers of `side`: its instances, or with DP attention (ep > tp) one per
    expert group of ep / tp instances."""
    cfg, c = getattr(s, side), s.cluster
    count = c.prefill_instances if side == "prefill" else c.decode_instances
    if cfg.ep <= cfg.tp:
        return count
    group = cfg.ep // cfg.tp
    if count % group:
        raise ExportError(
            f"{side}: {count} instances do not fill whole expert groups of {group} "
            f"(ep {cfg.ep} / tp {cfg.tp})"
        )
    return count // group


def _model(s: Scenario) -> str:
    from kvstage.shared.scenario.presets import PRESETS

    preset = PRESETS.get(s.model.preset or "")
    return preset.source if preset is not None and preset.source else MODEL_PLACEHOLDER


def sglang_flags(s: Scenario, side: str) -> tuple[dict[str, str], list[str]]:
    """(environment, flags) of one side ("prefill" or "decode") of the configuration."""
    cfg = s.prefill if side == "prefill" else s.decode
    flags = ["--model-path", _model(s), "--disaggregation-mode", side]
    if cfg.ep > cfg.tp:  # DP attention: one server over the expert group
        flags += ["--tp-size", str(cfg.ep), "--attn-dp-size", str(cfg.ep // cfg.tp)]
        flags += ["--ep-size", str(cfg.ep)]
    else:
        flags += ["--tp-size", str(cfg.tp)]
        if cfg.ep > 1:
            flags += ["--ep-size", str(cfg.ep)]
    if side == "prefill" and s.prefill.pp > 1:
        flags += ["--pp-size", str(s.prefill.pp)]
    if side == "prefill":
        flags += ["--chunked-prefill-size", str(s.prefill.chunked_prefill_size)]
    flags += [
        "--page-size",
        str(s.decode.page_size),
        "--disaggregation-transfer-backend",
        s.hardware.backend,
        "--mem-fraction-static",
        f"{cfg.memory_utilization:g}",
    ]
    if side == "decode":
        flags += ["--max-running-requests", str(s.decode.max_running_requests)]
    else:
        flags += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
    env: dict[str, str] = {}
    if s.transfer.path == "staging":
        env["SGLANG_DISAGG_STAGING_BUFFER"] = "1"
        if side == "decode":
            env["SGLANG_DISAGG_STAGING_POOL_SIZE_MB"] = f"{round(s.decode.staging_pool_mb)}"
    return env, flags


def multinode_flags(nodes: int, rank: str, head: str) -> list[str]:
    """The flags of one node of a server spanning `nodes` nodes (none for one node)."""
    if nodes == 1:
        return []
    return ["--nnodes", str(nodes), "--node-rank", rank, "--dist-init-addr", head]


def sglang_commands(s: Scenario) -> str:
    """The launch lines of both sides, each with its server count, and the router's
    line, as shell text."""
    c = s.cluster
    out = [
        f"# kvstage plan winner: prefill {c.prefill_instances} x TP{s.prefill.tp}"
        f"{f' PP{s.prefill.pp}' if s.prefill.pp > 1 else ''}, decode "
        f"{c.decode_instances} x TP{s.decode.tp}, transfer path {s.transfer.path}, "
        f"router {c.router}",
    ]
    for side in ("prefill", "decode"):
        env, flags = sglang_flags(s, side)
        nodes = node_count(s, side)
        words = [f"{k}={v}" for k, v in env.items()] + ["python", "-m", "sglang.launch_server"]
        head = f"${side.upper()}_HEAD:{DIST_PORT}"
        where = f"{nodes} nodes, node rank 0..{nodes - 1}" if nodes > 1 else "one node"
        out.append(f"# {side}: {servers(s, side)} server(s) of this, each on {where}")
        line = words + flags + multinode_flags(nodes, "$NODE_RANK", head)
        out.append(" ".join(w if w.startswith("$") else shlex.quote(w) for w in line))
    out.append("# the router, with each server's address")
    out.append(" ".join(shlex.quote(w) for w in sglang_router_command(s)))
    return "\n".join(out)


def sglang_router_command(s: Scenario) -> list[str]:
    """`python -m sglang_router.launch_router` in PD mode over every server, with
    placeholder host names (prefill-0, decode-0, ...)."""
    words = ["python", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for i in range(servers(s, "prefill")):
        words += ["--prefill", f"http://prefill-{i}:{SERVER_PORT}", str(BOOTSTRAP_PORT)]
    for i in range(servers(s, "decode")):
        words += ["--decode", f"http://decode-{i}:{SERVER_PORT}"]
    return words + ["--policy", ROUTER_POLICY[s.cluster.router]]
