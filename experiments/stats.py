"""Statistics of per-seed scores: summaries, a variant against the baseline, Holm's correction.

Pure functions of arrays of per-seed values (one value per seed: the decision metric of one
run). Distributions come from scipy.stats; nothing here reads files. With two or three seeds
most tests have little power, so every comparison also reports the minimum detectable effect
and the seeds needed to detect the observed difference, to tell "no difference" from "could
not have seen one".

Two analyses of the same values. Welch's t-test (`compare`) treats the variant's and the
baseline's seeds as independent groups. The paired analysis (`compare_paired`) uses that seed
s of a variant shares its prompt order and sampling streams with seed s of the baseline (common
random numbers): it tests the per-seed differences (scipy's `ttest_rel`, with Wilcoxon's
signed-rank test beside it), which removes whatever the two arms share. Each also gives a TOST
equivalence p-value (`tost_p`) for a margin: two one-sided tests that the difference lies above
-margin and below +margin, so "no detectable difference" can become "equivalent". The test
functions (`welch_p`, `paired_p`, `tost_p`) work along the last axis of (..., n) arrays as
well, which the Monte Carlo benchmark (bench/stats_validation.py) uses to run thousands of
simulated studies through the same code.

The promises are made for the test that decides. Power, the minimum detectable effect and the
seeds needed under Welch's design are Welch's own: its statistic's degrees of freedom are
estimated from the two sample variances, which costs power with a handful of seeds (at 3 seeds
a group the pooled t's formula overstates it by 10 points), so `power` integrates the exact
rejection probability over the two variances' chi-square distributions (`welch_power`). The
paired design's t-test of the differences has the noncentral t as its exact power. Intervals
are t intervals (a variant's mean, a difference), whose coverage is nominal for normal seeds at
any n; bench/stats_validation.py checks power and coverage by simulation. Where scores are kept
per prompt (the test split, experiments/heldout.py), `two_level_interval` also counts which prompts
were drawn: a bootstrap over prompts and independent units (lineages) at once.

A spread below the metric's resolution is no spread: a metric read off a grid (an accuracy over
128 prompts moves in steps of 1/128) gives tied seeds, and floating point leaves tied values
1e-17 apart. `is_flat` says when a spread is below `resolution / 4` (the smallest spread of
untied values on the grid is about 0.58 of a step) or below 1e-9 of the values' scale; the
tests are then undefined (NaN), never 1e-32. An interval of tied values is not a point either (a
zero-width interval claims certainty): on a grid the ties hide a spread of up to a step, so the
intervals take the rounding error's std, resolution / sqrt(12), as the values' spread (`grid_sd`);
without a resolution, tied values give an undefined (NaN) interval.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize, special, stats

from experiments.results import Comparison, PairedComparison

CONFIDENCE = 0.95
POWER = 0.80
MAX_SEEDS = 10_000
WELCH_NODES = 48
"""Gauss-Legendre nodes per variance in `welch_power`'s integral (48 x 48 points: within 1e-6
of a 200-node integral from 2 seeds a group up)."""
RELATIVE_FLAT = 1e-9
"""A spread below this fraction of the values' scale is floating-point noise (`is_flat`)."""
MAX_DESIGN_CORRELATION = 0.99
"""The largest measured correlation a paired power calculation uses (see `design_correlation`)."""


def _nan_to_none(x) -> Optional[float]:
    return None if x is None or not np.isfinite(x) else float(x)


def _scalar_or_array(p):
    """A float for one test, an array for a stack of them (the (..., n) inputs)."""
    p = np.asarray(p, float)
    return float(p) if p.ndim == 0 else p


def is_flat(sd, resolution: float = 0.0, scale: float = 1.0) -> Union[np.ndarray, np.bool_]:
    """Whether a std is no spread at all: below `resolution / 4` (a metric on a grid of step
    `resolution`: untied values on it spread at least 0.58 of a step) or below RELATIVE_FLAT
    times the values' scale (floating-point noise around tied values). NaN is not flat."""
    sd = np.asarray(sd, float)
    tol = np.maximum(resolution / 4.0, RELATIVE_FLAT * np.maximum(1.0, np.abs(scale)))
    return np.less_equal(sd, tol)


def grid_sd(resolution: float, values: int = 1) -> float:
    """The std of the rounding error of a value read off a grid of step `resolution`: uniform over
    +-half a step, resolution / sqrt(12); of a difference of `values` such values (2 for a paired
    difference), sqrt(values) times that. NaN without a resolution (nothing is known of the error)."""
    return resolution * math.sqrt(values / 12.0) if resolution > 0 else math.nan


