"""A package's import graph read from its source, for the structure tests of `rlhf/` and `experiments/`.

Every import counts: at the top of a module or deferred inside a function (a deferred import that
closes a circle is still a circle), and a 'package.module:function' string that a registry
imports when it is used (experiments/cli.py's subcommand hooks). A module's own parent packages
are left out: importing it always loads them first.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Sequence, Set

from tests.conftest import REPO


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path, modules: Iterable[str], importer: str, package: str) -> Set[str]:
    """The modules of `package` (among `modules`) that the module `importer` at `path` imports."""
    modules = set(modules)
    hook = re.compile(rf"^({re.escape(package)}(?:\.\w+)*):\w+$")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and hook.match(node.value):
            names = [hook.match(node.value).group(1)]
        for imported in names:
            if imported != package and not imported.startswith(package + "."):
                continue
            parts = imported.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                prefix = ".".join(parts[:i])
                if prefix in modules and not importer.startswith(prefix + "."):
                    found.add(prefix)
    return found - {importer}


def import_graph(package: str) -> Dict[str, Set[str]]:
    """{module: the package's modules it imports} for every module of the package dir REPO/package."""
    files = {module_name(p): p for p in (REPO / package).rglob("*.py")}
    return {name: imports(path, files, name, package) for name, path in files.items()}


def cycles(graph: Mapping[str, Iterable[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str, layers: Sequence[Sequence[str]], package: str) -> int:
    """The index of the layer that lists `module` (relative to `package`; a listed package takes
    its submodules, the longest listed name wins); -1 when no layer lists it."""
    best, depth = -1, -1
    for i, names in enumerate(layers):
        for name in names:
            full = f"{package}.{name}"
            if (module == full or module.startswith(full + ".")) and full.count(".") > depth:
                best, depth = i, full.count(".")
    return best


def layer_violations(graph: Mapping[str, Iterable[str]], layers: Sequence[Sequence[str]], package: str) -> List[str]:
    """'a (layer i) imports b (layer j > i)' for every import that goes up the layer order, and
    'a: in no layer' for a module the order does not place."""
    out = []
    for module in sorted(graph):
        if module == package:
            continue
        own = layer_of(module, layers, package)
        if own < 0:
            out.append(f"{module}: in no layer")
            continue
        for imported in sorted(graph[module]):
            theirs = layer_of(imported, layers, package)
            if imported != package and theirs > own:
                out.append(f"{module} (layer {own}) imports {imported} (layer {theirs})")
    return out


def loaded_packages(module: str) -> Set[str]:
    """The top-level packages loaded by importing `module` alone, in a fresh interpreter (raises with
    its stderr when the import fails)."""
    import json
    import subprocess
    import sys
    code = f"import json, sys; import {module}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"import {module} failed:\n{proc.stderr[-2000:]}")
    return set(json.loads(proc.stdout.splitlines()[-1]))
