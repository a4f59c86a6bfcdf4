"""Study recipes: parsing, defaults, and errors that name the binding, before any compute."""

from pathlib import Path

import pytest

from experiments.errors import StudyError
from experiments.study import BASELINE, load_study, split_cli_bindings

REPO = Path(__file__).resolve().parents[2]

MINIMAL = """
study.name = 'round1'
study.variants = {'kl': 'ppo.kl_coef = 0.1'}
"""


def test_shipped_smoke_study_parses():
    study = load_study(REPO / "recipes/studies/smoke.gin")
    assert study.name == "smoke"
    assert [v.name for v in study.all_variants] == [BASELINE, "kl_coef_x2"]
    assert study.seeds == (0, 1)
    assert study.baseline_recipe.endswith("recipes/tiny.gin")


def test_defaults_and_seed_forms(write_study):
    study = load_study(write_study(MINIMAL))
    assert study.seeds == (0, 1, 2)
    assert (study.metric, study.metric_from, study.direction) == ("eval/accuracy", "final", "higher")
    assert study.cpus_per_run == 1 and study.gpus_per_run == 0
    assert (study.analysis, study.equivalence_margin) == ("auto", 0.0)
    margin = load_study(write_study(MINIMAL + "study.metric = 'eval/rm_score'\nstudy.equivalence_margin = 1\n")
                        ).equivalence_margin  # a score's range is open: 1 is a margin (an accuracy's is not)
    assert margin == 1.0 and isinstance(margin, float)
    assert load_study(write_study(MINIMAL + "study.seeds = [7, 3]\n")).seeds == (7, 3)


def test_cli_bindings_split_between_study_and_runs(write_study):
    study = load_study(write_study(MINIMAL), ["study.seeds = 4", "ppo.total_steps = 5"])
    assert study.seeds == (0, 1, 2, 3)
    assert study.baseline_bindings[-1] == "ppo.total_steps = 5"
    assert split_cli_bindings(["study.retries = 0", "ppo.kl_coef = 1"]) == (["study.retries = 0"], ["ppo.kl_coef = 1"])


def test_coupled_variant_must_be_declared(write_study):
    text = """
    study.name = 'r'
    study.variants = {'lrs': ['ppo.actor_learning_rate = 1e-5', 'ppo.critic_learning_rate = 3e-5']}
    """
    with pytest.raises(StudyError, match=r"study.variants\['lrs'\].*study.coupled"):
        load_study(write_study(text))
    study = load_study(write_study(text + "study.coupled = ['lrs']\n"))
    assert study.variants[0].coupled and len(study.variants[0].bindings) == 2


@pytest.mark.parametrize("extra, match", [
    ("study.seeds = 0", "study.seeds"),
    ("study.seeds = [1, 1]", "distinct"),
    ("study.direction = 'up'", "study.direction"),
    ("study.metric_from = 'last'", "study.metric_from"),
    ("study.cpus_per_run = 0", "study.cpus_per_run"),
    ("study.retries = -1", "study.retries"),
    ("study.start_gap_s = -1", "study.start_gap_s = -1 is invalid: must be a number of seconds >= 0"),
    ("study.analysis = 'bootstrap'", r"study.analysis = 'bootstrap' is invalid: must be one of \('auto'"),
    ("study.equivalence_margin = -1", "study.equivalence_margin = -1 is invalid: must be a number >= 0"),
    ("study.guardrails = {'kl_divergence': {'below': 1}}", "study.guardrails"),
    ("study.variants = {'baseline': 'ppo.kl_coef = 0.1'}", "variant name"),
    ("study.variants = {'s': 'ppo.seed = 3'}", "ppo.seed is set by the manager"),
    ("study.variants = {'x': 'kl_coef: 0.1'}", "not a binding"),
    ("study.variants = ['ppo.kl_coef = 0.1']", "study.variants"),
    ("study.variants = {'x': 'foo.bar = 1'}", "allowed scopes"),
    ("study.baseline_recipe = 'nope.gin'", "study.baseline_recipe"),
    ("study.nope = 1", "nope"),
    ("ppo.kl_coef = 0.2", "binds only study"),
])
def test_invalid_studies_name_the_binding(write_study, extra, match):
    with pytest.raises(StudyError, match=match):
        load_study(write_study(MINIMAL + extra + "\n"))


def test_missing_required_name(write_study):
    with pytest.raises(StudyError, match="name"):
        load_study(write_study("study.variants = {'kl': 'ppo.kl_coef = 0.1'}\n"))


def test_missing_file():
    with pytest.raises(StudyError, match="does not exist"):
        load_study("nowhere.gin")
