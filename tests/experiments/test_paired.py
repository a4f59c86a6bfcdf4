"""The paired analysis over shared seeds and TOST equivalence: the statistics against scipy and
hand formulas, the `equivalent` verdict, the analysis a study picks, and the typed aggregate."""

import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from experiments import stats
from experiments.aggregate import aggregate, decide, verdicts
from experiments.errors import StudyError
from experiments.report import render
from experiments.results import BETTER, EQUIVALENT, NO_DIFFERENCE, PAIRED, WELCH, RunOutcome, StudyAggregate
from experiments.study import load_study, resolve_analysis

# Five seeds whose luck both arms share: the seed-to-seed spread (0.05) dwarfs the variant's
# effect on each seed (a few thousandths).
BASE = [0.50, 0.55, 0.45, 0.60, 0.52]
NEAR = [b + e for b, e in zip(BASE, [0.001, -0.002, 0.0015, -0.001, 0.0005])]
GAIN = [b + e for b, e in zip(BASE, [0.031, 0.028, 0.033, 0.029, 0.030])]


def test_paired_t_on_correlated_seeds_is_far_more_sensitive_than_welch():
    p_paired, p_welch = stats.paired_p(GAIN, BASE), stats.welch_p(GAIN, BASE)
    assert p_paired == pytest.approx(sps.ttest_rel(GAIN, BASE).pvalue)
    d = np.subtract(GAIN, BASE)
    t = d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))
    assert p_paired == pytest.approx(2 * sps.t.sf(abs(t), len(d) - 1))
    assert p_paired < 1e-5 and p_welch > 0.3  # the shared seed luck hides a +0.03 gain from Welch
    lo, hi = stats.paired_ci(GAIN, BASE)
    assert 0 < lo < d.mean() < hi
    assert stats.paired_p([0.5], [0.4]) != stats.paired_p([0.5], [0.4])  # NaN: one pair
    assert math.isnan(stats.paired_p([0.6, 0.7], [0.5, 0.6]))  # the same difference on every seed


def test_wilcoxon_agrees_with_scipy_and_handles_tiny_and_zero_differences():
    assert stats.wilcoxon_p(GAIN, BASE) == pytest.approx(sps.wilcoxon(np.subtract(GAIN, BASE)).pvalue)
    assert stats.wilcoxon_p(GAIN, BASE) == pytest.approx(2 / 2 ** 5)  # every sign up: the exact minimum
    assert stats.wilcoxon_p([1.0, 2.0, 3.0], [0.5, 1.2, 2.0]) == pytest.approx(0.25)
    assert math.isnan(stats.wilcoxon_p([0.5, 0.6, 0.7], [0.5, 0.6, 0.7]))  # no pair differs
    assert math.isnan(stats.wilcoxon_p([0.5], [0.4]))


def test_correlation_of_the_pairs_and_the_design_correlation():
    assert stats.pair_correlation(GAIN, BASE) == pytest.approx(sps.pearsonr(GAIN, BASE).statistic)
    assert stats.pair_correlation([0.1, 0.2], [0.3, 0.1]) is None  # two points: always on a line
    assert stats.pair_correlation([0.1, 0.2, 0.3], [0.5, 0.5, 0.5]) is None
    assert stats.design_correlation(None) == 0.0
    assert stats.design_correlation(-0.5) == 0.0
    assert stats.design_correlation(0.4) == 0.4
    assert stats.design_correlation(1.0) == stats.MAX_DESIGN_CORRELATION < 1


def test_compare_paired_counts_only_the_seeds_both_sides_ran():
    variant = {0: 0.61, 1: 0.58, 2: 0.66, 5: 0.9}
    baseline = {0: 0.52, 1: 0.55, 2: 0.50, 3: 0.57}
    c = stats.compare_paired(variant, baseline)
    assert c.n_pairs == 3
    assert c.difference == pytest.approx(np.mean([0.61 - 0.52, 0.58 - 0.55, 0.66 - 0.50]))
    assert c.p_value == pytest.approx(sps.ttest_rel([0.61, 0.58, 0.66], [0.52, 0.55, 0.50]).pvalue)
    assert c.sd_difference == pytest.approx(np.std([0.09, 0.03, 0.16], ddof=1))
    assert c.equivalence_p is None  # no margin
    # MDE and seeds needed of the paired t at the measured std of the differences (what it divides by).
    sd_d = c.sd_difference
    assert c.seeds_needed is not None
    assert c.seeds_needed == stats.seeds_needed(c.difference, 1.0, paired=True, sd_difference=sd_d)
    assert stats.paired_power(c.min_detectable_effect, sd_d, 3) == pytest.approx(0.8)
    assert stats.compare_paired({0: 0.5}, {1: 0.5}).n_pairs == 0


