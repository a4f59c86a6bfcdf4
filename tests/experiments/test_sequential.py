"""Seed waves (experiments/sequential.py): the boundaries against published values and an
independent Monte Carlo of the same design, the promises (family-wise error, power, runs, interval
coverage) by simulation, where the adaptive rule seed waves replaced breaks the first, the replay
of a study's looks, the binding's validation, and one tiny real study."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from experiments import sequential
from experiments.errors import StudyError
from experiments.sequential import (
    Waves,
    crossing,
    design,
    efficacy_bounds,
    interval_table,
    plan_waves,
    replay,
    schedule,
    simulate,
    to_difference,
)
from experiments.study import load_study

STUDIES = 20_000
ALPHA = 0.05


def mc_limit(rate: float = ALPHA, n: int = STUDIES) -> float:
    """alpha plus two Monte Carlo standard errors: the most a rate that holds alpha may show."""
    return rate + 2 * math.sqrt(rate * (1 - rate) / n)


def test_efficacy_boundaries_match_published_tables():
    """Lan-DeMets O'Brien-Fleming at three equal looks, one-sided 0.025 a side (gsDesign's sfLDOF
    design: 3.7103, 2.5114, 1.9930); one look is the fixed test's 1.96; and the classic constant
    boundaries of Jennison & Turnbull's tables 2.1 and 2.3 (Pocock 2.289, O'Brien-Fleming 2.004 at
    K = 3, two-sided 0.05) cross with probability 0.05 under the same integration."""
    t = np.array([1 / 3, 2 / 3, 1])
    assert efficacy_bounds(t, 0.05) == pytest.approx([3.7103, 2.5114, 1.9930], abs=2e-4)
    assert efficacy_bounds([1.0], 0.05)[0] == pytest.approx(sps.norm.ppf(0.975), abs=1e-6)
    for c in (np.full(3, 2.289), 2.004 * np.sqrt(1 / t)):
        up, _ = crossing(t, -c, c, 0.0)
        assert 2 * up.sum() == pytest.approx(0.05, abs=2e-4)


def test_boundaries_cross_at_the_spent_rate_in_a_monte_carlo_of_the_same_design():
    """Brownian motion at the looks, simulated: the first-crossing rates equal the spending
    function's increments (O'Brien-Fleming and Pocock), and the futility boundaries give the
    planned power at the design's drift."""
    rng = np.random.default_rng(7)
    t = np.array([0.25, 0.5, 0.75, 1.0])
    steps = rng.standard_normal((200_000, 4)) * np.sqrt(np.diff(t, prepend=0.0))
    for family in sequential.SPENDING:
        c = efficacy_bounds(t, ALPHA, family)
        z = np.cumsum(steps, axis=1) / np.sqrt(t)
        crossed = np.abs(z) >= c
        first = np.where(crossed.any(1), crossed.argmax(1), -1)
        spent = np.diff(2 * sequential.spend(family, ALPHA / 2, t), prepend=0.0)
        assert [np.mean(first == k) for k in range(4)] == pytest.approx(spent, abs=0.0012)
    d = design((5, 10, 15, 20), ALPHA, "obrien_fleming", "pocock", 0.8)
    z = (np.cumsum(steps, axis=1) + d.drift * t) / np.sqrt(t)
    alive, better = np.ones(len(z), bool), np.zeros(len(z), bool)
    for k in range(4):
        hit = alive & (z[:, k] >= d.efficacy[k])
        better |= hit
        alive &= ~hit & (z[:, k] >= d.futility[k])
    assert better.mean() == pytest.approx(0.8, abs=0.004)


def old_adaptive_rule(rng, seeds=range(3, 9)):
    """The rule seed waves replaced: a look at every seed count from 3 to 8, a variant decided as
    soon as the Welch 95% interval of its difference excludes zero, never corrected for looking."""
    v, b = rng.standard_normal((2, STUDIES, max(seeds)))
    rejected = np.zeros(STUDIES, bool)
    for n in seeds:
        p = sps.ttest_ind(v[:, :n], b[:, :n], axis=1, equal_var=False).pvalue
        rejected |= p < ALPHA
    return rejected.mean()


@pytest.mark.parametrize("paired", [False, True])
def test_the_false_positive_rate_holds_where_the_adaptive_rule_broke_it(paired):
    """One null variant, seeds 3..8: the adaptive rule's false-positive rate is 0.12, over twice its
    nominal 0.05; seed waves over the same seeds (first 3, last 8) stay within alpha plus two
    Monte Carlo standard errors, by Welch's test and by the paired one."""
    assert old_adaptive_rule(np.random.default_rng(1)) > mc_limit()
    d = design(schedule(3, 5, 8), ALPHA, "obrien_fleming", "pocock")
    assert d.waves == (3, 5, 6, 8)
    out = simulate(d, [0.0], paired=paired, studies=STUDIES, rng=np.random.default_rng(2))
    assert np.mean(np.isin(out.verdict[:, 0], ["better", "worse"])) <= mc_limit()


