"""What moved the bytes (hw/transport/used.py): UCX's protocol tables and Mooncake's
topology read into summary.json's `transport_used`, and the rule that fails a run that
asked for RDMA and moved its bytes over TCP. The real engines' records are checked by
test_hw.py (one host: CMA, TCP) and test_netns.py (two namespaces: TCP on the veth)."""

from __future__ import annotations

from types import SimpleNamespace

from kvstage.hw.transport.used import (
    carried_over,
    mooncake_hcas,
    mooncake_used,
    no_rdma_here,
    parse_ucx_proto_info,
    rdma_asked,
    rdma_problem,
    transport_name,
)

# The shape UCX 1.19 prints with UCX_PROTO_INFO=y (one table per endpoint configuration
# and operation; the first as printed by a NIXL rank here, the others with other cells).
UCX_LOG = """\
[1796194162.240671] [vm:24433:0]   +--------+-------------+-----------------------------------+
[1796194162.240671] [vm:24433:0]   | kvstage-prefill0-1 self cfg#0                            |
[1796194162.240671] [vm:24433:0]   | remote memory write by ucp_put* from host memory to host |
[1796194162.240671] [vm:24433:0]   +--------+-------------+-----------------------------------+
[1796194162.240671] [vm:24433:0]   | 0..inf | zero-copy   | cma/memory                        |
[1796194162.240671] [vm:24433:0]   +--------+-------------+-----------------------------------+
[1796194162.250000] [vm:24433:0]   | kvstage-prefill0-1 intra-node cfg#1                      |
[1796194162.250000] [vm:24433:0]   | remote memory write by ucp_put* from host memory to host |
[1796194162.250000] [vm:24433:0]   +--------+-------------+-----------------------------------+
[1796194162.250000] [vm:24433:0]   | Range  | Description |              Config               |
[1796194162.250000] [vm:24433:0]   | 0..inf | zero-copy   | cma/memory                        |
[1796194162.260000] [vm:24433:0]   | kvstage-prefill0-1 intra-node cfg#1                      |
[1796194162.260000] [vm:24433:0]   | active message by ucp_am_send* from host memory          |
[1796194162.260000] [vm:24433:0]   |      0 | short       | tcp/lo                            |
[1796194162.270000] [vm:24433:0]   | kvstage-prefill0-1 inter-node cfg#2                      |
[1796194162.270000] [vm:24433:0]   | remote memory write by ucp_put* from host memory to host |
[1796194162.270000] [vm:24433:0]   | 0..8K  | short       | rc_mlx5/mlx5_0:1                  |
[1796194162.270000] [vm:24433:0]   | 8K..inf| zero-copy   | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_3:1 |
"""


def test_ucx_tables_give_the_write_transports_per_scope():
    writes = parse_ucx_proto_info(UCX_LOG)
    # the process's endpoint to itself is left out; active messages are not writes
    assert writes == {
        "inter-node": ["rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_3:1"],
        "intra-node": ["cma/memory"],
    }
    assert carried_over(writes) == "rdma"
    assert carried_over({"intra-node": ["cma/memory"]}) == "same-host"
    assert carried_over({"inter-node": ["tcp/eth0"], "intra-node": ["cma/memory"]}) == "tcp"
    assert carried_over({}) is None
    assert transport_name("50% on rc_mlx5/mlx5_0:1 and 50% on tcp/eth0") == "rc_mlx5"


def test_mooncake_topology_names_its_hcas():
    none = '{\n\t"cpu:0" : \n\t[\n\t\t[],\n\t\t[]\n\t]\n}\n'  # as the engine answers on this host
    assert mooncake_hcas(none) == []
    two = '{"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cuda:0": [["mlx5_0"], []]}'
    assert mooncake_hcas(two) == ["mlx5_0", "mlx5_1"]
    assert mooncake_hcas("not json") == [] and mooncake_hcas('["a"]') == []
    assert mooncake_used("rdma", none)["over"] == "tcp"  # the engine falls back to TCP
    assert mooncake_used("rdma", two) == {
        "source": "Mooncake topology",
        "protocol": "rdma",
        "hcas": ["mlx5_0", "mlx5_1"],
        "writes": {"any": ["rdma/mlx5_0", "rdma/mlx5_1"]},
        "over": "rdma",
    }


def test_a_run_that_asked_for_rdma_and_wrote_over_tcp_fails_naming_the_rank():
    nixl = SimpleNamespace(backend="nixl", mooncake_protocol="tcp")
    mooncake = SimpleNamespace(backend="mooncake", mooncake_protocol="rdma")
    assert rdma_asked(nixl, {}) is None
    assert rdma_asked(nixl, {"UCX_TLS": "rc,cuda_copy"}) == "UCX_TLS = 'rc,cuda_copy'"
    assert rdma_asked(nixl, {"UCX_TLS": "^tcp"}) is None  # "all but tcp" names no RDMA transport
    assert rdma_asked(nixl, {"UCX_NET_DEVICES": "mlx5_0:1"}) == "UCX_NET_DEVICES = 'mlx5_0:1'"
    assert rdma_asked(mooncake, {}) == 'hardware.mooncake_protocol = "rdma"'
    used = {
        "prefill0": {"writes": {"inter-node": ["rc_mlx5/mlx5_0:1"]}, "over": "rdma"},
        "prefill1": {"writes": {"inter-node": ["tcp/eth0"]}, "over": "tcp"},
        "decode0": {"writes": {"intra-node": ["cma/memory"]}, "over": "same-host"},
    }
    problem = rdma_problem("UCX_TLS = 'rc'", used)
    assert problem == (
        "UCX_TLS = 'rc' asked for RDMA, but prefill1 wrote over tcp/eth0: the bytes did not "
        "move over RDMA"
    )
    assert rdma_problem(None, used) is None
    assert (
        rdma_problem("UCX_TLS = 'rc'", {k: v for k, v in used.items() if k != "prefill1"}) is None
    )


def test_asking_for_rdma_on_a_host_without_it_is_one_line():
    line = no_rdma_here('hardware.mooncake_protocol = "rdma"', devices=[])
    assert line.startswith('hardware.mooncake_protocol = "rdma" but this host has no RDMA device')
    assert "\n" not in line and "allowed:" in line
    assert no_rdma_here('hardware.mooncake_protocol = "rdma"', devices=["mlx5_0"]) is None
    assert no_rdma_here(None, devices=[]) is None