def test_tost_accepts_tight_equal_data_and_rejects_a_real_difference():
    margin = 0.02
    p = stats.tost_p(NEAR, BASE, margin, paired=True)
    d = np.subtract(NEAR, BASE)
    se = d.std(ddof=1) / math.sqrt(len(d))
    by_hand = max(sps.t.sf((d.mean() + margin) / se, len(d) - 1), sps.t.cdf((d.mean() - margin) / se, len(d) - 1))
    assert p == pytest.approx(by_hand) and p < 1e-4
    assert stats.tost_p(GAIN, BASE, margin, paired=True) > 0.5  # +0.03 on every seed: outside +-0.02
    # Welch's TOST on the same values cannot see it: the groups' spread is 0.05.
    assert stats.tost_p(NEAR, BASE, margin) > 0.2
    x, y = np.array(NEAR), np.array(BASE)
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    df = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    diff, se = x.mean() - y.mean(), math.sqrt(vx + vy)
    assert stats.tost_p(NEAR, BASE, margin) == pytest.approx(
        max(sps.t.sf((diff + margin) / se, df), sps.t.cdf((diff - margin) / se, df)))
    assert math.isnan(stats.tost_p(NEAR, BASE, 0.0)) and math.isnan(stats.tost_p(NEAR, BASE, 0.0, paired=True))


def test_the_test_functions_run_over_stacked_studies():
    rng = np.random.default_rng(0)
    x, y = rng.normal(0, 1, (50, 4)), rng.normal(0.2, 1, (50, 4))
    for vectorised, single in ((stats.welch_p(x, y), stats.welch_p), (stats.paired_p(x, y), stats.paired_p),
                               (stats.tost_p(x, y, 0.5), lambda a, b: stats.tost_p(a, b, 0.5)),
                               (stats.tost_p(x, y, 0.5, paired=True), lambda a, b: stats.tost_p(a, b, 0.5, True))):
        assert vectorised.shape == (50,)
        assert vectorised == pytest.approx([single(a, b) for a, b in zip(x, y)])


def test_equivalent_verdict_and_its_explanation():
    values = {"baseline": dict(enumerate(BASE)), "near": dict(enumerate(NEAR)), "gain": dict(enumerate(GAIN))}
    out = verdicts(values, higher=True, alpha=0.05, analysis=PAIRED, margin=0.02)
    near = out["near"]
    assert near.verdict == EQUIVALENT and not near.underpowered
    why = near.explanation
    assert why.startswith("equivalent within ±0.02 (TOST p = ") and "paired t, Holm-corrected" in why
    # Holm across the two variants: the smaller TOST p is doubled.
    raw = {n: out[n].comparison.paired.equivalence_p for n in ("near", "gain")}
    assert near.comparison.equivalence_p_holm == pytest.approx(min(1, 2 * raw["near"]))
    assert out["gain"].verdict == BETTER  # better wins over equivalence
    # Welch's analysis of the same values: neither shown different nor equivalent.
    welch = verdicts(values, higher=True, alpha=0.05, analysis=WELCH, margin=0.02)
    assert welch["near"].verdict == NO_DIFFERENCE
    assert "not shown equivalent within ±0.02 (TOST p = " in welch["near"].explanation
    assert welch["near"].comparison.analysis == WELCH and welch["near"].comparison.paired.n_pairs == 5
    # No margin: no equivalence.
    assert verdicts(values, True, 0.05, PAIRED)["near"].verdict == NO_DIFFERENCE


STUDY = """
study.name = 'eq'
study.baseline_recipe = 'tiny.gin'
study.variants = {'near': 'ppo.kl_coef = 0.1', 'gain': 'ppo.clip_range = 0.1'}
study.seeds = 5
study.equivalence_margin = 0.02
"""


def results(values):
    return [RunOutcome(variant=v, seed=s, run_dir=f"/r/eq/runs/{v}/seed{s}", status="completed", value=x,
                       guardrails={}, steps=5)
            for v, xs in values.items() for s, x in enumerate(xs)]


def test_auto_picks_paired_for_a_fixed_design_and_the_aggregate_round_trips(write_study, tmp_path):
    study = load_study(write_study(STUDY))
    assert study.analysis == "auto" and study.equivalence_margin == 0.02
    values = results({"baseline": BASE, "near": NEAR, "gain": GAIN})
    assert aggregate(study, values).analysis == WELCH  # no previous round measured a correlation
    agg = aggregate(study, values, pilot_correlation=0.9)  # a pilot whose paired seeds shared their luck
    assert agg.analysis == PAIRED and agg.equivalence_margin == 0.02
    near = agg.variants["near"]
    assert near.verdict == EQUIVALENT and near.comparison.analysis == PAIRED
    assert near.comparison.paired.n_pairs == 5 and near.comparison.paired.wilcoxon_p_value is not None
    assert near.comparison.decisive is near.comparison.paired
    assert agg.decision.chosen == "gain"  # better; 'near' is equivalent, never a reason to change
    assert decide({"baseline": agg.variants["baseline"], "near": near}, True).chosen == "baseline"
    path = tmp_path / "aggregate.json"
    agg.save(path)
    data = json.loads(path.read_text())
    assert data["analysis"] == "paired" and data["equivalence_margin"] == 0.02
    assert data["variants"]["near"]["comparison"]["paired"]["correlation"] == pytest.approx(
        sps.pearsonr(NEAR, BASE).statistic)
    assert StudyAggregate.load(path) == agg
    # An explicit Welch analysis decides by Welch's test, and records the paired one beside it.
    welch = aggregate(load_study(write_study(STUDY), ["study.analysis = 'welch'"]),
                      results({"baseline": BASE, "near": NEAR, "gain": GAIN}))
    assert welch.analysis == WELCH and welch.variants["near"].verdict == NO_DIFFERENCE
    assert welch.variants["near"].comparison.paired.p_value == near.comparison.paired.p_value


