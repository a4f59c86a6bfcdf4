"""Defaults are written once: rlhf/config.py documents every field, and no shipped recipe binds a
value equal to the engine's default (a recipe holds only what differs, each line with its reason)."""

import ast
import dataclasses

import pytest

from rlhf.configurable import SCOPES, iter_statements
from tests.conftest import REPO

CONFIG = REPO / "rlhf" / "config.py"
RECIPES = sorted((REPO / "recipes").glob("*.gin")) + sorted((REPO / "recipes" / "base").glob("*.gin")) + \
    [REPO / "recipes" / "models" / "tiny_llama.gin", REPO / "recipes" / "tasks" / "arithmetic.gin"]


def test_every_config_field_has_a_docstring():
    tree = ast.parse(CONFIG.read_text())
    missing = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for i, node in enumerate(cls.body):
            if isinstance(node, ast.AnnAssign):
                following = cls.body[i + 1] if i + 1 < len(cls.body) else None
                if not (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                        and isinstance(following.value.value, str)):
                    missing.append(f"{cls.name}.{node.target.id}")
    assert not missing, f"fields without a docstring: {missing}"


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.name != "gsm8k.gin"], ids=lambda p: p.name)
def test_recipes_restate_no_default(recipe):
    defaults = {f"{scope}.{f.name}": f.default for scope, cls in SCOPES.items() for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING}
    own = [s for path, s in iter_statements(recipe) if path == recipe.resolve()]
    restated = [f"{s.selector}.{s.arg_name} = {s.value!r}" for s in own
                if defaults.get(f"{s.selector}.{s.arg_name}", object()) == s.value
                and type(defaults[f"{s.selector}.{s.arg_name}"]) is type(s.value)]
    assert not restated, f"{recipe.name} restates defaults of rlhf/config.py: {restated}"

