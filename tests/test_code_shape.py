"""Code shape: no function or method with a body over 80 lines.

Every .py file under shared/, sim/, hw/ and kvstage/ is parsed with `ast`. A
function's length runs from its first statement after the docstring to its last
line: the signature (a typer command's options are declarations, laid out one per
line by `ruff format`) and the docstring are not counted (nor decorators; nested functions are measured on their own as well as inside their
parent). The only exceptions are documented algorithms, listed in ALLOWED_LONG
below; each entry must still exist and carry a docstring of at least
MIN_ALLOWLIST_DOCSTRING_LINES lines, so the list cannot rot. Files have no length
limit: a module holds one concept, however long (docs/contributing.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("shared", "sim", "hw", "kvstage")
MAX_FUNCTION_LINES = 80
MIN_ALLOWLIST_DOCSTRING_LINES = 5

# "path/from/root.py::qualified.name" -> why it may be long (a documented algorithm).
ALLOWED_LONG: dict[str, str] = {
    "sim/links.py::Fabric._waterfill": "max-min fair water-filling (progressive filling)",
}


def _source_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _functions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method, nested ones included."""
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                found.append((name, child))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of the body: signature and docstring are declarations, not logic."""
    body = node.body
    if (
        len(body) > 1
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def _parse(path: Path) -> tuple[str, ast.Module]:
    text = path.read_text(encoding="utf-8")
    return text, ast.parse(text, filename=str(path))


def test_source_dirs_exist():
    files = _source_files()
    for d in SOURCE_DIRS:
        assert any(_rel(p).startswith(f"{d}/") for p in files), f"no .py file under {d}/"


def test_no_function_over_limit():
    too_long = []
    for path in _source_files():
        _, tree = _parse(path)
        for name, node in _functions(tree):
            key = f"{_rel(path)}::{name}"
            n = _length(node)
            if n > MAX_FUNCTION_LINES and key not in ALLOWED_LONG:
                too_long.append(f"{key} (line {node.lineno}): {n} lines")
    assert not too_long, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them, or document the algorithm "
        "and add it to ALLOWED_LONG):\n  " + "\n  ".join(too_long)
    )


def test_allowlist_entries_exist_and_are_documented():
    problems = []
    for key in ALLOWED_LONG:
        rel, _, name = key.partition("::")
        path = ROOT / rel
        if not path.is_file():
            problems.append(f"{key}: no file {rel}")
            continue
        _, tree = _parse(path)
        nodes = [node for qual, node in _functions(tree) if qual == name]
        if not nodes:
            problems.append(f"{key}: no function {name} in {rel}")
            continue
        doc = ast.get_docstring(nodes[0]) or ""
        n = len(doc.strip().splitlines())
        if n < MIN_ALLOWLIST_DOCSTRING_LINES:
            problems.append(
                f"{key}: docstring of {n} lines, a documented algorithm needs at least "
                f"{MIN_ALLOWLIST_DOCSTRING_LINES}"
            )
    assert not problems, "stale or undocumented ALLOWED_LONG entries:\n  " + "\n  ".join(problems)


def test_tree_is_ruff_formatted():
    """`ruff format` is the style (docs/contributing.md): every tracked .py file is formatted."""
    import subprocess
    import sys

    ruff = Path(sys.executable).parent / "ruff"
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    res = subprocess.run(
        [str(ruff), "format", "--check", *files], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, "run `.venv/bin/ruff format .`:\n" + res.stdout + res.stderr
