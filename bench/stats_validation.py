"""Benchmark: the study's statistics on simulated studies whose truth is known (Monte Carlo; not a test).

    python bench/stats_validation.py [--quick] [--studies 20000] [--demo-results results] [--json PATH]

Draws per-seed scores of whole studies from known distributions (numpy, fixed seed: the figures
reproduce) and runs them through the project's own functions: `stats.welch_p`, `stats.paired_p`
and `stats.tost_p` over a stack of studies at once (they work along the last axis), `stats.holm`
per study, and, on a subset, `aggregate.verdicts` itself, whose better/worse verdicts must agree
with the stacked path. A seed's luck is shared between the arms as the engine shares it (common
random numbers): the baseline's score on seed s is b_s, a variant's rho * b_s +
sqrt(1 - rho^2) * e_s + effect (sd = 1 throughout, so effects are in sd units).

A promise is only as good as the test it is made for: the verdicts decide by Welch's test (or the
paired t), so the power, minimum detectable effect, seeds needed and seed plan are computed for
that test, and each is checked here against the rejection rate of that very test.

(a) false positives at alpha = 0.05 with no true effect, rho 0 and 0.6, n = 3, 5, 10 seeds: one
    variant by Welch's and by the paired t-test, and the family-wise rate of Holm over three null
    variants (any of them called better or worse), each with its binomial 95% interval
    (Clopper-Pearson). Each must be <= alpha: its interval, widened by Bonferroni over every rate
    checked against alpha in (a) and (b), must reach down to alpha (the paired t is exact, so its
    rate sits at alpha and a plain 95% interval would miss it in one cell of twenty).
(b) TOST at the boundary: the true difference exactly at +margin, Welch's and paired TOST; the
    rate of declared equivalence is the type-I error and must be <= alpha (same criterion).
(c) power, planned against achieved, at n = 3, 5, 10 seeds and alpha 0.05 and 0.05 / 3 (one
    variant; Holm's strictest step over three), for Welch's design and the paired one at
    rho 0 and 0.6: the effect `stats.min_detectable_effect` says is detected with 80% power, and
    the rejection rate of the deciding test at that effect (with its binomial standard error);
    it must be >= 0.78. Beside Welch's rows: what the pooled t's formula (df = 2n - 2, the power
    formula used before; computed here with scipy.stats.nct) promised at that effect, the effect
    it called detectable with 80% power, and Welch's achieved rate there.
(d) power at the planned N: `seed_plan.make_plan` from a pilot of sd 1 for a few effects (sd
    units), one and three variants (it plans at alpha / variants), Welch's design and the paired
    one (a pilot that measured rho 0.6); the rejection rate of the deciding test at N, at
    alpha / variants, must be >= 0.78. Beside it, the N the pooled t's formula planned and Welch's
    achieved rate at that N.
(e) interval coverage at n = 3, 5, 10: a variant's 95% interval (`stats.mean_ci`), Welch's
    interval of a difference (`stats.difference_ci`) and the paired one (`stats.paired_ci`), on
    normal seeds (checked: within 0.95 +- 4 SE) and, recorded but not checked, on two
    non-normal metrics: an accuracy over 128 prompts (binomial: discrete and bounded, at its
    resolution 1/128) and a log-normal score (skewed). The intervals are computed for the whole
    stack with scipy.stats.t.ppf and checked on a subset to equal the functions' own. Beside the
    variant's interval: the coverage of the percentile bootstrap it replaced (at 3 seeds that is
    [min, max], which covers the mean 75% of the time).
(f) the demo: the correlation of baseline and variant outcomes over shared seeds, measured on the
    demo's aggregates (results/round{1,2,3}/aggregate.json: each variant's pairs centred on their
    own means, then pooled), and the seeds each design needs at it for effects of the demo's
    size, with the power each achieves at its N. When the aggregates are not on disk (they are
    DVC outputs) the measurement recorded in the previous JSON is reused, and the JSON says so.
    A finding about the demo, not a check of the code.

Writes bench/results/stats/stats_validation.json. About a minute on two idle cores (`--quick`:
2000 studies per condition, seconds, for a smoke run; its rates are too noisy to judge by).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from scipy import optimize
from scipy import stats as sps

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from experiments import stats  # noqa: E402
from experiments.aggregate import verdicts  # noqa: E402
from experiments.results import (  # noqa: E402
    BASELINE,
    BETTER,
    PAIRED,
    WELCH,
    WORSE,
    Comparison,
    Decision,
    PairedComparison,
    RunOutcome,
    StudyAggregate,
    VariantResult,
)
from experiments.seed_plan import make_plan  # noqa: E402

ALPHA = 0.05
TARGET = stats.POWER
SHORTFALL = 0.02
"""Achieved power may fall this far below the target (N is an integer and the rate is simulated)."""
SEED_COUNTS = (3, 5, 10)
CORRELATIONS = (0.0, 0.6)
NULL_VARIANTS = 3
MARGIN = 0.5
"""TOST margin in units of the seed-to-seed std (sd = 1 in the simulations)."""
LEVELS = (ALPHA, ALPHA / 3)
"""One variant, and Holm's strictest step over three variants (the seed plan's level)."""
DESIGNS = ((WELCH, 0.0), (PAIRED, 0.0), (PAIRED, 0.6))
PLAN_EFFECTS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.5, 5.0)
"""Effects in sd units for (d): planned N from 3 to about 90; at 2.5 and 3.5 sd (one variant), 2 and
5 sd (three) the pooled t's formula planned one seed fewer than Welch's test needs."""
PLAN_VARIANTS = (1, 3)
PILOT_CORRELATION = 0.6
COVERAGE_Z = 4.0
"""Coverage on normal seeds must lie within 0.95 +- COVERAGE_Z standard errors (21 cells are
checked: 4 SE keeps a false alarm below 1 in 500). Welch's interval is only approximately a 95%
one: with equal spreads and a handful of seeds its estimated degrees of freedom make it
conservative (0.97 at 3 seeds), so it is checked from below only."""
PROMPTS = 128
ACCURACY = 0.3
"""The binomial metric of (e): an accuracy over PROMPTS prompts of true accuracy ACCURACY."""
BOOTSTRAP_STUDIES, BOOTSTRAP_RESAMPLES = 4000, 1000
"""The old percentile bootstrap's coverage is estimated on this many studies with this many
resamples each (its standard error is then about 0.006)."""
EXACT_SUBSET = 200
"""Studies per coverage cell on which the stacked intervals are compared with the functions'."""
AGREEMENT_STUDIES = 60
"""Studies per analysis on which aggregate.verdicts is run beside the stacked p-values."""


