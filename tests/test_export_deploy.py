"""`kvstage plan --export dynamo-sglang|dynamo-vllm|llm-d`: each manifest validated with
jsonschema against the schema of what consumes it (tests/data/schemas/, each written
from the published CRD or chart schema it cites), its containers built with the
Kubernetes client's V1Container model, and the schemas shown to refuse what the
consumer refuses."""

from __future__ import annotations

import json

import pytest
import yaml
from test_export import KV_SCHEMA, _build, _errors, _scenario, _scenario_ds, _validator

from kvstage.explore.export import ExportError, node_count, servers, sglang_flags
from kvstage.explore.export_dynamo import dynamo_graph, dynamo_yaml
from kvstage.explore.export_llmd import CHART_KEYS, llmd_values, llmd_yaml
from kvstage.explore.export_vllm import kv_transfer_config

DGD = _validator("dynamographdeployment.schema.json")
LLMD = _validator("llm-d-modelservice-values.schema.json")


# --------------------------------------------------------------------------- Dynamo

DYNAMO_CASES = [
    ("sglang", ("hardware.backend=nixl",), "scenarios/llama3-70b-p8-d2.toml"),
    ("sglang", ("transfer.path=staging",), "scenarios/llama3-70b-p16-d4.toml"),
    ("sglang", ("decode.ep=16", "cluster.decode_instances=2"),
     "scenarios/mla/deepseek-v3-p16-d8.toml"),
    ("vllm", ("hardware.backend=nixl",), "scenarios/llama3-70b-p8-d2.toml"),
    ("vllm", ("hardware.backend=nixl",), "scenarios/llama3-70b-p16-d4.toml"),
    ("sglang", ("prefill.tp=8", "prefill.pp=2"), "scenarios/llama3-70b-p8-d2.toml"),
]  # fmt: skip


@pytest.mark.parametrize(("framework", "sets", "path"), DYNAMO_CASES)
def test_dynamo_graphs_validate_against_the_crd_schema(framework, sets, path):
    s = _scenario(*sets, path=path)
    doc = yaml.safe_load(dynamo_yaml(s, framework))
    assert doc == dynamo_graph(s, framework)
    assert _errors(DGD, doc) == []
    services = doc["spec"]["services"]
    assert doc["spec"]["backendFramework"] == framework
    for svc in services.values():
        _build(svc["extraPodSpec"]["mainContainer"], "V1Container")
        for env in svc.get("envs", []):
            _build(env, "V1EnvVar")
    for side in ("prefill", "decode"):
        svc, cfg, nodes = services[side], getattr(s, side), node_count(s, side)
        assert svc["subComponentType"] == side and svc["replicas"] == servers(s, side)
        # the CRD: total GPUs = nodeCount x the GPU limit (x pp: the prefill's stages)
        pp = s.prefill.pp if side == "prefill" else 1
        assert int(svc["resources"]["limits"]["gpu"]) * nodes == max(cfg.tp, cfg.ep) * pp
        assert svc.get("multinode", {"nodeCount": 1})["nodeCount"] == nodes
        args = svc["extraPodSpec"]["mainContainer"]["args"]
        # the operator adds the rendezvous for a multi-node worker, the export does not
        assert "--nnodes" not in args and "--dist-init-addr" not in args
        assert args[:2] == ["-m", f"dynamo.{framework}"]
        if framework == "sglang":
            assert args[2:] == sglang_flags(s, side)[1]
        else:
            assert ("--is-prefill-worker" in args) == (side == "prefill")
            assert args[args.index("--connector") + 1] == "nixl"


def test_dynamo_multi_node_and_staging():
    s = _scenario("transfer.path=staging", path="scenarios/llama3-70b-p16-d4.toml")
    prefill = dynamo_graph(s, "sglang")["spec"]["services"]["prefill"]
    assert prefill["multinode"] == {"nodeCount": 2}
    assert prefill["resources"]["limits"]["gpu"] == "8"
    decode = dynamo_graph(s, "sglang")["spec"]["services"]["decode"]
    assert "multinode" not in decode
    assert {"name": "SGLANG_DISAGG_STAGING_BUFFER", "value": "1"} in decode["envs"]


@pytest.mark.parametrize(
    ("router", "args"),
    [("round-robin", ["--router-mode", "round-robin"]), ("cache-aware", ["--router-mode", "kv"]),
     ("least-outstanding", ["--router-mode", "kv", "--kv-overlap-score-weight", "0"])],
)  # fmt: skip
def test_dynamo_frontend_router(router, args):
    s = _scenario(f"cluster.router={router}")
    front = dynamo_graph(s, "sglang")["spec"]["services"]["Frontend"]
    assert front["componentType"] == "frontend"
    assert front["extraPodSpec"]["mainContainer"]["args"] == ["-m", "dynamo.frontend", *args]


