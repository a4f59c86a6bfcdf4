"""The statistics keep their promises for the test that decides, checked by simulation.

A power, a minimum detectable effect, a seed plan or a 95% interval is a claim about what the
verdict's own test does on repeated studies, so each is checked here against that test run on
simulated studies whose truth is known (numpy, fixed seeds; stacks of studies through the
vectorised `welch_p` / `paired_p`). Achieved power may fall at most SHORTFALL below the target:
with DRAWS studies the binomial standard error is 0.003, so a formula off by a few points (as
the pooled t's was for Welch's test at 3 seeds) fails while sampling noise does not.
bench/stats_validation.py reports the same figures over a wider grid.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import numpy as np
import pytest
from scipy import optimize
from scipy import stats as sps

from experiments import stats
from experiments.results import (
    BASELINE,
    Comparison,
    Decision,
    PairedComparison,
    RunOutcome,
    StudyAggregate,
    VariantResult,
)
from experiments.seed_plan import make_plan

TARGET = stats.POWER
SHORTFALL = 0.02
DRAWS = 20_000


def field(record, key):
    """A comparison's field, whether it is a dict or a dataclass."""
    return record[key] if isinstance(record, Mapping) else getattr(record, key)


def welch_rate(rng, n1: int, n2: int, effect: float, alpha: float, sd: float = 1.0, draws: int = DRAWS) -> float:
    """Share of simulated studies (normal groups of std `sd`, true difference `effect`) that
    Welch's test rejects at `alpha`."""
    x = rng.normal(effect, sd, (draws, n1))
    y = rng.normal(0.0, sd, (draws, n2))
    return float(np.mean(stats.welch_p(x, y) < alpha))


def paired_rate(rng, n: int, effect: float, alpha: float, rho: float = 0.0, draws: int = DRAWS) -> float:
    """Share of simulated studies (pairs of unit-std normals of correlation `rho`, true difference
    `effect`) that the paired t-test rejects at `alpha`."""
    base = rng.standard_normal((draws, n))
    variant = rho * base + math.sqrt(1 - rho ** 2) * rng.standard_normal((draws, n)) + effect
    return float(np.mean(stats.paired_p(variant, base) < alpha))


def pooled_t_power(effect: float, n: int, alpha: float) -> float:
    """The pooled two-sample t's power (df = 2n - 2): the formula Welch's design was planned with
    before, kept here to show that the checks below tell it apart."""
    df, ncp = 2 * n - 2, effect / math.sqrt(2 / n)
    crit = sps.t.ppf(1 - alpha / 2, df)
    return float(sps.nct.sf(crit, df, ncp) + np.nan_to_num(sps.nct.cdf(-crit, df, ncp)))


def se(p: float, draws: int = DRAWS) -> float:
    return math.sqrt(p * (1 - p) / draws)


# ---------------------------------------------------------------- A1: power of the deciding test
@pytest.mark.parametrize("n", [3, 5])
def test_a1_welch_detects_its_minimum_detectable_effect_with_the_promised_power(n):
    rng = np.random.default_rng(100 + n)
    mde = stats.min_detectable_effect(1.0, n, n, 0.05)
    assert stats.power(mde, 1.0, n, n, 0.05) == pytest.approx(TARGET, abs=1e-6)
    assert welch_rate(rng, n, n, mde, 0.05) >= TARGET - SHORTFALL


def test_a1_the_pooled_t_promise_fails_the_same_check_at_3_seeds():
    """The check discriminates: the effect the pooled t's formula called detectable with 80% power
    at 3 seeds a group is detected by Welch's test about 70% of the time."""
    rng = np.random.default_rng(7)
    old = optimize.brentq(lambda d: pooled_t_power(d, 3, 0.05) - TARGET, 0.5, 10.0)
    achieved = welch_rate(rng, 3, 3, old, 0.05)
    assert achieved < TARGET - SHORTFALL
    assert stats.power(old, 1.0, 3, 3, 0.05) == pytest.approx(achieved, abs=4 * se(achieved))
    assert old < stats.min_detectable_effect(1.0, 3, 3, 0.05)


