"""A plan's winner as vLLM launch lines: `kvstage plan --export vllm`.

One `vllm serve` line per side, each instance a server, the KV transfer configured by
`--kv-transfer-config` JSON. The names are vLLM's own, read in its code (vLLM does
not install here without a CUDA torch: PyPI vllm pins torch==2.14.0, the CUDA build,
against the project's CPU torch 2.13.0; its sdist needs torch to build even its
metadata). vLLM parses `--kv-transfer-config` with pydantic's TypeAdapter over
KVTransferConfig ([C] vllm/config/utils.py, the `config` decorator), so the tests
validate the JSON against tests/data/schemas/vllm-kv-transfer-config.schema.json,
written from that class: its fields and types, the kv_role values, and its
__post_init__ rule that a kv_connector needs a kv_role:

* `KVTransferConfig` ([C] vllm-project/vllm vllm/config/kv_transfer.py at
  007c643b4abb7a79e69ef2b343b3dc80eb643c0d): fields kv_connector, engine_id,
  kv_buffer_device, kv_buffer_size, kv_role (kv_producer / kv_consumer / kv_both),
  kv_rank, kv_parallel_size, kv_ip, kv_port, kv_connector_extra_config,
  kv_connector_module_path;
* the connector registry ([C] vllm/distributed/kv_transfer/kv_connector/factory.py at
  the same commit): SharedStorageConnector, P2pNcclConnector, LMCacheConnectorV1,
  NixlConnector, MultiConnector. kvstage's NIXL backend is `NixlConnector` with
  kv_role kv_both on both sides (the role vLLM's NIXL examples give both); the
  Mooncake backend has no connector at that commit, so it is refused;
* the serve flags, EngineArgs fields with dashes ([C] vllm/engine/arg_utils.py at
  001999d2f360c2c5da23a916510c273b1a73d06c: --tensor-parallel-size, --block-size
  (choices 8, 16, 32, 64, 128: the KV page), --gpu-memory-utilization,
  --max-num-batched-tokens (the step's token budget: the prefill chunk), --max-num-seqs
  (decode.max_running_requests); later EngineArgs add kv_transfer_config
  (`--kv-transfer-config`, the JSON above) and enable_expert_parallel
  (`--enable-expert-parallel`, = ParallelConfig.enable_expert_parallel: ep > 1, the
  experts over the TP group's GPUs)).

Multi-node vLLM runs over a Ray cluster (`--distributed-executor-backend ray`), which
this export does not set up: a side whose TP spans nodes is refused.
"""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING

from kvstage.explore.export import ExportError, _model

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = [
    "KV_CONNECTORS",
    "KV_TRANSFER_FIELDS",
    "kv_transfer_config",
    "one_node",
    "vllm_commands",
    "vllm_engine_flags",
    "vllm_flags",
]

KV_CONNECTORS = {"nixl": "NixlConnector"}
# [C] KVTransferConfig's fields at 007c643b (the module docstring)
KV_TRANSFER_FIELDS = (
    "kv_connector",
    "engine_id",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_role",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
)


def kv_transfer_config(s: Scenario, target: str = "vllm") -> dict[str, object]:
    """The `--kv-transfer-config` object of either side (`target` names the export in
    the message when the backend has no connector)."""
    connector = KV_CONNECTORS.get(s.hardware.backend)
    if connector is None:
        raise ExportError(
            f"--export {target}: vLLM has no connector for the {s.hardware.backend} backend "
            f"(its registry: SharedStorageConnector, P2pNcclConnector, LMCacheConnectorV1, "
            f'NixlConnector, MultiConnector); use hardware.backend = "nixl"'
        )
    return {"kv_connector": connector, "kv_role": "kv_both"}


def vllm_engine_flags(s: Scenario, side: str) -> list[str]:
    """The EngineArgs flags of one side (parallelism, memory, page, batch), the same
    under `vllm serve`, Dynamo's `dynamo.vllm` and llm-d's `vllmServe` command."""
    cfg = getattr(s, side)
    if cfg.ep > cfg.tp:
        raise ExportError(
            f"{side} ep {cfg.ep} > tp {cfg.tp} (DP attention) is not exported for vLLM"
        )
    if side == "prefill" and s.prefill.pp > 1:
        raise ExportError(
            f"prefill pp {s.prefill.pp} (pipeline stages) is not exported for vLLM: kvstage "
            "models prefill PP as SGLang runs it in PD (use --export sglang, lws or dynamo-sglang)"
        )
    flags = ["--enable-expert-parallel"] if cfg.ep > 1 else []
    flags += [
        "--gpu-memory-utilization",
        f"{cfg.memory_utilization:g}",
        "--block-size",
        str(s.decode.page_size),
    ]
    if side == "prefill":
        flags += ["--max-num-batched-tokens", str(s.prefill.chunked_prefill_size)]
    else:
        flags += ["--max-num-seqs", str(s.decode.max_running_requests)]
    return flags


RAY = "multi-node vLLM needs a Ray cluster, which this export does not set up"


def one_node(s: Scenario, side: str, target: str, why: str = RAY) -> None:
    """Refuse a side whose TP spans nodes, saying `why`."""
    cfg = getattr(s, side)
    if max(cfg.tp, cfg.ep) > s.cluster.gpus_per_node:
        raise ExportError(
            f"--export {target}: {side} TP{cfg.tp} spans nodes of "
            f"{s.cluster.gpus_per_node} GPUs; {why}"
        )


def vllm_flags(s: Scenario, side: str) -> list[str]:
    """`vllm serve` arguments of one side."""
    one_node(s, side, "vllm")
    try:
        engine = vllm_engine_flags(s, side)
    except ExportError as exc:
        raise ExportError(f"--export vllm: {exc}") from None
    config = json.dumps(kv_transfer_config(s), separators=(",", ":"))
    tp = str(getattr(s, side).tp)
    return ["serve", _model(s), "--tensor-parallel-size", tp, "--kv-transfer-config", config,
            *engine]  # fmt: skip


def vllm_commands(s: Scenario) -> str:
    """Both sides' `vllm serve` lines with their instance counts, as shell text."""
    c = s.cluster
    out = [f"# kvstage plan winner: prefill {c.prefill_instances} x TP{s.prefill.tp}, decode "
           f"{c.decode_instances} x TP{s.decode.tp} (vLLM, NixlConnector)"]  # fmt: skip
    for side, count in (("prefill", c.prefill_instances), ("decode", c.decode_instances)):
        out.append(f"# {side}: {count} instance(s) of this, one per {getattr(s, side).tp} GPU(s)")
        out.append(" ".join(shlex.quote(w) for w in ["vllm", *vllm_flags(s, side)]))
    return "\n".join(out)