def mean_ci(values: ArrayLike, confidence: float = CONFIDENCE, resolution: float = 0.0) -> tuple:
    """The t interval of the mean, mean +- t(n - 1) * s / sqrt(n): nominal coverage for normal
    seeds at any n (a percentile bootstrap of 3 seeds is [min, max], which covers 75%). Values that
    do not spread (`is_flat`) tie on the metric's grid, whose rounding hid their spread: s is then
    taken so that the mean's standard error is at least the rounding error's std,
    `grid_sd(resolution)` (tied seeds share one rounding error: it does not shrink with n), so the
    interval spans what the grid cannot tell apart, never a point; without a resolution it is undefined (NaNs), as
    below n = 2."""
    x = np.asarray(values, float)
    if len(x) < 2:
        return (math.nan, math.nan)
    sd = float(np.std(x, ddof=1))
    if is_flat(sd, resolution, float(np.mean(np.abs(x)))):
        if not resolution > 0:
            return (math.nan, math.nan)
        sd = max(sd, grid_sd(resolution) * math.sqrt(len(x)))  # tied seeds share one rounding error
    lo, hi = stats.t.interval(confidence, len(x) - 1, loc=float(x.mean()), scale=sd / math.sqrt(len(x)))
    return (float(lo), float(hi))


def _flat_pair(x: np.ndarray, y: np.ndarray, resolution: float):
    """Per leading index: neither group spreads (`is_flat`), along the last axis."""
    scale = np.maximum(np.mean(np.abs(x), axis=-1), np.mean(np.abs(y), axis=-1))
    return is_flat(np.std(x, axis=-1), resolution, scale) & is_flat(np.std(y, axis=-1), resolution, scale)


def _flat_differences(d: np.ndarray, x: np.ndarray, y: np.ndarray, resolution: float):
    """Per leading index: the pairs' differences do not spread (`is_flat`), along the last axis."""
    scale = np.maximum(np.mean(np.abs(x), axis=-1), np.mean(np.abs(y), axis=-1))
    return is_flat(np.std(d, axis=-1), resolution, scale)


def difference_ci(a: ArrayLike, b: ArrayLike, confidence: float = CONFIDENCE,
                  resolution: float = 0.0) -> tuple:
    """Welch's t interval of mean(a) - mean(b): the test behind `welch_p`, so at the same level
    it excludes zero exactly when p < 1 - confidence, where p is defined. When neither group
    spreads (`is_flat`: the test is undefined), each group's std is taken as at least the rounding
    error's, `grid_sd(resolution)`, so the interval is never a point; NaNs without a resolution,
    and below n = 2."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    if len(x) < 2 or len(y) < 2:
        return (math.nan, math.nan)
    if _flat_pair(x, y, resolution):
        if not resolution > 0:
            return (math.nan, math.nan)
        v1 = max(float(np.var(x, ddof=1)) / len(x), grid_sd(resolution) ** 2)  # one shared rounding error
        v2 = max(float(np.var(y, ddof=1)) / len(y), grid_sd(resolution) ** 2)
        df = (v1 + v2) ** 2 / (v1 ** 2 / (len(x) - 1) + v2 ** 2 / (len(y) - 1))
        lo, hi = stats.t.interval(confidence, df, loc=float(x.mean() - y.mean()), scale=math.sqrt(v1 + v2))
        return (float(lo), float(hi))
    with warnings.catch_warnings():  # near-identical values: scipy warns, the interval is still right
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = stats.ttest_ind(x, y, equal_var=False).confidence_interval(confidence)
    return (float(ci.low), float(ci.high))


def summarize(values: ArrayLike, resolution: float = 0.0) -> Dict:
    """n, mean, std (ddof=1), standard error, median, IQM (25% trimmed mean) and the mean's 95% t
    interval (`mean_ci`)."""
    x = np.asarray(values, float)
    n = len(x)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "se": None, "median": None, "iqm": None, "ci95": [None, None]}
    std = float(np.std(x, ddof=1)) if n > 1 else math.nan
    lo, hi = mean_ci(x, resolution=resolution)
    return {"n": n, "mean": float(np.mean(x)), "std": _nan_to_none(std),
            "se": _nan_to_none(std / math.sqrt(n)) if n > 1 else None, "median": float(np.median(x)),
            "iqm": float(stats.trim_mean(x, 0.25)), "ci95": [_nan_to_none(lo), _nan_to_none(hi)]}


def welch_p(a: ArrayLike, b: ArrayLike, resolution: float = 0.0):
    """Two-sided Welch's t-test p-value; NaN when it is undefined (n < 2, or neither group
    spreads: `is_flat`). Along the last axis of (..., n) arrays: one p-value per leading index."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    shape = np.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    if x.shape[-1] < 2 or y.shape[-1] < 2:
        return _scalar_or_array(np.full(shape, math.nan))
    with warnings.catch_warnings():  # near-identical values: scipy warns, the p-value is still right
        warnings.simplefilter("ignore", RuntimeWarning)
        p = stats.ttest_ind(x, y, axis=-1, equal_var=False).pvalue  # pyright: ignore[reportAttributeAccessIssue]
    return _scalar_or_array(np.where(_flat_pair(x, y, resolution), math.nan, p))


