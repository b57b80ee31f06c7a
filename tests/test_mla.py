"""MLA (DeepSeek-V2/V3, Kimi-K2): one latent per token per layer, on every TP rank.

The latent is replicated, so nothing is resharded: each decode rank reads it from one
prefill rank (d % P, spread over the prefill ranks), over the slice path, once per
(page, layer) and with no V. The layout, the schema, `kvstage validate`, the kernels,
the simulator and hardware mode (NIXL) must all agree on that.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import require_engine
from test_hw import run, write_scenario
from typer.testing import CliRunner

from kvstage.analysis.layout_report import duplicate_share
from kvstage.cli.main import app
from kvstage.hw.rank.kernels import apply_ops, block_bytes, slice_ops
from kvstage.hw.rank.kvpool import KVPool, fill_pattern, verify
from kvstage.shared.invariants import check_records
from kvstage.shared.layout import Geometry, LayoutError, owned_heads, room_pages, staging_address
from kvstage.shared.scenario import ScenarioError, load_scenario, scenario_from_dict
from kvstage.shared.scenario.presets import PRESETS
from kvstage.sim.driver import Simulation

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "mla" / "deepseek-v3-p16-d8.toml"
WIDE = {"COLUMNS": "300"}
LATENT = 36  # a tiny latent (the real one is 576) whose rows are not a power of two


def mla(p: int, d: int, layers: int = 3, page_size: int = 4) -> Geometry:
    return Geometry(p, d, 1, layers, LATENT, 2, page_size, attention="mla")


def model(**fields) -> dict:
    return {"attention": "mla", "layers": 4, "params_b": 1.0, **fields}


def scenario(model_table: dict, p: int = 8, d: int = 2, path: str = "slice"):
    return scenario_from_dict(
        {
            "model": model_table,
            "prefill": {"tp": p},
            "decode": {"tp": d},
            "transfer": {"path": path},
        }
    )


def error(model_table: dict, path: str = "slice") -> ScenarioError:
    with pytest.raises(ScenarioError) as info:
        scenario(model_table, path=path)
    return info.value


# --- layout ----------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "d"), [(8, 2), (2, 1), (1, 2), (2, 8), (4, 4), (16, 4)])
def test_each_decode_rank_reads_from_one_prefill_rank_spread_over_them(p, d):
    g = mla(p, d)
    assert [g.writers(r) for r in range(d)] == [[r % p] for r in range(d)]
    # the targets are exactly the inverse: every decode rank once, no duplicates
    pairs = sorted((t, q) for q in range(p) for t in g.targets(q))
    assert pairs == [(r, r % p) for r in range(d)]
    busy = [q for q in range(p) if g.targets(q)]
    assert busy == list(range(min(p, d)))  # spread: no prefill rank serves two while one idles
    for r in range(d):
        hs = g.head_slice(r % p, r)
        assert (hs.src_head_start, hs.num_heads, hs.dst_head_start) == (0, 1, 0)  # the whole latent
    assert g.prefill_heads == g.decode_heads == 1
    for q in range(p):
        assert list(owned_heads(p, q, g.total_kv_heads)) == [0]  # every rank holds it all


def test_prefill_rank_without_targets_is_legal():
    g = mla(8, 2)
    assert g.targets(5) == []
    with pytest.raises(LayoutError, match="its one writer is prefill rank 1"):
        g.head_slice(5, 1)


def test_latent_bytes_are_counted_once():
    g = Geometry(8, 2, 1, 61, 576, 2, 16, attention="mla")
    assert g.kv_factor == 1
    assert g.kv_bytes_per_token() == 61 * 576 * 2 == 70_272  # no x2 for K and V
    assert g.block_bytes(100, 1) == 100 * 61 * 576 * 2
    assert g.region_bytes(1) == 16 * 70_272  # one writer block per decode rank
    assert g.slice_contiguous_pages(0, 0)
    assert g.slice_requests(0, 0, 10) == 61 * 10  # one request per (page, layer)
    lay = g.staging_layout(1, 2)
    assert [(b.prefill_rank, b.offset, b.nbytes) for b in lay.blocks] == [(1, 0, 32 * 70_272)]
    assert staging_address(g, lay, 0, 0, 1, 3, 0) == (1 * 32 + 3) * 576 * 2
    # an MHA geometry of the same numbers keeps its K and V
    mha = Geometry(8, 2, 1, 61, 576, 2, 16)
    assert mha.kv_bytes_per_token() == 2 * g.kv_bytes_per_token()


def test_geometry_refuses_bad_attention():
    with pytest.raises(LayoutError, match="total_kv_heads must be 1"):
        Geometry(2, 1, 8, 2, 64, 2, 16, attention="mla")
    with pytest.raises(LayoutError, match="attention must be one of mha, mla"):
        Geometry(2, 1, 8, 2, 64, 2, 16, attention="gqa")


# --- schema and presets ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "layers", "params", "active", "source"),
    [
        ("deepseek-v3", 61, 671.0, 37.0, "deepseek-ai/DeepSeek-V3"),
        ("deepseek-v2", 60, 236.0, 21.0, "deepseek-ai/DeepSeek-V2"),
        ("kimi-k2", 61, 1000.0, 32.0, "moonshotai/Kimi-K2-Instruct"),
    ],
)
def test_mla_presets(name, layers, params, active, source):
    p = PRESETS[name]
    assert (p.attention, p.layers, p.latent_dim, p.params_b, p.active_params_b, p.source) == (
        "mla",
        layers,
        512 + 64,
        params,
        active,
        source,
    )
    assert p.kv_elems_per_token == layers * 576
    # fp8 weights over 16 GPUs a side: the size these models are served at
    s = scenario({"preset": name, "weight_dtype": "fp8"}, p=16, d=16)
    m = s.model
    assert (m.attention, m.latent_dim, m.kv_heads, m.head_dim, m.layers) == (
        "mla",
        576,
        1,
        576,
        layers,
    )
    g = s.geometry()
    assert g.mla and g.kv_bytes_per_token() == layers * 576 * 2


def test_existing_scenarios_stay_mha():
    s = load_scenario(ROOT / "scenarios" / "llama3-70b-p8-d2.toml")
    assert s.model.attention == "mha" and s.model.latent_dim is None
    assert not s.geometry().mla and s.geometry().kv_factor == 2


def test_explicit_mla_model_resolves_and_round_trips(tmp_path):
    s = scenario(model(latent_dim=LATENT))
    assert (s.model.kv_heads, s.model.head_dim) == (1, LATENT)
    (tmp_path / "s.toml").write_text(s.to_toml())
    again = load_scenario(tmp_path / "s.toml")
    assert again.model == s.model and again.geometry() == s.geometry()


@pytest.mark.parametrize(
    ("table", "field", "says"),
    [
        (model(attention="gqa", kv_heads=1, head_dim=8), "model.attention", "'mha' or 'mla'"),
        (model(), "model.latent_dim", 'required when attention = "mla"'),
        (model(latent_dim="wide"), "model.latent_dim", "valid integer"),
        (model(latent_dim=0), "model.latent_dim", "greater than or equal to 1"),
        (model(latent_dim=64, kv_heads=8), "model.kv_heads", "kv_heads must be 1 and head_dim 64"),
        (
            model(latent_dim=64, head_dim=128),
            "model.kv_heads",
            "kv_heads must be 1 and head_dim 64",
        ),
        (
            {"preset": "llama-3-8b", "latent_dim": 64},
            "model.latent_dim",
            'only with attention = "mla"',
        ),
        ({"preset": "llama-3-8b", "attention": "mla"}, "model.latent_dim", "512 + 64 = 576"),
    ],
)
def test_bad_mla_model_is_one_clear_error(table, field, says):
    exc = error(table)
    msg = str(exc)
    assert exc.field == field, msg
    assert says in msg and "\n" not in msg and "Traceback" not in msg, msg


def test_staging_path_refuses_mla():
    exc = error({"preset": "deepseek-v3"}, path="staging")
    msg = str(exc)
    assert exc.field == "transfer.path"
    assert "no heads to reshard" in msg and 'Use transfer.path = "slice"' in msg, msg
    with pytest.raises(ScenarioError, match="no heads to reshard"):
        load_scenario(SCENARIO, ["transfer.path=staging"])


# --- kvstage validate ------------------------------------------------------------------


def test_validate_says_latent_is_replicated():
    res = CliRunner().invoke(app, ["validate", str(SCENARIO)], env=WIDE)
    assert res.exit_code == 0, res.output
    assert (
        "latent KV replicated on every rank: no head resharding; decode rank d reads from "
        "prefill rank d % 16 (0 <- 0, 1 <- 1, 2 <- 2, 3 <- 3, 4 <- 4, 5 <- 5, 6 <- 6, 7 <- 7); "
        "prefill ranks 8..15 compute but send nothing"
    ) in res.output
    assert duplicate_share(load_scenario(SCENARIO)) == 0
    assert "0% (MLA: each decode rank reads the latent once" in res.output


# --- kernels: the slice path moves the latent, bit for bit -------------------------------


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2), (8, 2), (2, 4)])
def test_slice_ops_move_every_latent_byte(p, d):
    g = mla(p, d)
    pages, first, room, prefix = 3, 1, "room-m", 2 * g.page_size
    src = []
    for q in range(p):
        pool = KVPool(g.layers, 8, g.page_size, 1, LATENT, "bf16", kv_planes=1)
        fill_pattern(pool, first, pages, room, prefix, list(owned_heads(p, q, 1)))
        src.append(pool)
    for r in range(d):
        dst = KVPool(g.layers, 8, g.page_size, 1, LATENT, "bf16", fill_byte=0xA5, kv_planes=1)
        (writer,) = g.writers(r)
        ops = slice_ops(g, writer, r, src[writer].desc, first, dst.desc, 2, pages)
        assert len(ops) == g.slice_requests(writer, r, pages) == g.layers * pages
        assert (
            ops.total_bytes == g.block_bytes(pages * g.page_size, 1) == block_bytes(dst, pages, 1)
        )
        apply_ops(ops, src[writer].tensor, dst.tensor)
        checked, wrong = verify(dst, 2, pages, room, prefix, [0])
        assert (checked, wrong) == (g.block_bytes(pages * g.page_size, 1), 0)
        assert torch.all(dst.bytes[:, :, : 2 * g.page_size] == 0xA5)  # nothing outside the room


def test_a_wrong_latent_is_caught():
    g = mla(1, 1)
    src = KVPool(g.layers, 4, g.page_size, 1, LATENT, "bf16", kv_planes=1)
    dst = KVPool(g.layers, 4, g.page_size, 1, LATENT, "bf16", kv_planes=1)
    fill_pattern(src, 0, 2, "r", 0, [0])
    apply_ops(slice_ops(g, 0, 0, src.desc, 0, dst.desc, 0, 2), src.tensor, dst.tensor)
    assert verify(dst, 0, 2, "r", 0, [0])[1] == 0
    assert verify(dst, 0, 2, "other room", 0, [0])[1] > 0
    dst.bytes[0, 1, 3, 0, 5] ^= 1  # one bit of layer 1, token 3
    assert verify(dst, 0, 2, "r", 0, [0])[1] == 1


def test_slice_ops_refuse_a_k_and_v_pool_for_mla():
    g = mla(1, 1)
    two = KVPool(g.layers, 4, g.page_size, 1, LATENT, "bf16")  # K and V planes: not MLA's layout
    one = KVPool(g.layers, 4, g.page_size, 1, LATENT, "bf16", kv_planes=1)
    with pytest.raises(ValueError, match="kv_planes"):
        slice_ops(g, 0, 0, two.desc, 0, one.desc, 0, 1)


# --- simulation --------------------------------------------------------------------------


def test_sim_fan_out_every_room_done():
    """P1 -> D2: the one prefill rank feeds both decode ranks, one request per (page, layer).

    DeepSeek-V3's latent and layers, the weights of DeepSeek-V2-Lite (15.7B, the same
    576-wide latent): the full model does not fit one or two GPUs."""
    s = load_scenario(
        SCENARIO,
        [
            "prefill.tp=1",
            "decode.tp=2",
            "model.params_b=15.7",
            "workload.requests=4",
            "workload.prompt=fixed",
            "workload.prompt_tokens=2000",
            "workload.prompt_min=1000",
        ],
    )
    result = Simulation(s).run()
    assert not result.failures and not result.violations
    assert result.rooms_done == 4 and result.rooms_failed == 0
    writes = [r for r in result.records if r.phase == "slice_write"]
    pages = room_pages(2000, 0, 16)
    assert (
        sum(r.requests for r in writes) == 4 * 2 * 61 * pages
    )  # rooms x decode ranks x layers x pages
    assert sum(r.bytes for r in writes) == 4 * 2 * pages * 16 * 61 * 576 * 2
    assert check_records(result.records, "slice") == []


def test_cli_sim_runs_the_catalogue_scenario(tmp_path):
    run = tmp_path / "run"
    res = CliRunner().invoke(
        app, ["sim", str(SCENARIO), "--out", str(run), "--no-progress"], env=WIDE
    )
    summary = json.loads((run / "summary.json").read_text())
    assert res.exit_code == 0, res.output
    assert summary["requests_done"] == 16 and summary["requests_failed"] == 0
    assert summary["transfer_path"] == "slice"


# --- hardware mode: real NIXL transfers between processes --------------------------------


def hw_scenario(tmp_path: Path, p: int, d: int) -> Path:
    """tests/test_hw.py's small scenario on the slice path, its model made an MLA latent."""
    f = write_scenario(tmp_path, p, d, 1, path="slice")
    mha = "kv_heads = 1\nhead_dim = 16\n"
    assert mha in f.read_text()
    f.write_text(f.read_text().replace(mha, f'attention = "mla"\nlatent_dim = {LATENT}\n'))
    return f


@pytest.mark.hw
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1)])
def test_hw_nixl_every_latent_byte_lands(tmp_path, p, d):
    require_engine("nixl")
    from kvstage.run.rundir import read_summary
    from kvstage.shared.workload import generate_requests

    code, run_dir = run(tmp_path, "nixl", hw_scenario(tmp_path, p, d))
    sm = read_summary(run_dir)
    assert (code, sm["requests_done"], sm["requests_failed"], sm["bytes_wrong"]) == (0, 3, 0, 0), (
        sm.get("errors")
    )
    s = load_scenario(run_dir / "scenario.toml")
    pages = sum(room_pages(r.prompt_tokens, r.prefix_tokens, 16) for r in generate_requests(s))
    # every decode rank verified the latent of every page, once: no V, no duplicate
    assert sm["bytes_verified"] == d * pages * 16 * s.model.layers * LATENT * 2 > 0