def draw(rng: np.random.Generator, studies: int, n: int, rho: float, effects) -> tuple:
    """(baseline (studies, n), [variant (studies, n) per effect]): seed-shared luck of correlation rho."""
    base = rng.standard_normal((studies, n))
    variants = [rho * base + np.sqrt(1 - rho ** 2) * rng.standard_normal((studies, n)) + e for e in effects]
    return base, variants


RATES_AGAINST_ALPHA = len(CORRELATIONS) * len(SEED_COUNTS) * (2 * 2 + 2)
"""Rates checked against alpha: (a) 2 analyses x (one variant, Holm family), (b) 2 analyses."""
CHECK_CONFIDENCE = 1 - 0.05 / RATES_AGAINST_ALPHA
"""Bonferroni: all of those intervals hold together with 95% confidence."""


def rate(hits) -> dict:
    """The share of studies with a hit, its binomial standard error, its Clopper-Pearson 95%
    interval and the wider one the checks against alpha use (CHECK_CONFIDENCE)."""
    hits = np.asarray(hits, bool)
    k, n = int(hits.sum()), int(hits.size)
    test = sps.binomtest(k, n)
    ci, wide = test.proportion_ci(0.95), test.proportion_ci(CHECK_CONFIDENCE)
    return {"rate": k / n, "se": math.sqrt(k / n * (1 - k / n) / n), "ci95": [float(ci.low), float(ci.high)],
            "ci_check": [float(wide.low), float(wide.high)], "hits": k, "studies": n}


def at_most(r: dict, bound: float) -> bool:
    """The rate is consistent with being <= bound (its check interval reaches down to it)."""
    return r["ci_check"][0] <= bound


def p_values(analysis: str, variant, base):
    return stats.paired_p(variant, base) if analysis == PAIRED else stats.welch_p(variant, base)


def rejections(rng, studies: int, n: int, effect: float, rho: float, analysis: str, alpha: float) -> dict:
    """The rejection rate of the deciding test at level alpha for a true difference `effect` (sd 1)."""
    base, (variant,) = draw(rng, studies, n, rho, [effect])
    return rate(p_values(analysis, variant, base) < alpha)


# ---------------------------------------------------------------- the pooled t, for comparison
def pooled_t_power(effect: float, n: int, alpha: float) -> float:
    """The pooled two-sample t's power (df = 2n - 2, noncentral t; sd 1): what the power formula
    promised for Welch's design before it was Welch's own. Shown beside the new figures only."""
    df, ncp = 2 * n - 2, abs(effect) / math.sqrt(2 / n)
    crit = sps.t.ppf(1 - alpha / 2, df)
    lower = sps.nct.cdf(-crit, df, ncp)  # a significant result of the wrong sign; NaN once it underflows
    return float(sps.nct.sf(crit, df, ncp) + (lower if np.isfinite(lower) else 0.0))


def pooled_t_mde(n: int, alpha: float, target: float = TARGET) -> float:
    """The effect the pooled t's formula called detectable with `target` power at n seeds a group."""
    hi = 1.0
    while pooled_t_power(hi, n, alpha) < target:
        hi *= 2
    return float(optimize.brentq(lambda d: pooled_t_power(d, n, alpha) - target, 0.0, hi, xtol=1e-12))


def pooled_t_seeds(effect: float, alpha: float, target: float = TARGET) -> int:
    """The seeds per group the pooled t's formula planned for `effect` (smallest n reaching `target`)."""
    n = 2
    while pooled_t_power(effect, n, alpha) < target:
        n += 1
    return n


