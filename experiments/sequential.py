"""Seed waves: a group-sequential design for a tuning round.

A study with `study.sequential` runs its seeds in planned waves: every variant and the baseline
get the wave's seeds (seed s of a variant pairs with seed s of the baseline), then each variant
still running is judged at that look against boundaries fixed before the round started. A
variant that crosses the efficacy boundary is decided (better or worse) and gets no more seeds;
one that falls below the futility boundary stops as "no detectable difference" and saves its
remaining seeds; the rest continue to the next wave. The verdict is the design's own decision:
nothing is re-tested at the last look.

The boundaries (Jennison & Turnbull, *Group Sequential Methods*, ch. 7 and 19):
- Efficacy: two-sided, symmetric, from an alpha-spending function of the information fraction
  t = n_k / N (seeds at look k over the last wave's): Lan-DeMets O'Brien-Fleming,
  alpha(t) = 2 - 2 Phi(z_{1 - a/2} / sqrt(t)) per side at a = alpha / 2, which spends almost
  nothing early, or Pocock's, alpha(t) = a log(1 + (e - 1) t). Each look's boundary c_k solves
  P0(no crossing before k, Z_k >= c_k) = alpha(t_k) - alpha(t_{k-1}).
- Futility: non-binding. Its boundary b_k (on the improving side) spends the type-II error beta
  by the same families at the target effect, and the final look's equals the efficacy boundary,
  which fixes the drift the design needs. The efficacy boundaries are computed as if futility
  never stopped a variant, so stopping for futility, or not, can only lower the false-positive
  rate.
- Multiplicity: each of the m variants is tested at alpha / m (Bonferroni); the family-wise error
  is at most alpha whatever the variants' correlation through the shared baseline.

The probabilities are integrals over the score process S_k = Z_k sqrt(t_k), a Brownian motion
with drift theta (theta = effect / se at the last wave): the density of S on each look's
continuation region is carried to the next look by a normal convolution on a Simpson grid
(`_Walk`). scipy does the distribution functions and the root finding.

The seeds are few, so each look's statistic is a t (the paired t of the per-seed differences,
or Welch's), not a z. A look converts it to the z of the same one-sided p-value (the
"significance level approach", J&T 3.8), z = Phi^-1(F_t(t; df)), and compares that with the
z boundaries: each look's marginal level is then exact, and bench/stats_validation.py measures
the family-wise error of the whole procedure by simulation.

The interval of a stopped variant is the stagewise-ordering interval (J&T 8.4): outcomes are
ordered by the look they stopped at (an earlier crossing of the upper boundary is more extreme
than any later outcome, an earlier stop below less extreme), then by z; the interval holds the
drifts at which the observed outcome is not in either 2.5% tail of that ordering. It has the
nominal coverage under the design, where a t interval at the stopping look does not (a look that
stops early for efficacy overestimates). Its p-value at drift 0 is the design's p-value.

The planner (`plan_waves`) finds the fewest seeds per variant whose design, simulated with t
statistics at the planned waves, has the promised power at the target effect from each arm's own
spread (`simulate`, a fixed random seed: the same inputs give the same plan), and reports the
runs it expects under the null and at the target beside the fixed design's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize, special

from experiments.errors import StudyError

SPENDING = ("obrien_fleming", "pocock")
"""The spending families: Lan-DeMets O'Brien-Fleming (little spent early) and Lan-DeMets Pocock."""
FUTILITY = (*SPENDING, "none")
SIMPSON_POINTS = 401
"""Grid points per look in `_Walk` (odd, for Simpson's rule): boundaries within 1e-5 of a
1,601-point grid."""
PLAN_DRAWS = 20_000
"""Simulated studies per candidate design in `plan_waves` (power's Monte Carlo SE 0.003)."""
PLAN_SEED = 20_241_204
"""The planner's random seed: the same inputs give the same plan."""
BETTER, WORSE, FUTILE, CONTINUE = "better", "worse", "futile", "continue"


def spend(family: str, level: float, t) -> np.ndarray:
    """Cumulative error spent by information fraction t (0..1) out of `level` (one side)."""
    t = np.clip(np.asarray(t, float), 0.0, 1.0)
    if family == "obrien_fleming":
        with np.errstate(divide="ignore"):
            out = 2.0 - 2.0 * special.ndtr(special.ndtri(1.0 - level / 2.0) / np.sqrt(t))
        return np.where(t > 0, out, 0.0)
    if family == "pocock":
        return level * np.log1p((math.e - 1.0) * t)
    raise ValueError(f"unknown spending family {family!r}: one of {SPENDING}")