def paired_p(a: ArrayLike, b: ArrayLike, resolution: float = 0.0):
    """Two-sided paired t-test (scipy.stats.ttest_rel) of a - b, pair i being a[i] and b[i]; NaN
    when undefined: fewer than 2 pairs, or the differences do not spread (`is_flat`: every pair
    differs by the same amount). Along the last axis of (..., n) arrays: one p-value per leading
    index."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    d = x - y
    if d.shape[-1] < 2:
        return _scalar_or_array(np.full(d.shape[:-1], math.nan))
    with warnings.catch_warnings():  # near-identical values: scipy warns, the p-value is still right
        warnings.simplefilter("ignore", RuntimeWarning)
        p = stats.ttest_rel(x, y, axis=-1).pvalue
    return _scalar_or_array(np.where(_flat_differences(d, x, y, resolution), math.nan, p))


def paired_ci(a: ArrayLike, b: ArrayLike, confidence: float = CONFIDENCE,
              resolution: float = 0.0) -> tuple:
    """The paired t interval of mean(a - b) (scipy's `ttest_rel(...).confidence_interval`): it
    excludes zero exactly when `paired_p` < 1 - confidence, where it is defined. When the
    differences do not spread (`is_flat`: the test is undefined), their std is taken as at least
    the rounding error of a difference of two grid values, `grid_sd(resolution, 2)`, so the
    interval is never a point; NaNs without a resolution, and below 2 pairs."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    d = x - y
    if len(d) < 2:
        return (math.nan, math.nan)
    if _flat_differences(d, x, y, resolution):
        if not resolution > 0:
            return (math.nan, math.nan)
        sd = max(float(np.std(d, ddof=1)), grid_sd(resolution, 2) * math.sqrt(len(d)))  # one shared rounding error
        lo, hi = stats.t.interval(confidence, len(d) - 1, loc=float(d.mean()), scale=sd / math.sqrt(len(d)))
        return (float(lo), float(hi))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = stats.ttest_rel(x, y).confidence_interval(confidence)
    return (float(ci.low), float(ci.high))


def wilcoxon_p(a: ArrayLike, b: ArrayLike) -> float:
    """Two-sided Wilcoxon signed-rank p-value of the pairs' differences (scipy.stats.wilcoxon:
    exact for small n without ties, zero differences dropped). NaN when fewer than 2 pairs or
    every difference is zero (no signed rank to test). It assumes no normality, at a price with
    a handful of seeds: its smallest two-sided p is 2 / 2**n (0.25 at n = 3, 0.0625 at n = 5),
    so below six pairs it cannot reach 0.05; it is reported beside the paired t, never decides."""
    d = np.asarray(a, float) - np.asarray(b, float)
    if len(d) < 2 or not np.any(d != 0):
        return math.nan
    with warnings.catch_warnings():  # ties or zeros: scipy warns and uses the normal approximation
        warnings.simplefilter("ignore")
        return float(stats.wilcoxon(d).pvalue)  # pyright: ignore[reportAttributeAccessIssue]


def pair_correlation(a: ArrayLike, b: ArrayLike) -> Optional[float]:
    """Pearson's correlation (scipy.stats.pearsonr) of the pairs (a[i], b[i]): how much of a seed's
    luck the two arms share. None below 3 pairs (two points always lie on a line) or when either
    side does not vary."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    if len(x) < 3 or np.var(x) == 0 or np.var(y) == 0:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _nan_to_none(stats.pearsonr(x, y).statistic)  # pyright: ignore[reportAttributeAccessIssue]


def design_correlation(correlation: Optional[float]) -> float:
    """The correlation a paired power calculation assumes, from a measured one: clipped to
    [0, MAX_DESIGN_CORRELATION], 0 when unmeasured. Common random numbers make the arms of a seed
    share luck, so the true correlation is not negative: a negative estimate from a handful of
    seeds is noise, and taking it would promise the paired design less power than independent
    seeds. The upper clip keeps the std of the differences, sd * sqrt(2 (1 - rho)), above zero:
    at rho = 1 the power formula would claim two seeds detect any difference."""
    if correlation is None or not np.isfinite(correlation):
        return 0.0
    return float(min(max(correlation, 0.0), MAX_DESIGN_CORRELATION))


def per_test_alpha(alpha: float, compared: int) -> float:
    """The level a single comparison's power is promised at: alpha over the variants compared.
    Holm's first step tests at exactly this level (the seed plan plans at it), so a minimum
    detectable effect at it holds whichever variant Holm tests first."""
    return alpha / max(1, compared)


def paired_is_more_sensitive(n: int, correlation: Optional[float], alpha: float = 0.05,
                             target: float = POWER) -> bool:
    """Whether n seeds per arm detect a smaller difference paired (the t-test of n per-seed
    differences, at `design_correlation(correlation)`) than as two independent groups (Welch's
    test): pairing trades degrees of freedom for the luck the arms share, which pays only above a
    correlation that falls as n grows (and rises as alpha falls). `alpha`: the level a comparison is
    tested at, `per_test_alpha` for a study's."""
    if correlation is None or n < 2:
        return False
    paired = min_detectable_effect(1.0, n, n, alpha, target, paired=True, correlation=design_correlation(correlation))
    welch = min_detectable_effect(1.0, n, n, alpha, target)
    return bool(np.isfinite(paired) and np.isfinite(welch) and paired < welch)


def tost_p(a: ArrayLike, b: ArrayLike, margin: float, paired: bool = False, resolution: float = 0.0):
    """Equivalence of mean(a) - mean(b) within +-margin by two one-sided t-tests (TOST), Welch's
    or, with `paired`, the paired t of a[i] - b[i]: H0 difference <= -margin and H0 difference
    >= +margin, each one-sided (scipy's `alternative`); the p-value is the larger of the two, so
    p < alpha rejects both and the difference lies within the margin at level alpha. NaN when
    the margin is not > 0 or the t-tests are undefined (as in `welch_p` / `paired_p`). Along the
    last axis of (..., n) arrays: one p-value per leading index."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    shape = np.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    if margin is None or not np.isfinite(margin) or margin <= 0 or x.shape[-1] < 2 or y.shape[-1] < 2:
        return _scalar_or_array(np.full(shape, math.nan))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if paired:
            d = x - y
            above = stats.ttest_1samp(d, -margin, axis=-1,
                                      alternative="greater").pvalue  # pyright: ignore[reportAttributeAccessIssue]
            below = stats.ttest_1samp(d, margin, axis=-1,
                                      alternative="less").pvalue  # pyright: ignore[reportAttributeAccessIssue]
            undefined = _flat_differences(d, x, y, resolution)
        else:
            above = stats.ttest_ind(x + margin, y, axis=-1, equal_var=False,
                                    alternative="greater").pvalue  # pyright: ignore[reportAttributeAccessIssue]
            below = stats.ttest_ind(x - margin, y, axis=-1, equal_var=False,
                                    alternative="less").pvalue  # pyright: ignore[reportAttributeAccessIssue]
            undefined = _flat_pair(x, y, resolution)
    return _scalar_or_array(np.where(undefined, math.nan, np.maximum(above, below)))


BOOTSTRAP_REPLICATES = 10_000
"""Replicates of `two_level_interval`: its 2.5% and 97.5% quantiles then move by about 0.002 of the
interval's width from one bootstrap seed to another, below the 4 digits a report prints."""
BOOTSTRAP_SEED = 20_240_601
"""The fixed seed of `two_level_interval`'s resampling: the same data give the same bytes."""
_BOOTSTRAP_CHUNK = 1000


def seed_units(seeds: Sequence[int], lineages: Optional[Mapping[str, Sequence[int]]] = None) -> List[List[int]]:
    """The independent units among `seeds`: the seeds of one lineage (seeds that share a start
    checkpoint share its luck: `resume_from.shared_starts`, `StudyAggregate.lineages`) together,
    every other seed alone; in the order of their first seeds."""
    present = list(dict.fromkeys(seeds))
    units, placed = [], set()
    for group in (lineages or {}).values():
        members = [s for s in present if s in set(group)]
        if members:
            units.append(members)
            placed.update(members)
    units += [[s] for s in present if s not in placed]
    return sorted(units, key=lambda unit: present.index(unit[0]))


def unit_means(values: Mapping[int, float], lineages: Optional[Mapping[str, Sequence[int]]] = None) -> Dict[int, float]:
    """{unit: value}: `values` ({seed: value}) as independent units (`seed_units`), a lineage's
    seeds by their mean, keyed by its first seed; unchanged when no seeds share a start."""
    if not lineages:
        return dict(values)
    return {unit[0]: float(np.mean([values[s] for s in unit])) for unit in seed_units(list(values), lineages)}


def two_level_interval(scores: ArrayLike, confidence: float = CONFIDENCE, null: Optional[float] = None,
                       replicates: int = BOOTSTRAP_REPLICATES, seed: int = BOOTSTRAP_SEED) -> Dict:
    """The mean of a (units, prompts) table of scores, each row one independent unit of training
    (a lineage: the mean of its seeds' scores per prompt; for a paired comparison the units' per-prompt
    differences of two models), with an interval that counts both sources of its uncertainty: which
    units training happened to give, and which prompts the split happened to draw.

    The seeds-only t interval over the units' means treats the prompts as fixed: it answers how
    these very prompts would score with other training runs, and undercovers the mean over the
    task's prompts as soon as prompts differ in difficulty (the simulation in
    tests/experiments/test_stats.py: 73% where 95% is promised, with 3 lineages and 40 prompts that
    spread as the demo's do). Here each bootstrap replicate resamples the prompts once (the same draw for every
    unit, so a paired difference keeps its pairing by prompt) and the units, independently, with
    replacement: the two-way "pigeonhole" bootstrap of a crossed design (Owen 2007, Ann. Appl. Stat.),
    which errs on the wide side for the unit x prompt interaction. A bootstrap and not a linear mixed
    model (statsmodels' MixedLM with crossed variance components): per-prompt accuracies are bounded
    and lumpy (many prompts always or never solved), which normal random effects fit poorly, and with
    a handful of units REML puts their variance on the zero boundary, where Wald intervals say
    nothing; the bootstrap needs no fit, cannot fail to converge, and with a fixed `seed` gives the
    same bytes every time. Its one blind spot is few units: resampling L units sees (L - 1) / L of
    their variance and has no t tail, so where the units' spread dominates and L is 2 or 3 the
    percentile interval undercovers (77% at 3 units in the simulation). The interval is therefore
    the percentile interval widened to contain the t interval over the units' means (`mean_ci`),
    which holds there: at least as wide as each, near its level in both regimes (the simulation
    checks both).

    `null` (0 for a difference): `p_value`, the larger of the bootstrap's two-sided p (twice the
    share of replicates on the far side of it; the percentile interval excludes `null` exactly when
    it is below 1 - confidence) and the one-sample t-test's over the units, so p < 1 - confidence
    when the interval excludes `null`. One unit: prompts alone are resampled, and the interval is
    about that model's prompts only. Returns mean, ci95 (the interval), bootstrap_ci95, t_ci95 (None
    below 2 units), p_value (None without `null`), units, prompts, replicates."""
    y = np.asarray(scores, float)
    if y.ndim != 2 or y.shape[0] < 1 or y.shape[1] < 2 or not np.all(np.isfinite(y)):
        raise ValueError(f"two_level_interval: a (units, prompts) table of finite scores with at least 2 prompts "
                         f"is needed (got shape {y.shape})")
    units, prompts = y.shape
    rng = np.random.default_rng(seed)
    means = []
    for start in range(0, replicates, _BOOTSTRAP_CHUNK):
        size = min(_BOOTSTRAP_CHUNK, replicates - start)
        drawn_prompts = rng.multinomial(prompts, np.full(prompts, 1 / prompts), size=size)
        drawn_units = (rng.multinomial(units, np.full(units, 1 / units), size=size) if units > 1
                       else np.ones((size, 1), int))
        means.append(np.sum((drawn_units @ y) * drawn_prompts, axis=1) / (units * prompts))
    boot = np.concatenate(means)
    tail = (1 - confidence) / 2
    lo, hi = (float(q) for q in np.quantile(boot, [tail, 1 - tail]))
    unit_means = y.mean(axis=1)
    t_lo, t_hi = mean_ci(unit_means, confidence) if units > 1 else (math.nan, math.nan)
    mean = float(y.mean())
    ci = (lo, hi) if not np.isfinite(t_lo) else (min(lo, t_lo), max(hi, t_hi))
    p_value = None
    if null is not None:
        p_boot = min(1.0, 2 * min(float(np.mean(boot <= null)), float(np.mean(boot >= null))))
        p_t = math.nan
        if units > 1 and not is_flat(np.std(unit_means, ddof=1), scale=float(np.mean(np.abs(unit_means)))):
            p_t = float(stats.ttest_1samp(unit_means, null).pvalue)  # pyright: ignore[reportAttributeAccessIssue]
        p_value = max(p_boot, p_t) if np.isfinite(p_t) else p_boot
    return {"mean": mean, "ci95": ci, "bootstrap_ci95": (lo, hi),
            "t_ci95": (_nan_to_none(t_lo), _nan_to_none(t_hi)) if units > 1 else None,
            "p_value": p_value, "units": units, "prompts": prompts, "replicates": replicates}


def holm(pvalues: Sequence[float]) -> List[float]:
    """Holm's step-down adjusted p-values (family-wise error) over every compared variant: an
    undefined p-value (NaN) stays in the family as 1, so a variant whose test could not be computed
    still costs the others its share of alpha, and its own adjusted p is NaN. The values of
    statsmodels' `multipletests(method='holm')` (tests/experiments/test_stats.py checks them), whose
    Holm branch runs a full garbage collection per call: 0.25 s in a process holding torch, and the
    Monte Carlo benchmark calls this thousands of times."""
    p = np.asarray(pvalues, float)
    finite = np.isfinite(p)
    order = np.argsort(np.where(finite, p, 1.0), kind="stable")
    steps = np.where(finite, p, 1.0)[order] * np.arange(len(p), 0, -1)
    adjusted = np.empty(len(p))
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate(steps))
    return np.where(finite, adjusted, math.nan).tolist()


