"""The confirmation stage (experiments/confirm.py): the adopted changes shrunk for selection, the
seeds they plan, and a real confirmation of two tiny rounds, scored on the test split and read by
the summary."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from experiments.aggregate import aggregate
from experiments.confirm import fresh_seeds, seed_count, shrunk_effects
from experiments.results import RunOutcome, RunStatus
from experiments.study import load_study

STUDY = """
study.name = '{name}'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = {bindings}
study.variants = {variants}
study.seeds = {seeds}
study.metric = 'eval/accuracy'
{extra}
"""
RUN = ['ppo.total_steps = 2', 'ppo.eval_every = 2', 'ppo.save_every = 2', 'ppo.final_window = 2']


def outcomes(values):
    return [RunOutcome(variant=v, seed=s, run_dir=f"/r/x/runs/{v}/seed{s}", status=RunStatus.COMPLETED, value=x,
                       steps=2) for v, xs in values.items() for s, x in enumerate(xs)]


def round_of(write_study, name, values, variants):
    study = load_study(write_study(STUDY.format(name=name, bindings=RUN, variants=variants, seeds=5, extra=""),
                                   f"{name}.gin"))
    return study, None, aggregate(study, outcomes(values))


def test_the_adopted_difference_is_shrunk_by_the_spread_of_every_difference_measured(write_study):
    """Empirical Bayes over every measured difference: tau^2 = mean(d^2 - se^2), the adopted one
    times tau^2 / (tau^2 + se^2); its se from its 95% interval. A round that adopts nothing adds
    differences to the prior, no effect."""
    base = [0.30, 0.32, 0.31, 0.29, 0.33]
    won = [0.40, 0.43, 0.41, 0.42, 0.44]
    rounds = [round_of(write_study, "a", {"baseline": base, "up": won, "flat": [0.31, 0.30, 0.32, 0.30, 0.31]},
                       "{'up': 'ppo.kl_coef = 0.1', 'flat': 'ppo.clip_range = 0.1'}")]
    agg = rounds[0][2]
    assert agg.decision.chosen == "up"
    effect, adopted = shrunk_effects(rounds)
    d, s = [], []
    for name in ("up", "flat"):
        own = agg.variants[name].comparison.decisive
        d.append(own.difference)
        s.append((own.difference_ci95[1] - own.difference_ci95[0]) / (2 * 1.959964))
    tau2 = max(np.mean(np.square(d) - np.square(s)), 0.0)
    assert adopted[0]["variant"] == "up"
    assert effect == pytest.approx(d[0] * tau2 / (tau2 + s[0] ** 2)) and 0 < effect < d[0]


def test_seeds_are_planned_for_the_shrunk_effect_and_capped(write_study):
    rounds = [round_of(write_study, "a", {"baseline": [0.30, 0.36, 0.27, 0.33, 0.29],
                                          "up": [0.36, 0.41, 0.33, 0.40, 0.35]}, "{'up': 'ppo.kl_coef = 0.1'}")]
    assert rounds[0][2].decision.chosen == "up"
    plan = seed_count(rounds, 50)
    assert plan["basis"] == "the adopted changes' shrunk differences" and plan["seeds"] == plan["needed"] > 2
    assert 0.8 <= plan["power"] < 0.9
    capped = seed_count(rounds, 2)
    assert capped["seeds"] == 2 and capped["power"] < plan["power"]
    assert fresh_seeds(rounds, 3) == [5, 6, 7]  # above every seed the rounds ran


@pytest.mark.slow
def test_a_confirmation_of_two_tiny_rounds_is_scored_on_the_test_split_and_opens_the_summary(workdir, write_study):
    """r1 (the baseline) then r2, which resumes it with kl_coef 0.1 in its baseline: the tuned recipe is
    r2's as its runs got it, the original baseline r1's; each runs the rounds' 4 steps from the warm
    start on fresh seeds, scored on the test split; the summary's first line is the verdict."""
    from experiments.cli import main

    r1 = write_study(STUDY.format(name="r1", bindings=RUN, variants="{}", seeds=2, extra=""), "r1.gin")
    r2 = write_study(STUDY.format(name="r2", bindings=[*RUN, "ppo.kl_coef = 0.1"], variants="{}", seeds=2,
                                  extra=f"study.resume_from = '{workdir / 'r1'}'"), "r2.gin")
    for path in (r1, r2):
        assert main(["run", str(path), "--results", str(workdir), "--num-cpus", "2"]) in (0, 1)
    assert main(["testsplit", "--recipe", "recipes/tiny.gin", "--out", str(workdir / "test")]) == 0
    out = workdir / "confirmation.json"
    assert main(["confirm", str(r1), str(r2), "--results", str(workdir), "--test", str(workdir / "test"),
                 "--max-seeds", "2", "--num-cpus", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["bindings"] == ["ppo.kl_coef = 0.1"] and record["steps"] == 4
    assert record["seeds"] == [2, 3] and record["n_units"] == 2
    assert all(math.isfinite(x) for x in (record["difference"], *record["ci"], record["p"]))
    assert record["ci"][0] <= record["difference"] <= record["ci"][1]
    assert record["model"].endswith("checkpoints/step_4") and record["export"].startswith("python -m rlhf.export ")
    assert (workdir / "confirmation" / "aggregate.json").is_file()
    summary = workdir / "summary.md"
    assert main(["summary", str(r1), str(r2), "--results", str(workdir), "--confirmation", str(out),
                 "--out", str(summary)]) == 0
    first = next(line for line in summary.read_text().splitlines() if line.strip() and not line.startswith("#"))
    assert first.startswith(("**Deploy", "**No evidence", "**Keep")), first


def test_a_path_that_adopted_nothing_has_nothing_to_confirm(tmp_path):
    """The stage writes a record saying so (no run); the summary reads it as no confirmation."""
    from experiments.summary import NOTHING_TO_CONFIRM, read_confirmation
    path = tmp_path / "confirmation.json"
    path.write_text(json.dumps({NOTHING_TO_CONFIRM: True, "bindings": [], "why": "no change"}))
    assert read_confirmation(path) is None
    path.write_text(json.dumps({"bindings": ["ppo.kl_coef = 0.1"], "difference": None, "ci": [None, None]}))
    with pytest.raises(Exception, match="not a confirmation record"):
        read_confirmation(path)
