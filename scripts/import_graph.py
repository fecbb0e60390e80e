"""The import graph of a package, and its cycles: `python scripts/import_graph.py [tierfs]`.

Every import statement counts, also function-local and TYPE_CHECKING ones: a
cycle there is a cycle in the design. Exits 1 if there is one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports."""
    mods: dict[str, Path] = {}
    for p in root.rglob("*.py"):
        name = ".".join(p.relative_to(root.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        for node in ast.walk(ast.parse(p.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = m.split(".") if is_pkg else m.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "tierfs")
    edges = graph(root)
    found = cycles(edges)
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} import edges, "
          f"{len(found)} cycles")
    for c in found:
        print("  cycle:", " <-> ".join(c))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
