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


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "kvstage").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def arrows(mods: dict[str, Path]) -> set[tuple[str, str]]:
    found = set()
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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
                if any(t == c or t.startswith(c + ".") for c in CORE):
                    continue
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t != "kvstage":
                    found.add((name, t))
                    break
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arrows", action="store_true", help="print every arrow")
    p.add_argument(
        "--concepts", action="store_true", help="one node per concept folder of kvstage/"
    )
    p.add_argument(
        "--root", type=Path, default=ROOT, help="the checkout to read (default: this one)"
    )
    args = p.parse_args(argv)
    mods = modules(args.root)
    edges = arrows(mods)
    if args.concepts:

        def concept(m: str) -> str:
            return ".".join(m.split(".")[:2])

        edges = {(concept(a), concept(b)) for a, b in edges if concept(a) != concept(b)}
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
            print(f"  {a} -> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
