"""`kvstage plan --export`: each target checked by what consumes it where that installs
here -- the SGLang router's own argument parser (PyPI sglang-router), the Kubernetes
client's models for the pod templates -- and where it does not, against what was read
in the tools' code: vLLM's KVTransferConfig as a JSON schema (tests/data/schemas/;
vLLM needs its CUDA torch), the LeaderWorkerSet CRD's field lists (Go types); SGLang's
server (its GPU stack) by scripts/check_exports.py. kvstage/explore/export*.py cite
them."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes.client as k8s
import pytest
import yaml
from sglang_router.launch_router import parse_router_args

from kvstage.explore.export import (
    ExportError,
    node_count,
    server_gpus,
    servers,
    sglang_router_command,
)
from kvstage.explore.export_k8s import lws_manifests, lws_yaml
from kvstage.explore.export_vllm import KV_TRANSFER_FIELDS, kv_transfer_config, vllm_commands
from kvstage.shared.scenario import load_scenario

SCHEMAS = Path(__file__).parent / "data" / "schemas"


def _validator(name: str) -> jsonschema.protocols.Validator:
    """The validator of a schema in tests/data/schemas/ (each cites what it was written
    from), the schema itself checked against its draft's metaschema first."""
    schema = json.loads((SCHEMAS / name).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _errors(validator, doc) -> list[str]:
    return [e.message for e in validator.iter_errors(doc)]


KV_SCHEMA = _validator("vllm-kv-transfer-config.schema.json")


def _scenario(*sets: str, path: str = "scenarios/llama3-70b-p8-d2.toml"):
    return load_scenario(path, list(sets))


# --------------------------------------------------------------------------- SGLang router


@pytest.mark.parametrize(
    ("router", "policy"),
    [("round-robin", "round_robin"), ("cache-aware", "cache_aware"),
     ("least-outstanding", "power_of_two")],
)  # fmt: skip
def test_the_router_line_parses_with_the_routers_own_parser(router, policy):
    s = _scenario(
        "cluster.prefill_instances=3", "cluster.decode_instances=2", f"cluster.router={router}"
    )
    words = sglang_router_command(s)
    assert words[:3] == ["python", "-m", "sglang_router.launch_router"]
    args = parse_router_args(words[3:])
    assert args.pd_disaggregation is True and args.policy == policy
    assert [u for u, _ in args.prefill_urls] == [f"http://prefill-{i}:30000" for i in range(3)]
    assert all(port == 8998 for _, port in args.prefill_urls)
    assert args.decode_urls == ["http://decode-0:30000", "http://decode-1:30000"]


def test_dp_attention_servers_span_the_expert_group():
    s = _scenario_ds("cluster.decode_instances=4")
    assert servers(s, "decode") == 2  # 4 instances of TP8, 2 to an EP16 group
    assert node_count(s, "decode") == 2  # 16 GPUs per server, nodes of 8
    args = parse_router_args(sglang_router_command(s)[3:])
    assert len(args.decode_urls) == 2
    with pytest.raises(ExportError, match="expert groups"):
        servers(_scenario_ds("cluster.decode_instances=3"), "decode")


def _scenario_ds(*sets: str):
    return _scenario("decode.ep=16", *sets, path="scenarios/mla/deepseek-v3-p16-d8.toml")


def test_multi_node_lines_carry_the_rendezvous():
    s = _scenario(path="scenarios/llama3-70b-p16-d4.toml")
    assert node_count(s, "prefill") == 2 and node_count(s, "decode") == 1
    from kvstage.explore.export import sglang_commands

    lines = [x for x in sglang_commands(s).splitlines() if "sglang.launch_server" in x]
    prefill, decode = (shlex.split(x) for x in lines)
    i = prefill.index("--nnodes")
    assert prefill[i : i + 6] == [
        "--nnodes", "2", "--node-rank", "$NODE_RANK", "--dist-init-addr", "$PREFILL_HEAD:5000",
    ]  # fmt: skip
    assert "--nnodes" not in decode


def test_prefill_pipeline_stages_carry_the_pp_size():
    # Llama-3-70B prefill TP8 PP2: 16 GPUs a server over two nodes, SGLang's --pp-size
    # (scripts/check_exports.py parses it with ServerArgs: pp_size 2)
    s = _scenario("prefill.tp=8", "prefill.pp=2")
    assert node_count(s, "prefill") == 2 and node_count(s, "decode") == 1
    from kvstage.explore.export import sglang_commands

    text = sglang_commands(s)
    assert "prefill 1 x TP8 PP2" in text
    lines = [x for x in text.splitlines() if "sglang.launch_server" in x]
    prefill, decode = (shlex.split(x) for x in lines)
    assert prefill[prefill.index("--pp-size") + 1] == "2" and "--pp-size" not in decode
    assert prefill[prefill.index("--nnodes") + 1] == "2"
    assert "--pp-size" not in shlex.split(sglang_commands(_scenario()).splitlines()[2])
    with pytest.raises(ExportError, match="prefill pp 2 .* not exported for vLLM"):
        vllm_commands(_scenario("hardware.backend=nixl", "prefill.tp=4", "prefill.pp=2"))


# --------------------------------------------------------------------------- vLLM


def test_vllm_kv_transfer_config_validates_against_vllms_config():
    s = _scenario("hardware.backend=nixl")
    text = vllm_commands(s)
    configs = [json.loads(m) for m in re.findall(r"'(\{.*?\})'", text)]
    assert len(configs) == 2 and all(c == kv_transfer_config(s) for c in configs)
    for c in configs:
        assert _errors(KV_SCHEMA, c) == []
        assert c["kv_connector"] == "NixlConnector"
    lines = [shlex.split(x) for x in text.splitlines() if x.startswith("vllm")]
    assert lines[0][lines[0].index("--tensor-parallel-size") + 1] == "8"
    assert lines[1][lines[1].index("--max-num-seqs") + 1] == str(s.decode.max_running_requests)


def test_the_kv_transfer_schema_refuses_what_vllm_refuses():
    assert set(KV_SCHEMA.schema["properties"]) == set(KV_TRANSFER_FIELDS)
    errors = " | ".join(
        _errors(KV_SCHEMA, {"kv_connector": "NixlConnector"})  # no role: __post_init__
        + _errors(KV_SCHEMA, {"kv_connector": "NixlConnector", "kv_role": "kv_sender"})
        + _errors(KV_SCHEMA, {"kv_role": "kv_both", "kv_port": "5600", "kv_conector": "x"})
    )
    for word in ("'kv_role' is a required property", "'kv_sender' is not one of",
                 "'5600' is not of type 'integer'", "'kv_conector' was unexpected"):  # fmt: skip
        assert word in errors, errors


def test_vllm_refuses_what_it_cannot_express():
    with pytest.raises(ExportError, match="no connector for the mooncake backend"):
        vllm_commands(_scenario("hardware.backend=mooncake"))
    with pytest.raises(ExportError, match="Ray cluster"):
        vllm_commands(_scenario("hardware.backend=nixl", path="scenarios/llama3-70b-p16-d4.toml"))


# --------------------------------------------------------------------------- LeaderWorkerSet

# [C] kubernetes-sigs/lws api/leaderworkerset/v1/leaderworkerset_types.go at 024af084:
# the JSON names of LeaderWorkerSetSpec and LeaderWorkerTemplate
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE = {
    "leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
    "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy",
}  # fmt: skip
RESTART = {"Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"}


def _build(data, kind: str):
    """`data` as the Kubernetes client's model `kind` (e.g. "V1PodTemplateSpec"),
    every key a field of it, every value of its type; the model checks what it requires."""
    if kind.startswith("List["):
        assert isinstance(data, list), (kind, data)
        return [_build(x, kind[5:-1]) for x in data]
    if kind.startswith("Dict["):
        assert isinstance(data, dict), (kind, data)
        inner = kind[5:-1].split(", ", 1)[1]
        return {k: _build(v, inner) for k, v in data.items()}
    if kind in ("str", "int", "bool", "float"):
        assert type(data).__name__ == kind, (kind, data)
        return data
    cls = getattr(k8s, kind)
    names = {v: k for k, v in cls.attribute_map.items()}
    unknown = set(data) - set(names)
    assert not unknown, f"{kind} has no field {sorted(unknown)}"
    return cls(**{names[k]: _build(v, cls.openapi_types[names[k]]) for k, v in data.items()})


@pytest.mark.parametrize(
    ("sets", "path"),
    [(("cluster.prefill_instances=2",), "scenarios/llama3-70b-p16-d4.toml"),
     (("prefill.tp=8", "prefill.pp=2"), "scenarios/llama3-70b-p8-d2.toml")],
)  # fmt: skip
def test_lws_manifests_are_leaderworkersets_of_valid_pod_templates(sets, path):
    s = _scenario(*sets, path=path)
    docs = list(yaml.safe_load_all(lws_yaml(s)))
    assert docs == lws_manifests(s)
    for doc, side in zip(docs, ("prefill", "decode"), strict=True):
        assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        assert doc["kind"] == "LeaderWorkerSet"
        _build(doc["metadata"], "V1ObjectMeta")
        spec = doc["spec"]
        assert set(spec) <= LWS_SPEC and set(spec["leaderWorkerTemplate"]) <= LWS_TEMPLATE
        lwt = spec["leaderWorkerTemplate"]
        assert lwt["restartPolicy"] in RESTART
        assert spec["replicas"] == servers(s, side) and lwt["size"] == node_count(s, side)
        pod = _build(lwt["workerTemplate"], "V1PodTemplateSpec")
        (c,) = pod.spec.containers
        gpus = int(c.resources.limits["nvidia.com/gpu"])
        assert gpus * lwt["size"] == server_gpus(s, side)  # tp (x pp on the prefill)
    prefill_args = docs[0]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][
        0
    ]["args"]
    assert "$(LWS_WORKER_INDEX)" in prefill_args
    assert "$(LWS_LEADER_ADDRESS):5000" in prefill_args


def test_a_model_without_its_required_fields_is_refused():
    with pytest.raises(ValueError, match="name"):
        _build({"spec": {"containers": [{"image": "x"}]}}, "V1PodTemplateSpec")
    with pytest.raises(AssertionError, match="has no field"):
        _build({"spec": {"containerz": []}}, "V1PodTemplateSpec")
