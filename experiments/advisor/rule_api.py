"""What every rule shares: the `Suggestion` it returns, the `Rule` base, and the trend tests.

A rule is a frozen dataclass: its fields are its thresholds and step sizes (defaults: the guide's
numbers, in the terms of docs/tuning_guide.md; where the guide gives no number the default is ours
and the field's docstring says so), its class attributes say what it reads and which round of
the guide it belongs to (`kl_and_clip`: round 2; `throughput_and_quality`: round 3; `health`:
flags, every round). `check(window)` returns a `Suggestion` (ONE parameter to change, its new
value, or a bracket of values when the evidence says the step must be large but not how large,
with the rationale and the numbers that triggered it) or None when its condition does not hold
or its metrics were not logged: a rule never guesses from missing data.

Trends are judged per seed and combined, never on the seed-mean curve alone, because seeds that
swing out of phase average into a flat line: each seed's slope is a one-sided z (`slope_z`) and
the seeds' evidence is pooled with Stouffer's method (`combined_p`).

The guide's rules live in rules.py (which also lists every rule, `RULES`); the rules on signals
the guide does not read (entropy, held-out gold against the reward model) in drift.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Dict, Optional, Sequence, Tuple

import numpy as np
from scipy import stats

from experiments.advisor.window import Window

STABILITY, THROUGHPUT, HEALTH = "kl_and_clip", "throughput_and_quality", "health"
GROUPS = (STABILITY, THROUGHPUT, HEALTH)
"""The guide's rounds: 2 (KL and clip: KL, clipping, actor LR) and 3 (throughput and quality: lengths,
batch sizes, and a reward that slows late: kl_coef down, critic LR up); flags belong to every round."""
GUIDE_KL_STEP = 1.2
"""The guide's kl_coef step (0.1 -> 0.12): `kl_high` takes it; over-optimisation says what it would do."""


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One proposed single-parameter change (or, with parameter None, a flag that proposes none)."""

    rule: str
    group: str
    parameter: Optional[str]
    current: Any
    proposed: Any
    rationale: str
    evidence: Dict[str, Optional[float]]
    severity: float
    """How far past its threshold the evidence is, relative to the threshold (ranks suggestions)."""
    bracket: Tuple[Any, ...] = ()
    """Further values of the same parameter, each tried as its own variant beside `proposed`: a
    bracket, when the evidence says the step must be large but not how large. Still one parameter
    per variant; one suggestion, several variants. Empty for a single change."""
    predicted: Tuple[Dict[str, float], ...] = ()
    """Per value of `values`, what the rule expects a metric to become there ({metric: value};
    {} when it predicts nothing measurable): the tuning path sets it beside what the variant that
    tested the value measured, so a rule's sizing can be trusted or corrected."""

    @property
    def is_warning(self) -> bool:
        return self.parameter is None

    @property
    def values(self) -> Tuple[object, ...]:
        """Every proposed value: `proposed`, then the bracket's."""
        return (self.proposed, *self.bracket)

    @property
    def binding(self) -> str:
        return f"{self.parameter} = {self.proposed!r}"

    @property
    def variants(self) -> Tuple[Tuple[str, str], ...]:
        """(variant name, binding) per proposed value: 'kl_coef_up' or 'max_response_length_down'
        for a single change, 'kl_coef_x2.7' and 'kl_coef_x8.2' for a bracket (names a results folder)."""
        assert self.parameter is not None, "a flag proposes no change, so it has no variants"
        short = self.parameter.split(".", 1)[-1]
        if not self.bracket:
            return ((f"{short}_{'up' if self.proposed > self.current else 'down'}", self.binding),)
        return tuple((f"{short}_x{v / self.current:.2g}" if self.current else f"{short}_{i + 1}",
                      f"{self.parameter} = {v!r}") for i, v in enumerate(self.values))

    @property
    def variant_name(self) -> str:
        return self.variants[0][0]

    @property
    def bindings(self) -> Tuple[str, ...]:
        return tuple(binding for _, binding in self.variants)

    @property
    def change(self) -> str:
        if self.is_warning:
            return "no change (flag)"
        steps = [f"{v!r}" + (f" (x{v / self.current:.3g})" if self.current else "") for v in self.values]
        return f"{self.parameter}: {self.current!r} -> {' or '.join(steps)}" + (
            ", one variant each" if self.bracket else "")

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "change": self.change,
                "binding": None if self.is_warning else self.binding,
                "bindings": [] if self.is_warning else list(self.bindings)}