def test_three_null_variants_keep_the_family_wise_rate():
    """Three null variants over waves up to the plan's N: any false verdict among them, at most alpha."""
    d = design(schedule(3, 5, 21), ALPHA / 3, "obrien_fleming", "pocock")
    out = simulate(d, [0.0, 0.0, 0.0], correlation=0.6, studies=STUDIES, rng=np.random.default_rng(3))
    assert np.mean(np.isin(out.verdict, ["better", "worse"]).any(1)) <= mc_limit()


def test_the_planned_power_and_the_runs_saved_hold_in_an_independent_simulation():
    """The planner's N (its own seeded simulation), checked with other random numbers: power at the
    target at least the planned 0.8 - 0.02; runs averaged over the null and the target at most
    0.70 of the fixed design's for the same power and alpha."""
    plan = plan_waves(1.0, sd_baseline=1.0, sd_variant=1.0, correlation=0.0, paired=True, alpha=ALPHA,
                      variants=1, power=0.8, waves=Waves(first=3, looks=5))
    assert plan is not None and plan.fixed_seeds is not None and plan.runs_fixed is not None
    d = plan.design
    rng = np.random.default_rng(4)
    target = simulate(d, [1.0], studies=STUDIES, rng=rng)
    null = simulate(d, [0.0], studies=STUDIES, rng=rng)
    assert np.mean(target.verdict[:, 0] == "better") >= 0.78
    assert (target.runs.mean() + null.runs.mean()) / 2 <= 0.70 * plan.runs_fixed
    assert plan.runs_max == 2 * d.waves[-1] and d.waves[-1] >= plan.fixed_seeds


def test_each_arm_is_planned_with_its_own_spread():
    """A variant twice as noisy as the baseline needs more seeds than equal spreads promise, and the
    fixed design's count is Welch's at the two spreads (`stats.seeds_needed` with sd2)."""
    from experiments import stats
    equal = plan_waves(1.0, sd_baseline=1.0, sd_variant=1.0, paired=False, waves=Waves(looks=4))
    wide = plan_waves(1.0, sd_baseline=1.0, sd_variant=2.0, paired=False, waves=Waves(looks=4))
    assert equal is not None and wide is not None
    assert wide.design.waves[-1] > 2 * equal.design.waves[-1]
    assert wide.fixed_seeds == stats.seeds_needed(1.0, 1.0, ALPHA, 0.8, sd2=2.0) > stats.seeds_needed(1.0, 1.0)
    out = simulate(wide.design, [1.0], sd_variant=2.0, paired=False, studies=STUDIES,
                   rng=np.random.default_rng(5))
    assert np.mean(out.verdict[:, 0] == "better") >= 0.78


@pytest.mark.parametrize("effect", [0.0, 1.2])
def test_the_stagewise_interval_covers_at_its_level(effect):
    """The interval a stopped variant reports covers the true difference 94-96% of the time under
    the design, where the t interval at the stopping look does not when a real effect stops early."""
    d = design((3, 6, 9), ALPHA, "obrien_fleming", "pocock")
    out = simulate(d, [effect], studies=STUDIES, rng=np.random.default_rng(6))
    lo, hi = interval_table(d)(out.z[:, 0], out.look[:, 0])
    low, high = (to_difference(out.z[:, 0], m, out.t[:, 0], out.df[:, 0], out.se[:, 0]) for m in (lo, hi))
    assert 0.94 <= np.mean((low <= effect) & (effect <= high)) <= 0.96


def test_with_one_look_the_interval_and_p_value_are_the_t_tests():
    d = design((6,), ALPHA)
    x = np.array([0.3, 0.1, 0.5, 0.2, 0.6, 0.4])
    test = sps.ttest_1samp(x, 0.0)
    z = sequential.t_to_z(test.statistic, 5)
    lo, hi = d.interval(z, 0)
    se = x.std(ddof=1) / math.sqrt(6)
    ours = sorted(to_difference(z, m, test.statistic, 5, se) for m in (lo, hi))
    assert ours == pytest.approx(list(test.confidence_interval()), abs=1e-6)
    assert d.p_value(z, 0) == pytest.approx(test.pvalue, abs=1e-6)


def test_replay_stops_each_variant_at_its_first_decision_and_reads_lineage_units():
    """A clear gain is decided at the first look, a loss stops (futility: it cannot reach the target),
    later looks read only the variants still running; seeds that share a start are one unit."""
    d = design((3, 6), ALPHA, "obrien_fleming", "pocock")
    seeds = list(range(6))
    base = {s: 0.5 + 0.01 * ((-1) ** s) for s in seeds}
    values = {"baseline": base, "gain": {s: base[s] + 0.3 + 0.001 * s for s in seeds},
              "loss": {s: base[s] - 0.05 + 0.01 * (s % 2) for s in seeds},
              "unsure": {s: base[s] + (0.004 if s % 3 else -0.001) for s in seeds}}
    out = replay(d, seeds, values, "baseline", paired=True, higher=True)
    assert out.stopped["gain"]["decision"] == "better" and out.stopped["gain"]["look"] == 1
    assert out.stopped["loss"]["decision"] == "futile" and out.stopped["loss"]["look"] == 1
    assert [sorted(look["judged"]) for look in out.looks] == [["gain", "loss", "unsure"], ["unsure"]]
    assert out.stopped["gain"]["interval"][0] > 0 and out.stopped["gain"]["p_value"] < ALPHA
    lower = replay(d, seeds, values, "baseline", paired=True, higher=False)
    assert lower.stopped["gain"]["decision"] == "worse"
    shared = replay(d, seeds, values, "baseline", paired=True, higher=True, lineages={"a": (0, 3), "b": (1, 4),
                                                                                       "c": (2, 5)})
    assert shared.looks[-1]["judged"]["unsure"]["units"] == 3
    partial = replay(d, seeds, values, "baseline", paired=True, higher=True, ran={"unsure": 3, "gain": 6, "loss": 6})
    assert partial.stopped["unsure"]["decision"] == "continue" and len(partial.looks) == 1