def pooled_std(*groups: ArrayLike) -> float:
    """The within-group std pooled over groups: sqrt(sum (n_i - 1) s_i^2 / sum (n_i - 1)), each
    group's values around its own mean; NaN when any group has fewer than two values."""
    arrays = [np.asarray(g, float) for g in groups]
    if not arrays or any(len(x) < 2 for x in arrays):
        return math.nan
    return math.sqrt(sum((len(x) - 1) * np.var(x, ddof=1) for x in arrays) / sum(len(x) - 1 for x in arrays))


def hedges_g(a: Union[Sequence[float], np.ndarray], b: Union[Sequence[float], np.ndarray],
             resolution: float = 0.0) -> float:
    """(mean(a) - mean(b)) / pooled std, with the small-sample correction J = 1 - 3 / (4 df - 1);
    NaN when the groups do not spread (`is_flat`: a ratio over floating-point noise is no effect
    size)."""
    if len(a) < 2 or len(b) < 2:
        return math.nan
    s = pooled_std(a, b)
    scale = max(float(np.mean(np.abs(a))), float(np.mean(np.abs(b))))
    if not np.isfinite(s) or is_flat(s, resolution, scale):
        return math.nan
    df = len(a) + len(b) - 2
    return float((np.mean(a) - np.mean(b)) / s * (1 - 3 / (4 * df - 1)))


