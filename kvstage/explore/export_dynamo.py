"""A plan's winner as a Dynamo graph: `kvstage plan --export dynamo-sglang|dynamo-vllm`.

One DynamoGraphDeployment custom resource ([C] ai-dynamo/dynamo at
e20adb44366fff2154c4b9cc0abe3a8bc8071446, 2025-10-31: the CRD
deploy/cloud/operator/config/crd/bases/nvidia.com_dynamographdeployments.yaml, generated
from deploy/cloud/operator/api/v1alpha1/dynamographdeployment_types.go and
dynamocomponentdeployment_types.go; read from a snapshot of a fork whose head is that
commit): `apiVersion: nvidia.com/v1alpha1`, `kind: DynamoGraphDeployment`,
spec.backendFramework (sglang | vllm | trtllm) and spec.services, a map of components:

* `Frontend`: componentType frontend, one replica, `python3 -m dynamo.frontend` with its
  router (components/src/dynamo/frontend/main.py: `--router-mode` round-robin | random |
  kv, `--kv-overlap-score-weight`). kvstage's round-robin is round-robin; cache-aware is
  kv (the KV router's cost is overlap weight x prefill blocks + active blocks, docs/
  router/README.md "Cost Function"); least-outstanding and staging-aware are kv with
  the overlap weight 0, which that document gives as pure load balancing;
* `prefill` and `decode`: componentType worker, subComponentType prefill / decode (as
  the repository's examples/backends/*/deploy/disagg.yaml), replicas = the side's
  servers, resources.limits.gpu = GPUs per pod (a string, as the CRD types it), and a
  server spanning nodes as multinode.nodeCount (minimum 2 in the CRD). The operator
  then adds the rendezvous itself: for SGLang `--dist-init-addr LEADER:PORT --nnodes K
  --node-rank R` (deploy/cloud/operator/internal/dynamo/backend_sglang.go
  getMultinodeFlags), for vLLM a Ray head and workers (backend_vllm.go), so the
  exported args carry none of them.

The worker commands. SGLang: `python3 -m dynamo.sglang` with SGLang's own flags
(components/src/dynamo/sglang/args.py adds `ServerArgs.add_cli_args` to its parser), the
flags of `kvstage.explore.export.sglang_flags`, the staging environment as the
component's envs. vLLM: `python3 -m dynamo.vllm --model M` with vLLM's EngineArgs
flags (components/src/dynamo/vllm/args.py adds `AsyncEngineArgs.add_cli_args`),
`--is-prefill-worker` on the prefill side, and the KV connector as `--connector nixl`
(its choices: nixl, lmcache, kvbm, null, none; Dynamo builds vLLM's
kv_transfer_config from it), so the Mooncake backend is refused there.

tests/data/schemas/dynamographdeployment.schema.json is the CRD's schema for the fields
this writes, and the tests validate every export against it with jsonschema and build
the main containers with the Kubernetes client's models. The image is a placeholder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstage.explore.export import (
    ExportError,
    _model,
    node_count,
    server_gpus,
    servers,
    sglang_flags,
)
from kvstage.explore.export_vllm import vllm_engine_flags

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["DYNAMO_IMAGE", "FRONTEND_ROUTER", "dynamo_graph", "dynamo_yaml"]

DYNAMO_IMAGE = "DYNAMO_IMAGE"
API_VERSION = "nvidia.com/v1alpha1"  # [C] the CRD's group nvidia.com, version v1alpha1
# kvstage router -> dynamo.frontend flags (the module docstring)
FRONTEND_ROUTER = {
    "round-robin": ["--router-mode", "round-robin"],
    "cache-aware": ["--router-mode", "kv"],
    "least-outstanding": ["--router-mode", "kv", "--kv-overlap-score-weight", "0"],
    "staging-aware": ["--router-mode", "kv", "--kv-overlap-score-weight", "0"],
}
VLLM_CONNECTORS = {"nixl": "nixl"}  # [C] dynamo.vllm --connector's choices with a backend


def _worker_args(s: Scenario, side: str, framework: str) -> tuple[dict[str, str], list[str]]:
    """(environment, arguments) of one side's worker."""
    if framework == "sglang":
        env, flags = sglang_flags(s, side)
        return env, ["-m", "dynamo.sglang", *flags]
    connector = VLLM_CONNECTORS.get(s.hardware.backend)
    if connector is None:
        raise ExportError(
            f"--export dynamo-vllm: dynamo.vllm has no connector for the {s.hardware.backend} "
            "backend (its --connector choices: nixl, lmcache, kvbm, null, none); use "
            'hardware.backend = "nixl"'
        )
    try:
        engine = vllm_engine_flags(s, side)
    except ExportError as exc:
        raise ExportError(f"--export dynamo-vllm: {exc}") from None
    args = ["-m", "dynamo.vllm", "--model", _model(s)]
    args += ["--tensor-parallel-size", str(getattr(s, side).tp), *engine]
    args += ["--connector", connector]
    if side == "prefill":
        args.append("--is-prefill-worker")
    return {}, args


def _worker(s: Scenario, side: str, framework: str) -> dict[str, Any]:
    nodes = node_count(s, side)
    env, args = _worker_args(s, side, framework)
    out: dict[str, Any] = {
        "componentType": "worker",
        "subComponentType": side,
        "replicas": servers(s, side),
        "resources": {"limits": {"gpu": str(server_gpus(s, side) // nodes)}},
    }
    if nodes > 1:
        out["multinode"] = {"nodeCount": nodes}
    if env:
        out["envs"] = [{"name": k, "value": v} for k, v in env.items()]
    container = {"name": "main", "image": DYNAMO_IMAGE, "command": ["python3"], "args": args}
    out["extraPodSpec"] = {"mainContainer": container}
    return out


def dynamo_graph(s: Scenario, framework: str, name: str = "kvstage") -> dict[str, Any]:
    """The DynamoGraphDeployment of the configuration, served by `framework` (sglang or
    vllm), as plain data."""
    if framework not in ("sglang", "vllm"):
        raise ExportError(f"dynamo backend {framework!r}: one of sglang, vllm")
    frontend = {
        "componentType": "frontend",
        "replicas": 1,
        "extraPodSpec": {
            "mainContainer": {
                "name": "main",
                "image": DYNAMO_IMAGE,
                "command": ["python3"],
                "args": ["-m", "dynamo.frontend", *FRONTEND_ROUTER[s.cluster.router]],
            }
        },
    }
    services = {"Frontend": frontend}
    for side in ("prefill", "decode"):
        services[side] = _worker(s, side, framework)
    return {
        "apiVersion": API_VERSION,
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {"backendFramework": framework, "services": services},
    }


def dynamo_yaml(s: Scenario, framework: str, name: str = "kvstage") -> str:
    """The graph as YAML (`kubectl apply -f -`)."""
    import yaml

    head = (
        f"# kvstage plan winner as a Dynamo graph ({framework}); set the image ({DYNAMO_IMAGE})\n"
    )
    return head + yaml.safe_dump(dynamo_graph(s, framework, name), sort_keys=False)
