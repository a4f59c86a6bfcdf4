"""The engine's module structure: no import cycles, one class per role, proxies built from the
roles' own dispatch declarations, and every method called on a role declared on its protocol (the
type checker holds the calls to the protocols: the proxies are typed as them)."""

import ast
import functools
import re
import subprocess

import pytest

from tests.conftest import REPO, side_by_side
from tests.import_graph import cycles, import_graph, imports, loaded_packages, module_name

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


ALONE = ["rlhf.rollout.vllm", "rlhf.rollout.hf", "rlhf.placement.ray_roles", "rlhf.placement.host", "rlhf.roles.actor",
         "rlhf.trainer"]


def _loaded_or_error(module):
    try:
        return loaded_packages(module)
    except AssertionError as err:  # the import failed: that module's test fails with it
        return err


@pytest.fixture(scope="module")
def loaded_alone():
    """`loaded_packages` of each module of ALONE, their fresh interpreters side by side."""
    return dict(zip(ALONE, side_by_side(*(functools.partial(_loaded_or_error, m) for m in ALONE))))


@pytest.mark.parametrize("module", ALONE)
def test_each_module_imports_on_its_own_and_loads_no_optional_system(module, loaded_alone):
    """Each imports alone, and loads neither the manager, W&B nor DVC (the engine never imports
    them), nor vLLM or Ray: those load when a run builds the vLLM backend or a Ray placement."""
    loaded = loaded_alone[module]
    if isinstance(loaded, Exception):
        raise loaded
    assert "torch" in loaded and module.split(".")[0] in loaded  # the check sees what was loaded
    assert loaded & {"experiments", "wandb", "dvc", "vllm", "ray"} == set()


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
PROTOCOLS = ("ActorRole", "CriticRole", "ReferenceRole", "RewardRole", "RewardModelRole", "TrainedState", "PlacedRole",
             "RoleProxy")
ROLE_HOLDERS = ["rlhf/trainer.py", "rlhf/checkpoint.py", "rlhf/placement/__init__.py", "rlhf/placement/local.py",
                "rlhf/placement/ray_roles.py", "rlhf/placement/proxy.py", "rlhf/placement/host.py",
                "rlhf/memory/runtime.py", "rlhf/memory/offload.py", "rlhf/roles/reference.py", "rlhf/roles/reward.py"]
CALLER = """\
from rlhf.batch import Batch
from rlhf.roles import ActorRole, CriticRole, ReferenceRole, RewardModelRole, RewardRole
from rlhf.roles.actor import Actor
from rlhf.roles.critic import Critic
from rlhf.roles.reference import AdapterOffReference, Reference
from rlhf.roles.reward import Reward
from rlhf.roles.reward_model import RewardModel


def calls(actor: ActorRole, batch: Batch) -> None:
    actor.warp_speed()
    actor.update(batch, shuffle_seed="one", kl_coef=0.1)
    actor.update(batch, shuffle_seed=1, kl_coef=0.1)


def provided(a: Actor, c: Critic, r: Reference, o: AdapterOffReference, m: RewardModel, w: Reward):
    roles: tuple[ActorRole, CriticRole, ReferenceRole, ReferenceRole, RewardModelRole, RewardRole] = (a, c, r, o, m, w)
    return roles
"""


def type_errors(*paths):
    """basedpyright's errors in `paths` with the project's settings (pyproject.toml): (file, line, rule, message)."""
    import json
    proc = subprocess.run(["basedpyright", "--project", str(REPO / "pyproject.toml"), "--outputjson", *map(str, paths)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.stdout, proc.stderr[-2000:]
    return [(d["file"], d["range"]["start"]["line"] + 1, d.get("rule"), d["message"])
            for d in json.loads(proc.stdout)["generalDiagnostics"] if d["severity"] == "error"]


def test_the_type_checker_holds_every_call_on_a_role_to_its_protocol(tmp_path):
    """The placements hand out each proxy typed as its role's protocol (rlhf/placement/proxy.py
    `as_role`) and every holder of a role is annotated with one, so basedpyright reports a method
    that a protocol (rlhf/roles/__init__.py) does not declare, or an argument it does not take; each
    role class provides its protocol; the engine's holders of roles have no such error."""
    caller = tmp_path / "caller.py"
    caller.write_text(CALLER)
    errors = type_errors(caller, *(REPO / p for p in ROLE_HOLDERS))
    found = sorted((line, rule) for file, line, rule, _ in errors if file == str(caller))
    assert found == [(11, "reportAttributeAccessIssue"), (12, "reportArgumentType")], errors
    assert [m for f, line, _, m in errors if f == str(caller) and line == 11][0].startswith(
        'Cannot access attribute "warp_speed" for class "ActorRole"')
    on_roles = [(f, line, m) for f, line, _, m in errors if f != str(caller) and re.search("|".join(PROTOCOLS), m)]
    assert on_roles == []


def test_a_proxy_is_typed_as_a_role_only_with_every_method_of_its_protocol():
    """`as_role` checks at build what the type checker cannot: the proxy, built from the role
    class's `@dispatch` declarations, has each method of the protocol it is typed as."""
    from rlhf.placement.proxy import as_role, local_proxy
    from rlhf.roles import ActorRole, CriticRole, ReferenceRole, RewardModelRole
    from rlhf.roles.actor import Actor
    from rlhf.roles.critic import Critic
    from rlhf.roles.reference import Reference
    from rlhf.roles.reward_model import RewardModel

    for cls, protocol in {Actor: ActorRole, Critic: CriticRole, Reference: ReferenceRole,
                          RewardModel: RewardModelRole}.items():
        proxy = local_proxy(cls.name, [object.__new__(cls)])
        assert as_role(proxy, protocol) is proxy
    with pytest.raises(TypeError, match=r"lacks \['compute_values', .*'update'\] of CriticRole"):
        as_role(local_proxy("reference", [object.__new__(Reference)]), CriticRole)