def significant(x: float, digits: int = 3) -> float:
    """x rounded to `digits` significant digits, so a written recipe reads 0.06, not 0.060000001."""
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits}g}")


def excess(value: float, threshold: float, above: bool = True) -> float:
    """Relative distance past a threshold: the ranking score."""
    if threshold == 0:
        return abs(value)
    return max((value - threshold) / abs(threshold) if above else (threshold - value) / abs(threshold), 1e-6)


def slope_z(curve: np.ndarray) -> Tuple[Any, float]:
    """(scipy.stats.linregress fit of `curve` against its step index, z of an upward slope): the
    slope's t statistic turned into a standard normal quantile (+-8 when the fit is exact). The fit
    is scipy's LinregressResult, a class scipy builds at run time and does not export (hence Any)."""
    x = np.arange(len(curve), dtype=float)
    fit: Any = stats.linregress(x, curve)  # its stub types the result without slope and stderr
    if fit.stderr > 0:
        return fit, float(stats.norm.isf(stats.t.sf(fit.slope / fit.stderr, len(curve) - 2)))
    return fit, (math.copysign(8.0, fit.slope) if fit.slope else 0.0)


def combined_p(zs: Sequence[float]) -> float:
    """One-sided p of the seeds' pooled evidence for an upward effect (Stouffer's z)."""
    return float(stats.norm.sf(np.sum(zs) / math.sqrt(len(zs))))


def reward_trend(window: Window) -> Optional[Tuple[float, float, float]]:
    """(mean rise over the window, one-sided p of an upward slope, detrended reward variance),
    per seed by linear regression, rise/variance averaged over seeds and p from the seeds'
    combined evidence (Stouffer); None with fewer than 5 steps."""
    curves = [c for c in window.seed_curves("reward_mean") if len(c) >= 5]
    if not curves:
        return None
    rises, zs, variances = [], [], []
    for c in curves:
        fit, z = slope_z(c)
        rises.append(fit.slope * (len(c) - 1))
        residual = c - (fit.intercept + fit.slope * np.arange(len(c), dtype=float))
        variances.append(float(np.var(residual, ddof=2)))
        zs.append(z)
    return float(np.mean(rises)), combined_p(zs), float(np.mean(variances))


@dataclasses.dataclass(frozen=True)
class Rule:
    """Base: subclasses declare `name`, `reads`, `group`, `rationale` and their thresholds."""

    name: ClassVar[str] = ""
    reads: ClassVar[Tuple[str, ...]] = ()
    group: ClassVar[str] = STABILITY
    parameter: ClassVar[Optional[str]] = None
    rationale: ClassVar[str] = ""
    outranks: ClassVar[Tuple[str, ...]] = ()
    """Rules whose suggestion on the same parameter this rule's replaces, however severe (advise.py):
    a diagnosis that explains a symptom outranks the rule reading the symptom alone."""

    def check(self, window: Window) -> Optional[Suggestion]:
        raise NotImplementedError

    def predict(self, window: Window, value) -> Dict[str, float]:
        """What this rule expects its metric to become with its parameter at `value`; {} (the
        default) when its sizing makes no measurable prediction."""
        return {}

    def _suggest(self, window: Window, proposed, evidence: Dict[str, Optional[float]], severity: float,
                 rationale: str = "", bracket: Sequence = ()) -> Optional[Suggestion]:
        current = window.param(self.parameter) if self.parameter is not None else None
        if self.parameter is not None:
            if current is None or proposed is None or proposed == current:
                return None
        bracket = tuple(v for v in dict.fromkeys(bracket) if v not in (None, current, proposed))
        evidence = {k: _number(v) for k, v in evidence.items()}
        predicted = tuple({k: _number(v) for k, v in self.predict(window, value).items()}
                          for value in (proposed, *bracket))
        return Suggestion(self.name, self.group, self.parameter, current, proposed,
                          rationale or self.rationale, evidence, float(severity), bracket,
                          predicted if any(predicted) else ())


class KLScaling:
    """A rule on `ppo.kl_coef` that sizes its step by KL ~ 1 / kl_coef^2 (the reward's KL penalty
    pulls KL down with the square of its coefficient near equilibrium): it predicts the window's
    mean KL at the new coefficient."""

    def predict(self, window: Window, value) -> Dict[str, float]:
        kl, current = window.mean("kl_divergence"), window.param("ppo.kl_coef")
        if not kl or not current or not value:
            return {}
        return {"kl_divergence": kl * (float(current) / float(value)) ** 2}


def _number(v):
    """Evidence as it is written: counts as ints, measurements to 4 significant digits."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return significant(float(v), 4)
    return v
