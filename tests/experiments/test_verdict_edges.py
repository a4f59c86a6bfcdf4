"""Edge cases that must not decide: a NaN metric, seeds tied at the metric's resolution,
floating-point noise read as spread, seeds that share a start; and what the round's summary says
about them."""

import json
import math
from pathlib import Path

import pytest
from scipy import stats as sps

from experiments import sequential, stats
from experiments.aggregate import aggregate, lineage_units, verdicts
from experiments.collect import read_run
from experiments.plan import expand
from experiments.report import render
from experiments.results import BETTER, INSUFFICIENT, RunOutcome, RunStatus, SeedPlan
from experiments.study import load_study
from experiments.summary import _round_facts
from tests.experiments.conftest import fake_run

STUDY = """
study.name = 'edges'
study.baseline_recipe = 'tiny.gin'
study.variants = {'a': 'ppo.kl_coef = 0.1', 'b': 'ppo.clip_range = 0.1'}
study.seeds = 3
study.metric_resolution = 0.0078125
"""
STEP = 1 / 128


def outcomes(values, status=RunStatus.COMPLETED):
    return [RunOutcome(variant=v, seed=s, run_dir=f"/r/edges/runs/{v}/seed{s}", status=status, value=x, steps=5)
            for v, xs in values.items() for s, x in enumerate(xs)]


@pytest.fixture
def study(write_study):
    return load_study(write_study(STUDY))


