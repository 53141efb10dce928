"""Import cycles among a package's modules, read statically from the AST.

Every import counts: at module level, inside functions and under TYPE_CHECKING.
It counts edges the way the project's shared checker (../shared/tools/import_cycles.py)
does, so CI on a clean clone, where that folder is absent, sees the same answer.

    python tools/import_cycles.py src/chunklocal      # exit 1 and the cycles if any
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_graph(root: Path) -> dict[str, set[str]]:
    """module name -> the package's modules it imports (the package itself excluded)."""
    pkg = root.name
    mods = {}
    for f in root.rglob("*.py"):
        name = ".".join(f.relative_to(root.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = m.split(".") if is_pkg else m.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and t.startswith(pkg) and t != pkg:
                    edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main(argv=None) -> int:
    root = Path((argv or sys.argv[1:] or ["src/chunklocal"])[0])
    edges = module_graph(root)
    found = cycles(edges)
    for component in found:
        print("cycle:", " <-> ".join(component))
    print(f"{len(found)} import cycles among {len(edges)} modules of {root.name}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