# ---------------------------------------------------------------- (a) (b) type-I errors
def false_positives(rng, studies: int) -> list:
    rows = []
    for rho in CORRELATIONS:
        for n in SEED_COUNTS:
            base, variants = draw(rng, studies, n, rho, [0.0] * NULL_VARIANTS)
            row = {"rho": rho, "seeds": n}
            for analysis in (WELCH, PAIRED):
                ps = np.stack([p_values(analysis, v, base) for v in variants], axis=1)  # (studies, variants)
                holm = np.array([stats.holm(row_p) for row_p in ps])
                single = rate(ps[:, 0] < ALPHA)
                family = rate(np.any(holm < ALPHA, axis=1))
                row[analysis] = {"single": single, "holm_family_wise": family,
                                 "ok": at_most(single, ALPHA) and at_most(family, ALPHA)}
            rows.append(row)
    return rows


def _verdict(judged) -> str:
    """The verdict string of aggregate.verdicts' entry (a Verdict, or a (comparison, verdict, ...) tuple)."""
    return judged.verdict if hasattr(judged, "verdict") else judged[1]


def verdict_agreement(rng) -> dict:
    """aggregate.verdicts on whole studies against the stacked p-values with Holm: the same calls."""
    out = {}
    base, variants = draw(rng, AGREEMENT_STUDIES, 5, 0.6, [0.0, 0.0, 1.5])  # two nulls and a real gain
    names = [f"v{i}" for i in range(len(variants))]
    for analysis in (WELCH, PAIRED):
        ps = np.stack([p_values(analysis, v, base) for v in variants], axis=1)
        agree = 0
        for i in range(AGREEMENT_STUDIES):
            values = {BASELINE: list(base[i]), **{name: list(v[i]) for name, v in zip(names, variants)}}
            judged = verdicts(values, higher=True, alpha=ALPHA, analysis=analysis)
            stacked = np.array(stats.holm(ps[i])) < ALPHA
            agree += all((_verdict(judged[name]) in (BETTER, WORSE)) == bool(s) for name, s in zip(names, stacked))
        out[analysis] = {"studies": AGREEMENT_STUDIES, "agree": agree, "ok": agree == AGREEMENT_STUDIES}
    return out


def tost_at_the_margin(rng, studies: int) -> list:
    rows = []
    for rho in CORRELATIONS:
        for n in SEED_COUNTS:
            base, (variant,) = draw(rng, studies, n, rho, [MARGIN])
            row = {"rho": rho, "seeds": n, "margin": MARGIN, "true_difference": MARGIN}
            for analysis in (WELCH, PAIRED):
                r = rate(stats.tost_p(variant, base, MARGIN, paired=analysis == PAIRED) < ALPHA)
                row[analysis] = {**r, "ok": at_most(r, ALPHA)}
            rows.append(row)
    return rows


# ---------------------------------------------------------------- (c) (d) power
def power_at_the_mde(rng, studies: int) -> list:
    """Planned against achieved power at the minimum detectable effect, per design, n and level."""
    rows = []
    for analysis, rho in DESIGNS:
        paired = analysis == PAIRED
        for alpha in LEVELS:
            for n in SEED_COUNTS:
                mde = stats.min_detectable_effect(1.0, n, n, alpha, TARGET, paired=paired, correlation=rho)
                planned = stats.power(mde, 1.0, n, n, alpha, paired=paired, correlation=rho)
                achieved = rejections(rng, studies, n, mde, rho, analysis, alpha)
                row = {"analysis": analysis, "rho": rho, "alpha": alpha, "seeds": n, "mde": mde,
                       "planned_power": planned, "achieved": achieved,
                       "z": (achieved["rate"] - planned) / achieved["se"],
                       "ok": achieved["rate"] >= TARGET - SHORTFALL}
                if not paired:
                    old = pooled_t_mde(n, alpha)
                    row["pooled_t"] = {"power_at_mde": pooled_t_power(mde, n, alpha), "mde": old,
                                       "welch_power_at_its_mde": stats.power(old, 1.0, n, n, alpha),
                                       "achieved_at_its_mde": rejections(rng, studies, n, old, rho, WELCH, alpha)}
                rows.append(row)
    return rows


def pilot(correlation=None) -> StudyAggregate:
    """A finished round of sd exactly 1 (three seeds a variant, each variant's seeds -1, 0, +1 about
    its mean), recording `correlation` between paired seeds when given."""
    comparison = Comparison(paired=PairedComparison(correlation=correlation)) if correlation is not None else None
    variants = {name: VariantResult(runs=tuple(RunOutcome(seed=i, status="completed", value=shift + x)
                                               for i, x in enumerate((-1.0, 0.0, 1.0))),
                                    **({"comparison": comparison} if name != BASELINE and comparison else {}))
                for name, shift in ((BASELINE, 0.0), ("v", 0.5))}
    return StudyAggregate(study="pilot", study_file="", description="", metric="score", metric_from="final",
                          direction="higher", alpha=ALPHA, seeds=(0, 1, 2), guardrails=(), variants=variants,
                          decision=Decision(BASELINE, "pilot"))