@pytest.mark.parametrize("effect, sd, alpha", [(1.0, 1.0, 0.05), (0.03, 0.02, 0.05), (2.0, 1.0, 0.05 / 3)])
def test_a1_welch_reaches_the_target_at_seeds_needed(effect, sd, alpha):
    rng = np.random.default_rng(int(effect * 1000))
    n = stats.seeds_needed(effect, sd, alpha)
    assert stats.power(effect, sd, n, n, alpha) >= TARGET > stats.power(effect, sd, n - 1, n - 1, alpha)
    assert welch_rate(rng, n, n, effect, alpha, sd) >= TARGET - SHORTFALL


@pytest.mark.parametrize("n1, n2, effect", [(2, 2, 6.0), (3, 3, 3.0), (5, 5, 1.8), (3, 5, 2.5)])
def test_a1_welch_power_matches_simulated_welch_tests(n1, n2, effect):
    rng = np.random.default_rng(n1 * 10 + n2)
    draws = 40_000
    planned = stats.welch_power(effect, 1.0, n1, n2, 0.05)
    assert 0.3 < planned < 0.95
    assert welch_rate(rng, n1, n2, effect, 0.05, draws=draws) == pytest.approx(planned, abs=4 * se(planned, draws))


@pytest.mark.parametrize("n, rho", [(3, 0.0), (3, 0.6), (5, 0.0), (5, 0.6)])
def test_a1_paired_detects_its_minimum_detectable_effect_with_the_promised_power(n, rho):
    rng = np.random.default_rng(200 + n + int(10 * rho))
    mde = stats.min_detectable_effect(1.0, n, n, 0.05, paired=True, correlation=rho)
    achieved = paired_rate(rng, n, mde, 0.05, rho)
    assert achieved >= TARGET - SHORTFALL
    assert achieved == pytest.approx(TARGET, abs=4 * se(TARGET))  # the noncentral t is exact


def test_a1_paired_power_from_a_measured_sd_of_the_differences():
    rng = np.random.default_rng(11)
    sd_d, n = 0.5, 5
    mde = stats.min_detectable_effect(math.nan, n, n, 0.05, paired=True, sd_difference=sd_d)
    # sd * sqrt(2 (1 - rho)) = 0.5 at sd 1 and rho 0.875: the same design either way.
    assert mde == pytest.approx(stats.min_detectable_effect(1.0, n, n, 0.05, paired=True, correlation=0.875))
    d = rng.normal(mde, sd_d, (DRAWS, n))
    assert float(np.mean(stats.paired_p(d, np.zeros_like(d)) < 0.05)) >= TARGET - SHORTFALL


@pytest.mark.parametrize("effect, rho, alpha", [(1.0, 0.6, 0.05), (0.8, 0.0, 0.05), (2.0, 0.6, 0.05 / 3)])
def test_a1_paired_reaches_the_target_at_seeds_needed(effect, rho, alpha):
    rng = np.random.default_rng(300 + int(effect * 10))
    n = stats.seeds_needed(effect, 1.0, alpha, paired=True, correlation=rho)
    assert stats.power(effect, 1.0, n, n, alpha, paired=True, correlation=rho) >= TARGET
    assert paired_rate(rng, n, effect, alpha, rho) >= TARGET - SHORTFALL


# ---------------------------------------------------------------- A2: the seed plan's level
def pilot(correlation=None) -> StudyAggregate:
    """A finished round of std exactly 1 (each variant's three seeds at -1, 0, +1 about its mean),
    recording the correlation between paired seeds when given."""
    cmp = ({"comparison": Comparison(paired=PairedComparison(correlation=correlation))}
           if correlation is not None else {})
    variants = {name: VariantResult(runs=tuple(RunOutcome(seed=i, status="completed", value=shift + x)
                                               for i, x in enumerate((-1.0, 0.0, 1.0))),
                                    **(cmp if name != BASELINE else {}))
                for name, shift in ((BASELINE, 0.0), ("v", 0.5))}
    return StudyAggregate(study="pilot", study_file="", description="", metric="score", metric_from="final",
                          direction="higher", alpha=0.05, seeds=(0, 1, 2), guardrails=(), variants=variants,
                          decision=Decision(BASELINE, "pilot"))


