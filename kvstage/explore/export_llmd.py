"""A plan's winner as llm-d Helm values: `kvstage plan --export llm-d`.

The values of llm-d's ModelService chart ([C] llm-d-incubation/llm-d-modelservice at
3051935eb5a49f6df21cd6aeb5e4f05b98799262, chart v0.4.12: charts/llm-d-modelservice/
values.yaml, values.schema.tmpl.json, templates/_helpers.tpl, and the P/D example
examples/values-pd.yaml), installed with `helm install NAME llm-d-modelservice -f
values.yaml`. llm-d serves with vLLM, so the engine flags are the vLLM export's:

* `modelArtifacts.name` the model, `uri` hf://MODEL (the chart's default form);
* `prefill` and `decode`: `create: true`, `replicas` the side's instances,
  `parallelism.tensor` its TP (the chart's vllmServe command adds
  `--tensor-parallel-size`, `--port` and `--served-model-name`, and asks for
  nvidia.com/gpu = tensor x dataLocal per pod itself: `numGpuPerWorker`), and one
  container `vllm` with `modelCommand: vllmServe`, `mountModelVolume: true` and the
  args the chart appends: `--kv-transfer-config` (NixlConnector, kv_both, as in
  values-pd.yaml) and the EngineArgs flags of `export_vllm.vllm_engine_flags`;
* the NIXL side channel: `VLLM_NIXL_SIDE_CHANNEL_HOST` from the pod's IP (vLLM's
  default, vllm/envs.py, is localhost, which a peer pod cannot reach) and its port
  5600 (vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT) opened, as values-pd.yaml does;
* the container ports: the chart's routing sidecar runs beside the decode and serves
  `routing.servicePort` (8000) in front of vLLM on `routing.proxy.targetPort` (8200,
  the chart's default), so decode listens on 8200, prefill on 8000.

A side spanning nodes is refused (the chart's multinode mode is LeaderWorkerSet with
data parallel workers, not TP across nodes), as is DP attention and the Mooncake
backend (no vLLM connector: export_vllm). tests/data/schemas/llm-d-modelservice-values
.schema.json is the chart's values schema for the keys written here; the tests
validate every export against it and build each container with the Kubernetes
client's V1Container model (the chart's own keys taken off first).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvstage.explore.export import ExportError, _model
from kvstage.explore.export_vllm import kv_transfer_config, one_node, vllm_engine_flags

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["CHART_KEYS", "LLMD_IMAGE", "llmd_values", "llmd_yaml"]

LLMD_IMAGE = "LLMD_IMAGE"
SERVICE_PORT = 8000  # [C] the chart's routing.servicePort default
PROXY_PORT = 8200  # [C] the chart's routing.proxy.targetPort default
NIXL_SIDE_PORT = 5600  # [C] vllm/envs.py VLLM_NIXL_SIDE_CHANNEL_PORT's default
CHART_KEYS = ("modelCommand", "mountModelVolume")  # container keys the chart consumes


def _container(s: Scenario, side: str) -> dict[str, Any]:
    try:
        engine = vllm_engine_flags(s, side)
    except ExportError as exc:
        raise ExportError(f"--export llm-d: {exc}") from None
    config = kv_transfer_config(s, "llm-d")
    port = PROXY_PORT if side == "decode" else SERVICE_PORT
    env = [{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]  # fmt: skip
    return {
        "name": "vllm",
        "image": LLMD_IMAGE,
        "modelCommand": "vllmServe",
        "args": ["--kv-transfer-config", json.dumps(config, separators=(",", ":")), *engine],
        "env": env,
        "ports": [
            {"containerPort": port, "protocol": "TCP"},
            {"containerPort": NIXL_SIDE_PORT, "protocol": "TCP"},
        ],
        "mountModelVolume": True,
    }


def llmd_values(s: Scenario) -> dict[str, Any]:
    """The chart's values for the configuration, as plain data."""
    for side in ("prefill", "decode"):
        one_node(s, side, "llm-d", "the chart's multinode mode runs data-parallel workers, "
                 "not TP across nodes")  # fmt: skip
    c, model = s.cluster, _model(s)
    out: dict[str, Any] = {
        "multinode": False,
        "modelArtifacts": {
            "name": model,
            "uri": f"hf://{model}",
            "labels": {"llm-d.ai/inference-serving": "true"},
        },
        "routing": {"servicePort": SERVICE_PORT},
        "accelerator": {"type": "nvidia"},
    }
    for side, count in (("prefill", c.prefill_instances), ("decode", c.decode_instances)):
        out[side] = {
            "create": True,
            "replicas": count,
            "parallelism": {"tensor": getattr(s, side).tp},
            "containers": [_container(s, side)],
        }
    return out


def llmd_yaml(s: Scenario) -> str:
    """The values as YAML (`helm install NAME llm-d-modelservice -f -`)."""
    import yaml

    head = f"# kvstage plan winner as llm-d ModelService values; set the image ({LLMD_IMAGE})\n"
    return head + yaml.safe_dump(llmd_values(s), sort_keys=False)
