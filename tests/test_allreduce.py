"""shared/serving/allreduce.py by hand: one TP all-reduce by message size and world
size, the engines' custom kernel up to 8 MiB and NCCL's published curve above it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.shared.scenario import load_scenario
from kvstage.shared.serving.allreduce import (
    CUSTOM_ALLREDUCE_MAX_BYTES,
    allreduce_one_s,
    nccl_busbw_Bps,
)
from kvstage.shared.serving.kernels import allreduce_latency_s

BASE = Path(__file__).resolve().parents[1] / "scenarios" / "llama3-8b-p4-d2.toml"
MB = 1 << 20


def load(gpu: str):
    return load_scenario(BASE, ['transfer.path="slice"', f"prefill.gpu={gpu}"])


def test_up_to_the_custom_kernel_s_limit_the_link_model_stands():
    s = load("h100-sxm")
    n, nbytes = 8, CUSTOM_ALLREDUCE_MAX_BYTES
    link = 450e9 * 0.8
    want = nbytes * 2 * 7 / 8 / link + allreduce_latency_s(s, "prefill", n)
    assert allreduce_one_s(s, "prefill", nbytes, n) == pytest.approx(want)
    assert allreduce_one_s(s, "prefill", nbytes, 1) == 0.0


def test_a_prefill_message_on_8_gpus_reads_the_published_curve():
    s = load("h100-sxm")
    # 32 MiB on 8 GPUs: Azure ND H200 v5's 300.91 GB/s, under the ring's 360
    assert nccl_busbw_Bps(s, "prefill", 32 * MB, 8) == pytest.approx(300.91e9)
    assert allreduce_one_s(s, "prefill", 32 * MB, 8) == pytest.approx(
        32 * MB * 2 * 7 / 8 / 300.91e9
    )
    # A100's curve is its own: 132.77 GB/s at 32 MiB, far under its link x 0.8 (240)
    assert nccl_busbw_Bps(load("a100-80g"), "prefill", 32 * MB, 8) == pytest.approx(132.77e9)


def test_fewer_gpus_move_larger_steps_and_never_pass_the_ring_plateau():
    s = load("h100-sxm")
    # 2 GPUs at 16 MiB: steps of 8 MiB, as 8 GPUs at 64 MiB (368 GB/s), capped at 360
    assert nccl_busbw_Bps(s, "prefill", 16 * MB, 2) == pytest.approx(360e9)
    assert nccl_busbw_Bps(s, "prefill", 16 * MB, 4) == pytest.approx(300.91e9)
    for nbytes in (9 * MB, 40 * MB, 300 * MB, 4096 * MB):
        assert nccl_busbw_Bps(s, "prefill", nbytes, 8) <= 360e9


def test_a_larger_message_never_takes_less_time():
    for gpu in ("h100-sxm", "a100-80g", "l40s"):
        s = load(gpu)
        for n in (2, 4, 8):
            times = [allreduce_one_s(s, "prefill", b * MB, n) for b in range(1, 400, 3)]
            assert times == sorted(times), (gpu, n)


def test_a_gpu_without_a_curve_keeps_the_link_model():
    s = load("l40s")
    assert nccl_busbw_Bps(s, "prefill", 64 * MB, 4) is None
