"""The application's import graph: its modules, arrows and floors (layers).

Counts every import of one `kvstage` application module by another (package
`kvstage` itself, without `kvstage.shared`, `kvstage.sim` and `kvstage.hw`), at any
depth of the file (lazy imports inside functions count too). A module is a .py file;
an import of a package counts as an arrow to its `__init__.py`. Floors: the length of
the longest import chain ending at a module, plus one (a module that imports no other
application module is on floor 1), the number of floors being the largest.

    .venv/bin/python scripts/import_graph.py            # counts
    .venv/bin/python scripts/import_graph.py --arrows   # and every arrow
    .venv/bin/python scripts/import_graph.py --concepts # a node per concept folder
    .venv/bin/python scripts/import_graph.py --root DIR # another checkout (a git worktree)
    .venv/bin/python scripts/import_graph.py --shared   # the core's graph (shared/) instead
    .venv/bin/python scripts/import_graph.py --hw       # hardware mode's graph (hw/) instead
    .venv/bin/python scripts/import_graph.py --cycles   # and every import circle

With --shared the modules are those of `shared/` (kvstage.shared), and an import of one
by another counts at any depth as above; --concepts then makes a node of each
sub-package (kvstage.shared.scenario, kvstage.shared.serving). --hw does the same for
`hw/` (kvstage.hw; its imports of shared/ and sim/ are not counted), --concepts making a
node of each of its folders (kvstage.hw.rank.process, kvstage.hw.probes). --cycles prints each
circle (a strongly connected set of modules that import each other, directly or
through others), the arrows of imports made inside a function (lazy imports) marked
`(lazy)` and those under `if TYPE_CHECKING:` marked `(typing)`: first the circles of
the imports that run, then those the TYPE_CHECKING imports (which never run) close.

With --concepts every module inside a package of kvstage/ counts as that package
(kvstage.run.hwrun -> kvstage.run), a top-level module stays itself, and arrows inside
one concept are not counted: the graph a newcomer reads from the folder names.
"""

from __future__ import annotations

import argparse
import ast
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "kvstage"
CORE = ("kvstage.shared", "kvstage.sim", "kvstage.hw")
# the trees a graph can be drawn of: (folder, the package it installs as, what it skips)
TREES = {
    "app": ("kvstage", "kvstage", CORE),
    "shared": ("shared", "kvstage.shared", ("kvstage.sim", "kvstage.hw")),
    "hw": ("hw", "kvstage.hw", ("kvstage.shared", "kvstage.sim")),
}


def modules(root: Path = ROOT, tree: str = "app") -> dict[str, Path]:
    folder, package, _ = TREES[tree]
    out = {}
    for path in sorted((root / folder).rglob("*.py")):
        parts = [package, *path.relative_to(root / folder).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _import_kinds(tree: ast.AST) -> dict[ast.AST, str]:
    """Each import node of a module: "lazy" inside a function, "typing" under
    `if TYPE_CHECKING:`, else "top"."""
    kinds: dict[ast.AST, str] = {}

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            k = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                k = "lazy"
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                k = "typing" if kind == "top" else kind
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                kinds[child] = k
            visit(child, k)

    visit(tree, "top")
    return kinds


def arrows(mods: dict[str, Path], tree: str = "app") -> set[tuple[str, str]]:
    return set(arrow_kinds(mods, tree))


def arrow_kinds(mods: dict[str, Path], tree: str = "app") -> dict[tuple[str, str], str]:
    """Every arrow, with "top" when one of its imports runs at import time, else "lazy"
    or "typing"."""
    top, skip = TREES[tree][1], TREES[tree][2]
    found: dict[tuple[str, str], str] = {}
    rank = {"top": 0, "lazy": 1, "typing": 2}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        kinds = _import_kinds(ast.parse(path.read_text(encoding="utf-8")))
        for node, kind in kinds.items():
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                if any(t == c or t.startswith(c + ".") for c in skip):
                    continue
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t != top:
                    old = found.get((name, t), "typing")
                    found[(name, t)] = min(old, kind, key=rank.__getitem__)
                    break
    return found


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module (Tarjan)."""
    out: dict[str, list[str]] = {}
    for a, b in edges:
        out.setdefault(a, []).append(b)
        out.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(out[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(out):
        if v not in index:
            strong(v)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arrows", action="store_true", help="print every arrow")
    p.add_argument(
        "--concepts", action="store_true", help="one node per concept folder of kvstage/"
    )
    p.add_argument(
        "--root", type=Path, default=ROOT, help="the checkout to read (default: this one)"
    )
    p.add_argument("--shared", action="store_true", help="the graph of shared/ instead")
    p.add_argument("--hw", action="store_true", help="the graph of hw/ instead")
    p.add_argument("--cycles", action="store_true", help="print every import circle")
    args = p.parse_args(argv)
    if args.shared and args.hw:
        p.error("--shared and --hw each draw one tree: give one of them")
    tree = "shared" if args.shared else "hw" if args.hw else "app"
    mods = modules(args.root, tree)
    kinds = arrow_kinds(mods, tree)
    edges = set(kinds)
    if args.concepts:
        depth = 2 if tree == "app" else 3

        def concept(m: str) -> str:
            parts = m.split(".")
            keep = depth if mods.get(".".join(parts[:depth]), Path()).name == "__init__.py" else 99
            return ".".join(parts[:keep])

        merged: dict[tuple[str, str], str] = {}
        for (a, b), k in sorted(kinds.items(), key=lambda item: item[1] != "top"):
            if concept(a) != concept(b):
                merged.setdefault((concept(a), concept(b)), k)
        kinds = merged
        edges = set(kinds)
        mods = {concept(m): p for m, p in mods.items()}
    out: dict[str, set[str]] = {m: set() for m in mods}
    for a, b in edges:
        out[a].add(b)

    @cache
    def floor(m: str, seen: frozenset = frozenset()) -> int:
        if m in seen:
            return 0
        return 1 + max((floor(t, seen | {m}) for t in out[m]), default=0)

    floors = max(floor(m) for m in mods)
    print(
        f"{len(mods)} {'concepts' if args.concepts else 'modules'}, {len(edges)} arrows, {floors} floors"
    )
    if args.arrows:
        for a, b in sorted(edges):
            mark = "" if kinds[(a, b)] == "top" else f" ({kinds[(a, b)]})"
            print(f"  {a} -> {b}{mark}")
    if args.cycles:
        running = {e for e, k in kinds.items() if k != "typing"}
        _print_circles("import circles (imports that run, lazy ones included)", running, kinds)
        _print_circles("circles with the TYPE_CHECKING imports counted too", edges, kinds)
    return 0


def _print_circles(title: str, edges: set[tuple[str, str]], kinds: dict) -> None:
    circles = cycles(edges)
    print(f"{len(circles)} {title}")
    for group in circles:
        inside = sorted((a, b) for a, b in edges if a in group and b in group)
        print(f"  {len(group)} modules: " + ", ".join(group))
        for a, b in inside:
            mark = "" if kinds[(a, b)] == "top" else f" ({kinds[(a, b)]})"
            print(f"    {a} -> {b}{mark}")


if __name__ == "__main__":
    sys.exit(main())
