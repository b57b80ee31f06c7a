"""The core's imports: every module of shared/ imports first, with no circle, and the
serving model sits under the scenario (scripts/import_graph.py draws the graph)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts/import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_core_module_imports_first():
    """Each module of shared/ imported first, with no kvstage module loaded before it:
    a circle held together by import order fails here for the module that opens it."""
    names = sorted(_graph().modules(ROOT, "shared"))
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m == 'kvstage' or m.startswith('kvstage.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        print(f'{name}: {type(exc).__name__}: {exc}')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == "", f"modules of shared/ that do not import first:\n{r.stdout}"


def test_core_has_no_import_circle():
    """No circle among the imports of shared/ that run (lazy ones included)."""
    g = _graph()
    kinds = g.arrow_kinds(g.modules(ROOT, "shared"), "shared")
    running = {e for e, k in kinds.items() if k != "typing"}
    assert g.cycles(running) == []
    lazy = sorted(e for e, k in kinds.items() if k == "lazy")
    assert lazy == [], f"lazy imports inside shared/ (a circle waiting to happen): {lazy}"


def test_serving_model_sits_under_the_scenario():
    """shared/serving/ imports only itself, the layout and the CSV opener (a leaf: it
    imports nothing of kvstage) when it runs; the scenario only for type hints, so the
    schema can check a scenario against the model."""
    g = _graph()
    kinds = g.arrow_kinds(g.modules(ROOT, "shared"), "shared")
    allowed = ("kvstage.shared.serving", "kvstage.shared.layout", "kvstage.shared.csv_file")
    up = sorted(
        (a, b)
        for (a, b), k in kinds.items()
        if a.startswith("kvstage.shared.serving")
        and k != "typing"
        and not any(b == x or b.startswith(x + ".") for x in allowed)
    )
    assert up == [], f"serving modules importing above themselves: {up}"