def power_at_planned_n(rng, studies: int) -> list:
    """make_plan's N for each effect, variant count and design, and the power the test achieves there."""
    rows = []
    for analysis, rho in ((WELCH, None), (PAIRED, PILOT_CORRELATION)):
        paired = analysis == PAIRED
        for variants in PLAN_VARIANTS:
            alpha = ALPHA / variants
            for effect in PLAN_EFFECTS:
                plan = make_plan(pilot(rho), target_effect=effect, power=TARGET, alpha=ALPHA, variants=variants,
                                 seeds_run=3, analysis=analysis)
                n, r = plan.seeds, rho or 0.0
                assert plan.sigma == 1.0 and (plan.correlation is not None) == paired, plan
                assert n == stats.seeds_needed(effect, 1.0, alpha, TARGET, paired=paired, correlation=r)
                achieved = rejections(rng, studies, n, effect, r, analysis, alpha)
                row = {"analysis": analysis, "rho": r, "effect": effect, "variants": variants, "alpha": alpha,
                       "seeds": n, "planned_power": stats.power(effect, 1.0, n, n, alpha, paired=paired, correlation=r),
                       "planned_power_at_n_minus_1": stats.power(effect, 1.0, n - 1, n - 1, alpha, paired=paired,
                                                                 correlation=r),
                       "achieved": achieved, "ok": achieved["rate"] >= TARGET - SHORTFALL}
                if not paired:
                    old = pooled_t_seeds(effect, alpha)
                    row["pooled_t"] = {"seeds": old, "promised": pooled_t_power(effect, old, alpha),
                                       "achieved_at_its_n": (achieved if old == n else
                                                             rejections(rng, studies, old, effect, 0.0, WELCH, alpha))}
                rows.append(row)
    return rows


# ---------------------------------------------------------------- (e) coverage
def t_mean_interval(x: np.ndarray, confidence: float, resolution: float = 0.0) -> tuple:
    """`stats.mean_ci` for a (studies, n) stack: mean + t(n - 1) quantiles * s / sqrt(n), s at least
    the grid's rounding error (`stats.grid_sd`; NaN without a resolution) where the seeds do not spread."""
    n = x.shape[-1]
    m, s = x.mean(axis=-1), x.std(axis=-1, ddof=1)
    flat = stats.is_flat(s, resolution, np.mean(np.abs(x), axis=-1))
    se = np.where(flat, np.maximum(s, stats.grid_sd(resolution) * math.sqrt(n)), s) / math.sqrt(n)
    q = sps.t.ppf([(1 - confidence) / 2, (1 + confidence) / 2], n - 1)
    return m + q[0] * se, m + q[1] * se


