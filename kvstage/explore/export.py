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

The router is kvstage's (cluster.router); it is printed as a comment, not a flag.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["sglang_commands", "sglang_flags"]

MODEL_PLACEHOLDER = "MODEL"


def _model(s: Scenario) -> str:
    from kvstage.shared.scenario.presets import PRESETS

    preset = PRESETS.get(s.model.preset or "")
    return preset.source if preset is not None and preset.source else MODEL_PLACEHOLDER


def sglang_flags(s: Scenario, side: str) -> tuple[dict[str, str], list[str]]:
    """(environment, flags) of one side ("prefill" or "decode") of the configuration."""
    cfg = s.prefill if side == "prefill" else s.decode
    flags = [
        "--model-path",
        _model(s),
        "--disaggregation-mode",
        side,
        "--tp-size",
        str(cfg.tp),
    ]
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
    env: dict[str, str] = {}
    if s.transfer.path == "staging":
        env["SGLANG_DISAGG_STAGING_BUFFER"] = "1"
        if side == "decode":
            env["SGLANG_DISAGG_STAGING_POOL_SIZE_MB"] = f"{round(s.decode.staging_pool_mb)}"
    return env, flags


def sglang_commands(s: Scenario) -> str:
    """The launch lines of both sides, each with its instance count, as shell text."""
    c = s.cluster
    out = [
        f"# kvstage plan winner: prefill {c.prefill_instances} x TP{s.prefill.tp}, decode "
        f"{c.decode_instances} x TP{s.decode.tp}, transfer path {s.transfer.path}, "
        f"router {c.router} (kvstage's; route with your own)",
    ]
    for side, count in (("prefill", c.prefill_instances), ("decode", c.decode_instances)):
        env, flags = sglang_flags(s, side)
        words = [f"{k}={v}" for k, v in env.items()] + ["python", "-m", "sglang.launch_server"]
        out.append(f"# {side}: {count} instance(s) of this, one per {getattr(s, side).tp} GPU(s)")
        out.append(" ".join(shlex.quote(w) for w in words + flags))
    return "\n".join(out)