def _simpson(a: float, b: float) -> Tuple[np.ndarray, np.ndarray]:
    x = np.linspace(a, b, SIMPSON_POINTS)
    w = np.full(SIMPSON_POINTS, 2.0)
    w[1::2] = 4.0
    w[0] = w[-1] = 1.0
    return x, w * (b - a) / (3.0 * (SIMPSON_POINTS - 1))


def _root(f, a: float, b: float, xtol: float = 1e-10) -> float:
    """scipy's brentq root of f in [a, b], as a float."""
    return float(optimize.brentq(f, a, b, xtol=xtol))  # pyright: ignore[reportArgumentType]


class _Walk:
    """The score process S_k = Z_k sqrt(t_k) with drift `drift` (S_k ~ N(drift t_k, t_k)), its
    density carried look to look on the region where the design continued (`advance`)."""

    def __init__(self, drift: float):
        self.drift, self.t = float(drift), 0.0
        self.x: Optional[np.ndarray] = None
        self.mass: Optional[np.ndarray] = None  # Simpson weight x density at self.x

    def _standardised(self, t: float, s):
        d = t - self.t
        if self.x is None:
            return (np.asarray(s, float) - self.drift * t) / math.sqrt(t), None
        return (np.asarray(s, float)[..., None] - self.x - self.drift * d) / math.sqrt(d), d

    def uppers(self, t: float, z) -> np.ndarray:
        """P(continued to here, Z at fraction t >= z) for each z of an array."""
        u, _ = self._standardised(t, np.asarray(z, float) * math.sqrt(t))
        tail = special.ndtr(-u)
        return np.asarray(tail if self.mass is None else tail @ self.mass, float)

    def upper(self, t: float, z: float) -> float:
        """P(continued to here, Z at fraction t >= z)."""
        return float(self.uppers(t, z))

    def lower(self, t: float, z: float) -> float:
        """P(continued to here, Z at fraction t <= z)."""
        u, _ = self._standardised(t, z * math.sqrt(t))
        tail = special.ndtr(u)
        return float(tail if self.mass is None else tail @ self.mass)

    def advance(self, t: float, lo: float, hi: float) -> None:
        """Moves to fraction t, keeping the density where lo < Z < hi (the design continued)."""
        centre, spread = self.drift * t, 12.0 * math.sqrt(t)
        a = max(lo * math.sqrt(t), centre - spread)
        b = min(hi * math.sqrt(t), centre + spread)
        if b <= a:  # nothing continues
            self.x, self.mass, self.t = np.zeros(1), np.zeros(1), t
            return
        x, w = _simpson(a, b)
        u, d = self._standardised(t, x)
        if d is None:
            f = np.exp(-0.5 * u * u) / math.sqrt(2 * math.pi * t)
        else:
            f = (np.exp(-0.5 * u * u) @ self.mass) / math.sqrt(2 * math.pi * d)
        self.x, self.mass, self.t = x, w * f, t


def efficacy_bounds(fractions: ArrayLike, alpha: float, family: str = "obrien_fleming") -> np.ndarray:
    """Two-sided symmetric z boundaries c_k at information fractions t_k (increasing, last 1) for
    a test of two-sided level alpha: P0(|Z| crosses first at k) = 2 (alpha(t_k) - alpha(t_{k-1}))
    with `family`'s spending at alpha / 2 a side."""
    t = np.asarray(fractions, float)
    spent = spend(family, alpha / 2.0, t)
    walk, out, before = _Walk(0.0), [], 0.0
    for tk, cum in zip(t, spent):
        target = cum - before
        before = cum
        if target <= 1e-15:  # nothing spent here (an early look under O'Brien-Fleming): no stop
            c = math.inf
        else:
            c = _root(lambda z: walk.upper(tk, z) - target, 0.0, 40.0, xtol=1e-10)
        out.append(c)
        walk.advance(tk, -c, c)
    return np.asarray(out)


def _futility(fractions: np.ndarray, efficacy: np.ndarray, drift: float, beta: float,
              family: str) -> Tuple[np.ndarray, float]:
    """Futility boundaries b_k for looks before the last (the last: the efficacy boundary) spending
    beta at `drift` by `family`, and the resulting power P(drift)(cross c_k above first)."""
    spent = spend(family, beta, fractions)
    walk, out, power, before = _Walk(drift), [], 0.0, 0.0
    for k, (tk, ck, cum) in enumerate(zip(fractions, efficacy, spent)):
        power += walk.upper(tk, ck)
        target, before = cum - before, cum
        if k == len(fractions) - 1:
            out.append(ck)
            break
        if target <= 0 or walk.lower(tk, -40.0) >= target:
            b = -math.inf
        elif walk.lower(tk, ck) <= target:
            b = ck
        else:
            b = _root(lambda z: walk.lower(tk, z) - target, -40.0, ck, xtol=1e-10)
        out.append(b)
        walk.advance(tk, max(b, -ck), ck)
    return np.asarray(out), power