def test_a2_the_plan_for_three_variants_reaches_the_target_at_alpha_over_three():
    rng = np.random.default_rng(21)
    effect, variants = 1.0, 3
    plan = make_plan(pilot(), target_effect=effect, power=TARGET, alpha=0.05, variants=variants, seeds_run=3,
                     analysis="welch")
    assert plan.sigma == 1.0 and plan.correlation is None
    assert plan.seeds == stats.seeds_needed(effect, 1.0, 0.05 / variants)
    assert welch_rate(rng, plan.seeds, plan.seeds, effect, 0.05 / variants) >= TARGET - SHORTFALL
    # Planning at the family's alpha would fall short under Holm's strictest step.
    at_alpha = stats.seeds_needed(effect, 1.0, 0.05)
    assert at_alpha < plan.seeds
    assert welch_rate(rng, at_alpha, at_alpha, effect, 0.05 / variants) < TARGET - SHORTFALL
    assert plan.power_at_seeds_run == pytest.approx(stats.power(effect, 1.0, 3, 3, 0.05 / variants))


def test_a2_a_pilot_that_measured_a_correlation_plans_the_paired_design_at_alpha_over_variants():
    rng = np.random.default_rng(22)
    effect, variants, rho = 1.0, 3, 0.6
    plan = make_plan(pilot(rho), target_effect=effect, power=TARGET, alpha=0.05, variants=variants, seeds_run=3)
    assert plan.correlation == rho
    assert plan.seeds == stats.seeds_needed(effect, 1.0, 0.05 / variants, paired=True, correlation=rho)
    assert plan.seeds < stats.seeds_needed(effect, 1.0, 0.05 / variants)  # why 'auto' chose pairing
    assert paired_rate(rng, plan.seeds, effect, 0.05 / variants, rho) >= TARGET - SHORTFALL


# ---------------------------------------------------------------- A3: up to MAX_SEEDS
def test_a3_seeds_needed_counts_up_to_max_seeds():
    assert stats.MAX_SEEDS == 10_000
    n = stats.seeds_needed(0.05, 1.0, 0.05 / 3)
    assert n == 8377
    assert stats.power(0.05, 1.0, n, n, 0.05 / 3) >= TARGET > stats.power(0.05, 1.0, n - 1, n - 1, 0.05 / 3)
    near_cap = stats.seeds_needed(0.0407, 1.0, 0.05)  # between the last power of two and the cap
    assert near_cap is not None and 8192 < near_cap <= stats.MAX_SEEDS
    assert stats.seeds_needed(0.04, 1.0, 0.05 / 3) is None  # about 13 000 needed
    assert stats.seeds_needed(0.01, 1.0) is None


# ---------------------------------------------------------------- A4: the variant's 95% interval
def t_intervals(x: np.ndarray) -> tuple:
    """`stats.mean_ci` for a (draws, n) stack of spread-out values: mean + t(n - 1) * s / sqrt(n)."""
    n = x.shape[-1]
    se_ = x.std(axis=-1, ddof=1) / math.sqrt(n)
    q = sps.t.ppf([0.025, 0.975], n - 1)
    return x.mean(axis=-1) + q[0] * se_, x.mean(axis=-1) + q[1] * se_


