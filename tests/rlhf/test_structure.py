"""The engine's module structure: no import cycles, one class per role, proxies built from the
roles' own dispatch declarations."""

import ast
import subprocess
import sys

import pytest

from tests.conftest import REPO

RLHF = REPO / "rlhf"


def module_name(path):
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path, modules, importer):
    """rlhf modules a module imports, at the top or deferred inside a function (a deferred import
    that closes a circle is still a circle), less its own parent packages (always loaded first)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for imported in names:
            if not imported.startswith("rlhf"):
                continue
            parts = imported.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                prefix = ".".join(parts[:i])
                if prefix in modules and not importer.startswith(prefix + "."):
                    found.add(prefix)
    return found


def import_graph():
    files = {module_name(p): p for p in RLHF.rglob("*.py")}
    return {name: imports(path, files, name) - {name} for name, path in files.items()}


def cycles(graph):
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


def test_engine_has_no_import_cycles():
    graph = import_graph()
    assert "rlhf.placement.ray_roles" in graph and "rlhf.rollout.vllm" in graph
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the check itself finds one


@pytest.mark.parametrize("module", ["rlhf.rollout.vllm", "rlhf.rollout.hf", "rlhf.placement.ray_roles",
                                    "rlhf.placement.host", "rlhf.roles.actor", "rlhf.trainer"])
def test_each_module_imports_on_its_own(module):
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_role_is_one_class_and_its_proxy_comes_from_its_declarations():
    from rlhf.placement.proxy import RoleProxy
    from rlhf.roles.actor import Actor
    from rlhf.roles.critic import Critic
    from rlhf.roles.dispatch import ALL, CALLS, ROWS, dispatched_methods
    from rlhf.roles.reference import Reference
    from rlhf.roles.reward_model import RewardModel

    assert dispatched_methods(Actor)["compute_logprobs"] is ROWS
    assert dispatched_methods(Actor)["update"] is ALL and dispatched_methods(Actor)["generate"] is CALLS
    assert dispatched_methods(Critic)["compute_values"] is ROWS and dispatched_methods(Critic)["model_state"] is ALL
    assert dispatched_methods(Reference) == {"compute_logprobs": ROWS}
    assert dispatched_methods(RewardModel) == {"score": ROWS}
    proxy = RoleProxy("critic", Critic, hosts=[])
    assert set(proxy.methods) == set(dispatched_methods(Critic))
    assert all(callable(getattr(proxy, m)) for m in proxy.methods)
    # Nothing else stands in for a role.
    for gone in ("workers", "distributed"):
        assert not (RLHF / gone).exists()


def test_rows_and_calls_split_and_gather_in_order():
    import torch

    from rlhf.batch import Batch
    from rlhf.roles.dispatch import calls_per_rank, gather_rows, split_rows

    batch = Batch({"x": torch.arange(6)})
    parts = split_rows(batch, 3, "t")
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert gather_rows([(p["x"], {"y": p["x"] * 2}) for p in parts])[1]["y"].tolist() == [0, 2, 4, 6, 8, 10]
    assert calls_per_rank(5, 2) == [[0, 2, 4], [1, 3]]
    with pytest.raises(ValueError, match="cannot be split evenly over ppo.world_size = 4"):
        split_rows(batch, 4, "t")