def drift_for_power(fractions: ArrayLike, efficacy: ArrayLike, power: float,
                    futility: str = "none") -> float:
    """The drift (effect / se at the last look) at which the design has `power` to cross the upper
    efficacy boundary, futility boundaries (non-binding, followed) spending 1 - power."""
    t, c = np.asarray(fractions, float), np.asarray(efficacy, float)

    def achieved(drift):
        if futility == "none":
            return crossing(t, -c, c, drift)[0].sum()
        return _futility(t, c, drift, 1.0 - power, futility)[1]

    return _root(lambda d: achieved(d) - power, 0.0, 40.0)


def futility_bounds(fractions: ArrayLike, efficacy: ArrayLike, drift: float, beta: float,
                    family: str = "obrien_fleming") -> np.ndarray:
    """Futility z boundaries b_k (stop when Z_k < b_k; the last equals the efficacy boundary) that
    spend beta at `drift` by `family`; -inf for none ('none', or a look that spends nothing)."""
    t, c = np.asarray(fractions, float), np.asarray(efficacy, float)
    if family == "none":
        return np.concatenate([np.full(len(t) - 1, -math.inf), c[-1:]])
    return _futility(t, c, drift, beta, family)[0]


def crossing(fractions: ArrayLike, lower: ArrayLike, upper: ArrayLike,
             drift: float) -> Tuple[np.ndarray, np.ndarray]:
    """(P(stop above at look k), P(stop below at look k)) per look at `drift`, continuing while
    lower_k < Z_k < upper_k; the last look stops everything (above: Z >= upper_K)."""
    walk = _Walk(drift)
    up, down = [], []
    t, lows, highs = (np.asarray(a, float) for a in (fractions, lower, upper))
    for k, (tk, lo, hi) in enumerate(zip(t, lows, highs)):
        up.append(walk.upper(tk, hi))
        last = k == len(t) - 1
        down.append(walk.lower(tk, hi if last else lo) if last or lo > -math.inf else 0.0)
        if not last:
            walk.advance(tk, lo, hi)
    return np.asarray(up), np.asarray(down)


