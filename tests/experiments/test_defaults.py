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


def test_study_defaults_are_written_once_on_study():
    """`study()` restates none of `Study`'s defaults: it fills them from its fields."""
    import inspect

    from experiments.study import STUDY_DEFAULTS, STUDY_PARAMETERS, Study, study
    own = inspect.signature(study).parameters
    assert STUDY_DEFAULTS and not set(STUDY_DEFAULTS) & set(own)
    assert {k: study()[k] for k in STUDY_DEFAULTS} == {f.name: f.default for f in dataclasses.fields(Study)
                                                      if f.name in STUDY_DEFAULTS}
    assert set(STUDY_PARAMETERS) == set(study())
    with pytest.raises(TypeError, match="nonexistent"):
        study(nonexistent=1)
    assert study(power=0.9)["power"] == 0.9


def test_sampling_params_are_the_ppo_configs():
    """SamplingParams holds no defaults: every one is built from a PPOConfig."""
    from rlhf.config import PPOConfig
    from rlhf.rollout import SamplingParams
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(SamplingParams))
    ppo = PPOConfig(temperature=0.7, top_p=0.9, top_k=5, prompt_truncation="right")
    rollout, greedy = SamplingParams.from_ppo(ppo), SamplingParams.from_ppo(ppo, 0.0)
    assert (rollout.temperature, rollout.top_p, rollout.top_k, rollout.truncation) == (0.7, 0.9, 5, "right")
    assert rollout.max_new_tokens == ppo.max_response_length and rollout.max_prompt_length == ppo.max_prompt_length
    assert greedy.greedy and greedy.top_p == 1.0


def test_seed_streams_keep_their_values():
    """The named seed streams are the integers every run's samples and shuffles were drawn with."""
    from rlhf.rollout import SeedStream
    assert {s.name: int(s) for s in SeedStream} == {"CRITIC_SHUFFLE": 2, "ACTOR_SHUFFLE": 3, "EVAL": 7_919,
                                                    "TEST": 104_729}


def test_reports_select_from_one_signal_list():
    """The W&B panels are the signal list; the plots and curves a selection of it, in its order."""
    from experiments.plots import FIGURES
    from experiments.stages import CURVE_METRICS
    from experiments.wandb_report import SIGNALS as PANELS
    from rlhf.metrics import SIGNALS
    assert PANELS is SIGNALS
    plotted = [m for ms in FIGURES.values() for m in ms]
    assert plotted == [m for m in SIGNALS if m in plotted] and set(CURVE_METRICS) <= set(SIGNALS)
    assert CURVE_METRICS == ("reward_mean", "kl_divergence", "clip_fraction", "response_length_mean", "eval/accuracy")
