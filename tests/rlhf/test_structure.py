"""The engine's module structure: no import cycles, one class per role, proxies built from the
roles' own dispatch declarations, and every method called on a role declared on its protocol."""

import ast
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.import_graph import cycles, import_graph, imports, module_name

RLHF = REPO / "rlhf"


def test_engine_has_no_import_cycles():
    graph = import_graph("rlhf")
    assert "rlhf.placement.ray_roles" in graph and "rlhf.rollout.vllm" in graph
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the check itself finds one


ENTRY_POINTS = {"rlhf.train", "rlhf.export", "rlhf.memory.__main__", "rlhf.reward_model.__main__"}


def test_no_library_module_imports_an_entry_point():
    """The command lines sit on top: exit codes, ConfigError and check_writable live in
    rlhf/errors.py, so a library module never reaches up into a CLI for them."""
    graph = import_graph("rlhf")
    engine = set(graph)
    for path in (REPO / "experiments").rglob("*.py"):  # the manager is a library of the engine's too
        graph[module_name(path)] = imports(path, engine, module_name(path), "rlhf")
    reaching_up = {(module, entry) for module, imported in graph.items() for entry in imported & ENTRY_POINTS
                   if module not in ENTRY_POINTS}
    assert reaching_up == set()
    assert "rlhf.errors" in graph["rlhf.train"] and graph["rlhf.errors"] == set()


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
    proxy = RoleProxy("critic", Critic, world_size=1, run=None)
    assert set(proxy.methods) == set(dispatched_methods(Critic))
    assert all(callable(getattr(proxy, m)) for m in proxy.methods)



def test_the_updates_read_top_to_bottom():
    """The actor's and the critic's updates are their own loops (mini-batches x micro-batches from
    rlhf/roles/minibatches.py, the loss inline, clip and step after each mini-batch), with no
    closure handed to a shared loop: a recipe parameter (`ppo.kl_coef` through the `kl_coef`
    argument) is followed to the line that uses it."""
    import inspect
    import textwrap

    from rlhf.roles.actor import Actor
    from rlhf.roles.critic import Critic

    for fn in (Actor.update, Critic._update):
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        nested = [n for n in ast.walk(tree) if n is not tree and isinstance(n, (ast.FunctionDef, ast.Lambda))]
        assert nested == [], fn.__qualname__
        called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
                  for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert {"mini_batches", "backward", "clip_grad", "step"} <= called, fn.__qualname__
    source = inspect.getsource(Actor.update)
    assert "loss = loss + kl_coef * algos.aggregate(kl," in source
    assert not (RLHF / "roles" / "common.py").exists()

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


# ---------------------------------------------------------------- what is called on a role is declared
ROLE_PROTOCOLS = {"actor": "ActorRole", "critic": "CriticRole", "reference": "ReferenceRole", "reward": "RewardRole",
                  "reward_model": "RewardModelRole"}
"""A role is named for what it is, wherever the engine holds one: `self.actor`, `roles.critic`,
`roles["reward_model"]`, a parameter `reference`; an annotation naming a protocol (`role:
PlacedRole`, `roles: Dict[str, PlacedRole]`) says it where the name does not, and an annotation
naming anything else (`reward: RewardConfig`) says that the name is not a role there."""
ROLE_HOLDERS = ("self", "roles", "proxies")
CONTAINERS = ("Dict", "dict", "Mapping", "List", "list", "Sequence", "Tuple", "tuple")
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def protocol_methods(source):
    """Protocol name -> the methods it declares, with its protocol bases' (rlhf/roles/__init__.py)."""
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}

    def methods(name):
        own = {f.name for f in classes[name].body if isinstance(f, ast.FunctionDef)}
        for base in classes[name].bases:
            if isinstance(base, ast.Name) and base.id in classes:
                own |= methods(base.id)
        return own

    return {name: methods(name) for name, node in classes.items()
            if any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases)}