def prob_improvement(a: ArrayLike, b: ArrayLike, higher_is_better: bool = True) -> float:
    """P(a better than b) over all seed pairs, ties counting one half (rliable's definition)."""
    x, y = np.asarray(a, float)[:, None], np.asarray(b, float)[None, :]
    if x.size == 0 or y.size == 0:
        return math.nan
    better = (x > y) if higher_is_better else (x < y)
    return float(np.mean(better + 0.5 * (x == y)))


@functools.lru_cache(maxsize=512)
def _welch_threshold(n1: int, n2: int, alpha: float, ratio: float = 1.0) -> tuple:
    """Welch's rejection threshold over the two sample variances, for groups of true std 1 and
    `ratio` (the second's over the first's):
    (c, w), where c[i, j] = t-quantile(df_ij) * se_ij at Gauss-Legendre nodes of the variances'
    chi-square quantiles and w their weights. Power for a true difference d is then
    sum w * (Phi((d - c) / sd_D) + Phi((-d - c) / sd_D)), exactly (the difference of the means is
    independent of the variances), up to the quadrature."""
    x, w = np.polynomial.legendre.leggauss(WELCH_NODES)
    u, w = (x + 1) / 2, w / 2
    v1 = special.chdtri(n1 - 1, 1 - u) / (n1 - 1) / n1  # s1^2 / n1 at the nodes (sigma = 1)
    v2 = ratio ** 2 * special.chdtri(n2 - 1, 1 - u) / (n2 - 1) / n2
    v1, v2 = v1[:, None], v2[None, :]
    df = (v1 + v2) ** 2 / (v1 ** 2 / (n1 - 1) + v2 ** 2 / (n2 - 1))
    c = special.stdtrit(df, 1 - alpha / 2) * np.sqrt(v1 + v2)
    return c, w[:, None] * w[None, :]


