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
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
from scipy import optimize, special, stats

CONFIDENCE = 0.95
POWER = 0.80
N_RESAMPLES = 9999
BOOTSTRAP_SEED = 0
MAX_SEEDS = 10_000
MAX_DESIGN_CORRELATION = 0.99
"""The largest measured correlation a paired power calculation uses (see `design_correlation`)."""


def _nan_to_none(x) -> Optional[float]:
    return None if x is None or not np.isfinite(x) else float(x)


def _scalar_or_array(p):
    """A float for one test, an array for a stack of them (the (..., n) inputs)."""
    p = np.asarray(p, float)
    return float(p) if p.ndim == 0 else p


def bootstrap_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple:
    """Percentile bootstrap CI of the mean; (v, v) when all values are equal, NaNs below n=2."""
    x = np.asarray(values, float)
    if len(x) < 2:
        return (math.nan, math.nan)
    if np.all(x == x[0]):
        return (float(x[0]), float(x[0]))
    res = stats.bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=N_RESAMPLES,
                          method="percentile", rng=np.random.default_rng(BOOTSTRAP_SEED))
    return (float(res.confidence_interval.low), float(res.confidence_interval.high))


def difference_ci(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> tuple:
    """Welch's t interval of mean(a) - mean(b): the test behind `p_value`, so at the same level
    it excludes zero exactly when p < 1 - confidence. (A percentile bootstrap of the difference
    with two or three seeds a group is far narrower than its nominal level: it can exclude zero
    where Welch's p is 0.24.) A point when neither group varies; NaNs below n = 2."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    if len(x) < 2 or len(y) < 2:
        return (math.nan, math.nan)
    if np.var(x) == 0 and np.var(y) == 0:
        d = float(x.mean() - y.mean())
        return (d, d)
    with warnings.catch_warnings():  # near-identical values: scipy warns, the interval is still right
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = stats.ttest_ind(x, y, equal_var=False).confidence_interval(confidence)
    return (float(ci.low), float(ci.high))


def summarize(values: Sequence[float]) -> Dict:
    """n, mean, std (ddof=1), standard error, median, IQM (25% trimmed mean) and 95% bootstrap CI."""
    x = np.asarray(values, float)
    n = len(x)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "se": None, "median": None, "iqm": None, "ci95": [None, None]}
    std = float(np.std(x, ddof=1)) if n > 1 else math.nan
    lo, hi = bootstrap_ci(x)
    return {"n": n, "mean": float(np.mean(x)), "std": _nan_to_none(std),
            "se": _nan_to_none(std / math.sqrt(n)) if n > 1 else None, "median": float(np.median(x)),
            "iqm": float(stats.trim_mean(x, 0.25)), "ci95": [_nan_to_none(lo), _nan_to_none(hi)]}


def welch_p(a: Sequence[float], b: Sequence[float]):
    """Two-sided Welch's t-test p-value; NaN when it is undefined (n < 2 or no variance).
    Along the last axis of (..., n) arrays: one p-value per leading index."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    shape = np.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    if x.shape[-1] < 2 or y.shape[-1] < 2:
        return _scalar_or_array(np.full(shape, math.nan))
    with warnings.catch_warnings():  # near-identical values: scipy warns, the p-value is still right
        warnings.simplefilter("ignore", RuntimeWarning)
        p = stats.ttest_ind(x, y, axis=-1, equal_var=False).pvalue
    flat = (np.var(x, axis=-1) == 0) & (np.var(y, axis=-1) == 0)
    return _scalar_or_array(np.where(flat, math.nan, p))


def paired_p(a: Sequence[float], b: Sequence[float]):
    """Two-sided paired t-test (scipy.stats.ttest_rel) of a - b, pair i being a[i] and b[i]; NaN
    when undefined: fewer than 2 pairs, or every pair differs by the same amount (the differences
    have no variance; the verdict then reads the sign, as it does for Welch's zero variance).
    Along the last axis of (..., n) arrays: one p-value per leading index."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    d = x - y
    if d.shape[-1] < 2:
        return _scalar_or_array(np.full(d.shape[:-1], math.nan))
    with warnings.catch_warnings():  # near-identical values: scipy warns, the p-value is still right
        warnings.simplefilter("ignore", RuntimeWarning)
        p = stats.ttest_rel(x, y, axis=-1).pvalue
    return _scalar_or_array(np.where(np.var(d, axis=-1) == 0, math.nan, p))


def paired_ci(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> tuple:
    """The paired t interval of mean(a - b) (scipy's `ttest_rel(...).confidence_interval`): it
    excludes zero exactly when `paired_p` < 1 - confidence. A point when the differences do not
    vary; NaNs below 2 pairs."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    d = x - y
    if len(d) < 2:
        return (math.nan, math.nan)
    if np.var(d) == 0:
        return (float(d[0]), float(d[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = stats.ttest_rel(x, y).confidence_interval(confidence)
    return (float(ci.low), float(ci.high))


def wilcoxon_p(a: Sequence[float], b: Sequence[float]) -> float:
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
        return float(stats.wilcoxon(d).pvalue)


def pair_correlation(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    """Pearson's correlation (scipy.stats.pearsonr) of the pairs (a[i], b[i]): how much of a seed's
    luck the two arms share. None below 3 pairs (two points always lie on a line) or when either
    side does not vary."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    if len(x) < 3 or np.var(x) == 0 or np.var(y) == 0:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _nan_to_none(stats.pearsonr(x, y).statistic)


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


def paired_is_more_sensitive(n: int, correlation: Optional[float], alpha: float = 0.05,
                             target: float = POWER) -> bool:
    """Whether n seeds per arm detect a smaller difference paired (the t-test of n per-seed
    differences, at `design_correlation(correlation)`) than as two independent groups (Welch's
    design): pairing trades n - 1 degrees of freedom for the luck the arms share, which pays only
    above a correlation that falls as n grows (about 0.6 at 3 seeds, 0.3 at 5, 0.15 at 10)."""
    if correlation is None or n < 2:
        return False
    paired = min_detectable_effect(1.0, n, n, alpha, target, paired=True, correlation=design_correlation(correlation))
    welch = min_detectable_effect(1.0, n, n, alpha, target)
    return bool(np.isfinite(paired) and np.isfinite(welch) and paired < welch)


def tost_p(a: Sequence[float], b: Sequence[float], margin: float, paired: bool = False):
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
            above = stats.ttest_1samp(d, -margin, axis=-1, alternative="greater").pvalue
            below = stats.ttest_1samp(d, margin, axis=-1, alternative="less").pvalue
            undefined = np.var(d, axis=-1) == 0
        else:
            above = stats.ttest_ind(x + margin, y, axis=-1, equal_var=False, alternative="greater").pvalue
            below = stats.ttest_ind(x - margin, y, axis=-1, equal_var=False, alternative="less").pvalue
            undefined = (np.var(x, axis=-1) == 0) & (np.var(y, axis=-1) == 0)
    return _scalar_or_array(np.where(undefined, math.nan, np.maximum(above, below)))


def holm(pvalues: Sequence[float]) -> List[float]:
    """Holm's step-down adjusted p-values (family-wise error), NaNs left out of the family."""
    p = np.asarray(pvalues, float)
    out = np.full(len(p), math.nan)
    idx = [i for i in np.argsort(p, kind="stable") if np.isfinite(p[i])]
    m, running = len(idx), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out.tolist()


def pooled_std(*groups: Sequence[float]) -> float:
    """The within-group std pooled over groups: sqrt(sum (n_i - 1) s_i^2 / sum (n_i - 1)), each
    group's values around its own mean; NaN when any group has fewer than two values."""
    arrays = [np.asarray(g, float) for g in groups]
    if not arrays or any(len(x) < 2 for x in arrays):
        return math.nan
    return math.sqrt(sum((len(x) - 1) * np.var(x, ddof=1) for x in arrays) / sum(len(x) - 1 for x in arrays))


def hedges_g(a: Sequence[float], b: Sequence[float]) -> float:
    """(mean(a) - mean(b)) / pooled std, with the small-sample correction J = 1 - 3 / (4 df - 1)."""
    s = pooled_std(a, b)
    if not np.isfinite(s) or s == 0:
        return math.nan
    df = len(a) + len(b) - 2
    return float((np.mean(a) - np.mean(b)) / s * (1 - 3 / (4 * df - 1)))


def prob_improvement(a: Sequence[float], b: Sequence[float], higher_is_better: bool = True) -> float:
    """P(a better than b) over all seed pairs, ties counting one half (rliable's definition)."""
    x, y = np.asarray(a, float)[:, None], np.asarray(b, float)[None, :]
    if x.size == 0 or y.size == 0:
        return math.nan
    better = (x > y) if higher_is_better else (x < y)
    return float(np.mean(better + 0.5 * (x == y)))


def power(effect: float, sd: float, n1: int, n2: int, alpha: float = 0.05, paired: bool = False,
          correlation: float = 0.0) -> float:
    """Power of a two-sided t-test to detect a true difference `effect` between groups of std `sd`.

    Two-sample (Welch's design, df = n1 + n2 - 2) by default. With `paired`, the test is the
    one-sample t-test of the n = min(n1, n2) per-seed differences (df = n - 1), whose std is
    sd * sqrt(2 (1 - correlation)) for a correlation between the paired outcomes: common random
    numbers help exactly as far as the two arms' seeds correlate. NaN when undefined (an empty
    group, too few seeds for a degree of freedom, or no finite positive std)."""
    if min(n1, n2) < 1 or not np.isfinite(sd):
        return math.nan
    if paired:
        n = min(n1, n2)
        df = n - 1
        sd_diff = sd * math.sqrt(max(2.0 * (1.0 - correlation), 0.0))
        if df < 1 or not sd_diff > 0:
            return math.nan
        ncp = abs(effect) / (sd_diff / math.sqrt(n))
    else:
        df = n1 + n2 - 2
        if df < 1 or min(n1, n2) < 1 or not sd > 0:
            return math.nan
        ncp = abs(effect) / (sd * math.sqrt(1 / n1 + 1 / n2))
    # scipy.special's t and noncentral t distribution functions: the values of stats.t.ppf and
    # stats.nct.sf/.cdf without their per-call overhead (50x faster; leave-one-seed-out calls
    # this hundreds of times through `min_detectable_effect` and `seeds_needed`).
    # The lower tail (a significant result of the wrong sign) is at most alpha / 2 and vanishes as
    # ncp grows; there the noncentral cdf underflows to NaN for small df, which is 0.
    crit = special.stdtrit(df, 1 - alpha / 2)
    lower = special.nctdtr(df, ncp, -crit)
    return float(1.0 - special.nctdtr(df, ncp, crit) + (lower if np.isfinite(lower) else 0.0))


def min_detectable_effect(sd: float, n1: int, n2: int, alpha: float = 0.05, target: float = POWER,
                          paired: bool = False, correlation: float = 0.0) -> float:
    """Smallest true difference detected with `target` power at these sample sizes and std
    (`paired` and `correlation` as in `power`)."""
    if not np.isfinite(sd) or sd <= 0 or not np.isfinite(power(sd, sd, n1, n2, alpha, paired, correlation)):
        return math.nan
    hi = sd

    def pw(d):
        return power(d, sd, n1, n2, alpha, paired, correlation)

    while pw(hi) < target:
        hi *= 2
        if hi > 1e12 * sd:
            return math.nan
    return float(optimize.brentq(lambda d: pw(d) - target, 0.0, hi, xtol=1e-12 * hi))


def seeds_needed(effect: float, sd: float, alpha: float = 0.05, target: float = POWER, paired: bool = False,
                 correlation: float = 0.0) -> Optional[int]:
    """Seeds per variant needed to detect `effect` with `target` power (`paired` and `correlation`
    as in `power`); None if above MAX_SEEDS or undefined."""
    if not np.isfinite(sd) or not np.isfinite(effect) or effect == 0:
        return None
    if sd == 0 or (paired and correlation >= 1.0):
        return 2

    def enough(n):
        return power(effect, sd, n, n, alpha, paired, correlation) >= target

    lo, hi = 2, 2
    while not enough(hi):
        lo, hi = hi, hi * 2
        if hi > MAX_SEEDS:
            return None
    while lo < hi:  # smallest n with enough power
        mid = (lo + hi) // 2
        if enough(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def compare(variant: Sequence[float], baseline: Sequence[float], higher_is_better: bool = True,
            alpha: float = 0.05, margin: float = 0.0) -> Dict:
    """A variant's per-seed values against the baseline's as independent groups (Welch), before
    multiple-test correction; `equivalence_p`: the Welch TOST p for `margin` (None when 0)."""
    x, y = np.asarray(variant, float), np.asarray(baseline, float)
    diff = float(np.mean(x) - np.mean(y)) if len(x) and len(y) else math.nan
    lo, hi = difference_ci(x, y)
    sd = pooled_std(x, y)
    return {
        "difference": _nan_to_none(diff), "difference_ci95": [_nan_to_none(lo), _nan_to_none(hi)],
        "p_value": _nan_to_none(welch_p(x, y)), "hedges_g": _nan_to_none(hedges_g(x, y)),
        "prob_improvement": _nan_to_none(prob_improvement(x, y, higher_is_better)),
        "pooled_std": _nan_to_none(sd),
        "min_detectable_effect": _nan_to_none(min_detectable_effect(sd, len(x), len(y), alpha)),
        "seeds_needed": seeds_needed(diff, sd, alpha),
        "equivalence_p": _nan_to_none(tost_p(x, y, margin)),
    }


def compare_paired(variant: Mapping[int, float], baseline: Mapping[int, float], alpha: float = 0.05,
                   margin: float = 0.0) -> Dict:
    """A variant against the baseline seed by seed ({seed: value} each): only seeds present on
    both sides count. The mean of the per-seed differences with its paired t interval and p-value,
    Wilcoxon's signed-rank p, the pairs' Pearson correlation, the number of pairs, the std of the
    differences, the paired TOST p for `margin` (None when 0), and the minimum detectable effect
    and seeds needed under the paired design (`power(paired=True)`: the pooled std of the paired
    values with the measured correlation, clipped by `design_correlation`)."""
    seeds = sorted(set(variant) & set(baseline))
    x = np.array([variant[s] for s in seeds], float)
    y = np.array([baseline[s] for s in seeds], float)
    n = len(seeds)
    d = x - y
    diff = float(d.mean()) if n else math.nan
    lo, hi = paired_ci(x, y)
    correlation = pair_correlation(x, y)
    rho, sd = design_correlation(correlation), pooled_std(x, y)
    return {
        "n_pairs": n, "difference": _nan_to_none(diff), "difference_ci95": [_nan_to_none(lo), _nan_to_none(hi)],
        "sd_difference": _nan_to_none(float(np.std(d, ddof=1))) if n > 1 else None,
        "p_value": _nan_to_none(paired_p(x, y)), "wilcoxon_p_value": _nan_to_none(wilcoxon_p(x, y)),
        "correlation": correlation,
        "min_detectable_effect": _nan_to_none(min_detectable_effect(sd, n, n, alpha, paired=True, correlation=rho)),
        "seeds_needed": seeds_needed(diff, sd, alpha, paired=True, correlation=rho),
        "equivalence_p": _nan_to_none(tost_p(x, y, margin, paired=True)),
    }