def _flat_scale(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.maximum(np.mean(np.abs(x), axis=-1), np.mean(np.abs(y), axis=-1))


def t_difference_interval(x: np.ndarray, y: np.ndarray, confidence: float, resolution: float = 0.0) -> tuple:
    """`stats.difference_ci` for stacks: Welch's interval, df by Welch-Satterthwaite; where neither
    group spreads, each group's variance at least the grid's rounding error's (`stats.grid_sd`)."""
    scale = _flat_scale(x, y)
    flat = (stats.is_flat(np.std(x, axis=-1), resolution, scale)
            & stats.is_flat(np.std(y, axis=-1), resolution, scale))
    floor = stats.grid_sd(resolution) ** 2  # the mean's variance at least: tied seeds share one rounding error
    vx = np.where(flat, np.maximum(x.var(axis=-1, ddof=1) / x.shape[-1], floor), x.var(axis=-1, ddof=1) / x.shape[-1])
    vy = np.where(flat, np.maximum(y.var(axis=-1, ddof=1) / y.shape[-1], floor), y.var(axis=-1, ddof=1) / y.shape[-1])
    d, se = x.mean(axis=-1) - y.mean(axis=-1), np.sqrt(vx + vy)
    with np.errstate(invalid="ignore", divide="ignore"):
        df = (vx + vy) ** 2 / (vx ** 2 / (x.shape[-1] - 1) + vy ** 2 / (y.shape[-1] - 1))
    half = sps.t.ppf((1 + confidence) / 2, df) * se
    return d - half, d + half


def t_paired_interval(x: np.ndarray, y: np.ndarray, confidence: float, resolution: float = 0.0) -> tuple:
    """`stats.paired_ci` for stacks: the t interval of the mean difference; where the differences do
    not spread, their std at least a difference's rounding error (`stats.grid_sd(resolution, 2)`)."""
    diff = x - y
    n = diff.shape[-1]
    flat = stats.is_flat(np.std(diff, axis=-1), resolution, _flat_scale(x, y))
    sd = diff.std(axis=-1, ddof=1)
    floor = stats.grid_sd(resolution, 2) * math.sqrt(n)  # one shared rounding error a side
    m, se = diff.mean(axis=-1), np.where(flat, np.maximum(sd, floor), sd) / math.sqrt(n)
    half = sps.t.ppf((1 + confidence) / 2, n - 1) * se
    return m - half, m + half


def bootstrap_interval(rng, x: np.ndarray, confidence: float, resamples: int) -> tuple:
    """The percentile bootstrap of the mean (the variant's interval before the t interval), for a
    stack: the (1 - confidence) / 2 quantiles of the resampled means; a point for tied seeds."""
    studies, n = x.shape
    lo, hi = np.empty(studies), np.empty(studies)
    for start in range(0, studies, 250):  # 250 x resamples x n indices at a time
        part = x[start:start + 250]
        idx = rng.integers(0, n, (len(part), resamples, n))
        means = np.take_along_axis(part[:, None, :], idx, axis=-1).mean(axis=-1)
        lo[start:start + 250], hi[start:start + 250] = np.quantile(
            means, [(1 - confidence) / 2, (1 + confidence) / 2], axis=1)
    return lo, hi


def accuracies(rng, shape) -> np.ndarray:
    """Per-seed accuracies over PROMPTS prompts (binomial / PROMPTS): discrete steps of 1/128."""
    return rng.binomial(PROMPTS, ACCURACY, shape) / PROMPTS


def paired_accuracies(rng, studies: int, n: int, shared: float) -> tuple:
    """(variant, baseline) accuracies whose seeds share each prompt's outcome with probability
    `shared` (a common prompt order and sampling stream), else draw it afresh: correlation `shared`."""
    base = rng.random((studies, n, PROMPTS)) < ACCURACY
    fresh = rng.random((studies, n, PROMPTS)) < ACCURACY
    variant = np.where(rng.random((studies, n, PROMPTS)) < shared, base, fresh)
    return variant.mean(axis=-1), base.mean(axis=-1)


def _covers(lo, hi, truth) -> np.ndarray:
    return (lo <= truth) & (truth <= hi)


def _max_gap(stacked: tuple, own) -> float:
    """Largest absolute difference between the stacked interval and the function's, per study."""
    lo, hi = stacked
    got = np.array([own(i) for i in range(len(lo))])
    return float(np.max(np.abs(got - np.stack([lo, hi], axis=1))))


def coverage(rng, studies: int) -> list:
    """Coverage of the variant's interval, Welch's difference interval and the paired interval."""
    rows = []
    conf = stats.CONFIDENCE

    def row(interval, data, n, covered, gap, checked, **extra):
        r = rate(covered)
        low, high = r["rate"] >= conf - COVERAGE_Z * r["se"], r["rate"] <= conf + COVERAGE_Z * r["se"]
        within = low and (high or interval == "difference_ci")  # Welch's may be conservative
        rows.append({"interval": interval, "data": data, "seeds": n, "coverage": r["rate"], "se": r["se"],
                     "studies": r["studies"], "max_abs_gap_to_function": gap, "checked": checked,
                     "ok": (not checked or within) and gap <= 1e-12, **extra})

    k = EXACT_SUBSET
    for n in SEED_COUNTS:
        # The variant's interval: normal seeds, then the accuracy over 128 prompts, then a skewed score.
        x = rng.standard_normal((studies, n))
        ci = t_mean_interval(x, conf)
        boot = bootstrap_interval(rng, x[:BOOTSTRAP_STUDIES], conf, BOOTSTRAP_RESAMPLES)
        row("mean_ci", "normal", n, _covers(*ci, 0.0), _max_gap(tuple(c[:k] for c in ci),
                                                                lambda i: stats.mean_ci(x[i])), True,
            old_percentile_bootstrap=rate(_covers(*boot, 0.0)))
        acc = accuracies(rng, (studies, n))
        ci = t_mean_interval(acc, conf, 1 / PROMPTS)
        row("mean_ci", f"accuracy over {PROMPTS} prompts (binomial, non-normal)", n, _covers(*ci, ACCURACY),
            _max_gap(tuple(c[:k] for c in ci), lambda i: stats.mean_ci(acc[i], resolution=1 / PROMPTS)), False)
        skew = rng.lognormal(0.0, 1.0, (studies, n))
        ci = t_mean_interval(skew, conf)
        row("mean_ci", "log-normal, sigma 1 (skewed, non-normal)", n, _covers(*ci, math.exp(0.5)),
            _max_gap(tuple(c[:k] for c in ci), lambda i: stats.mean_ci(skew[i])), False)
        # Welch's interval of a difference: equal and unequal spreads, then accuracies.
        for sds in ((1.0, 1.0), (1.0, 2.0)):
            a, b = sds[0] * rng.standard_normal((studies, n)), sds[1] * rng.standard_normal((studies, n)) + 0.3
            ci = t_difference_interval(a, b, conf)
            row("difference_ci", f"normal, sds {sds[0]:g} and {sds[1]:g}", n, _covers(*ci, -0.3),
                _max_gap(tuple(c[:k] for c in ci), lambda i: stats.difference_ci(a[i], b[i])), True)
        a, b = accuracies(rng, (studies, n)), accuracies(rng, (studies, n))
        ci = t_difference_interval(a, b, conf, 1 / PROMPTS)
        row("difference_ci", f"accuracy over {PROMPTS} prompts (binomial, non-normal)", n, _covers(*ci, 0.0),
            _max_gap(tuple(c[:k] for c in ci), lambda i: stats.difference_ci(a[i], b[i], resolution=1 / PROMPTS)),
            False)
        # The paired interval: normal pairs at rho 0 and 0.6, then accuracies sharing 60% of prompt outcomes.
        for rho in CORRELATIONS:
            base, (variant,) = draw(rng, studies, n, rho, [0.3])
            ci = t_paired_interval(variant, base, conf)
            row("paired_ci", f"normal, rho {rho:g}", n, _covers(*ci, 0.3),
                _max_gap(tuple(c[:k] for c in ci), lambda i: stats.paired_ci(variant[i], base[i])), True)
        variant, base = paired_accuracies(rng, min(studies, 20_000), n, PILOT_CORRELATION)
        ci = t_paired_interval(variant, base, conf, 1 / PROMPTS)
        row("paired_ci", f"accuracy over {PROMPTS} prompts sharing 60% of outcomes (binomial, non-normal)", n,
            _covers(*ci, 0.0),
            _max_gap(tuple(c[:k] for c in ci), lambda i: stats.paired_ci(variant[i], base[i], resolution=1 / PROMPTS)),
            False)
    return rows


# ---------------------------------------------------------------- (f) the demo
def demo_pairs(results_dir: Path) -> dict:
    """Pearson's correlation of baseline and variant values over shared seeds in the demo's rounds."""
    pooled_base, pooled_variant, per_variant, within, files = [], [], {}, [], {}
    for path in sorted(results_dir.glob("round*/aggregate.json")):
        agg = StudyAggregate.load(path)
        files[str(path.relative_to(results_dir))] = hashlib.sha256(path.read_bytes()).hexdigest()
        base = {r.seed: r.value for r in agg.variants[BASELINE].runs if r.value is not None}
        within.append(agg.variants[BASELINE].values)
        for name, v in agg.variants.items():
            if name == BASELINE:
                continue
            mine = {r.seed: r.value for r in v.runs if r.value is not None}
            within.append(list(mine.values()))
            seeds = sorted(set(base) & set(mine))
            b, x = np.array([base[s] for s in seeds]), np.array([mine[s] for s in seeds])
            per_variant[f"{agg.study}/{name}"] = {"seeds": seeds, "correlation": stats.pair_correlation(x, b)}
            pooled_base += list(b - b.mean())
            pooled_variant += list(x - x.mean())
    if len(pooled_base) < 3:
        raise ValueError(f"{results_dir}: fewer than 3 baseline/variant pairs in round*/aggregate.json")
    fit = sps.pearsonr(pooled_variant, pooled_base)
    ci = fit.confidence_interval(0.95)
    # The seed-to-seed std: pooled over every variant's and baseline's seeds, each about its own mean.
    sd = float(np.sqrt(sum(np.var(v, ddof=1) * (len(v) - 1) for v in within if len(v) > 1)
                       / sum(len(v) - 1 for v in within if len(v) > 1)))
    return {"aggregates_sha256": files, "pairs": len(pooled_base), "correlation": float(fit.statistic),
            "correlation_ci95": [float(ci.low), float(ci.high)],
            "correlation_ci_note": "pearsonr's interval over the pooled centred pairs; centring costs each "
                                   "variant one degree of freedom, so the true interval is wider",
            "per_variant": per_variant, "sd": sd, "source": "measured"}


def demo_measurement(results_dir: Path, previous_json: Path):
    """The demo's measurement: from its aggregates when they are on disk, else the one the previous
    JSON recorded (marked 'recorded'); None when neither exists."""
    if list(results_dir.glob("round*/aggregate.json")):
        return demo_pairs(results_dir)
    try:
        demo = json.loads(previous_json.read_text())["demo"]
    except (OSError, KeyError, TypeError, ValueError):
        return None
    if not demo:
        return None
    shown = results_dir.relative_to(REPO) if results_dir.is_relative_to(REPO) else results_dir
    return {**demo, "source": f"recorded (no {shown}/round*/aggregate.json on disk: the measurement of the "
                              f"aggregates whose sha256 it lists)"}


def demo_designs(rng, studies: int, demo: dict) -> dict:
    rho = stats.design_correlation(demo["correlation"])
    sd = demo["sd"]
    rows = []
    for effect in (0.01, 0.02, 0.03, 0.05):
        welch_n = stats.seeds_needed(effect, sd, ALPHA)
        paired_n = stats.seeds_needed(effect, sd, ALPHA, paired=True, correlation=rho)
        row = {"effect": effect, "welch_seeds": welch_n, "paired_seeds": paired_n,
               "paired_fewer": paired_n < welch_n}
        if max(welch_n, paired_n) <= 200:  # the simulated power at each design's own N
            row["welch_achieved"] = rejections(rng, studies, welch_n, effect / sd, rho, WELCH, ALPHA)["rate"]
            row["paired_achieved"] = rejections(rng, studies, paired_n, effect / sd, rho, PAIRED, ALPHA)["rate"]
        # The smallest correlation at which pairing needs fewer seeds than Welch's design.
        grid = np.round(np.arange(0.0, 0.96, 0.01), 2)
        row["break_even_correlation"] = next(
            (float(r) for r in grid if stats.seeds_needed(effect, sd, ALPHA, paired=True, correlation=r) < welch_n),
            None)
        rows.append(row)
    return {"correlation_used": rho, "sd": sd, "effects": rows,
            "mde_at_3_seeds": {WELCH: stats.min_detectable_effect(sd, 3, 3, ALPHA),
                               PAIRED: stats.min_detectable_effect(sd, 3, 3, ALPHA, paired=True, correlation=rho),
                               "paired_at_rho_0.6": stats.min_detectable_effect(sd, 3, 3, ALPHA, paired=True,
                                                                                correlation=0.6)}}


# ---------------------------------------------------------------- printing
def _fmt_rate(r: dict) -> str:
    return f"{r['rate']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}]"


def _pm(r: dict) -> str:
    return f"{r['rate']:.3f} ± {r['se']:.3f}"


def table(headers, rows, text_columns: int = 1) -> str:
    """The first `text_columns` columns left-aligned, the rest right-aligned, two spaces apart."""
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) if i < text_columns else c.rjust(w)
                       for i, (c, w) in enumerate(zip(line, widths))).rstrip()
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
    return "\n".join("  " + line for line in lines)