def test_dynamo_schema_refuses_what_the_crd_refuses():
    good = dynamo_graph(_scenario("hardware.backend=nixl"), "sglang")
    bad = json.loads(json.dumps(good))
    bad["spec"]["services"]["prefill"]["multinode"] = {"nodeCount": 1}  # CRD minimum 2
    bad["spec"]["services"]["decode"]["resources"]["limits"]["gpu"] = 2  # a string there
    bad["spec"]["services"]["decode"]["replica"] = 2  # no such field
    bad["spec"]["backendFramework"] = "tgi"
    errors = " | ".join(_errors(DGD, bad))
    for word in ("less than the minimum of 2", "2 is not of type 'string'", "'replica'",
                 "'tgi' is not one of"):  # fmt: skip
        assert word in errors, errors


def test_dynamo_refusals_name_the_reason():
    with pytest.raises(ExportError, match="dynamo.vllm has no connector for the mooncake"):
        dynamo_graph(_scenario("hardware.backend=mooncake"), "vllm")
    with pytest.raises(ExportError, match="DP attention"):
        dynamo_graph(_scenario_ds("cluster.decode_instances=2"), "vllm")
    with pytest.raises(ExportError, match="one of sglang, vllm"):
        dynamo_graph(_scenario(), "trtllm")
    with pytest.raises(ExportError, match="dynamo-vllm: prefill pp 2 .* not exported for vLLM"):
        dynamo_graph(_scenario("hardware.backend=nixl", "prefill.tp=4", "prefill.pp=2"), "vllm")


# --------------------------------------------------------------------------- llm-d


def test_llmd_values_validate_against_the_chart_schema():
    s = _scenario("hardware.backend=nixl", "cluster.prefill_instances=3")
    doc = yaml.safe_load(llmd_yaml(s))
    assert doc == llmd_values(s) and _errors(LLMD, doc) == []
    for side, port in (("prefill", 8000), ("decode", 8200)):
        role = doc[side]
        assert role["replicas"] == (3 if side == "prefill" else s.cluster.decode_instances)
        assert role["parallelism"] == {"tensor": getattr(s, side).tp}
        (c,) = role["containers"]
        container = _build({k: v for k, v in c.items() if k not in CHART_KEYS}, "V1Container")
        assert container.ports[0].container_port == port
        args = c["args"]
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert config == kv_transfer_config(s) and _errors(KV_SCHEMA, config) == []
        # the chart's vllmServe adds the TP flag from parallelism.tensor
        assert "--tensor-parallel-size" not in args


def test_llmd_schema_refuses_what_the_chart_refuses():
    bad = llmd_values(_scenario("hardware.backend=nixl"))
    bad["decode"]["parallelism"]["pipeline"] = 2  # parallelism is closed
    bad["prefill"]["containers"][0]["modelCommand"] = "sglangServe"  # the chart fails
    bad["modelArtifacts"]["path"] = "/x"
    errors = " | ".join(_errors(LLMD, bad))
    for word in ("'pipeline'", "'sglangServe' is not one of", "'path'"):
        assert word in errors, errors


def test_llmd_refusals_name_the_reason():
    with pytest.raises(ExportError, match="--export llm-d: vLLM has no connector"):
        llmd_values(_scenario("hardware.backend=mooncake"))
    with pytest.raises(ExportError, match="--export llm-d: prefill pp 2 .* not exported"):
        llmd_values(_scenario("hardware.backend=nixl", "prefill.tp=4", "prefill.pp=2"))
    with pytest.raises(ExportError, match="--export llm-d: prefill TP16 spans nodes"):
        llmd_values(_scenario("hardware.backend=nixl", path="scenarios/llama3-70b-p16-d4.toml"))


def test_the_plan_command_prints_a_valid_dynamo_graph(tmp_path):
    from test_plan import CLI_GRID, SCENARIO, SLO
    from typer.testing import CliRunner

    from kvstage.cli.main import app

    path = tmp_path / "tiny.toml"
    path.write_text(SCENARIO + SLO)
    res = CliRunner().invoke(
        app,
        ["plan", str(path), *CLI_GRID, "--workers", "1", "--out", str(tmp_path / "p"),
         "--no-progress", "--no-colocated", "--export", "dynamo-sglang"],
        env={"COLUMNS": "400"},
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    text = res.output[res.output.index("# kvstage plan winner as a Dynamo graph") :]
    doc = yaml.safe_load(text)
    assert doc["kind"] == "DynamoGraphDeployment" and _errors(DGD, doc) == []