def test_resolve_analysis_reads_the_design():
    shared = {"baseline": [0, 1, 2, 3], "a": [0, 1, 2, 3], "b": [0, 1]}  # seed waves: b stopped early
    # 'auto' pairs shared seeds only where a previous round measured a correlation that repays the
    # halved degrees of freedom at this round's seeds (b's 2 here: from about 0.6, Welch's test
    # having between 1 and 2 degrees of freedom itself).
    assert resolve_analysis("auto", shared) == WELCH  # no pilot correlation
    four = {"baseline": [0, 1, 2, 3], "a": [0, 1, 2, 3]}
    assert resolve_analysis("auto", four, pilot_correlation=0.8) == PAIRED
    assert resolve_analysis("auto", four, pilot_correlation=0.03) == WELCH  # the demo's: pairing would cost
    assert resolve_analysis("auto", shared, pilot_correlation=0.5) == WELCH  # b ran 2 seeds: 1 df paired
    assert resolve_analysis("auto", shared, pilot_correlation=0.8) == PAIRED
    assert resolve_analysis("auto", {"baseline": [0, 1], "a": [2, 3]}, pilot_correlation=0.9) == WELCH
    assert resolve_analysis("welch", shared) == WELCH and resolve_analysis("paired", {"baseline": [0]}) == PAIRED


def test_auto_weighs_pairing_at_the_per_test_level(write_study):
    """'auto' compares the designs at alpha over the variants compared: the level the verdicts'
    minimum detectable effects and the seed plan use, not alpha itself."""
    three = {"baseline": [0, 1, 2], "a": [0, 1, 2], "b": [0, 1, 2], "c": [0, 1, 2]}
    # At 3 seeds a correlation of 0.5 repays pairing at alpha 0.05 (one variant), not at 0.05 / 3.
    assert stats.paired_is_more_sensitive(3, 0.5, 0.05) and not stats.paired_is_more_sensitive(3, 0.5, 0.05 / 3)
    assert resolve_analysis("auto", {"baseline": [0, 1, 2], "a": [0, 1, 2]}, pilot_correlation=0.5) == PAIRED
    assert resolve_analysis("auto", three, pilot_correlation=0.5) == WELCH
    assert resolve_analysis("auto", three, pilot_correlation=0.7) == PAIRED
    # The study's two variants of 5 seeds: 0.27 repays pairing at 0.05, not at 0.05 / 2.
    assert stats.paired_is_more_sensitive(5, 0.27, 0.05) and not stats.paired_is_more_sensitive(5, 0.27, 0.025)
    agg = aggregate(load_study(write_study(STUDY)), results({"baseline": BASE, "near": NEAR, "gain": GAIN}),
                    pilot_correlation=0.27)
    assert agg.analysis == WELCH


def test_report_shows_the_analysis_both_analyses_and_the_margin(write_study):
    agg = aggregate(load_study(write_study(STUDY)), results({"baseline": BASE, "near": NEAR, "gain": GAIN}),
                    pilot_correlation=0.9)
    text = render(agg)
    p = agg.variants["near"].comparison.equivalence_p_holm
    assert f"| equivalent within ±0.02 (p = {p:.3g}) |" in text
    assert "paired t-test over the seeds both sides ran, Holm-corrected across 2 variant(s)" in text
    assert "equivalence: TOST within ±0.02" in text
    assert "## Both analyses" in text and "| Wilcoxon p | correlation | TOST p (Welch) | TOST p (paired) |" in text
    assert "- `near`: equivalent within ±0.02 (TOST p = " in text
    row = next(line for line in text.splitlines() if line.startswith("| near | `ppo.kl_coef"))
    assert "| paired |" in row


@pytest.mark.parametrize("binding, match", [
    ("study.analysis = 'bayes'", "study.analysis = 'bayes' is invalid: must be one of ('auto', 'paired', 'welch')"),
    ("study.equivalence_margin = -0.1", "study.equivalence_margin = -0.1 is invalid: must be a number >= 0"),
    ("study.equivalence_margin = 'small'", "study.equivalence_margin = 'small' is invalid"),
])
def test_bad_analysis_bindings_name_the_binding(write_study, binding, match):
    with pytest.raises(StudyError, match=match.replace("(", r"\(").replace(")", r"\)")):
        load_study(write_study(STUDY), [binding])
