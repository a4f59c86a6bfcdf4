"""Statistics of per-seed scores: summaries, a variant against the baseline, Holm's correction.

Pure functions of arrays of per-seed values (one value per seed: the decision metric of one
run). Distributions come from scipy.stats; nothing here reads files. With two or three seeds
most tests have little power, so every comparison also reports the minimum detectable effect
and the seeds needed to detect the observed difference, to tell "no difference" from "could
not have seen one".
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, List, Optional, Sequence

import numpy as np
from scipy import optimize, stats

CONFIDENCE = 0.95
POWER = 0.80
N_RESAMPLES = 9999
BOOTSTRAP_SEED = 0
MAX_SEEDS = 10_000


def _nan_to_none(x) -> Optional[float]:
    return None if x is None or not np.isfinite(x) else float(x)


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


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided Welch's t-test p-value; NaN when it is undefined (n < 2 or no variance)."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    if len(x) < 2 or len(y) < 2 or (np.var(x) == 0 and np.var(y) == 0):
        return math.nan
    with warnings.catch_warnings():  # near-identical values: scipy warns, the p-value is still right
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_ind(x, y, equal_var=False).pvalue)


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


def pooled_std(a: Sequence[float], b: Sequence[float]) -> float:
    x, y = np.asarray(a, float), np.asarray(b, float)
    n1, n2 = len(x), len(y)
    if n1 < 2 or n2 < 2:
        return math.nan
    return math.sqrt(((n1 - 1) * np.var(x, ddof=1) + (n2 - 1) * np.var(y, ddof=1)) / (n1 + n2 - 2))


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
    numbers help exactly as far as the two arms' seeds correlate."""
    if paired:
        n = min(n1, n2)
        df = n - 1
        sd_diff = sd * math.sqrt(max(2.0 * (1.0 - correlation), 0.0))
        if df < 1 or sd_diff <= 0:
            return math.nan
        ncp = abs(effect) / (sd_diff / math.sqrt(n))
    else:
        df = n1 + n2 - 2
        if df < 1 or min(n1, n2) < 1 or sd <= 0:  # an empty arm (a variant whose runs all failed)
            return math.nan
        ncp = abs(effect) / (sd * math.sqrt(1 / n1 + 1 / n2))
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(crit, df, ncp) + stats.nct.cdf(-crit, df, ncp))


def min_detectable_effect(sd: float, n1: int, n2: int, alpha: float = 0.05, target: float = POWER,
                          paired: bool = False, correlation: float = 0.0) -> float:
    """Smallest true difference detected with `target` power at these sample sizes and std
    (`paired` and `correlation` as in `power`)."""
    if not np.isfinite(power(sd, sd, n1, n2, alpha, paired, correlation)) or not np.isfinite(sd) or sd <= 0:
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
            alpha: float = 0.05) -> Dict:
    """A variant's per-seed values against the baseline's (before multiple-test correction)."""
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
    }