@pytest.mark.parametrize("n", [3, 5, 10])
def test_a4_the_variants_interval_covers_the_mean_95_percent_of_the_time(n):
    rng = np.random.default_rng(400 + n)
    draws = 40_000
    x = rng.normal(0.6, 0.05, (draws, n))
    lo, hi = t_intervals(x)
    for i in range(100):  # the stacked formula is the function's
        assert stats.mean_ci(x[i]) == pytest.approx((lo[i], hi[i]), rel=1e-12, abs=1e-15)
    covered = float(np.mean((lo <= 0.6) & (0.6 <= hi)))
    assert covered == pytest.approx(0.95, abs=3 * se(0.95, draws))
    if n == 3:  # the check tells the old interval apart: [min, max] covers 1 - 2 / 2**3 of the time
        assert float(np.mean((x.min(axis=1) <= 0.6) & (0.6 <= x.max(axis=1)))) == pytest.approx(0.75, abs=0.01)


def test_a4_tied_seeds_give_the_grids_width_or_no_interval_and_three_seeds_more_than_min_to_max():
    step = 1 / 128
    # Seeds tied on the grid share one rounding error: its std, step / sqrt(12), is the mean's
    # standard error at least, in the t interval of 3 seeds (it does not shrink with the seeds).
    half = sps.t.ppf(0.975, 2) * step / math.sqrt(12)
    assert stats.mean_ci([0.5, 0.5, 0.5], resolution=step) == pytest.approx((0.5 - half, 0.5 + half))
    m = 0.5 + 1 / 1536  # a spread below a quarter of a step is a tie too
    assert stats.mean_ci([0.5, 0.5, 0.5 + 1 / 512], resolution=step) == pytest.approx((m - half, m + half))
    assert stats.summarize([0.5, 0.5, 0.5], step)["ci95"] == pytest.approx([0.5 - half, 0.5 + half])
    # Without a resolution nothing is known of the spread the ties hide: no interval, never a point.
    assert all(math.isnan(v) for v in stats.mean_ci([0.5, 0.5, 0.5]))
    assert all(math.isnan(v) for v in stats.mean_ci([0.1 + 0.2, 0.3, 0.3]))  # 1e-17 apart
    assert stats.summarize([0.5, 0.5, 0.5])["ci95"] == [None, None]
    # The percentile bootstrap of 3 seeds was [min, max] (it covers the mean 75% of the time); the
    # t interval's half-width, 2.48 s, exceeds the farthest a value can lie from the mean, 1.15 s.
    rng = np.random.default_rng(44)
    for x in rng.normal(0.6, 0.05, (500, 3)):
        lo, hi = stats.mean_ci(x)
        assert lo < x.min() and x.max() < hi
    assert all(math.isnan(v) for v in stats.mean_ci([0.5]))


def test_a4_seeds_tied_on_a_grid_cover_the_mean_where_a_point_did_not():
    """An accuracy over 128 prompts whose seeds vary by a tenth of a step: most draws of 3 seeds
    tie. The point interval of tied seeds held the true mean only when it lay on the grid (never);
    the interval with the grid's width holds it at least 95% of the time."""
    rng = np.random.default_rng(45)
    step, draws = 1 / 128, 4000
    truth = 0.3 + rng.uniform(-0.5, 0.5, draws) * step  # anywhere within a grid cell
    x = np.round((truth[:, None] + rng.normal(0.0, 0.1 * step, (draws, 3))) / step) * step
    tied = np.ptp(x, axis=1) == 0
    assert tied.mean() > 0.5
    covered = [lo <= t <= hi for t, (lo, hi) in
               ((t, stats.mean_ci(xs, resolution=step)) for t, xs in zip(truth[tied], x[tied]))]
    point = np.mean(x[tied].mean(axis=1) == truth[tied])
    assert point < 0.01 and np.mean(covered) >= 0.95