def own_nodes(scope):
    """The nodes of `scope`, without descending into the scopes it defines (those it yields)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def role_calls(tree, protocols):
    """(line, protocol, method) of every method called on a role in a module's syntax tree. A
    variable that runs over several roles (`for name, role in (("actor", actor), ("critic",
    critic))`) gives one entry per protocol: what it calls must be declared on each."""
    found = []

    def annotated(annotation):
        """(protocols, is a container of roles) of an annotation; None: not a role."""
        text = ast.unparse(annotation)
        protos = frozenset(p for p in protocols if re.search(rf"\b{p}\b", text))
        return (protos, text.startswith(CONTAINERS)) if protos else None

    def class_attributes(cls):
        """self.X -> annotation: dataclass fields, `self.X: T = ...`, `self.X = param` of an annotated param."""
        out = {n.target.id: annotated(n.annotation) for n in cls.body
               if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            params = {a.arg: a.annotation for a in fn.args.args + fn.args.kwonlyargs if a.annotation is not None}
            for node in ast.walk(fn):
                target = node.target if isinstance(node, ast.AnnAssign) else (
                    node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
                if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self"):
                    continue
                if isinstance(node, ast.AnnAssign):
                    out[target.attr] = annotated(node.annotation)
                elif isinstance(node.value, ast.Name) and node.value.id in params:
                    out[target.attr] = annotated(params[node.value.id])
        return out

    def kind(node, env, attrs):
        """(protocols, container) of an expression, or None when it is not a role."""
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            return (frozenset({ROLE_PROTOCOLS[node.id]}), False) if node.id in ROLE_PROTOCOLS else None
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in attrs:
                return attrs[node.attr]
            holder = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)
            if node.attr in ROLE_PROTOCOLS and holder in ROLE_HOLDERS:
                return frozenset({ROLE_PROTOCOLS[node.attr]}), False
            return None
        if isinstance(node, ast.Subscript):
            container = kind(node.value, env, attrs)
            if container is not None and container[1]:
                return container[0], False
            holder = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)
            key = node.slice
            if holder in ROLE_HOLDERS and isinstance(key, ast.Constant) and key.value in ROLE_PROTOCOLS:
                return frozenset({ROLE_PROTOCOLS[key.value]}), False
        return None

    def bind(target, value, env):
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                bind(t, None, env)

    def bind_loop(target, iterable, env, attrs):
        """A loop over a written-out tuple of roles binds its variable to each in turn."""
        items = iterable.elts if isinstance(iterable, (ast.Tuple, ast.List)) else None
        names = [target] if isinstance(target, ast.Name) else list(getattr(target, "elts", []))
        for pos, name in enumerate(names):
            if not isinstance(name, ast.Name):
                continue
            kinds = [] if items is None else [
                kind(item if isinstance(target, ast.Name) else
                     (item.elts[pos] if isinstance(item, ast.Tuple) and len(item.elts) > pos else None), env, attrs)
                if item is not None else None for item in items]
            ok = kinds and all(k is not None and not k[1] for k in kinds)
            env[name.id] = (frozenset().union(*(k[0] for k in kinds)), False) if ok else None

    def visit(scope, env, attrs):
        env = dict(env)
        if isinstance(scope, ast.ClassDef):
            attrs = class_attributes(scope)
        else:
            if not isinstance(scope, ast.Module):
                args = scope.args
                for arg in args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]:
                    if arg.annotation is not None:
                        env[arg.arg] = annotated(arg.annotation)
                    else:
                        env.pop(arg.arg, None)
            for node in own_nodes(scope):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        bind(target, kind(node.value, env, attrs) if isinstance(target, ast.Name) else None, env)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    env[node.target.id] = annotated(node.annotation)
                elif isinstance(node, (ast.For, ast.comprehension)):
                    bind_loop(node.target, node.iter, env, attrs)
                elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                    bind(node.optional_vars, None, env)
        for node in own_nodes(scope):
            if isinstance(node, SCOPES):
                visit(node, env, attrs)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                role = kind(node.func.value, env, attrs)
                if role is not None and not role[1]:
                    found.extend((node.lineno, protocol, node.func.attr) for protocol in sorted(role[0]))

    visit(tree, {}, {})
    return found


def test_every_method_called_on_a_role_is_declared_on_its_protocol():
    """What the trainer, the checkpoints, the placements and the roles call on a role is on the
    role's protocol (rlhf/roles/__init__.py), so the protocols say what a role must provide."""
    protocols = protocol_methods((RLHF / "roles" / "__init__.py").read_text())
    called, undeclared = set(), []
    for path in sorted(RLHF.rglob("*.py")):
        for line, protocol, method in role_calls(ast.parse(path.read_text()), protocols):
            called.add((protocol, method))
            if method not in protocols[protocol]:
                undeclared.append(f"{path.relative_to(REPO)}:{line}: {method} is not on {protocol}")
    assert sorted(undeclared) == []
    # The reading finds the calls it must: each phase of the loop, the checkpoints, the placements'.
    assert {("ActorRole", "generate"), ("ActorRole", "set_rollout_sleep"), ("RewardRole", "model_scores"),
            ("RewardModelRole", "score"), ("CriticRole", "model_files"), ("ActorRole", "load_scheduler_state"),
            ("ReferenceRole", "compute_logprobs"), ("PlacedRole", "device_state")} <= called
    # ... and catches one that is not declared, or a name that is not a role.
    snippet = ast.parse(
        "def f(actor, reward: RewardConfig, roles: Dict[str, PlacedRole]):\n"
        "    for name, role in (('actor', actor), ('critic', critic)):\n"
        "        role.model_files()\n"
        "    actor.warp_speed()\n    reward.uses_model()\n    roles[name].device_state()\n    roles.items()\n")
    assert sorted(role_calls(snippet, protocols)) == [
        (3, "ActorRole", "model_files"), (3, "CriticRole", "model_files"), (4, "ActorRole", "warp_speed"),
        (6, "PlacedRole", "device_state")]


def test_every_role_class_provides_its_protocol_and_its_proxy_has_it():
    """Each role class implements every method of its protocol; a device role declares each with
    `@dispatch`, so that the proxy built from the declarations (every placement's) has it too."""
    from rlhf import roles
    from rlhf.placement.proxy import local_proxy
    from rlhf.roles.actor import Actor
    from rlhf.roles.critic import Critic
    from rlhf.roles.dispatch import dispatched_methods
    from rlhf.roles.reference import AdapterOffReference, Reference
    from rlhf.roles.reward import Reward
    from rlhf.roles.reward_model import RewardModel

    protocols = protocol_methods((RLHF / "roles" / "__init__.py").read_text())
    device = {Actor: "ActorRole", Critic: "CriticRole", Reference: "ReferenceRole", RewardModel: "RewardModelRole"}
    controller = {Reward: "RewardRole", AdapterOffReference: "ReferenceRole"}
    for cls, protocol in {**device, **controller}.items():
        assert hasattr(roles, protocol)
        missing = [m for m in protocols[protocol] if not callable(getattr(cls, m, None))]
        assert missing == [], (cls.__name__, missing)
    for cls, protocol in device.items():
        assert sorted(protocols[protocol] - set(dispatched_methods(cls))) == [], cls.__name__
        assert callable(getattr(cls, "device_state")) and protocols["PlacedRole"] == {"device_state"}
        proxy = local_proxy(cls.name, [object.__new__(cls)])
        assert all(callable(getattr(proxy, m, None)) for m in protocols[protocol]), cls.__name__