def welch_power(effect: float, sd: float, n1: int, n2: int, alpha: float = 0.05,
                sd2: Optional[float] = None) -> float:
    """Power of Welch's two-sided test at level alpha for a true difference `effect` between
    normal groups of std `sd` (and `sd2` for the second group, when the arms spread differently)
    with n1 and n2 seeds: the rejection probability integrated over the sample variances, whose
    ratio sets the test's degrees of freedom (`_welch_threshold`). Below the pooled t's power at
    small n (0.70 against 0.80 at 3 seeds a group), equal to it as n grows. NaN when undefined
    (fewer than 2 seeds a group, or no finite positive std)."""
    ratio = 1.0 if sd2 is None else sd2 / sd if np.isfinite(sd2) and sd2 > 0 and sd > 0 else math.nan
    if min(n1, n2) < 2 or not np.isfinite(sd) or not sd > 0 or not np.isfinite(effect) or not np.isfinite(ratio):
        return math.nan
    c, w = _welch_threshold(int(n1), int(n2), float(alpha), float(ratio))
    sd_d = math.sqrt(1 / n1 + ratio ** 2 / n2)
    d = abs(effect) / sd
    return float(np.sum(w * (special.ndtr((d - c) / sd_d) + special.ndtr((-d - c) / sd_d))))


