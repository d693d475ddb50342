"""Import cycles between the modules of ``cua_rl``, found by reading the source (nothing runs).

Every import counts, including those inside functions: a deferred import hides a cycle from
Python's loader but not from a reader, who still cannot understand one module without the other.
``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of
``pkg``. An import of a package is not an edge to each of its submodules.

    python scripts/import_cycles.py [PACKAGE_DIR]   # exit status 1 and the cycles if any
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted name -> file for every module below ``package_dir`` (a package's is __init__)."""
    base = package_dir.parent
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    # A module's own package is its name minus the last part; an __init__ is its own package.
    anchor = parts[: len(parts) - node.level + (1 if is_package else 0)]
    return ".".join(anchor + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports anywhere in its source."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node)
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # ``import a.b.c`` needs a.b.c; the longest known prefix is the module meant.
            parts = target.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != module:
                found.add(".".join(parts))
    return found


def find_cycles(package_dir: Path) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module, each sorted
    (a module naming itself is not an edge)."""
    names = module_names(package_dir)
    graph = {n: imports_of(n, p, set(names)) for n, p in names.items()}
    return [sorted(c) for c in _components(graph) if len(c) > 1]


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit to hit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    result.append(component)
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    package_dir = Path(args[0]) if args else ROOT / "cua_rl"
    cycles = find_cycles(package_dir)
    for cycle in cycles:
        print("cycle:", " <-> ".join(cycle))
    print(f"{len(cycles)} import cycle(s) in {package_dir.name}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