@dataclasses.dataclass(frozen=True)
class Design:
    """One variant's boundaries: at look k (n_k seeds a side, information fraction n_k / N) it is
    decided better when Z_k >= efficacy[k] (Z signed so that positive improves), worse when
    Z_k <= -efficacy[k], futile when Z_k < futility[k], and continues otherwise; the last look
    decides everything (futility[-1] = efficacy[-1])."""

    waves: Tuple[int, ...]
    alpha: float
    """Two-sided level of this variant's test (the study's alpha over its variants)."""
    spending: str
    futility_spending: str
    power: float
    efficacy: Tuple[float, ...]
    futility: Tuple[float, ...]
    drift: float
    """The drift the futility boundaries were spent at (effect / se at the last wave for the
    target effect); 0 when futility is off."""

    @property
    def fractions(self) -> np.ndarray:
        return np.asarray(self.waves, float) / self.waves[-1]

    @property
    def continuation(self) -> Tuple[np.ndarray, np.ndarray]:
        """(lower, upper) z of each look's continuation region, futility followed."""
        c = np.asarray(self.efficacy)
        return np.maximum(np.asarray(self.futility), -c), c

    def nominal_p(self) -> np.ndarray:
        """The two-sided p-value each look's efficacy boundary corresponds to."""
        return 2.0 * special.ndtr(-np.asarray(self.efficacy))

    def decide(self, z: float, look: int) -> str:
        """'better', 'worse', 'futile' or 'continue' at look (0-based) for a look's z."""
        c, b = self.efficacy[look], self.futility[look]
        if not np.isfinite(z):
            return CONTINUE if look < len(self.waves) - 1 else FUTILE
        if z >= c:
            return BETTER
        if z <= -c:
            return WORSE
        if z < b or look == len(self.waves) - 1:
            return FUTILE
        return CONTINUE

    def _tail_above(self, z: float, look: int, drift: float) -> float:  # noqa: D401
        """P(drift)(an outcome at least as high as (look, z) in the stagewise ordering)."""
        lower, upper = self.continuation
        t = self.fractions
        walk, above = _Walk(drift), 0.0
        for k in range(look):
            above += walk.upper(t[k], upper[k])
            walk.advance(t[k], lower[k], upper[k])
        return above + walk.upper(t[look], z)

    def p_value(self, z: float, look: int) -> float:
        """The design's two-sided p-value of stopping at (look, z): twice the smaller stagewise tail
        at drift 0 (at most 1)."""
        if not np.isfinite(z):
            return math.nan
        above = self._tail_above(z, look, 0.0)
        return float(min(1.0, 2.0 * min(above, 1.0 - above)))

    def interval(self, z: float, look: int, confidence: float = 0.95) -> Tuple[float, float]:
        """The stagewise-ordering interval of the drift for an outcome stopped at (look, z), at
        level `confidence`, as the mean of Z at that look (drift x sqrt(t_look)): z minus it is
        the pivot `to_difference` maps onto the t statistic's scale."""
        if not np.isfinite(z):
            return (math.nan, math.nan)
        tail = (1.0 - confidence) / 2.0
        scale = math.sqrt(self.fractions[look])

        def solve(target):
            return _root(lambda drift: self._tail_above(z, look, drift) - target,
                                   z / scale - 12.0, z / scale + 12.0, xtol=1e-9)

        return (solve(tail) * scale, solve(1.0 - tail) * scale)

    def estimate(self, z: float, look: int) -> float:
        """The median-unbiased drift (as the mean of Z at the look): where the stagewise tail is one
        half. An early stop for efficacy overestimates; this does not, in the median."""
        if not np.isfinite(z):
            return math.nan
        scale = math.sqrt(self.fractions[look])
        return _root(lambda drift: self._tail_above(z, look, drift) - 0.5,
                               z / scale - 12.0, z / scale + 12.0, xtol=1e-9) * scale

    def boundary_rows(self) -> List[Dict]:
        """Per look: seeds, information fraction, efficacy and futility z, nominal p."""
        return [{"look": k + 1, "seeds": n, "fraction": float(f), "efficacy_z": float(c),
                 "futility_z": float(b) if np.isfinite(b) else None, "nominal_p": float(p)}
                for k, (n, f, c, b, p) in enumerate(zip(self.waves, self.fractions, self.efficacy,
                                                        self.futility, self.nominal_p()))]


@functools.lru_cache(maxsize=256)
def design(waves: Tuple[int, ...], alpha: float, spending: str = "obrien_fleming",
           futility: str = "pocock", power: float = 0.8) -> Design:
    """The design for seeds `waves` (cumulative, increasing) at two-sided level alpha: efficacy by
    `spending`, futility by `futility` spending 1 - power at the drift that gives `power`."""
    waves = tuple(int(n) for n in waves)
    if not waves or any(b <= a for a, b in zip(waves, waves[1:])):
        raise ValueError(f"waves must increase: {waves}")
    t = np.asarray(waves, float) / waves[-1]
    c = efficacy_bounds(t, alpha, spending)
    if futility == "none" or len(waves) == 1:
        b, drift = np.concatenate([np.full(len(t) - 1, -math.inf), c[-1:]]), 0.0
    else:
        drift = drift_for_power(t, c, power, futility)
        b = futility_bounds(t, c, drift, 1.0 - power, futility)
    return Design(waves=waves, alpha=alpha, spending=spending, futility_spending=futility, power=power,
                  efficacy=tuple(map(float, c)), futility=tuple(map(float, b)), drift=drift)


def to_difference(z, mean_z, t, df, se):
    """A drift bound from `Design.interval` (the mean of Z at the look) as a difference in the
    metric's units: the pivot z - mean_z is a standard normal quantile, mapped to the t quantile
    of the same probability at the look's df, so that with one look the interval is the t
    interval, diff +- t_{df} se, exactly (the z's own scale would drop the t's heavier tails: at
    3 seeds it covers 85%). Arrays work elementwise."""
    with np.errstate(invalid="ignore"):
        return se * (t - special.stdtrit(df, special.ndtr(np.asarray(z, float) - mean_z)))


def t_to_z(t, df):
    """The z of the same one-sided p-value as t at df degrees of freedom (NaN stays NaN)."""
    with np.errstate(invalid="ignore"):
        return special.ndtri(special.stdtr(df, t))


def schedule(first: int, looks: int, last: int) -> Tuple[int, ...]:
    """Cumulative seeds per wave: `looks` equal steps of information up to `last` (k last / looks,
    rounded), none below `first` (fewer looks when they would coincide); (last,) when
    last <= first."""
    if last <= first or looks <= 1:
        return (max(last, 1),)
    steps = np.maximum(first, np.rint(np.arange(1, looks + 1) * last / looks)).astype(int)
    return tuple(sorted(set(int(n) for n in steps)))


