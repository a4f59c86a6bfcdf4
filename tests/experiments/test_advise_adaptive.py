"""Adaptive seeds: the stopping rule on synthetic per-seed values (stops early on a clear
difference, goes to the maximum on a null one), its validation, and one tiny real study."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.adaptive import AdaptiveSeeds, decide_look, extra_seeds, run_looks, simulate
from experiments.errors import StudyError
from experiments.study import load_study

CFG = AdaptiveSeeds(max_seeds=8, min_seeds=3)


def draws(effects, sd=0.01):
    """Per-seed scores; a variant with effect None scores exactly the baseline's (a certain null)."""
    rng = np.random.default_rng(0)
    table = {name: 0.4 + (effect or 0.0) + sd * rng.standard_normal(CFG.max_seeds)
             for name, effect in {"baseline": 0.0, **effects}.items()}
    table.update({name: table["baseline"] for name, effect in effects.items() if effect is None})
    return lambda name, seed: float(table[name][seed])


def test_a_clear_difference_stops_at_the_first_look():
    out = simulate(draws({"better": 0.1, "worse": -0.1}), ["better", "worse"], CFG)
    assert {k: (d["n"], d["decided"]) for k, d in out["variants"].items()} == {"better": (3, True),
                                                                               "worse": (3, True)}
    assert out["runs_used"] == 9 and out["runs_fixed"] == 24
    assert out["variants"]["better"]["interval"][0] > 0 > out["variants"]["worse"]["interval"][1]


def test_a_null_variant_goes_to_the_maximum_and_the_baseline_with_it():
    out = simulate(draws({"null": None, "better": 0.1}), ["null", "better"], CFG)
    assert out["variants"]["null"]["n"] == 8 and not out["variants"]["null"]["decided"]
    assert out["variants"]["better"]["n"] == 3 and out["baseline_seeds"] == 8
    assert out["runs_used"] == 8 + 8 + 3 < out["runs_fixed"]


def test_the_one_look_loop_measures_only_the_undecided_and_stops_when_measuring_stops():
    """`run_looks` is the loop of both `simulate` and a real adaptive study: each look measures the
    variants still undecided at `step` more seeds, records the look, and ends where a variant is
    decided or at max_seeds; a measurement that stops (an interrupted launch) ends it with None."""
    cfg = AdaptiveSeeds(max_seeds=7, min_seeds=3, step=2)
    baseline = lambda n: [0.01 * (-1) ** s for s in range(n)]  # noqa: E731
    curves = {"clear": lambda n: [1.0 + 0.01 * s for s in range(n)], "null": baseline}
    asked, heard = [], []

    def measure(n, active):
        asked.append((n, list(active)))
        return {v: curves[v](n) for v in active}, baseline(n)

    ended = run_looks(cfg, ["clear", "null"], 0.95, measure,
                      lambda look, n, decisions: heard.append((look, n, sorted(decisions))))
    assert asked == [(3, ["clear", "null"]), (5, ["null"]), (7, ["null"])]  # only the undecided, step 2
    assert heard == [(1, 3, ["clear", "null"]), (2, 5, ["null"]), (3, 7, ["null"])]
    assert {k: (d["decided"], d["n"], look) for k, (d, look) in ended.stopped.items()} == {
        "clear": (True, 3, 1), "null": (False, 7, 3)}
    assert [look["seeds"] for look in ended.looks] == [3, 5, 7] and ended.looks[1]["active"] == ["null"]
    assert ended.seeds == 7
    assert run_looks(cfg, ["clear"], 0.95, lambda n, active: None) is None


def test_interval_and_alpha_spending():
    look = decide_look({"a": [1.0, 1.1, 0.9]}, [0.0, 0.1, -0.1], 0.95)
    assert look["a"]["decided"] and look["a"]["n"] == 3
    assert not decide_look({"a": [1.0]}, [0.0, 0.1], 0.95)["a"]["decided"]  # one seed: no interval
    assert not decide_look({"a": [0.5, 0.5]}, [0.4, 0.4], 0.95)["a"]["decided"]  # tied seeds: none either
    strict = AdaptiveSeeds(max_seeds=8, min_seeds=3, spend_alpha_over_looks=True)
    assert strict.looks == 6 and strict.confidence(0.05, 2) == pytest.approx(1 - 0.05 / 2 / 6)
    assert extra_seeds([5, 0], 4) == [5, 0, 1, 2]


@pytest.mark.parametrize("value, message", [
    ("{'max_seeds': 1}", "max_seeds'] = 1 is invalid"),
    ("{'min_seeds': 2}", "needs 'max_seeds'"),
    ("{'max_seeds': 2}", "must be >= min_seeds = 3"),
    ("{'max_seeds': 5, 'steps': 1}", "allowed keys"),
    ("8", "must be a dict"),
])
def test_invalid_adaptive_seeds_name_the_key(value, message):
    with pytest.raises(StudyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_study("recipes/studies/smoke.gin", [f"study.adaptive_seeds = {value}", "study.seeds = 3"])


def test_adaptive_seeds_parse_with_the_study_seeds_as_minimum():
    study = load_study("recipes/studies/smoke.gin", ["study.adaptive_seeds = {'max_seeds': 6}"])
    assert study.adaptive_seeds == AdaptiveSeeds(max_seeds=6, min_seeds=2)


@pytest.mark.slow
def test_tiny_adaptive_study_runs_only_the_seeds_it_needs(workdir, write_study):
    """Two seeds, then one more for an undecided variant at most: 4 to 6 runs, never the fixed 6 twice."""
    from experiments.cli import main

    path = write_study("""
        study.name = 'adaptive'
        study.baseline_recipe = 'tiny.gin'
        study.baseline_bindings = ['ppo.total_steps = 2', 'ppo.eval_every = 2', 'ppo.save_every = 2',
                                   'ppo.final_window = 2']
        study.variants = {'kl_up': 'ppo.kl_coef = 0.5'}
        study.seeds = 2
        study.adaptive_seeds = {'max_seeds': 3}
        study.metric = 'kl_divergence'
        study.metric_from = 'final_window'
    """)
    assert main(["run", str(path), "--results", str(workdir), "--num-cpus", "2"]) == 0
    agg = json.loads((workdir / "adaptive" / "aggregate.json").read_text())
    adaptive = agg["adaptive"]
    assert adaptive["runs_fixed"] == 6 and 4 <= adaptive["runs_used"] <= 6
    assert adaptive["variants"]["kl_up"]["n"] in (2, 3)
    assert "## Adaptive seeds" in (workdir / "adaptive" / "report.md").read_text()
