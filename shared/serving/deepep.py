"""DeepEP's low-latency dispatch and combine: one MoE layer's expert-parallel all-to-all
in a decode step (`decode.deepep_mode = "low_latency"`, SGLang's choice for decode).

The low-latency kernels send every token straight to each rank that holds one of its k
experts, k copies, with no forwarding over NVLink and no merging of the copies bound
for one node (the normal kernels do both; shared/serving/compute.py `alltoall_s` costs
those on bandwidth) [C] https://github.com/deepseek-ai/DeepEP docs/legacy.md: "a set
of low-latency kernels with pure RDMA". Their published latencies are
[P] DeepEP's README (V1 kernels, docs/legacy.md, "Low-latency kernels with pure RDMA"):
H800, one ConnectX-7 400 Gb/s NIC per GPU (~50 GB/s), 128 tokens a GPU, hidden 7,168,
top-8, FP8 dispatch, BF16 combine:

    EP        8    16    32    64   128   256
    dispatch  77   118   155   173   192   194  us
    combine  114   195   273   314   369   360  us

kvstage prices a layer of this GPU's `tokens` the way that table's setup would be: the
copies that stay in the node over the scale-up link and the copies that leave it over
this GPU's share of the NIC, at once (the longer of the two), times the ratio the table
shows between the measured latency and that same ideal time on its own setup (H800:
NVLink 200 GB/s a direction, NIC 50 GB/s; the ratio is 1.3-2.4: what the kernels lose
to signalling and small messages). EP sizes between the table's rows take the ratio of
the next one down (above 256, 256's). Each of the two kernels waits at least one
one-way latency of the link its copies cross (the links profile's inter or intra
`latency_us`): fewer tokens never take less.

The table's benchmark routes its tokens uniformly at random ([C] DeepEP
tests/test_low_latency.py: top-k of random scores), so its latencies already hold that
routing's busiest rank (1,024 copies a rank: 4-6% over the mean,
shared/serving/ep_balance.py); the ratio divides it out, and the caller multiplies the
scenario's own busiest rank back in (compute.py `alltoall_parts`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstage.shared.serving.ep_balance import imbalance

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["LOW_LATENCY_US", "low_latency_layer_s", "nic_Bps"]

# [P] DeepEP README (see above): EP -> (dispatch us, combine us), 128 tokens a GPU
LOW_LATENCY_US: dict[int, tuple[float, float]] = {
    8: (77, 114),
    16: (118, 195),
    32: (155, 273),
    64: (173, 314),
    128: (192, 369),
    256: (194, 360),
}
# the table's setup: [P] the README's H800 (NVLink "~160 GB/s" measured of its 200 GB/s
# a direction, [D] H800: 400 GB/s both ways) and one CX7 NIC "~50 GB/s" per GPU
_TABLE_TOKENS, _TABLE_HIDDEN, _TABLE_K, _TABLE_GPN = 128, 7168, 8, 8
_TABLE_NVLINK_BPS, _TABLE_NIC_BPS = 200e9, 50e9
_DISPATCH_BYTES, _COMBINE_BYTES = 1, 2  # FP8 out, BF16 back


def nic_Bps(s: Scenario) -> float:
    """One GPU's share of the NIC between nodes (the links profile's inter link)."""
    r = s.links.resolved()
    link = r.inter or r.link
    return link.bandwidth_bytes_s / max(1, r.gpus_per_nic)


def _ideal_s(
    tokens: float, hidden: int, k: int, ep: int, gpn: int, per: int, nvl: float, nic: float
) -> float:
    """One kernel's bytes on its two links at once: the copies for the node's other GPUs
    over NVLink, those for other nodes over the NIC."""
    copies = tokens * k
    local = copies * (min(ep, gpn) - 1) / ep
    remote = copies * max(0, ep - gpn) / ep
    return max(local * hidden * per / nvl, remote * hidden * per / nic)


def _row(ep: int) -> tuple[int, tuple[float, float]]:
    keys = sorted(LOW_LATENCY_US)
    below = [e for e in keys if e <= ep] or keys[:1]
    return below[-1], LOW_LATENCY_US[below[-1]]


def low_latency_layer_s(
    s: Scenario, ep: int, tokens: float, scaleup_Bps: float
) -> tuple[float, float]:
    """(dispatch, combine) of one MoE layer for `tokens` tokens of one GPU in an EP group
    of `ep`, over a scale-up link of `scaleup_Bps` a direction, with every rank at the
    mean load (see above)."""
    if tokens <= 0:
        return 0.0, 0.0
    m = s.model
    gpn = min(ep, s.cluster.gpus_per_node)
    row_ep, (d_us, c_us) = _row(ep)
    r = s.links.resolved()
    floor = ((r.inter or r.link) if ep > gpn else (r.intra or r.link)).latency_s
    nic = nic_Bps(s)
    table_busiest = 1.0 + imbalance(_TABLE_TOKENS * _TABLE_K, row_ep, 0.0)  # uniform routing
    parts = []
    for per, us in ((_DISPATCH_BYTES, d_us), (_COMBINE_BYTES, c_us)):
        ref = _ideal_s(_TABLE_TOKENS, _TABLE_HIDDEN, _TABLE_K, row_ep, _TABLE_GPN, per,
                       _TABLE_NVLINK_BPS, _TABLE_NIC_BPS)  # fmt: skip
        ratio = us * 1e-6 / (ref * table_busiest)
        here = _ideal_s(tokens, m.hidden, m.experts_per_token, ep, gpn, per, scaleup_Bps, nic)
        parts.append(max(floor, here * ratio))
    return parts[0], parts[1]