def _design(analysis: str, rho: float) -> str:
    return "Welch" if analysis == WELCH else f"paired rho {rho:g}"


def _alpha(alpha: float) -> str:
    return "0.05" if alpha == ALPHA else "0.05/3"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--studies", type=int, default=None,
                   help="simulated studies per condition (default 20000; 2000 with --quick)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2000 studies per condition")
    p.add_argument("--demo-results", default=str(REPO / "results"),
                   help="the demo's results dir, holding round*/aggregate.json")
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "stats" / "stats_validation.json"))
    args = p.parse_args(argv)
    studies = args.studies or (2_000 if args.quick else 20_000)
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    seconds, last = {}, [started]

    def lap(name: str) -> None:
        now = time.perf_counter()
        seconds[name], last[0] = round(now - last[0], 1), now

    fp = false_positives(rng, studies)
    agreement = verdict_agreement(rng)
    lap("false_positives")
    print(f"(a) false positives at alpha {ALPHA} ({studies} null studies each; rate [binomial 95% CI]):")
    for row in fp:
        for analysis in (WELCH, PAIRED):
            r = row[analysis]
            print(f"  rho {row['rho']:.1f} n {row['seeds']:>2} {analysis:>6}: one variant {_fmt_rate(r['single'])}; "
                  f"Holm over {NULL_VARIANTS}, family-wise {_fmt_rate(r['holm_family_wise'])}"
                  f"{'' if r['ok'] else '  ABOVE ALPHA'}")
    for analysis, a in agreement.items():
        print(f"  aggregate.verdicts agrees with the stacked {analysis} p-values + Holm on {a['agree']}/{a['studies']} "
              f"studies")

    tost = tost_at_the_margin(rng, studies)
    lap("tost_at_margin")
    print(f"\n(b) TOST with the true difference at the margin (+{MARGIN} sd): declared equivalent")
    for row in tost:
        print(f"  rho {row['rho']:.1f} n {row['seeds']:>2}: " + "; ".join(
            f"{a} {_fmt_rate(row[a])}{'' if row[a]['ok'] else ' ABOVE ALPHA'}" for a in (WELCH, PAIRED)))

    mde_rows = power_at_the_mde(rng, studies)
    lap("power_at_the_mde")
    print(f"\n(c) power at the minimum detectable effect (effect in sd units; target {TARGET:.0%}; achieved: rejection "
          f"rate of the deciding test ± binomial SE, {studies} studies; pooled t: the formula used before)")
    print(table(["design", "alpha", "n", "MDE", "planned", "achieved", "z", "pooled t promised at MDE",
                 "pooled-t MDE", "Welch achieved there", "check"],
                [[_design(r["analysis"], r["rho"]), _alpha(r["alpha"]), r["seeds"], f"{r['mde']:.3f}",
                  f"{r['planned_power']:.3f}", _pm(r["achieved"]), f"{r['z']:+.1f}",
                  *((f"{r['pooled_t']['power_at_mde']:.3f}", f"{r['pooled_t']['mde']:.3f}",
                     _pm(r['pooled_t']['achieved_at_its_mde'])) if "pooled_t" in r else ("–", "–", "–")),
                  "ok" if r["ok"] else "SHORT"] for r in mde_rows]))

    plan_rows = power_at_planned_n(rng, studies)
    lap("power_at_planned_n")
    print("\n(d) power at the planned N (seed_plan.make_plan from a pilot of sd 1, at alpha 0.05 / variants; achieved "
          "at N by the deciding test; pooled t: the N its formula planned and Welch's achieved power there)")
    print(table(["design", "effect", "variants", "N", "planned at N", "at N-1", "achieved at N", "pooled-t N",
                 "Welch achieved at pooled-t N", "check"],
                [[_design(r["analysis"], r["rho"]), f"{r['effect']:g}", r["variants"], r["seeds"],
                  f"{r['planned_power']:.3f}", f"{r['planned_power_at_n_minus_1']:.3f}", _pm(r["achieved"]),
                  *((r["pooled_t"]["seeds"], _pm(r["pooled_t"]["achieved_at_its_n"])) if "pooled_t" in r
                    else ("–", "–")),
                  "ok" if r["ok"] else "SHORT"] for r in plan_rows]))

    cov = coverage(rng, studies)
    lap("coverage")
    print(f"\n(e) coverage of the 95% intervals ± SE ({studies} studies a cell; normal rows checked within 0.95 ± "
          f"{COVERAGE_Z:g} SE; the stacked intervals equal the functions' on {EXACT_SUBSET} studies a cell to the "
          f"max gap shown)")
    print(table(["interval", "data", "n", "coverage", "max gap", "old percentile bootstrap", "check"],
                [[r["interval"], r["data"], r["seeds"], f"{r['coverage']:.4f} ± {r['se']:.4f}",
                  f"{r['max_abs_gap_to_function']:.1e}",
                  _pm(r["old_percentile_bootstrap"]) if "old_percentile_bootstrap" in r else "",
                  ("ok" if r["ok"] else "OFF") if r["checked"] else "not checked"] for r in cov], text_columns=2))

    demo = demo_measurement(Path(args.demo_results), Path(args.json))
    designs = demo_designs(rng, studies, demo) if demo is not None else None
    lap("demo")
    if demo is None:
        print(f"\n(f) the demo: no {args.demo_results}/round*/aggregate.json and no recorded measurement: skipped")
    else:
        source = demo["source"].split(" ")[0]
        print(f"\n(f) the demo ({source}: {', '.join(demo['aggregates_sha256'])}): correlation of "
              f"baseline and variant over shared seeds {demo['correlation']:+.3f} (95% CI "
              f"[{demo['correlation_ci95'][0]:+.2f}, {demo['correlation_ci95'][1]:+.2f}], {demo['pairs']} pairs, each "
              f"variant centred); per variant: "
              + ", ".join(f"{k} {v['correlation']:+.2f}" if v["correlation"] is not None else f"{k} –"
                          for k, v in demo["per_variant"].items()))
        print(f"  seed-to-seed sd {demo['sd']:.4f}; the paired design uses rho = {designs['correlation_used']:.3f}")
        for row in designs["effects"]:
            sim = (f"; achieved power: Welch {row['welch_achieved']:.3f}, paired {row['paired_achieved']:.3f}"
                   if "welch_achieved" in row else "")
            print(f"  effect {row['effect']}: Welch needs {row['welch_seeds']} seeds, paired {row['paired_seeds']} "
                  f"({'fewer' if row['paired_fewer'] else 'not fewer'}){sim}; pairing saves seeds from rho >= "
                  f"{row['break_even_correlation']}")
        mde = designs["mde_at_3_seeds"]
        print(f"  MDE at 3 seeds: Welch {mde[WELCH]:.4f}, paired at the demo's rho {mde[PAIRED]:.4f}, paired at "
              f"rho 0.6 {mde['paired_at_rho_0.6']:.4f}")

    checks = {"false_positives": all(r[a]["ok"] for r in fp for a in (WELCH, PAIRED)),
              "verdicts_agree": all(a["ok"] for a in agreement.values()),
              "tost_type_one": all(r[a]["ok"] for r in tost for a in (WELCH, PAIRED)),
              "power_at_the_mde": all(r["ok"] for r in mde_rows),
              "power_at_planned_n": all(r["ok"] for r in plan_rows),
              "coverage": all(r["ok"] for r in cov)}
    elapsed = time.perf_counter() - started
    summary = ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items())
    print(f"\nchecks: {summary} ({elapsed:.0f} s)")
    out = {"alpha": ALPHA, "target_power": TARGET, "allowed_shortfall": SHORTFALL, "studies": studies,
           "seed": args.seed, "check_confidence": CHECK_CONFIDENCE, "coverage_z": COVERAGE_Z,
           "pooled_t_note": "pooled_t: the pooled two-sample t's power formula (df = 2n - 2, noncentral t), which "
                            "planned Welch's design before the power was Welch's own; shown for comparison only",
           "false_positives": fp, "verdict_agreement": agreement, "tost_at_margin": tost,
           "power_at_the_mde": mde_rows, "power_at_planned_n": plan_rows, "coverage": cov,
           "demo": demo, "demo_designs": designs, "checks": checks, "seconds": round(elapsed, 1),
           "seconds_per_section": seconds}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