def strict_json(text: str):
    """json.loads that refuses the NaN / Infinity tokens Python's json writes by default."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_a_nan_metric_fails_its_run_and_never_reaches_a_verdict_or_a_file(study, tmp_path):
    specs = expand(study, tmp_path / "results")
    values = {"baseline": [0.50, 0.52, 0.48], "a": [0.70, 0.72, math.nan], "b": [0.5, 0.51, 0.49]}
    for spec in specs:
        fake_run(spec, values[spec.variant][spec.seed])
    nan_spec = next(s for s in specs if s.variant == "a" and s.seed == 2)
    run = read_run(nan_spec, study)  # the project's writer turned the NaN into null
    assert run.status == RunStatus.FAILED and run.value is None
    assert "eval/accuracy = null (not a finite number)" in run.error
    summary = Path(nan_spec.run_dir) / "summary.json"  # a file another writer left with a bare NaN token
    summary.write_text(summary.read_text().replace('"eval/accuracy": null', '"eval/accuracy": NaN'))
    run = read_run(nan_spec, study)
    assert run.status == RunStatus.FAILED and "eval/accuracy = nan (not a finite number)" in run.error
    from experiments.report import write_report
    agg = write_report(study, tmp_path / "results" / "edges", specs)
    a = agg.variants["a"]
    assert a.failed == 1 and a.summary.n == 2 and "no observed difference" not in a.explanation
    assert agg.decision.chosen != "a"  # a variant with a failed run is never chosen
    text = (tmp_path / "results" / "edges" / "aggregate.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    strict_json(text)
    assert "not a finite number" in render(agg)


def test_nan_in_every_baseline_run_decides_nothing(study):
    runs = outcomes({"baseline": [None] * 3, "a": [0.5, 0.6, 0.7], "b": [0.5, 0.5, 0.6]})
    runs = [r if r.variant != "baseline" else RunOutcome(**{**r.__dict__, "status": RunStatus.FAILED,
                                                            "error": "final eval/accuracy = nan"}) for r in runs]
    agg = aggregate(study, runs)
    assert agg.decision.chosen is None and "no baseline run" in agg.decision.reason


def test_a_guardrail_is_violated_by_a_value_that_is_missing_or_not_a_finite_number(write_study):
    study = load_study(write_study(STUDY), ["study.guardrails = {'kl_divergence': {'max': 0.5}, "
                                            "'response_length_mean': {'min': 0.1}}"])
    kl, length = study.guardrails
    assert not kl.violated_by(0.1) and kl.violated_by(0.6) and not length.violated_by(0.2)
    for value in (None, math.nan, math.inf, -math.inf):
        assert kl.violated_by(value) and length.violated_by(value), value
    # In a study: a KL of -inf breaks `kl_divergence <= 0.5`, so the better variant is not chosen.
    runs = outcomes({"baseline": [0.25, 0.26, 0.24], "a": [0.45, 0.46, 0.44], "b": [0.25, 0.24, 0.26]})
    runs = [RunOutcome(**{**r.__dict__, "guardrails": {"kl_divergence": -math.inf if r.key == "a/seed1" else 0.1,
                                                       "response_length_mean": 0.2}}) for r in runs]
    agg = aggregate(study, runs)
    a = agg.variants["a"]
    assert a.verdict == BETTER and not a.guardrails_ok and a.guardrails["kl_divergence"].violated_seeds == (1,)
    assert agg.decision.chosen == "baseline" and agg.decision.guardrail_violations == ("a",)


def test_seeds_tied_at_the_resolution_are_insufficient_and_stay_in_holms_family(study):
    base = [0.25] * 3
    tied = [0.25 + STEP] * 3  # one grid step above, every seed tied: no spread to judge chance by
    spread = [0.40, 0.45, 0.43]
    agg = aggregate(study, outcomes({"baseline": base, "a": tied, "b": spread}))
    a, b = agg.variants["a"], agg.variants["b"]
    assert a.verdict == INSUFFICIENT and "resolution" in a.explanation
    assert a.comparison.flat and a.comparison.p_value is None and a.comparison.hedges_g is None
    assert agg.decision.chosen != "a"
    # 'a' counts in the family: b's p is multiplied by 2, as if 'a' were tested and lost.
    assert b.comparison.p_value_holm == pytest.approx(min(1.0, 2 * b.comparison.p_value))
    # The t interval of tied seeds spans the rounding error's std (step / sqrt(12)), not a point,
    # nor a spread of floating-point noise; so does the difference's.
    half = sps.t.ppf(0.975, 2) * STEP / math.sqrt(12)  # the tied seeds share one rounding error
    assert a.summary.ci95 == pytest.approx((0.25 + STEP - half, 0.25 + STEP + half))
    assert agg.variants["baseline"].summary.ci95 == pytest.approx((0.25 - half, 0.25 + half))
    lo, hi = a.comparison.difference_ci95
    assert lo < STEP < hi and hi - lo > STEP
    text = render(agg)
    assert f"[{0.25 + STEP - half:.4g}, {0.25 + STEP + half:.4g}]" in text and "[0.2578, 0.2578]" not in text


def test_floating_point_noise_is_no_spread():
    noise = {"baseline": {0: 0.1 + 0.1, 1: 0.2, 2: 0.3 - 0.1}, "v": {0: 0.2 + 0.1 - 0.1, 1: 0.2, 2: 0.2}}
    for s in (0, 1, 2):
        noise["v"][s] += 0.1  # 0.3 in floating point, three ways
    judged = verdicts(noise, True, 0.05)["v"]  # no resolution given: only floating-point noise ties
    assert judged.verdict == INSUFFICIENT and judged.comparison.p_value is None
    assert judged.comparison.hedges_g is None
    # Nor an interval: without a resolution, the spread tied values hide is unknown (not a point).
    assert judged.comparison.difference_ci95 == (None, None)
    assert judged.comparison.paired.difference_ci95 == (None, None)


def test_a_clear_difference_with_spread_is_still_decided(study):
    agg = aggregate(study, outcomes({"baseline": [0.25, 0.26, 0.24], "a": [0.45, 0.46, 0.44],
                                     "b": [0.25, 0.24, 0.26]}))
    assert agg.variants["a"].verdict == BETTER and agg.decision.chosen == "a"


def test_seeds_that_share_a_start_are_one_unit(study):
    starts = {0: "ckpt/seed0", 1: "ckpt/seed1", 2: "ckpt/seed0"}
    by_seed = {"baseline": {0: 0.2, 1: 0.3, 2: 0.4}, "a": {0: 0.5, 1: 0.6, 2: 0.7}}
    units, lineages = lineage_units(by_seed, starts)
    assert lineages == {"ckpt/seed0": (0, 2), "ckpt/seed1": (1,)}
    assert units["a"] == {0: pytest.approx(0.6), 1: 0.6}
    assert lineage_units(by_seed, {0: "x", 1: "y", 2: "z"}) == (by_seed, {})
    agg = aggregate(study, outcomes({"baseline": [0.2, 0.3, 0.4], "a": [0.5, 0.6, 0.7], "b": [0.2, 0.3, 0.4]}),
                    starts=starts)
    assert agg.lineages == {"ckpt/seed0": (0, 2), "ckpt/seed1": (1,)}
    assert agg.variants["a"].summary.n == 3  # the summary stays per seed; the tests read 2 units
    assert agg.variants["a"].verdict == INSUFFICIENT or "lineage means" in agg.variants["a"].explanation
    text = render(agg)
    assert "**Shared starts:** seeds 0, 2 start from `ckpt/seed0`" in text
    assert "| a | `ppo.kl_coef = 0.1` | 3/3 (2 lineages) |" in text


def test_one_grouping_of_seeds_into_units_serves_every_reader():
    lineages = {"ckpt/a": (3, 5), "ckpt/b": (4,)}
    assert stats.seed_units([5, 4, 3, 9], lineages) == [[5, 3], [4], [9]]  # a seed of no lineage stands alone
    assert stats.unit_means({3: 0.2, 4: 0.9, 5: 0.4, 9: 0.1}, lineages) == {3: pytest.approx(0.3), 4: 0.9, 9: 0.1}
    # a look that has seen only some of a lineage's seeds averages those it has
    assert sequential._in_wave({3: 0.2, 4: 0.9, 5: 0.4}, [3, 4], lineages) == {3: 0.2, 4: 0.9}


def test_round_facts_say_the_shortfall_and_the_equivalence_answer(study):
    import dataclasses
    agg = aggregate(study, outcomes({"baseline": [0.25, 0.27, 0.26], "a": [0.26, 0.27, 0.27],
                                     "b": [0.30, 0.28, 0.35]}))
    plan = SeedPlan(target_effect=0.05, power=0.8, alpha=0.05, comparisons=2, seeds=21, sigma=0.048,
                    pilot="round1", pilot_seeds=3, pilot_variants=1, seeds_run=3, power_at_seeds_run=0.067)
    agg = dataclasses.replace(agg, seed_plan=plan, equivalence_margin=0.03)
    facts = "\n".join(_round_facts(agg))
    assert "Seeds: 3 per variant ran; 21 seeds per variant detect +0.05 at 80% power" in facts
    assert "**Short of the plan:**" in facts and "7% power" in facts
    assert "Equivalence within ±0.03? a: not shown" in facts


def test_plan_says_when_seeds_share_starts():
    from experiments.resume_from import lineage_notice, shared_starts
    assert shared_starts({0: "a", 1: "b", 2: "c"}) == {} and lineage_notice({0: "a", 1: "b"}) is None
    text = lineage_notice({0: "a", 1: "b", 2: "c", 3: "a", 4: "b"})
    assert text.startswith("notice: seeds 0, 3; 1, 4 share their start checkpoints")
    assert "3 lineage means per variant, not 5 seeds" in text