def paired_power(effect: float, sd_difference: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test (the one-sample t of n per-seed differences of std
    `sd_difference`): the noncentral t, exact for normal differences. NaN when undefined."""
    df = n - 1
    if df < 1 or not np.isfinite(sd_difference) or not sd_difference > 0 or not np.isfinite(effect):
        return math.nan
    ncp = abs(effect) / (sd_difference / math.sqrt(n))
    # scipy.special's t and noncentral t distribution functions: the values of stats.t.ppf and
    # stats.nct.sf/.cdf without their per-call overhead. The lower tail (a significant result of
    # the wrong sign) is at most alpha / 2 and vanishes as ncp grows; there the noncentral cdf
    # underflows to NaN for small df, which is 0.
    crit = special.stdtrit(df, 1 - alpha / 2)
    lower = special.nctdtr(df, ncp, -crit)
    return float(1.0 - special.nctdtr(df, ncp, crit) + (lower if np.isfinite(lower) else 0.0))


def power(effect: float, sd: float, n1: int, n2: int, alpha: float = 0.05, paired: bool = False,
          correlation: float = 0.0, sd_difference: Optional[float] = None, sd2: Optional[float] = None) -> float:
    """Power of the deciding test to detect a true difference `effect` between groups of std `sd`
    (the second group's `sd2` when the arms spread differently).

    Welch's test by default (`welch_power`). With `paired`, the paired t-test of the
    n = min(n1, n2) per-seed differences (`paired_power`), whose std is `sd_difference` when
    measured, else sqrt(sd^2 + sd2^2 - 2 correlation sd sd2) for a correlation between the paired
    outcomes: common random numbers help exactly as far as the two arms' seeds correlate."""
    if paired:
        if sd_difference is None:
            other = sd if sd2 is None else sd2
            var = sd * sd + other * other - 2.0 * correlation * sd * other
            sd_difference = math.sqrt(max(var, 0.0)) if np.isfinite(var) else math.nan
        return paired_power(effect, sd_difference, min(n1, n2), alpha)
    return welch_power(effect, sd, n1, n2, alpha, sd2)


def min_detectable_effect(sd: float, n1: int, n2: int, alpha: float = 0.05, target: float = POWER,
                          paired: bool = False, correlation: float = 0.0,
                          sd_difference: Optional[float] = None) -> float:
    """Smallest true difference the deciding test detects with `target` power at these sample
    sizes and std (`paired`, `correlation` and `sd_difference` as in `power`)."""
    scale = sd_difference if paired and sd_difference is not None else sd
    if scale is None or not np.isfinite(scale) or scale <= 0:
        return math.nan

    def pw(d):
        return power(d, sd, n1, n2, alpha, paired, correlation, sd_difference)

    if not np.isfinite(pw(scale)):
        return math.nan
    hi = scale
    while pw(hi) < target:
        hi *= 2
        if hi > 1e12 * scale:
            return math.nan
    return float(optimize.brentq(lambda d: pw(d) - target, 0.0, hi,  # pyright: ignore[reportArgumentType]
                                 xtol=1e-12 * hi))


def seeds_needed(effect: float, sd: float, alpha: float = 0.05, target: float = POWER, paired: bool = False,
                 correlation: float = 0.0, sd_difference: Optional[float] = None,
                 sd2: Optional[float] = None) -> Optional[int]:
    """Seeds per variant the deciding test needs to detect `effect` with `target` power (`paired`,
    `correlation`, `sd_difference` and `sd2` as in `power`); None if more than MAX_SEEDS or undefined."""
    spread = sd_difference if paired and sd_difference is not None else sd
    if effect is None or spread is None or not np.isfinite(spread) or not np.isfinite(effect) or effect == 0:
        return None
    if spread == 0 or (paired and sd_difference is None and correlation >= 1.0):
        return 2

    def enough(n):
        return power(effect, sd, n, n, alpha, paired, correlation, sd_difference, sd2) >= target

    lo, hi = 2, 2
    while not enough(hi):
        if hi >= MAX_SEEDS:
            return None
        lo, hi = hi + 1, min(hi * 2, MAX_SEEDS)
    while lo < hi:  # smallest n with enough power
        mid = (lo + hi) // 2
        if enough(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def compare(variant: Sequence[float], baseline: Sequence[float], higher_is_better: bool = True,
            alpha: float = 0.05, margin: float = 0.0, resolution: float = 0.0) -> Comparison:
    """A variant's per-seed values against the baseline's as independent groups (Welch), before
    multiple-test correction; `equivalence_p`: the Welch TOST p for `margin` (None when 0).
    `alpha` is the level the minimum detectable effect and the seeds needed are computed at."""
    x, y = np.asarray(variant, float), np.asarray(baseline, float)
    diff = float(np.mean(x) - np.mean(y)) if len(x) and len(y) else math.nan
    lo, hi = difference_ci(x, y, resolution=resolution)
    sd = pooled_std(x, y)
    flat = len(x) > 1 and len(y) > 1 and bool(_flat_pair(x, y, resolution))
    return Comparison(
        difference=_nan_to_none(diff), difference_ci95=(_nan_to_none(lo), _nan_to_none(hi)),
        p_value=_nan_to_none(welch_p(x, y, resolution)), hedges_g=_nan_to_none(hedges_g(x, y, resolution)),
        prob_improvement=_nan_to_none(prob_improvement(x, y, higher_is_better)),
        pooled_std=_nan_to_none(sd),
        min_detectable_effect=None if flat else _nan_to_none(min_detectable_effect(sd, len(x), len(y), alpha)),
        seeds_needed=None if flat else seeds_needed(diff, sd, alpha),
        equivalence_p=_nan_to_none(tost_p(x, y, margin, resolution=resolution)),
        flat=flat, alpha_per_test=alpha)


def compare_paired(variant: Mapping[int, float], baseline: Mapping[int, float], alpha: float = 0.05,
                   margin: float = 0.0, resolution: float = 0.0) -> PairedComparison:
    """A variant against the baseline seed by seed ({seed: value} each): only seeds present on
    both sides count. The mean of the per-seed differences with its paired t interval and p-value,
    Wilcoxon's signed-rank p, the pairs' Pearson correlation, the number of pairs, the std of the
    differences, the paired TOST p for `margin` (None when 0), and the minimum detectable effect
    and seeds needed of the paired t-test at `alpha`, from the measured std of the differences
    (what the test itself divides by)."""
    seeds = sorted(set(variant) & set(baseline))
    x = np.array([variant[s] for s in seeds], float)
    y = np.array([baseline[s] for s in seeds], float)
    n = len(seeds)
    d = x - y
    diff = float(d.mean()) if n else math.nan
    lo, hi = paired_ci(x, y, resolution=resolution)
    sd_d = float(np.std(d, ddof=1)) if n > 1 else math.nan
    flat = n > 1 and bool(_flat_differences(d, x, y, resolution))
    return PairedComparison(
        n_pairs=n, difference=_nan_to_none(diff), difference_ci95=(_nan_to_none(lo), _nan_to_none(hi)),
        sd_difference=_nan_to_none(sd_d),
        p_value=_nan_to_none(paired_p(x, y, resolution)), wilcoxon_p_value=_nan_to_none(wilcoxon_p(x, y)),
        correlation=pair_correlation(x, y),
        min_detectable_effect=None if flat else _nan_to_none(
            min_detectable_effect(math.nan, n, n, alpha, paired=True, sd_difference=sd_d)),
        seeds_needed=None if flat else seeds_needed(diff, math.nan, alpha, paired=True, sd_difference=sd_d),
        equivalence_p=_nan_to_none(tost_p(x, y, margin, paired=True, resolution=resolution)),
        flat=flat)