def look_statistic(variant: np.ndarray, baseline: np.ndarray, paired: bool, sign: float = 1.0):
    """(z, t, df, difference, se) of the variants' seeds against the baseline's along the last
    axis (the first n of each), signed so that positive improves (`sign` -1: lower is better):
    the paired t of the per-seed differences or Welch's, and the z of its one-sided p-value.
    Undefined (no spread, fewer than 2 seeds) is NaN."""
    v, b = np.asarray(variant, float), np.asarray(baseline, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        if paired:
            d = sign * (v - b)
            n = d.shape[-1]
            diff = d.mean(-1)
            se = d.std(-1, ddof=1) / math.sqrt(n) if n > 1 else np.full(diff.shape, math.nan)
            df = np.full(np.shape(diff), n - 1.0)
        else:
            n1, n2 = v.shape[-1], b.shape[-1]
            diff = sign * (v.mean(-1) - b.mean(-1))
            v1 = v.var(-1, ddof=1) / n1 if n1 > 1 else np.full(np.shape(diff), math.nan)
            v2 = b.var(-1, ddof=1) / n2 if n2 > 1 else np.full(np.shape(diff), math.nan)
            se = np.sqrt(v1 + v2)
            df = (v1 + v2) ** 2 / (v1 ** 2 / max(n1 - 1, 1) + v2 ** 2 / max(n2 - 1, 1))
        t = np.where(se > 0, diff / se, math.nan)
        z = t_to_z(t, df)
    return z, t, df, diff, se


@dataclasses.dataclass(frozen=True)
class Simulated:
    """Simulated studies (rows) of one design over variants (columns)."""

    verdict: np.ndarray
    """'better' / 'worse' / 'futile' per study and variant."""
    look: np.ndarray
    """The look (0-based) each variant stopped at."""
    z: np.ndarray
    t: np.ndarray
    df: np.ndarray
    se: np.ndarray
    runs: np.ndarray
    """Runs per study: every variant's seeds and the baseline's (it runs while any variant does)."""


def simulate(d: Design, effects: Sequence[float], *, sd_baseline: float = 1.0, sd_variant: float = 1.0,
             correlation: float = 0.0, paired: bool = True, studies: int = PLAN_DRAWS,
             rng: Optional[np.random.Generator] = None) -> Simulated:
    """Runs `studies` studies of design `d` with one variant per true effect in `effects` (in the
    metric's units, positive improves): seed s of the baseline scores sd_baseline * b_s, of variant
    j effect_j + sd_variant (rho b_s + sqrt(1 - rho^2) e_js), normal. The seeds pair (common random
    numbers); `paired` decides by the paired t, else by Welch's."""
    rng = rng if rng is not None else np.random.default_rng(PLAN_SEED)
    m, n_max = len(effects), d.waves[-1]
    rho = float(correlation)
    b = rng.standard_normal((studies, 1, n_max))
    e = rng.standard_normal((studies, m, n_max))
    base = sd_baseline * b
    var = np.asarray(effects, float)[None, :, None] + sd_variant * (rho * b + math.sqrt(max(1 - rho * rho, 0.0)) * e)
    verdict = np.full((studies, m), CONTINUE, dtype=object)
    look = np.full((studies, m), len(d.waves) - 1)
    z_at, t_at, df_at, se_at = (np.full((studies, m), math.nan) for _ in range(4))
    active = np.ones((studies, m), bool)
    for k, n in enumerate(d.waves):
        z, t, df, _, se = look_statistic(var[..., :n], base[..., :n], paired)
        df = np.broadcast_to(df, z.shape)
        last = k == len(d.waves) - 1
        c, f = d.efficacy[k], d.futility[k]
        decided = np.where(z >= c, BETTER, np.where(z <= -c, WORSE,
                           np.where((z < f) | last | ~np.isfinite(z) & last, FUTILE, CONTINUE)))
        stop = active & (decided != CONTINUE)
        verdict[stop], look[stop], z_at[stop], se_at[stop] = decided[stop], k, z[stop], se[stop]
        t_at[stop], df_at[stop] = t[stop], df[stop]
        active &= ~stop
    seeds = np.asarray(d.waves)[look]
    return Simulated(verdict=verdict.astype(str), look=look, z=z_at, t=t_at, df=df_at, se=se_at,
                     runs=seeds.sum(1) + seeds.max(1))


def interval_table(d: Design, confidence: float = 0.95, points: int = 241):
    """A function (z, look) -> the stagewise interval's (low, high) in se units, for arrays: the
    ordering's tail tabulated over a grid of drifts and interpolated (within 1e-3 of
    `Design.interval`); for simulations, where thousands of intervals are needed."""
    lower, upper = d.continuation
    t = d.fractions
    z_grid = np.linspace(-12.0, 12.0, 481)
    drifts = np.linspace(-14.0, 14.0, points)
    tables = np.empty((len(t), points, len(z_grid)))
    for i, drift in enumerate(drifts):
        walk, above = _Walk(drift), 0.0
        for k in range(len(t)):
            tables[k, i] = above + walk.uppers(t[k], z_grid)
            if k < len(t) - 1:
                above += walk.upper(t[k], upper[k])
                walk.advance(t[k], lower[k], upper[k])
    tail = (1.0 - confidence) / 2.0

    def at(z, look):
        z, look = np.atleast_1d(np.asarray(z, float)), np.atleast_1d(np.asarray(look, int))
        lo, hi = np.full(z.shape, math.nan), np.full(z.shape, math.nan)
        for k in np.unique(look):
            sel = (look == k) & np.isfinite(z)
            # the tail at each drift for these z (linear in z on the grid), then the drift where it crosses
            column = np.array([np.interp(z[sel], z_grid, row) for row in tables[k]])  # drifts x chosen
            scale = math.sqrt(t[k])
            for j, target in ((0, tail), (1, 1.0 - tail)):
                idx = np.argmax(column >= target, axis=0)  # the tail rises with the drift
                i0 = np.clip(idx - 1, 0, points - 1)
                a, b2 = column[i0, np.arange(column.shape[1])], column[idx, np.arange(column.shape[1])]
                w = np.where(b2 > a, (target - a) / np.where(b2 > a, b2 - a, 1.0), 0.0)
                drift = drifts[i0] + w * (drifts[idx] - drifts[i0])
                (lo if j == 0 else hi)[sel] = drift * scale
        return lo, hi

    return at


MC_MAX_SEEDS = 400
"""Above this many seeds per variant the planner trusts the z design (the t's extra tail is then
below 0.2% of power) instead of simulating."""


@dataclasses.dataclass(frozen=True)
class Waves:
    """`study.sequential`: first, the seeds of the first wave; looks, the waves at most; max_seeds,
    the last wave's seeds (None: the seed plan's); spending and futility, the families."""

    first: int = 3
    looks: int = 5
    max_seeds: Optional[int] = None
    spending: str = "obrien_fleming"
    futility: str = "pocock"


def parse_waves(value) -> Optional[Waves]:
    """`study.sequential` -> Waves (None when unset); errors name the key and what is allowed."""
    if value is None or value is False or value == {}:
        return None
    if value is True:
        return Waves()
    if not isinstance(value, Mapping):
        raise StudyError(f"study.sequential = {value!r} is invalid: must be True or a dict such as "
                         "{'looks': 4, 'first': 3}")
    allowed = [f.name for f in dataclasses.fields(Waves)]
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise StudyError(f"study.sequential has unknown key(s) {', '.join(map(repr, unknown))}: allowed keys: "
                         f"{', '.join(allowed)}")
    cfg = Waves(**dict(value))
    for key, low in (("first", 2), ("looks", 1), ("max_seeds", 2)):
        v = getattr(cfg, key)
        if v is None and key == "max_seeds":
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < low or v > 10_000:
            raise StudyError(f"study.sequential['{key}'] = {v!r} is invalid: must be an integer from {low} to 10000")
    if cfg.max_seeds is not None and cfg.max_seeds < cfg.first:
        raise StudyError(f"study.sequential['max_seeds'] = {cfg.max_seeds} is invalid: must be >= "
                         f"first = {cfg.first}")
    if cfg.spending not in SPENDING:
        raise StudyError(f"study.sequential['spending'] = {cfg.spending!r} is invalid: must be one of {SPENDING}")
    if cfg.futility not in FUTILITY:
        raise StudyError(f"study.sequential['futility'] = {cfg.futility!r} is invalid: must be one of {FUTILITY}")
    return cfg


@dataclasses.dataclass(frozen=True)
class WavePlan:
    """The planned design and what it costs: seeds per variant at most, power (simulated with t
    statistics), and runs at most and expected under the null and at the target, beside the
    fixed design's seeds for the same power (`stats.seeds_needed`, the same alpha)."""

    design: Design
    effect: float
    variants: int
    power: float
    runs_max: int
    runs_null: float
    runs_target: float
    fixed_seeds: Optional[int]

    @property
    def runs_fixed(self) -> Optional[int]:
        return None if self.fixed_seeds is None else (self.variants + 1) * self.fixed_seeds


def unit_sd(sd_baseline: float, sd_variant: float, correlation: float, paired: bool) -> float:
    """The std of one seed's contribution to the difference: of a pair's difference (paired), or
    sqrt(sd_b^2 + sd_v^2) (Welch's, equal seeds per arm)."""
    rho = correlation if paired else 0.0
    return math.sqrt(max(sd_baseline ** 2 + sd_variant ** 2 - 2 * rho * sd_baseline * sd_variant, 1e-300))


def operating(d: Design, effect: float, variants: int, *, sd_baseline: float, sd_variant: float,
              correlation: float, paired: bool, studies: int = PLAN_DRAWS,
              seed: int = PLAN_SEED) -> Tuple[float, float, float]:
    """(power of one variant at `effect`, expected runs with every variant null, expected runs
    with every variant at `effect`), simulated (`simulate`, seeded: reproducible)."""
    kw: Dict[str, Any] = dict(sd_baseline=sd_baseline, sd_variant=sd_variant, correlation=correlation, paired=paired,
              studies=studies)
    target = simulate(d, [effect] * variants, rng=np.random.default_rng(seed), **kw)
    null = simulate(d, [0.0] * variants, rng=np.random.default_rng(seed + 1), **kw)
    return float(np.mean(target.verdict[:, 0] == BETTER)), float(null.runs.mean()), float(target.runs.mean())


def plan_waves(effect: float, *, sd_baseline: float, sd_variant: Optional[float] = None, correlation: float = 0.0,
               paired: bool = True, alpha: float = 0.05, variants: int = 1, power: float = 0.8,
               waves: Waves = Waves(), max_seeds: int = 10_000) -> Optional[WavePlan]:
    """The fewest seeds per variant N whose waves (`schedule(first, looks, N)`) give `power` at a
    true difference `effect` (in the metric's units) for each of `variants` variants at
    alpha / variants, from each arm's own spread; None beyond `max_seeds`. With waves.max_seeds set,
    that N, and the power it gives."""
    from experiments import stats

    sd_variant = sd_baseline if sd_variant is None else sd_variant
    level = alpha / max(variants, 1)
    sd_unit = unit_sd(sd_baseline, sd_variant, correlation, paired)
    effect = abs(effect)
    fixed = stats.seeds_needed(effect, sd_baseline, level, power, paired=paired, correlation=correlation,
                               sd2=sd_variant)
    kw: Dict[str, Any] = dict(sd_baseline=sd_baseline, sd_variant=sd_variant, correlation=correlation, paired=paired)

    def build(n):
        return design(schedule(waves.first, waves.looks, n), level, waves.spending, waves.futility, power)

    def powered(n) -> Tuple[Design, float]:
        d = build(n)
        if n > MC_MAX_SEEDS:
            drift = effect * math.sqrt(n) / sd_unit
            lower, upper = d.continuation
            return d, float(crossing(d.fractions, lower, upper, drift)[0].sum())
        return d, operating(d, effect, 1, **kw, studies=PLAN_DRAWS // 2)[0]

    if waves.max_seeds is not None:
        n = waves.max_seeds
    else:
        n = max(waves.first, 2)
        for _ in range(6):  # the z design's N: the drift it needs at its own waves
            drift = drift_for_power(build(n).fractions, build(n).efficacy, power, waves.futility)
            guess = max(waves.first, math.ceil((drift * sd_unit / effect) ** 2)) if effect > 0 else max_seeds + 1
            if guess == n or guess > max_seeds:
                n = guess
                break
            n = guess
        if n > max_seeds:
            return None
        while True:  # the t statistics' heavier tails cost a few seeds at small N
            d, p = powered(n)
            if p >= power or n >= max_seeds:
                break
            n += max(1, n // 50)
        if p < power:
            return None
    d = build(n)
    p, runs_null, runs_target = (operating(d, effect, max(variants, 1), **kw) if n <= MC_MAX_SEEDS
                                 else (powered(n)[1], math.nan, math.nan))
    return WavePlan(design=d, effect=effect, variants=max(variants, 1), power=p,
                    runs_max=(max(variants, 1) + 1) * n, runs_null=runs_null, runs_target=runs_target,
                    fixed_seeds=fixed)


def extra_seeds(seeds: Sequence[int], count: int) -> List[int]:
    """The study's seeds, extended with the smallest unused integers up to `count`."""
    out, candidate = list(seeds), 0
    while len(out) < count:
        if candidate not in out:
            out.append(candidate)
        candidate += 1
    return out[:max(count, 0)]


def study_design(cfg: Waves, max_seeds: int, alpha: float, variants: int, power: float) -> Design:
    """The design of a study with `cfg` whose last wave has `max_seeds` seeds per variant, at
    alpha / variants a variant."""
    return design(schedule(cfg.first, cfg.looks, max_seeds), alpha / max(variants, 1), cfg.spending, cfg.futility,
                  power)


def _in_wave(values: Mapping[int, float], seeds: Sequence[int],
             lineages: Mapping[str, Sequence[int]]) -> Dict[int, float]:
    """{unit: value} over the seeds a look has seen (`stats.unit_means`)."""
    from experiments import stats

    return stats.unit_means({s: values[s] for s in seeds if s in values}, lineages)


def judge(d: Design, look: int, variant: Mapping[int, float], baseline: Mapping[int, float], *,
          paired: bool, higher: bool, confidence: float = 0.95) -> Dict:
    """One variant at one look: its statistic over the units both arms have (paired) or each has
    (Welch), the design's decision, and, for a stop, the stagewise interval, p-value and the
    median-unbiased difference."""
    if paired:
        units = sorted(set(variant) & set(baseline))
        v, b = np.array([variant[u] for u in units]), np.array([baseline[u] for u in units])
    else:
        v, b = np.array(list(variant.values()), float), np.array(list(baseline.values()), float)
    sign = 1.0 if higher else -1.0
    if min(len(v), len(b)) < 2:
        z = t = df = se = math.nan
        diff = sign * float(np.mean(v) - np.mean(b)) if len(v) and len(b) else math.nan
    else:
        z, t, df, diff, se = (float(x) for x in look_statistic(v, b, paired, sign))
    decision = d.decide(z, look)
    out: Dict = {"look": look + 1, "seeds": d.waves[look], "units": int(min(len(v), len(b))), "z": _f(z),
                 "t": _f(t), "df": _f(df), "difference": _f(sign * diff), "se": _f(se), "decision": decision,
                 "efficacy_z": d.efficacy[look], "futility_z": _f(d.futility[look])}
    if decision != CONTINUE and np.isfinite(z):
        lo, hi = d.interval(z, look, confidence)
        mid = d.estimate(z, look)
        bounds = sorted(sign * float(to_difference(z, m, t, df, se)) for m in (lo, hi))
        out.update(p_value=d.p_value(z, look), interval=bounds,
                   estimate=sign * float(to_difference(z, mid, t, df, se)))
    return out


def _f(x) -> Optional[float]:
    return float(x) if x is not None and np.isfinite(x) else None


@dataclasses.dataclass(frozen=True)
class Replay:
    """The looks of a sequential study, replayed from its per-seed values."""

    looks: Tuple[Dict, ...]
    """Per look: seeds, the variants judged and each one's `judge` record."""
    stopped: Dict[str, Dict]
    """Per variant, its last `judge` record (decision 'continue' when its waves are not all run)."""


def replay(d: Design, seeds: Sequence[int], by_seed: Mapping[str, Mapping[int, float]], baseline: str, *,
           paired: bool, higher: bool, lineages: Optional[Mapping[str, Sequence[int]]] = None,
           ran: Optional[Mapping[str, int]] = None) -> Replay:
    """The design's looks over `by_seed` ({arm: {seed: value}}, the baseline's under `baseline`):
    look k reads the first waves[k] of `seeds`; a variant stops at its first decision. `ran`:
    {variant: seeds it was run at} (its runs so far); a look beyond it is not judged. Pure: the
    manager's looks and a later `report` reach the same decisions from the same values."""
    lineages = lineages or {}
    active = [n for n in by_seed if n != baseline]
    looks, stopped = [], {}
    for k, n in enumerate(d.waves):
        wave = list(seeds[:n])
        judged = {}
        base = _in_wave(by_seed.get(baseline, {}), wave, lineages)
        for name in active:
            if ran is not None and ran.get(name, 0) < n:
                continue
            judged[name] = judge(d, k, _in_wave(by_seed[name], wave, lineages), base, paired=paired, higher=higher)
            stopped[name] = judged[name]
        if not judged:
            break
        looks.append({"look": k + 1, "seeds": n, "judged": judged})
        active = [a for a in active if a not in judged or judged[a]["decision"] == CONTINUE]
        if not active:
            break
    return Replay(looks=tuple(looks), stopped=stopped)
