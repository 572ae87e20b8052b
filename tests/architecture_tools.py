"""The import graph of the project's own packages, read from source (every import statement, at module
level or inside a function), for tests/test_architecture.py."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bottom to top: a package may import only those before it (and itself)
LAYERS = ("shared", "services", "tophatctl", "loadgen", "tophat")


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # the project module the statement loads (a package means its __init__)
    names: tuple[str, ...]  # for `from X import a, b`: a, b (empty for `import X`)
    line: int


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, modules: dict[str, Path]) -> Iterable[Import]:
    path = modules[module]
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := _owner(alias.name, modules)) is not None:
                    yield Import(module, target, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:  # `from package import submodule`
                    yield Import(module, full, (), node.lineno)
                elif (target := _owner(base, modules)) is not None:
                    yield Import(module, target, (alias.name,), node.lineno)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports, plus the packages whose __init__ importing it runs."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name in modules:
        for imp in imports_of(name, modules):
            parts = imp.target.split(".")
            graph[name].update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles between packages (every package, nested ones too): `a.b` importing `a.c.x` is an edge b -> c."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = module.split("."), target.split(".")
            common = 0
            while common < min(len(a), len(b)) - 1 and a[common] == b[common]:
                common += 1
            if common < len(a) - 1 and common < len(b) and a[:common] == b[:common]:
                src, dst = ".".join(a[: common + 1]), ".".join(b[: common + 1])
                if src != dst and dst in graph:  # into a module of the same parent: not a package edge
                    packages.setdefault(src, set()).add(dst)
    nodes = {name: set() for name in packages}
    for src, dsts in packages.items():
        for dst in dsts:
            nodes[src].add(dst)
            nodes.setdefault(dst, set())
    return cycles(nodes)
