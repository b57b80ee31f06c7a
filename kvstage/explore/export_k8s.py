"""A plan's winner as Kubernetes LeaderWorkerSet manifests: `kvstage plan --export lws`.

One LeaderWorkerSet per side ([C] kubernetes-sigs/lws
api/leaderworkerset/v1/leaderworkerset_types.go at
024af0845195be26fb4a0847c37d7209849d69da): `apiVersion: leaderworkerset.x-k8s.io/v1`,
`kind: LeaderWorkerSet`; spec.replicas = the side's SGLang servers (one group each),
spec.leaderWorkerTemplate.size = the nodes one server spans (the leader counts: 1
on one node), restartPolicy RecreateGroupOnPodRestart (a TP group is lost with any
of its pods), and one workerTemplate for every pod of the group (no leaderTemplate:
the LWS controller uses the worker template for the leader when none is given). Each
pod runs SGLang's launch_server with the flags of `kvstage.explore.export.sglang_flags`;
a group spanning nodes adds `--nnodes`, `--node-rank $(LWS_WORKER_INDEX)` and
`--dist-init-addr $(LWS_LEADER_ADDRESS):PORT`, the environment variables LWS sets in
every container of the group (LwsWorkerIndex, LwsLeaderAddress in the same file;
Kubernetes expands `$(VAR)` in a container's args). A pod asks for its GPUs as
`nvidia.com/gpu` limits (the NVIDIA device plugin's resource name).

The pod templates are core/v1 PodTemplateSpecs; the tests build them with the
`kubernetes` Python client's models (generated from the Kubernetes OpenAPI spec), every
key checked against the model's fields. The image is a placeholder to set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstage.explore.export import (
    DIST_PORT,
    SERVER_PORT,
    multinode_flags,
    node_count,
    server_gpus,
    servers,
    sglang_flags,
)

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["IMAGE_PLACEHOLDER", "lws_manifests", "lws_yaml"]

IMAGE_PLACEHOLDER = "SGLANG_IMAGE"


def _pod_template(s: Scenario, side: str) -> dict[str, Any]:
    env, flags = sglang_flags(s, side)
    nodes = node_count(s, side)
    gpus = server_gpus(s, side) // nodes
    args = [
        *flags,
        *multinode_flags(nodes, "$(LWS_WORKER_INDEX)", f"$(LWS_LEADER_ADDRESS):{DIST_PORT}"),
        "--host",
        "0.0.0.0",
        "--port",
        str(SERVER_PORT),
    ]
    container = {
        "name": "sglang",
        "image": IMAGE_PLACEHOLDER,
        "command": ["python", "-m", "sglang.launch_server"],
        "args": args,
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "ports": [{"containerPort": SERVER_PORT, "name": "http"}],
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
    }
    return {
        "metadata": {"labels": {"app": f"kvstage-{side}", "kvstage/role": side}},
        "spec": {"containers": [container]},
    }


def lws_manifests(s: Scenario, name: str = "kvstage") -> list[dict[str, Any]]:
    """The two LeaderWorkerSet objects (prefill, decode) as plain data."""
    out = []
    for side in ("prefill", "decode"):
        out.append(
            {
                "apiVersion": "leaderworkerset.x-k8s.io/v1",
                "kind": "LeaderWorkerSet",
                "metadata": {"name": f"{name}-{side}"},
                "spec": {
                    "replicas": servers(s, side),
                    "leaderWorkerTemplate": {
                        "size": node_count(s, side),
                        "restartPolicy": "RecreateGroupOnPodRestart",
                        "workerTemplate": _pod_template(s, side),
                    },
                },
            }
        )
    return out


def lws_yaml(s: Scenario, name: str = "kvstage") -> str:
    """The manifests as one YAML stream (`kubectl apply -f -`)."""
    import yaml

    head = (
        f"# kvstage plan winner as LeaderWorkerSets; set the image ({IMAGE_PLACEHOLDER}) "
        "and the model path\n"
    )
    return head + yaml.safe_dump_all(lws_manifests(s, name), sort_keys=False)
