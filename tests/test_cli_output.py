"""What the command line prints when it is not talking to a terminal (CI logs, pipes):
errors literal and on one line, --version and -h, the choices of every enum flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstage.cli.errors import one_line

REPO = Path(__file__).resolve().parents[1]


def kvstage(*args: str) -> subprocess.CompletedProcess:
    # stdout and stderr are pipes here: exactly the "not a terminal" case
    return subprocess.run(
        [str(Path(sys.executable).parent / "kvstage"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "80"},
    )


def test_a_scenario_error_is_one_literal_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[model]\npreset = "llama-3-8b"\n[prefill]\ntp = 2\n[decode]\ntp = 1\nbogus = 1\n'
    )
    res = kvstage("validate", str(bad))
    assert res.returncode == 2
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr  # 80 columns, yet not wrapped
    # the brackets are text, not rich markup to be swallowed
    assert "decode.bogus: unknown key; allowed keys in [decode]: tp, page_size" in lines[0]
    assert lines[0].startswith("error: ")


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_two_batch_overlap_on_a_dense_model_is_one_line(side):
    res = kvstage(
        "validate", "scenarios/llama3-8b-p4-d2.toml", "--set", f"{side}.two_batch_overlap=true"
    )
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and not res.stdout
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(
        f"error: scenarios/llama3-8b-p4-d2.toml: {side}.two_batch_overlap = true, {side}.ep = 1"
    )
    assert f"needs a MoE model with {side}.ep > {side}.tp" in lines[0]


def test_several_problems_join_on_one_line():
    assert (
        one_line("f.toml: 2 problems:\n  a.b: bad\n  c: missing\n")
        == "f.toml: 2 problems: a.b: bad; c: missing"
    )
    assert one_line("plain") == "plain"


def test_a_refused_flag_value_names_the_choices_on_one_line():
    res = kvstage("hw", "scenarios/llama3-8b-p4-d2.toml", "--backend", "ucx")
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "error: Invalid value for '--backend': 'ucx' is not one of 'nixl', 'mooncake'. "
        "(see 'kvstage hw --help')"
    )
    res = kvstage("nosuch")
    assert (
        res.returncode == 2
        and res.stderr.strip() == "error: No such command 'nosuch'. (see 'kvstage --help')"
    )


def test_version_and_short_help():
    from importlib.metadata import version

    res = kvstage("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"kvstage {version('kvstage')}"
    for args in (("-h",), ("sim", "-h"), ("hw", "-h")):
        res = kvstage(*args)
        assert res.returncode == 0 and "Usage: kvstage" in res.stdout, args


def test_help_lists_the_choices_of_enum_flags():
    hw = " ".join(kvstage("hw", "--help").stdout.split())
    for choices in ("nixl|mooncake", "full|sample|off", "parquet|jsonl", "cpu|cuda|cuda:N"):
        assert choices in hw, choices
    assert "prefill|decode" in " ".join(kvstage("hw-rank", "--help").stdout.split())
    assert "parquet|jsonl" in " ".join(kvstage("sim", "--help").stdout.split())


@pytest.mark.slow
def test_everyday_output_fits_80_columns_off_a_terminal(tmp_path):
    """Tables, help and notes wrap to 80 columns in a log or a pipe: nothing a reader
    of a CI log must scroll sideways for."""
    scenario = "scenarios/llama3-8b-p4-d2.toml"
    outputs = {
        "help": kvstage("--help"),
        "validate": kvstage("validate", scenario),
        "presets": kvstage("presets"),
    }
    for path in ("staging", "slice"):
        outputs[f"sim {path}"] = kvstage(
            "sim", scenario, "--out", str(tmp_path / path), "--set", f"transfer.path={path}"
        )
    outputs["compare"] = kvstage("compare", str(tmp_path / "staging"), str(tmp_path / "slice"))
    for name, res in outputs.items():
        assert res.returncode == 0, (name, res.stderr)
        wide = [line for line in (res.stdout + res.stderr).splitlines() if len(line) > 80]
        assert not wide, (name, wide)
    # a simulation's table does not judge the host: simulated times do not depend on it
    assert "host of" not in outputs["compare"].stdout


def test_presets_in_a_pipe_keep_every_name_whole_at_80_columns():
    """Off a terminal at 80 columns every model, GPU, engine and profile name is printed
    whole (a table too wide for the width prints as plain text, never "llama…")."""
    import re

    from kvstage.shared.scenario.engines import ENGINE_PRESETS
    from kvstage.shared.scenario.presets import PRESETS
    from kvstage.shared.scenario.profiles import available_profiles
    from kvstage.shared.serving.gpus import GPUS

    out = kvstage("presets")
    profiles = kvstage("profiles")
    assert out.returncode == 0 and profiles.returncode == 0, out.stderr + profiles.stderr
    text = out.stdout + profiles.stdout
    assert not [line for line in text.splitlines() if len(line) > 80]
    assert "…" not in text
    names = [*PRESETS, *(g.name for g in GPUS.values()), *ENGINE_PRESETS, *available_profiles()]
    for name in names:
        assert re.search(rf"(^|[\s│|]){re.escape(name)}($|[\s│|:])", text, re.M), name


def test_a_table_that_fits_stays_a_table_and_one_too_wide_prints_plain():
    from rich.console import Console
    from rich.table import Table

    from kvstage.tables import print_table

    t = Table(title="t")
    for col in ("name", "a", "b"):
        t.add_column(col)
    t.add_row("a-rather-long-model-name-1", "x" * 30, "y " * 20)
    wide, narrow = Console(width=200, record=True), Console(width=40, record=True)
    print_table(wide, t)
    print_table(narrow, t)
    assert "┃ name" in wide.export_text()
    lines = narrow.export_text().splitlines()
    assert lines[:2] == ["t", "a-rather-long-model-name-1"]
    assert all(len(line) <= 40 for line in lines) and "…" not in "".join(lines)


def test_sim_scaled_applies_the_scale_down(tmp_path):
    """`--scaled` applies [hardware.scale_down] (the flag once shadowed the function)."""
    res = kvstage("sim", "scenarios/llama3-8b-p4-d2.toml", "--scaled", "--out", str(tmp_path / "r"))
    assert res.returncode == 0, res.stderr
    assert "requests done / failed: 8 / 0 of 8" in " ".join(res.stdout.split())
