"""[gpus.NAME]: a GPU of the user's own, named like a catalogue entry; every number
required but FP8 and the all-reduce latency; one clear error per missing field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.serving.compute import decode_step
from kvstage.shared.serving.gpus import side_gpu
from kvstage.shared.serving.kernels import allreduce_latency_s

OWN = """
name = "own"
[model]
preset = "llama-3-8b"
[prefill]
tp = 2
gpu = "mygpu"
[decode]
tp = 2
gpu = "mygpu"
[gpus.mygpu]
memory_gib = 64
hbm_gbs = 2000
bf16_tflops = 400
scaleup_gbs = 100
scaleup = "PCIe Gen5 x16"
source = "the vendor's sheet, rev 1"
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "own.toml"
    p.write_text(text)
    return p


def test_an_own_gpu_is_used_like_a_catalogue_one(tmp_path):
    s = load_scenario(write(tmp_path, OWN))
    g = side_gpu(s, "decode")
    assert (g.name, g.memory_gib, g.hbm_gbs, g.bf16_tflops) == ("mygpu", 64, 2000, 400)
    assert g.fp8_tflops is None and g.source == "the vendor's sheet, rev 1"
    # never faster than its own sheet: the weights (less the embedding) over its HBM
    step = decode_step(s, 1, 1000)
    assert step.total_s >= (8e9 - 128256 * 4096) * 2 / 2 / 2000e9
    # PCIe: the link's latency by kind, unless the table gives its own
    assert allreduce_latency_s(s, "decode", 2) == pytest.approx(6e-6)
    s2 = load_scenario(write(tmp_path, OWN), ["gpus.mygpu.allreduce_latency_us=20"])
    assert allreduce_latency_s(s2, "decode", 4) == pytest.approx(20e-6 + 2 * 7e-6)


def test_missing_fields_are_each_named(tmp_path):
    text = OWN.replace("hbm_gbs = 2000\n", "").replace(
        'source = "the vendor\'s sheet, rev 1"\n', ""
    )
    with pytest.raises(ScenarioError) as e:
        load_scenario(write(tmp_path, text))
    msg = str(e.value)
    assert "gpus.mygpu.hbm_gbs: missing (required)" in msg
    assert "gpus.mygpu.source: missing (required)" in msg


def test_an_unknown_gpu_names_the_catalogue_and_the_own_tables(tmp_path):
    with pytest.raises(ScenarioError) as e:
        load_scenario(write(tmp_path, OWN), ['decode.gpu="other"'])
    msg = str(e.value)
    assert 'decode.gpu = "other": unknown GPU' in msg
    assert "h100-sxm" in msg and "[gpus.NAME] tables: mygpu" in msg


def test_an_own_gpu_may_have_fp4_tensor_cores_or_refuse_fp4_without_cuda(tmp_path):
    path = write(tmp_path, OWN)
    native = load_scenario(path, ["gpus.mygpu.fp4_tflops=1600", "model.weight_dtype=fp4"])
    assert side_gpu(native, "decode").peak_flops("fp4") == 1600e12
    emulated = load_scenario(path, ["model.weight_dtype=fp4"])  # W4A16: the BF16 rate
    assert side_gpu(emulated, "decode").peak_flops("fp4") == 400e12
    with pytest.raises(ScenarioError, match='prefill.gpu = "mygpu".*FP4 tensor cores'):
        load_scenario(path, ["gpus.mygpu.cuda=false", "model.weight_dtype=fp4"])