def test_a4_tied_differences_give_the_grids_width_or_no_interval():
    step = 1 / 128
    base, up = [0.25] * 3, [0.25 + step] * 3
    # Welch's: both groups tied, each mean with one rounding error's std; equal: 4 degrees of freedom.
    half = sps.t.ppf(0.975, 4) * step / math.sqrt(12) * math.sqrt(2)
    assert stats.difference_ci(up, base, resolution=step) == pytest.approx((step - half, step + half))
    assert math.isnan(stats.welch_p(up, base, resolution=step))  # the test itself stays undefined
    # Paired: every pair differs by one step; a difference carries two values' rounding errors,
    # which the tied pairs share.
    half = sps.t.ppf(0.975, 2) * step / math.sqrt(6)
    assert stats.paired_ci(up, base, resolution=step) == pytest.approx((step - half, step + half))
    assert math.isnan(stats.paired_p(up, base, resolution=step))
    # Without a resolution: undefined, never a point.
    for ci in (stats.difference_ci(up, base), stats.paired_ci(up, base), stats.paired_ci([0.6, 0.7], [0.5, 0.6])):
        assert all(math.isnan(v) for v in ci)
    comparison = stats.compare(up, base, resolution=step)
    assert comparison.flat and comparison.difference_ci95[0] < comparison.difference_ci95[1]


# ---------------------------------------------------------------- A5: the paired MDE's spread
BASE = [0.40, 0.45, 0.50, 0.55, 0.60]


def test_a5_pairs_that_differ_by_the_same_amount_are_no_test_and_need_no_seed_count():
    """+0.01 on every seed, up to floating point (the differences spread by ~1e-17): the paired
    test is undefined, not p = 1e-29, and there is no seed count to report (the pooled std with
    the clipped correlation claimed a few dozen seeds)."""
    base = [0.1, 0.2, 0.7]
    variant = [b + 0.01 for b in base]
    d = np.subtract(variant, base)
    assert 0 < np.std(d) < 1e-15  # the noise is there, and scipy's t divides by it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert sps.ttest_rel(variant, base).pvalue < 1e-10
    c = stats.compare_paired(dict(enumerate(variant)), dict(enumerate(base)))
    assert field(c, "flat") is True
    assert field(c, "p_value") is None
    assert field(c, "seeds_needed") is None and field(c, "min_detectable_effect") is None
    assert field(c, "difference") == pytest.approx(0.01)


def test_a5_the_paired_mde_follows_the_spread_of_the_differences():
    rng = np.random.default_rng(55)
    tight = [b + 0.02 + e for b, e in zip(BASE, rng.normal(0, 0.005, 5))]
    loose = tight[::-1]  # the same values, paired against the baseline the other way round
    assert stats.pooled_std(tight, BASE) == pytest.approx(stats.pooled_std(loose, BASE))
    small = stats.compare_paired(dict(enumerate(tight)), dict(enumerate(BASE)))
    large = stats.compare_paired(dict(enumerate(loose)), dict(enumerate(BASE)))
    assert field(large, "sd_difference") > 10 * field(small, "sd_difference")
    assert field(large, "min_detectable_effect") > 10 * field(small, "min_detectable_effect")
    for c in (small, large):  # the paired t's own power at the measured std of the differences
        sd_d, mde = field(c, "sd_difference"), field(c, "min_detectable_effect")
        assert sd_d == pytest.approx(np.std(np.subtract(tight if c is small else loose, BASE), ddof=1))
        assert mde == pytest.approx(stats.min_detectable_effect(math.nan, 5, 5, paired=True, sd_difference=sd_d))
        assert stats.paired_power(mde, sd_d, 5) == pytest.approx(TARGET, abs=1e-6)


def test_a5_the_paired_seeds_needed_follow_the_spread_of_the_differences():
    rng = np.random.default_rng(56)
    tight = [b + 0.02 + e for b, e in zip(BASE, rng.normal(0, 0.02, 5))]
    c = stats.compare_paired(dict(enumerate(tight)), dict(enumerate(BASE)))
    sd_d, diff = field(c, "sd_difference"), field(c, "difference")
    expected = stats.seeds_needed(diff, 1.0, paired=True, sd_difference=sd_d)  # sd unused given sd_difference
    assert expected is not None and expected > 2
    assert field(c, "seeds_needed") == expected
    assert stats.paired_power(diff, sd_d, expected) >= TARGET > stats.paired_power(diff, sd_d, expected - 1)