@pytest.mark.parametrize("binding, message", [
    ("study.adaptive_seeds = {'max_seeds': 8}", "was replaced by study.sequential"),
    ("study.sequential = {'max_seeds': 1}", "'max_seeds'] = 1 is invalid"),
    ("study.sequential = {'looks': 4}", "no 'max_seeds' and no study.target_effect"),
    ("study.sequential = {'max_seeds': 5, 'step': 1}", "allowed keys: first, looks"),
    ("study.sequential = {'max_seeds': 5, 'spending': 'linear'}", "must be one of ('obrien_fleming', 'pocock')"),
    ("study.sequential = 8", "must be True or a dict"),
])
def test_invalid_seed_waves_name_the_key(binding, message):
    with pytest.raises(StudyError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        load_study("recipes/studies/smoke.gin", [binding, "study.seeds = 3"])


def test_seed_waves_and_an_equivalence_margin_are_refused_together():
    with pytest.raises(StudyError, match="equivalence is tested on a fixed design"):
        load_study("recipes/studies/smoke.gin", ["study.sequential = {'max_seeds': 6}",
                                                 "study.equivalence_margin = 0.02"])


def test_seed_waves_parse_with_the_study_seeds_as_the_first_wave():
    study = load_study("recipes/studies/smoke.gin", ["study.sequential = {'max_seeds': 6}"])
    assert study.sequential == Waves(first=2, looks=5, max_seeds=6)


@pytest.mark.slow
def test_tiny_study_in_waves_runs_only_the_waves_it_needs(workdir, write_study):
    """Two seeds, then a third for a variant still running: 4 to 6 runs; the report has the waves."""
    from experiments.cli import main

    path = write_study("""
        study.name = 'waves'
        study.baseline_recipe = 'tiny.gin'
        study.baseline_bindings = ['ppo.total_steps = 2', 'ppo.eval_every = 2', 'ppo.save_every = 2',
                                   'ppo.final_window = 2']
        study.variants = {'kl_up': 'ppo.kl_coef = 0.5'}
        study.seeds = 2
        study.sequential = {'looks': 2, 'max_seeds': 3}
        study.metric = 'kl_divergence'
        study.metric_from = 'final_window'
    """)
    assert main(["run", str(path), "--results", str(workdir), "--num-cpus", "2"]) == 0
    agg = json.loads((workdir / "waves" / "aggregate.json").read_text())
    record = agg["sequential"]
    assert record["waves"] == [2, 3] and record["runs_max"] == 6 and 4 <= record["runs_used"] <= 6
    assert record["variants"]["kl_up"]["decision"] in ("better", "worse", "futile")
    assert "## Seed waves" in (workdir / "waves" / "report.md").read_text()
    assert main(["report", str(path), "--results", str(workdir)]) == 0  # the looks replay from the runs
    again = json.loads((workdir / "waves" / "aggregate.json").read_text())["sequential"]
    assert again["variants"] == record["variants"]


def test_a_variant_without_a_statistic_at_the_last_look_is_insufficient_not_no_difference():
    """Its runs failed but one: no look could judge it, so no verdict says 'no difference'."""
    from experiments.aggregate import aggregate
    from experiments.results import INSUFFICIENT, RunOutcome, RunStatus

    study = load_study("recipes/studies/smoke.gin", ["study.sequential = {'looks': 2, 'max_seeds': 4}",
                                                     "study.seeds = 2", "study.metric = 'eval/accuracy'"])
    name = study.variants[0].name
    runs = [RunOutcome(variant="baseline", seed=s, run_dir=f"/r/w/runs/baseline/seed{s}", status=RunStatus.COMPLETED,
                       value=0.3 + 0.01 * s, steps=2) for s in range(4)]
    runs += [RunOutcome(variant=name, seed=s, run_dir=f"/r/w/runs/{name}/seed{s}",
                        status=RunStatus.COMPLETED if s == 0 else RunStatus.FAILED,
                        value=0.35 if s == 0 else None, steps=2) for s in range(4)]
    agg = aggregate(study, runs)
    assert agg.sequential is not None and agg.sequential.variants[name]["z"] is None
    assert agg.variants[name].verdict == INSUFFICIENT and "no statistic" in agg.variants[name].explanation
